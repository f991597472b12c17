"""graphmesh-frontend: CoordinatorService, KServe v2 and the OpenAI HTTP API for clients, in a process of its own.

Each client's Generate stream costs the process that serves it a gRPC call of its own (its HTTP/2 stream, a
message per response, its start and end): at hundreds of streams that was a fifth of a core of the coordinator,
whose GIL also runs the scheduler (bench/RESULTS.md, "One stream for many calls"). A front end takes those calls and
relays them to the coordinator over one GenerateStreams stream, where a message carries every response ready at
once; several front ends share one coordinator. Status and ComputeLogits are forwarded as they are. With the
model's tokenizer (--model) it also serves KServe v2 (kserve.py), its requests parsed and answered here and their
sessions relayed the same way.

With --http-listen it serves the OpenAI API too, as vLLM's API server process does: it parses each request
(tokenizing its chat with the model's tokenizer, --model), relays its choices as Generate calls over a stream of its
own, and writes their JSON or Server-Sent Events, so that of an HTTP request the coordinator does only what a gRPC
one costs it. What it needs of the model beyond the tokenizer (the context, what one session may hold, the
vocabulary, the default speculation) is the coordinator's Status, read each time the coordinator turns serving."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from opentelemetry import trace

from graphmesh import errors, tensors
from graphmesh.bundled import resolve_model
from graphmesh.channels import KEEPALIVE_OPTIONS, MESSAGE_OPTIONS, open_channel
from graphmesh.checkpoints import open_checkpoint
from graphmesh.coordinator_client import FINISH_REASONS
from graphmesh.errors import NotFound, Unavailable
from graphmesh.kserve import grpc_service_pb2 as kserve_pb2
from graphmesh.kserve import grpc_service_pb2_grpc as kserve_grpc
from graphmesh.security import Tls, bearer, read_token
from graphmesh.tokenizer import Tokenizer
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2
from graphmesh_coordinator import guided, http_api, speculative
from graphmesh_coordinator.generation import Detokenizer, Event, GenerationRequest, TokenLogprob
from graphmesh_coordinator.http_api import HttpApi
from graphmesh_coordinator.kserve import KServeServicer
from graphmesh_coordinator.servicer import as_status, prompt_token_ids
from graphmesh_coordinator.speculative import Mode
from graphmesh_server import bootstrap, logs, telemetry
from graphmesh_server.aio_serving import AioServer, MirroredHealth
from graphmesh_server.bootstrap import ServerSecurity
from graphmesh_server.policy import GENERATE
from graphmesh_server.serving import run_until_signalled

if TYPE_CHECKING:
    from graphmesh_coordinator.openai_server import OpenAIServer
    from graphmesh_coordinator.upstream import Sessions

log = logging.getLogger("graphmesh.frontend")
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, as the client's metadata carries it
HEALTH_RETRY_S = 1.0  # between watches of the coordinator's health, while it cannot be reached
TOKENIZE_WORKERS = 4  # threads tokenizing relayed calls' prompts


class _StreamEnded(Exception):
    """The relay's stream to the coordinator ended while a call was on it."""


class Relay:
    """Generate calls to one coordinator over one GenerateStreams stream, opened when the first call comes and again
    after it ends. A call's events come to it through a queue of its own, so a slow client holds up no other; a call
    whose client leaves is cancelled on the stream (its session ends, its KV is released)."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]]) -> None:
        # Any: the generated stub types its calls as a synchronous channel's
        self._stub: Any = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        self._metadata = tuple(metadata)
        self._stream: _Stream | None = None
        self.streams_opened = 0

    @property
    def calls(self) -> int:
        """Calls on their way now."""
        return len(self._stream.calls) if self._stream is not None else 0

    async def generate(self, request: coordinator_pb2.GenerateRequest,
                       trace_context: Mapping[str, str]) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        """The call's responses; it ends as the coordinator's Generate would (_CallFailed with its status), or with
        _StreamEnded. trace_context: the W3C trace context the coordinator's work on it joins."""
        if self._stream is None or self._stream.ended:
            self._stream = _Stream(self._stub, self._metadata)
            self.streams_opened += 1
        async for response in self._stream.call(request, trace_context):
            yield response

    async def logits(self, request: coordinator_pb2.ComputeLogitsRequest,
                     trace_context: Mapping[str, str]) -> coordinator_pb2.ComputeLogitsResponse:
        """The coordinator's ComputeLogits (a unary call: one forward pass, not a stream of tokens)."""
        response: coordinator_pb2.ComputeLogitsResponse = await self._stub.ComputeLogits(
            request, metadata=(*self._metadata, *trace_context.items()))
        return response

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()


class _Stream:
    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._outbox: asyncio.Queue[coordinator_pb2.GenerateStreamsRequest | None] = asyncio.Queue()
        self.calls: dict[int, asyncio.Queue[coordinator_pb2.GenerateStreamsEvent | None]] = {}
        self._ids = itertools.count()
        self.ended = ""  # why the stream ended; "" while it runs
        self._reader = asyncio.create_task(self._read(stub, metadata))

    async def _requests(self) -> AsyncIterator[coordinator_pb2.GenerateStreamsRequest]:
        while (request := await self._outbox.get()) is not None:
            yield request

    async def _read(self, stub: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        try:
            async for message in stub.GenerateStreams(self._requests(), metadata=metadata):
                for event in message.events:
                    queue = self.calls.get(event.id)
                    if queue is not None:  # else a call that its client left, whose cancel is on its way
                        queue.put_nowait(event)
            self.ended = "the coordinator ended the stream"
        except grpc.aio.AioRpcError as e:
            self.ended = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            self.ended = "the front end is stopping"
        finally:
            if not self.ended:
                self.ended = "the stream failed"
            log.warning("the stream to the coordinator ended", extra={"why": self.ended, "calls": len(self.calls)})
            for queue in self.calls.values():
                queue.put_nowait(None)

    async def call(self, request: coordinator_pb2.GenerateRequest,
                   trace_context: Mapping[str, str]) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        if self.ended:  # before the call's first await: a stream that has not ended yet tells its calls when it does
            raise _StreamEnded(self.ended)
        call_id = next(self._ids)
        queue: asyncio.Queue[coordinator_pb2.GenerateStreamsEvent | None] = asyncio.Queue()
        self.calls[call_id] = queue
        self._outbox.put_nowait(coordinator_pb2.GenerateStreamsRequest(id=call_id, generate=request,
                                                                       trace_context=trace_context))
        over = False
        try:
            while True:
                event = await queue.get()
                if event is None:
                    over = True
                    raise _StreamEnded(self.ended)
                if event.WhichOneof("kind") == "response":
                    yield event.response
                    continue
                over = True
                status = status_pb2.Status.FromString(event.status)
                if status.code != grpc.StatusCode.OK.value[0]:
                    raise _CallFailed(status)
                return
        finally:
            del self.calls[call_id]
            if not over and not self.ended:  # the client left (or its deadline passed): end the session now
                self._outbox.put_nowait(coordinator_pb2.GenerateStreamsRequest(id=call_id, cancel=True))

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class _CallFailed(Exception):
    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self.status = status


class FrontendServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, relay: Relay, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]],
                 model: RelayUpstream | None = None) -> None:
        """model: the coordinator's model as this front end knows it (--model), whose tokenizer turns the calls'
        text into tokens and their tokens into text here, off the coordinator's GIL; None: relayed as they are."""
        self.relay = relay
        self._stub: Any = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        self._metadata = tuple(metadata)
        self._model = model
        # tokenizing a long prompt takes the thread it runs on for a while: not the loop every stream is served from
        self._pool = ThreadPoolExecutor(TOKENIZE_WORKERS, thread_name_prefix="tokenize")

    def _tokenizes(self, request: coordinator_pb2.GenerateRequest) -> bool:
        """Whether the call's text prompt is tokenized here: once this front end has read the coordinator's Status,
        for a call of the coordinator's model; one that names another model, or brings its token ids, goes as it
        is."""
        model = self._model
        return model is not None and model.tokenizer is not None and model.status is not None and \
            not request.prompt_token_ids and bool(request.prompt or request.messages) and \
            request.model in ("", model.status.model)

    def _prompt_ids(self, request: coordinator_pb2.GenerateRequest) -> list[int]:
        """The call's prompt as the coordinator would tokenize it: the same function, under the coordinator's
        --max-prompt-bytes (_tokenizes said it can)."""
        model = self._model
        assert model is not None and model.status is not None
        return prompt_token_ids(model.tokenizer, model.status.model, prompt=request.prompt, raw=request.raw,
                                messages=[(m.role, m.content) for m in request.messages],
                                parse_special=request.parse_special_tokens)

    async def Generate(self, request: coordinator_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        headers = {k: v for k, v in context.invocation_metadata() or () if k in TRACE_HEADERS and isinstance(v, str)}
        span = telemetry.start_rpc_span(GENERATE, headers)
        status: grpc.Status | None = None
        code = grpc.StatusCode.CANCELLED  # unless it ends otherwise: its client left
        try:
            ids = await asyncio.get_running_loop().run_in_executor(self._pool, self._prompt_ids, request) \
                if self._tokenizes(request) else None
            tokenizer = self._model.tokenizer if self._model is not None else None
            # the text written here, off the coordinator's GIL, unless stop strings need the coordinator's
            detok = Detokenizer(tokenizer) if tokenizer is not None and not request.stop and not request.skip_text \
                else None
            if ids is not None or detok is not None:  # the call as relayed: one copy of the client's
                relayed = coordinator_pb2.GenerateRequest()
                relayed.CopyFrom(request)
                if ids is not None:
                    relayed.ClearField("prompt")
                    relayed.ClearField("messages")
                    relayed.prompt_token_ids[:] = ids
                relayed.skip_text |= detok is not None
                request = relayed
            # the coordinator's work joins this span's trace (its client's, when it sent one)
            async for response in self.relay.generate(request, telemetry.span_carrier(span) or headers):
                if detok is not None:
                    response.text = text(response, detok)
                yield response
            code = grpc.StatusCode.OK
        except _CallFailed as e:  # the coordinator's status as it is, its ErrorInfo with it
            status = rpc_status.to_status(e.status)
        except errors.GraphmeshError as e:  # its prompt, refused here as the coordinator would
            status = as_status(e)
        except _StreamEnded as e:
            status = Unavailable(f"the front end lost its stream to the coordinator ({e}); resume or retry the call",
                                 "COORDINATOR_STREAM_LOST").to_status()
        finally:
            telemetry.finish_rpc_span(span, *((status.code, status.details) if status is not None else (code,)))
        if status is not None:
            await context.abort(status.code, status.details, status.trailing_metadata)

    async def GenerateStreams(self, requests: AsyncIterator[coordinator_pb2.GenerateStreamsRequest],
                              context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        """Not relayed: it is what a front end itself sends, so a caller that multiplexes its calls gains nothing
        here over calling the coordinator."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a front end relays Generate; call GenerateStreams on the "
                                                           "coordinator")
        yield  # an async generator, as the method streams

    async def Status(self, request: coordinator_pb2.StatusRequest,
                     context: grpc.aio.ServicerContext[Any, Any]) -> coordinator_pb2.StatusResponse:
        return await self._forward(self._stub.Status, request, context)

    async def ComputeLogits(self, request: coordinator_pb2.ComputeLogitsRequest,
                            context: grpc.aio.ServicerContext[Any, Any]) -> coordinator_pb2.ComputeLogitsResponse:
        return await self._forward(self._stub.ComputeLogits, request, context)

    async def _forward(self, method: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await method(request, metadata=self._metadata, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "", e.trailing_metadata())
            raise


def generate_request(request: GenerationRequest, skip_text: bool = False) -> coordinator_pb2.GenerateRequest:
    """A request the OpenAI API parsed, as the Generate call that runs it (the servicer's reading inverted)."""
    return coordinator_pb2.GenerateRequest(skip_text=skip_text,
        prompt_token_ids=request.prompt_ids, max_tokens=request.max_tokens,
        sampling=stage_pb2.SamplingParams(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
                                          seed=request.seed),
        stop=request.stop, ignore_eos=request.ignore_eos, resume_token_ids=request.resume_ids,
        guided=guided.to_proto(request.guided), logprobs=request.logprobs, top_logprobs=request.top_logprobs,
        speculative=speculative.to_proto(request.speculative) if request.speculative is not None else None)


def text(response: coordinator_pb2.GenerateResponse, detok: Detokenizer) -> str:
    """The text of a response the coordinator sent without (skip_text), detokenized as the Generator does: an
    end-of-sequence token that ends the completion adds none."""
    tokens = list(response.token_ids)
    return detok.push_many(tokens[:-1] if response.finish_reason == coordinator_pb2.FINISH_REASON_EOS else tokens)


def event(response: coordinator_pb2.GenerateResponse, detok: Detokenizer | None = None) -> Event:
    """A response as the Generator's Event, its text written here with `detok`."""
    return Event(list(response.token_ids), response.text if detok is None else text(response, detok),
                 FINISH_REASONS.get(response.finish_reason, ""), response.ttft_ms, response.prefill_computed_tokens,
                 response.session_id, [TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                                       for lp in response.logprobs])


class RelayUpstream:
    """The coordinator's model as a front end knows it: its tokenizer (--model) and the coordinator's Status
    (follow()), which the relayed gRPC calls' prompts and text use too; and the sessions of the APIs served here
    (KServe on the gRPC server's loop, the OpenAI API on the HTTP server's) as Generate calls to the coordinator, over
    a relay per loop (`relays`: those already open; another is opened by its loop's first request)."""

    def __init__(self, tokenizer: Tokenizer | None, open_channel: Callable[[], Awaitable[grpc.aio.Channel]],
                 metadata: Sequence[tuple[str, str]],
                 relays: Mapping[asyncio.AbstractEventLoop, Relay] | None = None) -> None:
        self._tokenizer, self._open, self._metadata = tokenizer, open_channel, tuple(metadata)
        self._relays = dict(relays or {})
        self.status: coordinator_pb2.StatusResponse | None = None  # the coordinator's, as it last turned serving
        self.serving = False

    def follow(self, channel: grpc.Channel, serving: bool) -> None:
        """The coordinator's health changed (mirror_health's thread): when it serves, its Status is read again (a
        new leader, a mesh installed afresh, may hold another KV pool)."""
        if serving:
            status = coordinator_pb2_grpc.CoordinatorServiceStub(channel).Status(
                coordinator_pb2.StatusRequest(), metadata=self._metadata, timeout=HEALTH_RETRY_S * 5)
            if self._tokenizer is not None:  # the coordinator's bound (--max-prompt-bytes) on what one request costs
                self._tokenizer.max_input_bytes = status.max_prompt_bytes
            self.status = status
        self.serving = serving

    def _status(self) -> coordinator_pb2.StatusResponse:
        if self.status is None:
            raise Unavailable("the front end has not reached the coordinator yet", "COORDINATOR_UNKNOWN")
        return self.status

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def context_tokens(self) -> int:
        return self._status().context_tokens

    @property
    def session_tokens(self) -> int:
        return self._status().session_tokens

    @property
    def vocab_size(self) -> int:
        return self._status().vocab_size

    @property
    def speculative(self) -> Mode:
        return speculative.from_status(self._status().speculative)

    def ready(self) -> bool:
        return self.serving and self.status is not None

    async def _relay(self) -> Relay:
        loop = asyncio.get_running_loop()
        if loop not in self._relays:
            channel = await self._open()
            if loop not in self._relays:  # else another request opened it meanwhile
                self._relays[loop] = Relay(channel, self._metadata)
            else:
                await channel.close()
        return self._relays[loop]

    async def events(self, request: GenerationRequest, sessions: Sessions) -> AsyncGenerator[Event, None]:
        relay = await self._relay()
        # Detokenized here, off the coordinator's GIL, unless the coordinator needs the text for stop strings.
        detok = Detokenizer(self._tokenizer) if self._tokenizer is not None and not request.stop else None
        try:
            # the coordinator's work joins the request's trace
            async for response in relay.generate(generate_request(request, detok is not None),
                                                 telemetry.span_carrier(sessions.span)):
                yield event(response, detok)
        except _CallFailed as e:  # the coordinator's status, as the API's error
            raise errors.from_status_proto(e.status) or errors.Internal(e.status.message) from None
        except _StreamEnded as e:
            raise Unavailable(f"the front end lost its stream to the coordinator ({e}); retry the request",
                              "COORDINATOR_STREAM_LOST") from None

    async def logits(self, token_ids: list[int], pool: Executor, ready_wait_s: float) -> np.ndarray:
        """The coordinator's ComputeLogits (which answers UNAVAILABLE while its mesh is not ready)."""
        relay = await self._relay()
        try:
            response = await relay.logits(coordinator_pb2.ComputeLogitsRequest(token_ids=token_ids),
                                          telemetry.span_carrier(trace.get_current_span()))
        except grpc.aio.AioRpcError as e:
            raise errors.from_rpc_error(e) from None
        return tensors.from_proto(response.logits)


def mirror_health(address: str, credentials: grpc.ChannelCredentials | None, health: MirroredHealth,
                  follow: Callable[[grpc.Channel, bool], None] | None = None) -> None:
    """The coordinator's readiness as this front end's, for ever (a thread): SERVING while it serves (a standby, a
    recovering mesh and an unreachable coordinator are NOT_SERVING), so that whatever routes clients routes them
    only where they are served. `follow` is told each change, with the channel to the coordinator."""
    with open_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                for answer in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    if follow is not None:
                        follow(channel, answer.status == health_pb2.HealthCheckResponse.SERVING)
                    health.set("", answer.status)
            except grpc.RpcError:
                pass
            if follow is not None:
                follow(channel, False)
            health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            time.sleep(HEALTH_RETRY_S)


@dataclass
class FrontendConfig:
    listen: str
    coordinator: str
    security: ServerSecurity = field(default_factory=ServerSecurity)
    coordinator_token: str = ""  # the bearer token the coordinator wants of its clients
    metrics_port: int = 0  # Prometheus /metrics; 0: off
    http: HttpApi = field(default_factory=HttpApi)  # the OpenAI HTTP API; off unless it has an address
    model: str = ""  # the coordinator's --model: its tokenizer parses HTTP requests and detokenizes relayed tokens


@dataclass
class Frontend:
    server: AioServer
    port: int
    relay: Relay
    http: OpenAIServer | None = None


def build_server(config: FrontendConfig) -> Frontend:
    server = config.security.server(64, MESSAGE_OPTIONS, (), "frontend-rpc", asynchronous=True)
    assert isinstance(server, AioServer)
    tls: Tls | None = config.security.tls

    options = [*MESSAGE_OPTIONS, *KEEPALIVE_OPTIONS]  # a frozen coordinator's stream breaks: its calls resume

    async def open_channel() -> grpc.aio.Channel:
        if tls is None:
            return grpc.aio.insecure_channel(config.coordinator, options=options)
        return grpc.aio.secure_channel(config.coordinator, tls.channel_credentials(), options=options)
    channel = server.run(open_channel())
    metadata = bearer(config.coordinator_token)
    relay = Relay(channel, metadata)
    # the coordinator's model, followed through its Status: for the calls' text, KServe and the HTTP API
    model = RelayUpstream(_tokenizer(config.model), open_channel, metadata, {server.loop: relay}) \
        if config.model else None
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(FrontendServicer(relay, channel, metadata, model),
                                                                  server)
    names = [coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name]
    if model is not None:  # KServe's requests are parsed and answered here, the coordinator's name checked here
        kserve_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(model, config.model), server)
        names.append(kserve_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name)
    health = MirroredHealth(server)
    port, _ = config.security.start(server, config.listen, names, health,
                                    {"": health_pb2.HealthCheckResponse.NOT_SERVING})
    http = None
    if config.http.listen:
        if model is None:
            raise errors.InvalidArgument("--http-listen needs --model: the HTTP API tokenizes requests with the "
                                         "coordinator's model's tokenizer", "NO_MODEL")
        http = http_api.start(config.http, model, config.model, config.security)
    threading.Thread(target=mirror_health, args=(config.coordinator, tls.channel_credentials() if tls else None, health,
                                                 model.follow if model is not None else None),
                     name="health-mirror", daemon=True).start()
    if config.metrics_port:
        telemetry.expose(
            ("graphmesh_frontend_calls", "gauge", "Generate calls relayed to the coordinator now", lambda: relay.calls),
            ("graphmesh_frontend_streams_opened", "counter", "GenerateStreams streams opened to the coordinator "
             "(one, and one more each time one ended)", lambda: relay.streams_opened))
        telemetry.serve_metrics(config.metrics_port)
    return Frontend(server, port, relay, http)


def _tokenizer(model: str) -> Tokenizer | None:
    try:
        return Tokenizer.from_checkpoint(open_checkpoint(resolve_model(model)))
    except NotFound as e:
        log.warning("no tokenizer: the HTTP API serves only token-id prompts, and relayed calls are tokenized and "
                    "detokenized by the coordinator", extra={"reason": e.message})
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="graphmesh-frontend", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:50040")
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--coordinator-token-file", default="",
                        help="file holding the bearer token the coordinator wants of its clients (its "
                             "--auth-token-file); default: none")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 is off")
    parser.add_argument("--model", default="",
                        help="the coordinator's --model (a bundled name or a checkpoint directory): its tokenizer "
                             "parses KServe's and the HTTP API's requests, tokenizes relayed calls' prompts and "
                             "writes their tokens' text (off the coordinator's GIL); needed for KServe and with "
                             "--http-listen")
    http_api.add_arguments(parser)
    bootstrap.add_arguments(parser, auth_token=True)
    args = parser.parse_args(argv)
    http = http_api.from_args(args, parser)
    logs.configure("frontend")
    telemetry.setup("graphmesh-frontend")
    try:
        config = FrontendConfig(args.listen, args.coordinator, bootstrap.from_args(args),
                                read_token(args.coordinator_token_file), args.metrics_port, http, args.model)
        running = build_server(config)
    except Exception as e:
        log.error("front end failed to start", extra={"error": str(e)})
        raise SystemExit(f"graphmesh-frontend: {e}") from e
    log.info("serving", extra={"listen": config.listen, "port": running.port, "coordinator": config.coordinator})
    try:
        run_until_signalled(running.server, grace_s=2.0)
    finally:
        if running.http is not None:
            running.http.stop()
        running.server.run(running.relay.close())


if __name__ == "__main__":
    main()
