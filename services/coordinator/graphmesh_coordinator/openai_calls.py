"""One OpenAI request as the coordinator runs it: its parsed form (Call) and the sessions that generate its choices
(Sessions). The chat and text completions routes (openai_server.py) and the Responses API (responses.py) both run
requests so; this module is what they share, so neither imports the other's internals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from opentelemetry.trace import Span

from graphmesh_coordinator import tool_calls
from graphmesh_coordinator.generation import Event, GenerationRequest, Generator
from graphmesh_coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest
from graphmesh_server import telemetry
from graphmesh_server.aio_serving import Wait, aiterate


@dataclass
class Call:
    """One parsed request: a prompt per entry of `prompts`, each generated `n` times."""

    operation: Literal["chat", "text_completion"]
    body: ChatCompletionRequest | CompletionRequest
    prompts: list[list[int]]
    requests: list[GenerationRequest]  # prompt-major: choice index = prompt * n + i
    logprobs: bool
    top_logprobs: int
    max_tokens: int | None  # as asked (None: up to the context)
    tools: bool = False  # chat with tools offered: completions are parsed for tool calls (tool_calls.py)
    parallel_tool_calls: bool = True
    tool_format: str = tool_calls.HERMES  # the model's (tool_calls.format_of)
    tool_prefix: str = ""  # what the prompt ends with that the completion continues (tool_calls.encode)

    def tool_parser(self) -> tool_calls.StreamParser | tool_calls.JsonCallsParser:
        return tool_calls.parser(self.tool_format, self.tool_prefix)

    @property
    def stream(self) -> bool:
        return self.body.stream

    @property
    def include_usage(self) -> bool:
        return self.body.stream and self.body.stream_options is not None and self.body.stream_options.include_usage


class Sessions:
    """The sessions of one request, each an asyncio task on the server's loop; their events come to the request
    through one queue as (choice index, Event | the error that ended it | None at the end). A session's code runs on
    `pool` only while it computes (aiterate): one that waits for the mesh, for KV cache or for its tokens holds no
    thread, so thousands of queued requests cost no thread each."""

    def __init__(self, generator: Generator, requests: Sequence[GenerationRequest], span: Span,
                 pool: ThreadPoolExecutor, ready_wait_s: float) -> None:
        self.queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()
        self.cancelled = False
        self.generator, self.span, self.pool, self.ready_wait_s = generator, span, pool, ready_wait_s
        self._tasks = [asyncio.create_task(self._run(index, request)) for index, request in enumerate(requests)]

    def _events(self, request: GenerationRequest) -> Iterator[Event | Wait]:
        with telemetry.use(self.span):  # the Generator's spans and the steps join the request's trace
            yield from self.generator.generate_waiting(request, alive=lambda: not self.cancelled,
                                                       ready_wait_s=self.ready_wait_s)

    async def _run(self, index: int, request: GenerationRequest) -> None:
        try:
            async for event in aiterate(self.pool, lambda: self._events(request)):
                self.queue.put_nowait((index, event))
            self.queue.put_nowait((index, None))
        except Exception as e:
            self.queue.put_nowait((index, e))
        # cancelled (cancel()): aiterate closes the session's generator, which ends the session and releases its KV

    def cancel(self) -> None:
        self.cancelled = True
        for task in self._tasks:
            task.cancel()
