"""One OpenAI request in its parsed form (Call). The chat and text completions routes (openai_server.py) and the
Responses API (responses.py) both run requests so, on an Upstream (upstream.py); this module is what they share, so
neither imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from graphmesh_coordinator import tool_calls
from graphmesh_coordinator.generation import GenerationRequest
from graphmesh_coordinator.openai_protocol import ChatCompletionRequest, CompletionRequest


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
