"""One OpenAI request as it runs: its parsed form (Call), what runs it (an Upstream: the coordinator's Generator in
its own process, or a coordinator a front end relays to) and the sessions that generate its choices (Sessions). The
chat and text completions routes (openai_server.py) and the Responses API (responses.py) both run requests so; this
module is what they share, so neither imports the other's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Protocol

from opentelemetry.trace import Span

from graphmesh.tokenizer import Tokenizer
from graphmesh_coordinator import tool_calls
from graphmesh_coordinator.generation import Event, GenerationRequest, Generator
from graphmesh_coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest
from graphmesh_coordinator.pipeline import Mesh
from graphmesh_coordinator.speculative import Mode
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


class Upstream(Protocol):
    """What the OpenAI API's requests run on: the Generator of the coordinator it is served by (LocalUpstream), or a
    coordinator that a front end relays them to (frontend.RelayUpstream)."""

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def context_tokens(self) -> int: ...

    @property
    def session_tokens(self) -> int:
        """The most tokens one session may hold (Generator.session_tokens): a request without max_tokens
        generates up to it."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def speculative(self) -> Mode:
        """The default of requests that do not choose (--speculative)."""

    def ready(self) -> bool:
        """Whether a request would be served now (/health)."""

    def events(self, request: GenerationRequest, sessions: Sessions) -> AsyncGenerator[Event, None]:
        """One session's events, on the server's loop; closing the generator ends the session."""


class LocalUpstream:
    """The Generator in this process: each session's code runs on the server's pool only while it computes
    (aiterate)."""

    def __init__(self, generator: Generator, mesh: Mesh) -> None:
        self.generator, self.mesh = generator, mesh

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.generator.tokenizer

    @property
    def context_tokens(self) -> int:
        return self.generator.context_tokens

    @property
    def session_tokens(self) -> int:
        return self.generator.session_tokens

    @property
    def vocab_size(self) -> int:
        return self.mesh.config.vocab_size

    @property
    def speculative(self) -> Mode:
        return self.generator.speculative

    def ready(self) -> bool:
        return self.mesh.ready

    def events(self, request: GenerationRequest, sessions: Sessions) -> AsyncGenerator[Event, None]:
        def run() -> Iterator[Event | Wait]:
            with telemetry.use(sessions.span):  # the Generator's spans and the steps join the request's trace
                yield from self.generator.generate_waiting(request, alive=lambda: not sessions.cancelled,
                                                           ready_wait_s=sessions.ready_wait_s)
        return aiterate(sessions.pool, run)


class Sessions:
    """The sessions of one request, each an asyncio task on the server's loop; their events come to the request
    through one queue as (choice index, Event | the error that ended it | None at the end). A session that waits for
    the mesh, for KV cache or for its tokens holds no thread, so thousands of queued requests cost no thread each."""

    def __init__(self, upstream: Upstream, requests: Sequence[GenerationRequest], span: Span,
                 pool: ThreadPoolExecutor, ready_wait_s: float) -> None:
        self.queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()
        self.cancelled = False
        self.span, self.pool, self.ready_wait_s = span, pool, ready_wait_s
        self._tasks = [asyncio.create_task(self._run(index, upstream.events(request, self)))
                       for index, request in enumerate(requests)]

    async def _run(self, index: int, events: AsyncGenerator[Event, None]) -> None:
        try:
            async with contextlib.aclosing(events):  # cancelled (cancel()): closing it ends the session
                async for event in events:
                    self.queue.put_nowait((index, event))
            self.queue.put_nowait((index, None))
        except Exception as e:
            self.queue.put_nowait((index, e))

    def cancel(self) -> None:
        self.cancelled = True
        for task in self._tasks:
            task.cancel()
