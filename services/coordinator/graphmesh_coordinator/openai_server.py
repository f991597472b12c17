"""The OpenAI HTTP API's server: the coordinator's (`--http-listen`, on its Generator, beside gRPC, in the same
process), or a front end's (graphmesh-frontend --http-listen, relaying each request to the coordinator).

POST /v1/chat/completions and /v1/completions (streamed as Server-Sent Events ending in `data: [DONE]`, or not),
GET /v1/models, /health (200 only while the mesh can serve) and /metrics (every Prometheus metric of the process).
Requests are checked the way Generate checks them (generation.validate); their schemas and the error shape are
openai_protocol.py's.

FastAPI serves on uvicorn's event loop in a thread of its own. Every choice of a request is a task there (the
coordinator's runs the Generator's code on a small pool only while it computes, aiterate), so a request waiting for
the mesh, for KV cache or for its tokens holds no thread; when a client goes away its tasks are cancelled, which
ends their sessions and releases their KV. Requests are never refused for load: they queue with the gRPC ones, and
get 429 only past --max-waiting-requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import socket
import ssl
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from opentelemetry.trace import Span
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from graphmesh.errors import GraphmeshError, NotFound, Unauthenticated
from graphmesh.security import Tls
from graphmesh_coordinator import genai, http_limits, responses, speculative, structured, tool_calls
from graphmesh_coordinator.generation import Event, GenerationRequest, TokenLogprob, validate
from graphmesh_coordinator.openai_calls import Call
from graphmesh_coordinator.openai_protocol import (
    FINISH,
    MAX_CHOICES,
    MAX_PROMPTS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationBody,
    api_error,
    bad,
    check_unsupported,
    message_text,
    stop_strings,
)
from graphmesh_coordinator.servicer import prompt_token_ids
from graphmesh_coordinator.upstream import Sessions, Upstream
from graphmesh_server import telemetry

log = logging.getLogger("graphmesh.coordinator.http")

_SEED_MASK = (1 << 64) - 1
_DISCONNECT_POLL_S = 1.0  # how often a non-streamed request checks that its client is still there
HTTP_WORKERS = 16
MAX_BODY_BYTES = 64 << 20  # FastAPI reads a whole body before anything checks it: bigger ones are refused first


class _BodyLimit:
    """Refuses a request body over `limit` bytes (413) before it is read into memory: by its Content-Length, or,
    for a chunked body, as soon as the bytes received pass the limit (FastAPI then answers the unreadable body
    with a 400)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            error = APIError(413, f"the request body must be at most {self.limit} bytes with a valid Content-Length",
                             "invalid_request_error", "body_too_large")
            await error.response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Any:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise ValueError(f"the request body passed {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


@dataclass
class _Choice:
    index: int
    prompt_tokens: int
    text: str = ""
    tokens: int = 0
    finish_reason: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_at: float = 0.0
    done: bool = False


# -- the server ----------------------------------------------------------------------------------------------
class OpenAIServer:
    def __init__(self, upstream: Upstream, model_name: str, auth_token: str = "",
                 ready_wait_s: float = 10.0, leader_gate: Callable[[], None] | None = None,
                 responses_store: responses.Store | None = None) -> None:
        self.upstream, self.model_name = upstream, model_name
        self.leader_gate = leader_gate  # raises NOT_LEADER (503 here) on a standby, naming the leader
        self._expected = f"Bearer {auth_token}" if auth_token else ""
        # the requests' code while it runs (parsing, tokenizing, detokenizing); none waits on it
        self.pool = ThreadPoolExecutor(HTTP_WORKERS, thread_name_prefix="http-generate")
        self.ready_wait_s = ready_wait_s
        self.responses_store = responses_store  # None: in memory (responses.MemoryStore)
        self.created = int(time.time())
        self.address, self.port = "", 0
        self._serving: http_limits.Serving | None = None
        self._tls_dir: tempfile.TemporaryDirectory[str] | None = None
        self.app = self._app()

    # -- FastAPI app --
    def _app(self) -> FastAPI:
        app = FastAPI(title="graphmesh", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
        authorized = [Depends(self._authorize)]
        app.post("/v1/chat/completions", dependencies=authorized)(self.chat_completions)
        app.post("/v1/completions", dependencies=authorized)(self.completions)
        responses.ResponsesAPI(self, self.responses_store).mount(app, authorized)  # POST /v1/responses, GET /v1/responses/{id}
        app.get("/v1/models", dependencies=authorized)(self.models)
        app.get("/v1/models/{model:path}", dependencies=authorized)(self.model)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        app.exception_handler(APIError)(self._api_error)
        app.exception_handler(RequestValidationError)(self._validation_error)
        app.exception_handler(StarletteHTTPException)(self._http_error)
        app.exception_handler(GraphmeshError)(self._graphmesh_error)
        return app

    async def _api_error(self, request: Request, error: Exception) -> Response:
        return api_error(error).response()

    async def _graphmesh_error(self, request: Request, error: Exception) -> Response:
        return api_error(error).response()

    async def _validation_error(self, request: Request, error: Exception) -> Response:
        """FastAPI answers a body that does not parse with 422; OpenAI (and its clients) expect 400."""
        assert isinstance(error, RequestValidationError)
        errors = error.errors()
        first = errors[0] if errors else {}
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', '')}"
                            for e in errors[:5])
        return bad(message or "the request body is not valid", ".".join(where) or "body").response()

    async def _http_error(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, StarletteHTTPException)
        type_ = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return APIError(error.status_code, str(error.detail), type_).response()

    async def _authorize(self, request: Request) -> None:
        if not self._expected:
            return
        sent = request.headers.get("authorization", "")
        # compare_digest: the time taken must not reveal how much of a guessed token was right
        if not sent or not hmac.compare_digest(sent.encode(), self._expected.encode()):
            raise api_error(Unauthenticated("this API needs 'Authorization: Bearer <token>'" if not sent
                                            else "the bearer token is wrong", "MISSING_TOKEN" if not sent
                                            else "BAD_TOKEN"))

    async def health(self) -> Response:
        return self.health_response()

    def health_response(self) -> Response:
        """/health's answer, on any thread (plain-HTTP probes are answered on http_limits.Acceptor's)."""
        if self.leader_gate is not None:
            try:
                self.leader_gate()
            except GraphmeshError as e:
                return api_error(e).response()
        if self.upstream.ready():
            return PlainTextResponse("ok")
        return PlainTextResponse("the mesh is not ready (starting or recovering)", 503, headers={"Retry-After": "1"})

    async def metrics(self) -> Response:
        return Response(generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "graphmesh",
                "max_model_len": self.upstream.context_tokens}

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str) -> dict[str, Any]:
        self._check_model(model)
        return self._model_card()

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise api_error(NotFound(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                                     "MODEL_NOT_FOUND", {"parameter": "model"}))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return await self._serve("chat", body, request)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return await self._serve("text_completion", body, request)

    # -- requests --
    def parse(self, operation: Literal["chat", "text_completion"], body: ChatCompletionRequest | CompletionRequest) -> Call:
        """The request's prompts as token ids and its sessions, checked as Generate checks them. Runs on a worker
        thread: tokenizing a long prompt must not hold up every other stream on the event loop."""
        self._check_model(body.model)
        check_unsupported(body)
        tokenizer, model = self.upstream.tokenizer, self.model_name
        tool_format, tool_prefix = tool_calls.HERMES, ""
        if isinstance(body, ChatCompletionRequest):
            if not body.messages:
                raise bad("messages must not be empty", "messages")
            chat = [message_text(m, i) for i, m in enumerate(body.messages)]
            functions = tool_calls.functions(body.tools)
            tool_format = tool_calls.format_of(tokenizer) if tokenizer is not None else tool_calls.HERMES
            choice, guided = structured.tool_choice(body.tool_choice, functions, tool_format)
            offered = functions if choice != "none" else []
            if offered or any(m.tool_calls or m.role == "tool" for m in body.messages):
                if tokenizer is None:
                    raise bad("tools need the model's tokenizer", "tools")
                ids, tool_prefix = tool_calls.encode(
                    tokenizer, [{"role": r, "content": c, "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id}
                                for (r, c), m in zip(chat, body.messages)], offered, tool_format, guided is not None)
                prompts = [ids]
            else:
                prompts = [prompt_token_ids(tokenizer, model, messages=chat)]
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            logprobs, top = body.logprobs, body.top_logprobs or 0
            if top and not logprobs:
                raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        else:
            prompt = body.prompt
            if isinstance(prompt, str):
                prompts = [prompt_token_ids(tokenizer, model, prompt=prompt, raw=True)]
            elif prompt and all(isinstance(p, int) for p in prompt):
                prompts = [[int(t) for t in prompt]]  # type: ignore[arg-type]
            else:
                if not prompt:
                    raise bad("the prompt is empty", "prompt", "empty_prompt")
                if len(prompt) > MAX_PROMPTS:
                    raise bad(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}", "prompt")
                prompts = [prompt_token_ids(tokenizer, model, prompt=p, raw=True) if isinstance(p, str)
                           else [int(t) for t in p] if isinstance(p, list) else [p] for p in prompt]
            max_tokens = body.max_tokens
            logprobs, top = body.logprobs is not None, body.logprobs or 0
        if len(prompts) * body.n > MAX_CHOICES:
            raise bad(f"{len(prompts)} prompts x n={body.n} is more than {MAX_CHOICES} choices", "n")
        formatted = structured.response_format(body.response_format)
        if isinstance(body, ChatCompletionRequest):
            if guided is not None and formatted is not None:
                raise bad("response_format cannot be combined with a required or named tool_choice", "response_format")
            kind = "tool_call" if guided is not None else formatted.kind if formatted is not None else \
                "tools" if offered else "text"
            guided = guided or formatted
        else:
            guided, kind = formatted, formatted.kind if formatted is not None else "text"
        stop = stop_strings(body.stop)
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        requests = []
        for ids in prompts:
            context = self.upstream.context_tokens
            if max_tokens is not None and len(ids) < context < len(ids) + max_tokens:
                # Generate quietly stops at the context; an OpenAI client expects to be told, as OpenAI and vLLM do.
                raise APIError(400, f"the context holds {context} tokens: {len(ids)} in the prompt and "
                               f"{max_tokens} to generate do not fit", "invalid_request_error",
                               "context_length_exceeded", "max_tokens")
            for i in range(body.n):
                # A seed makes a request reproducible; its choices differ from each other because each draws with
                # its own. Without one, every choice draws with a fresh random seed (OpenAI's behaviour).
                seed = (body.seed + i) & _SEED_MASK if body.seed is not None else secrets.randbits(63)
                # the default must never be a request that is refused for not fitting
                budget = max_tokens if max_tokens is not None else max(1, self.upstream.session_tokens - len(ids))
                request = GenerationRequest(ids, budget, temperature, body.top_k or 0, top_p, seed, stop,
                                            body.ignore_eos, logprobs, top, guided=guided,
                                            speculative=speculative.from_json(body.speculative, self.upstream.speculative))
                validate(request, context, self.upstream.vocab_size)
                requests.append(request)
        structured.count(kind)
        tools = isinstance(body, ChatCompletionRequest) and kind in ("tool_call", "tools")
        parallel = not isinstance(body, ChatCompletionRequest) or body.parallel_tool_calls is not False
        return Call(operation, body, prompts, requests, logprobs, top, max_tokens, tools, parallel,
                     tool_format, tool_prefix)

    async def _serve(self, operation: Literal["chat", "text_completion"], body: ChatCompletionRequest | CompletionRequest,
                     request: Request) -> Response:
        t0 = time.perf_counter()
        response_id = ("chatcmpl-" if operation == "chat" else "cmpl-") + uuid.uuid4().hex
        usage = genai.Usage()
        span = telemetry.start_request_span(genai.span_name(operation, body.model), dict(request.headers),
                                            self._request_attributes(operation, body, request))
        try:
            if self.leader_gate is not None:
                self.leader_gate()
            call = await asyncio.get_running_loop().run_in_executor(self.pool, self.parse, operation, body)
            usage.input_tokens = sum(len(p) for p in call.prompts)
            # Queued with every other generation (the Generator's --max-waiting-requests: 429 past it), waiting out
            # a mesh that is not ready for ready_wait_s (503 after)
            sessions = Sessions(self.upstream, call.requests, span, self.pool, self.ready_wait_s)
            choices = [_Choice(i, len(call.prompts[i // body.n])) for i in range(len(call.requests))]
            try:
                first = await sessions.queue.get()  # an error before the first token is an HTTP status, not an event
                if isinstance(first[1], BaseException):
                    raise first[1]
                if call.stream:
                    stream = self._stream(call, sessions, choices, first, response_id, usage, span, t0)
                    return StreamingResponse(stream, media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                await self._collect(call, sessions, choices, first, request, t0)
            except BaseException:
                sessions.cancel()
                raise
            self._done(call, choices, usage, response_id, span, t0)
            return JSONResponse(self._full_response(call, choices, response_id, usage))
        except Exception as e:
            error = api_error(e)
            self._failed(operation, usage, response_id, span, t0, error.code or error.type)
            raise error from None
        except asyncio.CancelledError:
            self._failed(operation, usage, response_id, span, t0, "cancelled")
            raise

    def _failed(self, operation: str, usage: genai.Usage, response_id: str, span: Span, t0: float,
                error_type: str) -> None:
        # Labelled with the served model even when the request named another: a label taken from requests would
        # let any client add time series without bound.
        genai.record(operation, self.model_name, usage, time.perf_counter() - t0, error_type)
        genai.finish_span(span, response_id, self.model_name, usage, error_type)

    def _request_attributes(self, operation: str, body: GenerationBody, request: Request) -> dict[str, Any]:
        max_tokens = body.max_completion_tokens if isinstance(body, ChatCompletionRequest) and \
            body.max_completion_tokens is not None else body.max_tokens
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return genai.request_attributes(operation, body.model, max_tokens=max_tokens,
                                        temperature=1.0 if body.temperature is None else body.temperature,
                                        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                                        seed=body.seed, stop=stop, choices=body.n,
                                        server_address=request.url.hostname or "", server_port=request.url.port or 0)

    def _apply(self, call: Call, choice: _Choice, event: Event, t0: float) -> None:
        """One event of a choice: its text, tokens and logprobs, and the time-to-first-token metric."""
        now = time.perf_counter()
        if not choice.tokens and event.token_ids:
            choice.first_token_at = now
            genai.TIME_TO_FIRST_TOKEN.labels(call.operation, self.model_name).observe(now - t0)
        choice.tokens += len(event.token_ids)
        choice.text += event.text
        choice.logprobs += event.logprobs
        if event.finish_reason:
            choice.finish_reason = FINISH.get(event.finish_reason, "stop")

    def _end(self, call: Call, choice: _Choice) -> None:
        choice.done = True
        if choice.tokens > 1:
            per_token = (time.perf_counter() - choice.first_token_at) / (choice.tokens - 1)
            genai.TIME_PER_OUTPUT_TOKEN.labels(call.operation, self.model_name).observe(per_token)

    async def _collect(self, call: Call, sessions: Sessions, choices: list[_Choice],
                       first: tuple[int, Event | BaseException | None], request: Request, t0: float) -> None:
        item: tuple[int, Event | BaseException | None] | None = first
        while not all(c.done for c in choices):
            if item is None:
                try:
                    item = await asyncio.wait_for(sessions.queue.get(), _DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():  # nobody will read the answer: stop generating
                        raise APIError(499, "the client closed the connection", "cancelled", "client_disconnected") \
                            from None
                    continue
            index, event = item
            item = None
            if isinstance(event, BaseException):
                raise event
            if event is None:
                self._end(call, choices[index])
            else:
                self._apply(call, choices[index], event, t0)

    def _done(self, call: Call, choices: list[_Choice], usage: genai.Usage, response_id: str, span: Span,
              t0: float) -> None:
        usage.output_tokens = sum(c.tokens for c in choices)
        usage.finish_reasons = [c.finish_reason for c in choices]
        genai.record(call.operation, self.model_name, usage, time.perf_counter() - t0)
        genai.finish_span(span, response_id, self.model_name, usage)

    @staticmethod
    def _usage(usage: genai.Usage) -> dict[str, int]:
        return {"prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
                "total_tokens": usage.input_tokens + usage.output_tokens}

    # -- responses --
    def _logprobs(self, call: Call, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        if not call.logprobs:
            return None
        text = self._token_text
        if call.operation == "chat":
            return {"content": [{"token": text(e.token_id), "logprob": e.logprob, "bytes": list(text(e.token_id).encode()),
                                 "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
                                                  for t, lp in e.top]} for e in entries]}
        tokens = [text(e.token_id) for e in entries]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]  # into this piece of text
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries] if call.top_logprobs else None,
                "text_offset": offsets}

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.upstream.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    def _full_response(self, call: Call, choices: list[_Choice], response_id: str, usage: genai.Usage) -> dict[str, Any]:
        out: list[dict[str, Any]] = []
        for c in choices:
            if call.operation == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                finish = c.finish_reason
                if call.tools:
                    content, calls = tool_calls.parse(c.text, call.tool_format, call.tool_prefix)
                    if calls:
                        calls = calls if call.parallel_tool_calls else calls[:1]
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                        finish = "tool_calls" if finish == "stop" else finish
                out.append({"index": c.index, "message": message, "logprobs": self._logprobs(call, c.logprobs),
                            "finish_reason": finish})
            else:
                out.append({"index": c.index, "text": c.text, "logprobs": self._logprobs(call, c.logprobs),
                            "finish_reason": c.finish_reason})
        return {"id": response_id, "object": "chat.completion" if call.operation == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": out, "usage": self._usage(usage),
                "system_fingerprint": None}

    def _chunk(self, call: Call, response_id: str, created: int, choices: list[dict[str, Any]],
               usage: dict[str, int] | None = None) -> bytes:
        chunk: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk" if call.operation == "chat"
                                 else "text_completion", "created": created, "model": self.model_name, "choices": choices}
        if call.include_usage:
            chunk["usage"] = usage
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def _delta(self, call: Call, index: int, text: str, logprobs: list[TokenLogprob], finish: str | None,
               role: bool = False) -> dict[str, Any]:
        if call.operation == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text} if text \
                else {}
            return {"index": index, "delta": delta, "logprobs": self._logprobs(call, logprobs) if logprobs else None,
                    "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": self._logprobs(call, logprobs) if logprobs else None,
                "finish_reason": finish}

    def _tool_deltas(self, call: Call, parser: tool_calls.StreamParser | tool_calls.JsonCallsParser, index: int,
                     event: Event) -> list[dict[str, Any]]:
        """A chat choice's deltas when tools were offered: content as soon as it cannot be the start of a call, each
        call whole once it closes (OpenAI's tool_calls deltas), finish_reason tool_calls when there were any."""
        had = len(parser.calls)
        text, calls = parser.feed(event.text)
        if not call.parallel_tool_calls:
            calls = calls[: max(0, 1 - had)]
            del parser.calls[1:]
        if event.finish_reason:
            text += parser.finish()
        deltas = []
        if text or (call.logprobs and event.logprobs):
            deltas.append(self._delta(call, index, text, event.logprobs, None))
        if calls:
            deltas.append({"index": index, "delta": {"tool_calls": tool_calls.call_deltas(calls, had)},
                           "logprobs": None, "finish_reason": None})
        if event.finish_reason:
            finish = FINISH.get(event.finish_reason, "stop")
            deltas.append(self._delta(call, index, "", [], "tool_calls" if parser.calls and finish == "stop"
                                      else finish))
        return deltas

    async def _stream(self, call: Call, sessions: Sessions, choices: list[_Choice],
                      first: tuple[int, Event | BaseException | None], response_id: str, usage: genai.Usage, span: Span,
                      t0: float) -> AsyncIterator[bytes]:
        """The SSE body. Starlette cancels it when the client disconnects; `finally` then ends the sessions."""
        created, error, recorded = int(time.time()), "cancelled", False  # "cancelled" until it ends otherwise
        try:
            if call.operation == "chat":  # OpenAI opens every choice with the assistant's role
                yield self._chunk(call, response_id, created, [self._delta(call, c.index, "", [], None, role=True)
                                                               for c in choices])
            parsers = {c.index: call.tool_parser() for c in choices} if call.tools else {}
            item: tuple[int, Event | BaseException | None] | None = first
            while not all(c.done for c in choices):
                index, event = item if item is not None else await sessions.queue.get()
                item = None
                choice = choices[index]
                if isinstance(event, BaseException):  # a choice failed after the 200 was sent: an error event
                    failure = api_error(event)
                    error = failure.code or failure.type
                    yield b"data: " + json.dumps(failure.body()).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    return
                if event is None:
                    self._end(call, choice)
                    continue
                self._apply(call, choice, event, t0)
                if index in parsers:
                    for delta in self._tool_deltas(call, parsers[index], index, event):
                        yield self._chunk(call, response_id, created, [delta])
                    continue
                if event.text or event.finish_reason or (call.logprobs and event.logprobs):
                    finish = FINISH.get(event.finish_reason, "stop") if event.finish_reason else None
                    yield self._chunk(call, response_id, created,
                                      [self._delta(call, index, event.text, event.logprobs, finish)])
            self._done(call, choices, usage, response_id, span, t0)
            recorded = True
            if call.include_usage:
                yield self._chunk(call, response_id, created, [], self._usage(usage))
            yield b"data: [DONE]\n\n"
        finally:
            sessions.cancel()
            if not recorded:
                usage.output_tokens = sum(c.tokens for c in choices)
                self._failed(call.operation, usage, response_id, span, t0, error)

    # -- lifecycle --
    def start(self, listen: str, tls: Tls | None = None, max_connections: int = 0) -> int:
        """Binds `listen` (HOST:PORT; port 0 picks one) and serves in a thread; returns the port. With TLS the
        API serves the coordinator's certificate and, under mutual TLS, requires a client certificate of its CA.
        At most `max_connections` connections are open (0: http_limits.default_max_connections()); more are closed
        as they are accepted, and one that completes no request's headers within http_limits.REQUEST_TIMEOUT_S
        is closed, on plain HTTP as under TLS."""
        host, _, port_text = listen.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port_text)))  # here, so a port in use fails the coordinator's start, not a thread
        sock.listen(2048)
        tls_args = self._tls_args(tls) if tls is not None else {}
        self._serving = http_limits.serve(self.app, sock, lambda: http_limits.response_bytes(self.health_response()),
                                          max_connections, log_level="warning", access_log=False,
                                          timeout_graceful_shutdown=2, timeout_keep_alive=5, **tls_args)
        self.address, self.port = host, int(sock.getsockname()[1])
        return self.port

    def _tls_args(self, tls: Tls) -> dict[str, Any]:
        """uvicorn reads certificates from files: the PEMs go to a private temporary directory."""
        self._tls_dir = tempfile.TemporaryDirectory(prefix="graphmesh-http-tls-")
        root = Path(self._tls_dir.name)
        files = {"cert.pem": tls.cert, "key.pem": tls.key, **({"ca.pem": tls.ca} if tls.ca else {})}
        for name, data in files.items():
            (root / name).write_bytes(data)
            (root / name).chmod(0o600)
        args: dict[str, Any] = {"ssl_certfile": str(root / "cert.pem"), "ssl_keyfile": str(root / "key.pem")}
        if tls.ca:
            args.update(ssl_ca_certs=str(root / "ca.pem"), ssl_cert_reqs=ssl.CERT_REQUIRED)
        return args

    def stop(self) -> None:
        if self._serving is not None:
            self._serving.stop()
        if self._tls_dir is not None:
            self._tls_dir.cleanup()
