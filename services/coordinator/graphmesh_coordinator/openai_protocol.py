"""The OpenAI HTTP API's protocol: its request bodies (pydantic), the checks on their fields that only OpenAI's
shapes need (generation.validate makes the checks every API shares), and its error shape, {"error": {"message",
"type", "param", "code"}} with the HTTP status a client library retries on (429, 503) or does not (400, 401, 404).
The routes and streams that serve it are openai_server.py's.

Unknown fields are ignored, as OpenAI-compatible servers do; vLLM's extensions top_k and ignore_eos are taken.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from graphmesh_coordinator.failures import public_error
from graphmesh_coordinator.generation import MAX_TOP_LOGPROBS

MAX_CHOICES = 16  # n (times the prompts of a batch): each choice is a session of its own
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_STOP = 16  # stop strings
ROLES = ("system", "developer", "user", "assistant", "tool")
# gRPC code name -> (HTTP status, OpenAI error type). RESOURCE_EXHAUSTED is 429 (retry later) except for a request
# that could never fit (KV_CAPACITY_EXCEEDED): no retry helps, so it is a bad request, as a too-long prompt is.
STATUS = {"INVALID_ARGUMENT": (400, "invalid_request_error"), "OUT_OF_RANGE": (400, "invalid_request_error"),
          "FAILED_PRECONDITION": (400, "invalid_request_error"), "NOT_FOUND": (404, "not_found_error"),
          "UNAUTHENTICATED": (401, "authentication_error"), "PERMISSION_DENIED": (403, "permission_error"),
          "RESOURCE_EXHAUSTED": (429, "rate_limit_error"), "UNAVAILABLE": (503, "service_unavailable_error"),
          "DEADLINE_EXCEEDED": (503, "service_unavailable_error"), "CANCELLED": (499, "cancelled")}
NEVER_FITS = {"KV_CAPACITY_EXCEEDED"}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


# -- requests ------------------------------------------------------------------------------------------------
class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do: clients send many (user, metadata, store, ...).
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (tool_calls.py renders them back)
    tool_call_id: str | None = None  # a tool message's answer to a call


class StreamOptions(_Body):
    include_usage: bool = False


class GenerationBody(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI's default is 1
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted at their neutral values only: a client that asks for a penalty must not silently get none.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema: guided decoding (structured.py)
    # graphmesh's extension: "prompt-lookup", "draft" (the coordinator's draft model), "off" or {"method",
    # "max_proposed"} (speculative.py); None: the default
    speculative: str | dict[str, Any] | None = None


class ChatCompletionRequest(GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(GenerationBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class APIError(Exception):
    """An error as OpenAI sends it: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def api_error(error: BaseException) -> APIError:
    """The HTTP form of whatever a request raised (failures.public_error): typed errors keep their meaning, anything
    else is a 500."""
    if isinstance(error, APIError):
        return error
    public = public_error(error)
    status, type_ = STATUS.get(public.code.name, (500, "internal_error"))
    if public.reason in NEVER_FITS:
        status, type_ = 400, "invalid_request_error"
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    return APIError(status, public.message, type_, public.reason.lower(), public.metadata.get("parameter"), headers)


def bad(message: str, param: str, code: str = "invalid_parameter") -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP:
        raise bad(f"at most {MAX_STOP} stop strings, got {len(strings)}", "stop")
    if any(not s for s in strings):
        raise bad("a stop string must not be empty (it would end every completion at once)", "stop")
    return tuple(strings)


def check_unsupported(body: GenerationBody) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name):
            raise bad(f"{name} is not supported (only 0)", name, "unsupported_parameter")
    if body.logit_bias:
        raise bad("logit_bias is not supported", "logit_bias", "unsupported_parameter")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise bad("echo is not supported", "echo", "unsupported_parameter")
        if body.best_of not in (None, 1, body.n):
            raise bad("best_of is not supported", "best_of", "unsupported_parameter")
        if body.suffix:
            raise bad("suffix is not supported", "suffix", "unsupported_parameter")


def message_text(message: ChatMessage, index: int) -> tuple[str, str]:
    if message.role not in ROLES:
        raise bad(f"messages[{index}].role {message.role!r} is not one of {', '.join(ROLES)}", f"messages[{index}].role")
    content = message.content
    if isinstance(content, list):
        other = next((p.type for p in content if p.type != "text"), None)
        if other is not None:
            raise bad(f"messages[{index}] has a {other!r} part; only text is supported", f"messages[{index}].content")
        content = "".join(p.text or "" for p in content)
    role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for a system message
    return role, content or ""


