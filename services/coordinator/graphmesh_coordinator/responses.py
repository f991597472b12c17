"""OpenAI's Responses API on the OpenAI server's chat path: POST /v1/responses (text and function calls, streamed as
its typed Server-Sent Events or not), GET /v1/responses/{id}, `instructions`, and `previous_response_id` chaining
through a bounded store of the responses' conversations.

A request becomes a chat completion (ChatCompletionRequest): `instructions` a system message, `input` (a string, or
message, function_call and function_call_output items) the turns after the previous response's conversation, `text`'s
format the response_format, `tools` (the flat function form) and `tool_choice` as chat's. Fields that would change the
answer and are not supported (reasoning, background, include, conversation, prompt, truncation other than disabled,
a tool other than a function, n) are refused with 400 rather than ignored.

The store keeps each stored response and the conversation that led to it (without its instructions, which OpenAI does
not carry over): in memory, up to STORE_LIMIT responses, the oldest dropped first; or, with the coordinator's
--redis-url, in Redis/Valkey, each for STORE_TTL_S, so that any coordinator on that Redis (a new leader, a restarted
process) continues a conversation another one started. A Redis that does not answer is a 503 (STORE_UNAVAILABLE):
a response that cannot be stored or read back is not answered as if it had been.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from graphmesh.errors import Unavailable
from graphmesh_coordinator import genai
from graphmesh_coordinator.generation import Event
from graphmesh_coordinator.openai_calls import Call
from graphmesh_coordinator.openai_protocol import FINISH, APIError, ChatCompletionRequest, CompletionRequest, api_error
from graphmesh_coordinator.upstream import Sessions, Upstream
from graphmesh_server import telemetry

STORE_LIMIT = 1024  # stored responses (memory), the oldest dropped first
STORE_TTL_S = 24 * 3600  # Redis
REDIS_TIMEOUT_S = 2.0  # a Redis call that takes longer fails the request (503) rather than holding it
SUPPORTED = {"model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "parallel_tool_calls",
             "text", "max_output_tokens", "temperature", "top_p", "stream", "store", "metadata", "user", "seed",
             "top_k", "truncation", "service_tier", "stream_options", "safety_identifier", "prompt_cache_key"}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    truncation: str | None = None


class Store(Protocol):
    def put(self, response_id: str, record: dict[str, Any]) -> None: ...
    def get(self, response_id: str) -> dict[str, Any] | None: ...


class MemoryStore:
    def __init__(self, limit: int = STORE_LIMIT) -> None:
        self.limit = limit
        self._items: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        with self._lock:
            self._items[response_id] = json.dumps(record)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            text = self._items.get(response_id)
        return json.loads(text) if text is not None else None


class RedisStore:
    """The same store in Redis: each record a key with a TTL (Redis bounds it by memory policy and the TTL)."""

    KEY = "graphmesh:response:"

    def __init__(self, url: str, password_file: Path | None = None, ttl_s: int = STORE_TTL_S,
                 timeout_s: float = REDIS_TIMEOUT_S) -> None:
        import redis

        # from a file (read once, here) rather than the URL, which a process list shows
        password = {"password": password_file.read_text().strip()} if password_file is not None else {}
        # from_url checks the scheme now (ValueError), so a bad --redis-url fails the coordinator's start
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           **password)
        self._where = re.sub(r"//[^@/]*@", "//", url)  # never a password in an error message
        self.ttl_s = ttl_s

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        self._call(lambda: self._redis.set(self.KEY + response_id, json.dumps(record), ex=self.ttl_s))

    def get(self, response_id: str) -> dict[str, Any] | None:
        text = self._call(lambda: self._redis.get(self.KEY + response_id))
        return json.loads(text) if text else None

    def _call(self, command: Callable[[], Any]) -> Any:
        import redis

        try:
            return command()
        except redis.RedisError as e:
            raise Unavailable(f"the Responses API's store (Redis at {self._where}) failed: {type(e).__name__}: "
                              f"{str(e)[:200]}", "STORE_UNAVAILABLE") from None


def open_store(redis_url: str, password_file: Path | None = None) -> Store:
    """The store the coordinator's flags ask for: Redis at `redis_url`, else memory."""
    return RedisStore(redis_url, password_file) if redis_url else MemoryStore()


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise _bad(f"content parts of type {kind!r} are not supported (only text)", "input")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    return ""


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, "invalid_request_error", "unsupported_parameter", param)


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages (assistant function calls and their outputs included)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}] if items else []
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role", "user"), "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise _bad(f"input[{i}] has type {kind!r}; supported: message, function_call, function_call_output",
                       f"input[{i}].type")
    return out


class ChatServer(Protocol):
    """What the Responses API takes of the OpenAI server it is mounted on (OpenAIServer): its chat path."""

    upstream: Upstream
    model_name: str
    ready_wait_s: float
    pool: ThreadPoolExecutor
    leader_gate: Callable[[], None] | None

    def parse(self, operation: Literal["chat", "text_completion"],
              body: ChatCompletionRequest | CompletionRequest) -> Call: ...


class ResponsesAPI:
    def __init__(self, server: ChatServer, store: Store | None = None) -> None:
        self.server, self.store = server, store or MemoryStore()

    def mount(self, app: Any, dependencies: list[Any]) -> None:
        app.post("/v1/responses", dependencies=dependencies)(self.create)
        app.get("/v1/responses/{response_id}", dependencies=dependencies)(self.retrieve)

    async def retrieve(self, response_id: str) -> Response:
        record = await asyncio.get_running_loop().run_in_executor(self.server.pool, self.store.get, response_id)
        if record is None:
            raise APIError(404, f"no stored response {response_id!r}", "not_found_error", "response_not_found",
                           "response_id")
        return JSONResponse(record["response"])

    def _chat(self, body: ResponsesRequest) -> tuple[Any, list[dict[str, Any]]]:
        """The chat completion request of `body`, and the conversation (without instructions) it continues."""
        unsupported = sorted(k for k, v in (body.model_extra or {}).items() if k not in SUPPORTED and v is not None)
        if unsupported:
            raise _bad(f"{', '.join(unsupported)} is not supported by this server's Responses API", unsupported[0])
        if body.truncation not in (None, "disabled", "auto"):
            raise _bad(f"truncation {body.truncation!r} is not supported", "truncation")
        history: list[dict[str, Any]] = []
        if body.previous_response_id:
            record = self.store.get(body.previous_response_id)  # on the server's pool (create)
            if record is None:
                raise APIError(404, f"previous_response_id {body.previous_response_id!r} is not stored (expired, "
                               "or made with store: false)", "not_found_error", "response_not_found",
                               "previous_response_id")
            history = record["conversation"]
        conversation = history + _messages(body.input)
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
        if not messages:
            raise _bad("input must not be empty", "input")
        tools = [t if t.get("type") != "function" or "function" in t else
                 {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                 for t in body.tools or []]
        fmt = (body.text or {}).get("format")
        chat = ChatCompletionRequest(
            model=body.model, messages=messages, max_tokens=body.max_output_tokens, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, seed=body.seed, stream=body.stream, tools=tools or None,
            tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls, response_format=fmt)
        return chat, conversation

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        server, t0 = self.server, time.perf_counter()
        response_id = "resp_" + uuid.uuid4().hex
        usage = genai.Usage()
        span = telemetry.start_request_span(genai.span_name("responses", body.model), dict(request.headers), {})
        try:
            if server.leader_gate is not None:
                server.leader_gate()
            chat, conversation = await asyncio.get_running_loop().run_in_executor(server.pool, self._chat, body)
            call = await asyncio.get_running_loop().run_in_executor(server.pool, server.parse, "chat", chat)
            usage.input_tokens = len(call.prompts[0])
            sessions = Sessions(server.upstream, call.requests, span, server.pool, server.ready_wait_s)
            first = await sessions.queue.get()
            if isinstance(first[1], BaseException):
                sessions.cancel()
                raise first[1]
            run = _Run(self, body, call, conversation, response_id, usage)
            if body.stream:
                return StreamingResponse(run.stream(sessions, first, span, t0), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            try:
                item: Any = first
                while True:
                    _, event = item
                    if isinstance(event, BaseException):
                        raise event
                    if event is None:
                        break
                    run.apply(event)
                    item = await sessions.queue.get()
            finally:
                sessions.cancel()
            response = await run.finish()
            genai.record("responses", server.model_name, usage, time.perf_counter() - t0)
            genai.finish_span(span, response_id, server.model_name, usage)
            return JSONResponse(response)
        except Exception as e:
            error = api_error(e)
            genai.record("responses", server.model_name, usage, time.perf_counter() - t0, error.code or error.type)
            genai.finish_span(span, response_id, server.model_name, usage, error.code or error.type)
            raise error from None


class _Run:
    """One response as it is generated: its output items, text and calls, and (streamed) its events."""

    def __init__(self, api: ResponsesAPI, body: ResponsesRequest, call: Call, conversation: list[dict[str, Any]],
                 response_id: str, usage: genai.Usage) -> None:
        self.api, self.body, self.call, self.conversation = api, body, call, conversation
        self.response_id, self.usage = response_id, usage
        self.created = int(time.time())
        self.parser = call.tool_parser() if call.tools else None
        self.text, self.finish_reason = "", ""
        self.calls: list[dict[str, Any]] = []
        self.message_id = "msg_" + uuid.uuid4().hex
        self.sequence = 0

    def apply(self, event: Event) -> tuple[str, list[dict[str, Any]]]:
        """The event's new content text and newly complete calls."""
        self.usage.output_tokens += len(event.token_ids)
        text, calls = (self.parser.feed(event.text) if self.parser is not None else (event.text, []))
        if event.finish_reason:
            self.finish_reason = FINISH.get(event.finish_reason, "stop")
            if self.parser is not None:
                text += self.parser.finish()
        if not self.call.parallel_tool_calls:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.text += text
        self.calls += calls
        return text, calls

    def _message(self, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _function_call(call: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    def output(self) -> list[dict[str, Any]]:
        items = [self._message()] if self.text or not self.calls else []
        return items + [self._function_call(c) for c in self.calls]

    def response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body, server = self.body, self.api.server
        incomplete = status == "incomplete"
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created, "status": status,
            "model": server.model_name, "output": output, "instructions": body.instructions,
            "previous_response_id": body.previous_response_id, "tools": body.tools or [],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": self.call.parallel_tool_calls, "temperature": body.temperature,
            "top_p": body.top_p, "max_output_tokens": body.max_output_tokens, "text": {"format": fmt},
            "truncation": body.truncation or "disabled", "metadata": body.metadata or {}, "store": body.store,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {"input_tokens": self.usage.input_tokens, "output_tokens": self.usage.output_tokens,
                      "total_tokens": self.usage.input_tokens + self.usage.output_tokens,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}

    async def finish(self) -> dict[str, Any]:
        """The finished response, stored (with its conversation) unless store is false: on the server's pool, since
        a Redis store answers over the network."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        response = self.response(status, self.output())
        if self.body.store:
            turn: dict[str, Any] = {"role": "assistant", "content": self.text or None}
            if self.calls:
                turn["tool_calls"] = self.calls
            record = {"response": response, "conversation": [*self.conversation, turn]}
            await asyncio.get_running_loop().run_in_executor(self.api.server.pool, self.api.store.put,
                                                             self.response_id, record)
        return response

    def _event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        data = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    async def stream(self, sessions: Any, first: Any, span: Any, t0: float) -> AsyncIterator[bytes]:
        server = self.api.server
        error = "cancelled"
        try:
            yield self._event("response.created", response=self.response("in_progress", []))
            yield self._event("response.in_progress", response=self.response("in_progress", []))
            opened = False  # the message item
            item = first
            while True:
                _, event = item
                if isinstance(event, BaseException):
                    failure = api_error(event)
                    error = failure.code or failure.type
                    yield self._event("error", code=failure.code, message=failure.message, param=failure.param)
                    return
                if event is None:
                    break
                text, calls = self.apply(event)
                if text:
                    if not opened:
                        opened = True
                        yield self._event("response.output_item.added", output_index=0,
                                          item={**self._message("in_progress"), "content": []})
                        yield self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                                          content_index=0, part={"type": "output_text", "text": "",
                                                                 "annotations": [], "logprobs": []})
                    yield self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                      content_index=0, delta=text, logprobs=[])
                for c in calls:
                    index = int(opened) + self.calls.index(c)
                    fc = self._function_call(c)
                    yield self._event("response.output_item.added", output_index=index,
                                      item={**fc, "arguments": "", "status": "in_progress"})
                    yield self._event("response.function_call_arguments.delta", item_id=fc["id"],
                                      output_index=index, delta=fc["arguments"])
                    yield self._event("response.function_call_arguments.done", item_id=fc["id"],
                                      output_index=index, arguments=fc["arguments"], name=fc["name"])
                    yield self._event("response.output_item.done", output_index=index, item=fc)
                item = await sessions.queue.get()
            if opened:
                part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
                yield self._event("response.output_text.done", item_id=self.message_id, output_index=0,
                                  content_index=0, text=self.text, logprobs=[])
                yield self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                                  content_index=0, part=part)
                yield self._event("response.output_item.done", output_index=0, item=self._message())
            try:
                response = await self.finish()
            except Exception as e:  # the store did not take it: the client must not chain on it
                failure = api_error(e)
                error = failure.code or failure.type
                yield self._event("error", code=failure.code, message=failure.message, param=failure.param)
                return
            if not opened and not self.calls:  # an empty answer is still a message
                response["output"] = [self._message()]
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield self._event(kind, response=response)
            error = ""
        finally:
            sessions.cancel()
            genai.record("responses", server.model_name, self.usage, time.perf_counter() - t0, error)
            genai.finish_span(span, self.response_id, server.model_name, self.usage, error)
