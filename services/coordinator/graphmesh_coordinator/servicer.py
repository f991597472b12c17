"""gRPC translation of CoordinatorService over the Generator and the Mesh."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent import futures
from typing import Any, cast

import grpc
from google.rpc import status_pb2

from graphmesh import plan as dag
from graphmesh import tensors
from graphmesh.coordinator_client import FINISH_REASONS
from graphmesh.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from graphmesh.tokenizer import Tokenizer
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2
from graphmesh_coordinator import guided, speculative
from graphmesh_coordinator.failures import public_error
from graphmesh_coordinator.generation import Event, GenerationRequest, Generator
from graphmesh_coordinator.pipeline import Mesh
from graphmesh_server import telemetry
from graphmesh_server.aio_serving import Wait, aiterate
from graphmesh_server.bootstrap import ServerSecurity
from graphmesh_server.policy import GENERATE, MESH

log = logging.getLogger("graphmesh.coordinator")
RECOVERY_WAIT_S = 120.0
STREAM_WORKERS = 32  # threads that run the code of GenerateStreams' calls (each only while it runs: Waits)
_OK = status_pb2.Status().SerializeToString()
_CANCELLED = status_pb2.Status(code=grpc.StatusCode.CANCELLED.value[0], message="cancelled by the caller").SerializeToString()

_FINISH: dict[str, coordinator_pb2.FinishReason.ValueType] = {name: kind for kind, name in FINISH_REASONS.items()}


def as_status(error: BaseException) -> grpc.Status:
    """A failure as the gRPC status its caller gets (failures.public_error), here and on KServe."""
    return public_error(error).to_status()


def prompt_token_ids(tokenizer: Tokenizer | None, model_name: str, *, prompt: str = "", raw: bool = False,
                     messages: Sequence[tuple[str, str]] = (), token_ids: Sequence[int] = (),
                     parse_special: bool = False) -> list[int]:
    """A request's prompt as token ids, shared by every API: token ids win over text, a chat (role, content)
    wins over a prompt, and a prompt is one user message of the chat template unless it is raw. What the user
    typed is text: "<|im_start|>" in it becomes control tokens only when the request sets parse_special (else
    a user could forge turns of the conversation, a system prompt among them)."""
    if token_ids:
        return list(token_ids)
    if tokenizer is None:
        raise FailedPrecondition(f"model {model_name!r} has no tokenizer: send prompt_token_ids", "NO_TOKENIZER")
    if messages:
        return tokenizer.encode_chat([{"role": r, "content": c} for r, c in messages], parse_special=parse_special)
    if not prompt:
        raise InvalidArgument("the prompt is empty", "EMPTY_PROMPT")
    if raw:
        return tokenizer.encode(prompt) if parse_special else tokenizer.encode_text(prompt)
    return tokenizer.encode_chat([{"role": "user", "content": prompt}], parse_special=parse_special)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, generator: Generator, mesh: Mesh, model_name: str,
                 security: ServerSecurity | None = None, leader_gate: Callable[[], None] | None = None) -> None:
        """leader_gate raises (UNAVAILABLE, NOT_LEADER) unless this coordinator leads its cluster: a standby or a
        leader that stepped down refuses at once rather than waiting for a mesh it will never drive."""
        self.generator, self.mesh, self.model_name = generator, mesh, model_name
        self.security = security or ServerSecurity()
        self.leader_gate = leader_gate
        self._pool = futures.ThreadPoolExecutor(STREAM_WORKERS, thread_name_prefix="generate-streams")

    def _check_model(self, model: str, wait_ready: bool = True) -> None:
        if self.leader_gate is not None:
            self.leader_gate()
        if model and model != self.model_name:
            raise NotFound(f"unknown model {model!r}; this coordinator serves {self.model_name!r}", "UNKNOWN_MODEL")
        if wait_ready and not self.mesh.wait_ready(RECOVERY_WAIT_S):
            raise Unavailable(f"the mesh has not been ready for {RECOVERY_WAIT_S:.0f} s", "MESH_NOT_READY")

    def Generate(self, request: coordinator_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[Any]:  # GenerateResponses, and Waits (an AioServer's)
        """Not behind the admission limit (graphmesh_server.policy.QUEUED): the Generator queues it (--max-waiting-requests).
        Served by an AioServer, it yields Waits instead of blocking, so a queued stream holds no thread."""
        try:
            self._check_model(request.model, wait_ready=False)  # the Generator waits for the mesh, as queued
            prompt_ids = prompt_token_ids(self.generator.tokenizer, self.model_name, prompt=request.prompt,
                                          raw=request.raw, messages=[(m.role, m.content) for m in request.messages],
                                          token_ids=request.prompt_token_ids,
                                          parse_special=request.parse_special_tokens)
            s = request.sampling
            gen = GenerationRequest(prompt_ids, request.max_tokens, s.temperature, s.top_k, s.top_p or 1.0, s.seed,
                                    tuple(request.stop), request.ignore_eos, resume_ids=tuple(request.resume_token_ids),
                                    encoder_input=tensors.from_proto(request.encoder_input)
                                    if request.HasField("encoder_input") else None,
                                    guided=guided.from_proto(request.guided),
                                    speculative=speculative.from_proto(request.speculative, self.generator.speculative)
                                    if request.HasField("speculative") else None,
                                    logprobs=request.logprobs, top_logprobs=request.top_logprobs,
                                    skip_text=request.skip_text)
            first = True
            events = (self.generator.generate_waiting if getattr(context, "yields_waits", False)
                      else self.generator.generate)(gen, alive=context.is_active, ready_wait_s=RECOVERY_WAIT_S)
            for event in events:
                if isinstance(event, Wait):
                    yield event
                    continue
                yield self._response(event, prompt_ids if first else None)
                first = False
        except Exception as e:
            context.abort_with_status(as_status(e))

    async def GenerateStreams(self, requests: AsyncIterator[coordinator_pb2.GenerateStreamsRequest],
                              context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        """Generate calls over one stream, each run as Generate runs it (its code on this servicer's pool while it
        runs, its waits on the loop), their responses gathered: a message carries every response ready when it is
        written, which at hundreds of calls is a step's worth. A bad or failed call ends with its status in-band; the id
        of a call still running ends the stream (INVALID_ARGUMENT: its events could not be told apart). Once the
        caller closes its side, the stream ends after the calls it started; if the caller leaves, every call ends."""
        # events, then None once every call ended; or the caller's protocol error, which ends the stream
        out: asyncio.Queue[coordinator_pb2.GenerateStreamsEvent | InvalidArgument | None] = asyncio.Queue()
        running: dict[int, asyncio.Task[None]] = {}

        def ended(call_id: int, status: bytes) -> None:
            out.put_nowait(coordinator_pb2.GenerateStreamsEvent(id=call_id, status=status))

        async def serve(call_id: int, request: coordinator_pb2.GenerateStreamsRequest) -> None:
            call = _Multiplexed(lambda: not context.done())
            span = telemetry.start_rpc_span(GENERATE, request.trace_context)  # as a Generate call's own
            code, details = grpc.StatusCode.OK, ""

            def events() -> Iterator[Any]:
                with telemetry.use(span):  # the Generator's spans and the steps join the call's trace
                    yield from self.Generate(request.generate, cast(grpc.ServicerContext, call))
            try:
                async for response in aiterate(self._pool, events):
                    out.put_nowait(coordinator_pb2.GenerateStreamsEvent(id=call_id, response=response))
                ended(call_id, _OK)
            except _Ended as e:
                ended(call_id, e.status)
                code, details = e.code, str(e)
            except asyncio.CancelledError:
                ended(call_id, _CANCELLED)  # the caller's cancel (the iterator is closed: the session ends)
                code = grpc.StatusCode.CANCELLED
            except Exception as e:  # not one of Generate's own (those end the call with their status)
                error = public_error(e)
                ended(call_id, error.to_status_proto().SerializeToString())
                code, details = error.code, error.message
            finally:
                running.pop(call_id, None)
                telemetry.finish_rpc_span(span, code, details)

        async def read() -> None:
            try:
                async for request in requests:
                    action = request.WhichOneof("action")
                    if action == "generate" and request.id in running:  # its events would be taken for the other's
                        out.put_nowait(InvalidArgument(f"call {request.id} is running already: an id names one call "
                                                       "until it ended", "DUPLICATE_CALL_ID"))
                        return
                    if action == "generate":
                        running[request.id] = asyncio.create_task(serve(request.id, request))
                    elif action == "cancel":
                        task = running.get(request.id)
                        if task is not None:
                            task.cancel()
                    else:
                        ended(request.id, InvalidArgument(f"call {request.id} has neither generate nor cancel",
                                                          "BAD_STREAM_CALL").to_status_proto().SerializeToString())
            finally:  # the caller closed its side, or left (then the calls see context.done() and end)
                await asyncio.gather(*running.values(), return_exceptions=True)
                out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            item = await out.get()
            while isinstance(item, coordinator_pb2.GenerateStreamsEvent):
                events = [item]
                while not out.empty() and isinstance(item := out.get_nowait(), coordinator_pb2.GenerateStreamsEvent):
                    events.append(item)
                yield coordinator_pb2.GenerateStreamsResponse(events=events)
                if isinstance(item, coordinator_pb2.GenerateStreamsEvent):
                    item = await out.get()
            if item is not None:
                status = item.to_status()
                await context.abort(status.code, status.details, status.trailing_metadata)
        finally:
            reader.cancel()
            for task in list(running.values()):
                task.cancel()

    @staticmethod
    def _response(event: Event, prompt_ids: list[int] | None) -> coordinator_pb2.GenerateResponse:
        response = coordinator_pb2.GenerateResponse(token_ids=event.token_ids, text=event.text,
                                                    finish_reason=_FINISH.get(event.finish_reason,
                                                                              coordinator_pb2.FINISH_REASON_UNSPECIFIED),
                                                    ttft_ms=event.ttft_ms, session_id=event.session_id,
                                                    prefill_computed_tokens=event.prefill_computed_tokens)
        if prompt_ids is not None:
            response.prompt_token_ids.extend(prompt_ids)
        for lp in event.logprobs:
            response.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                                  top=[stage_pb2.TokenLogprob(token_id=t, logprob=p) for t, p in lp.top])
        return response

    def ComputeLogits(self, request: coordinator_pb2.ComputeLogitsRequest,
                      context: grpc.ServicerContext) -> coordinator_pb2.ComputeLogitsResponse:
        try:
            self._check_model(request.model)
            logits = self.generator.logits(list(request.token_ids))
            return coordinator_pb2.ComputeLogitsResponse(logits=tensors.to_proto(logits))
        except Exception as e:
            context.abort_with_status(as_status(e))
            raise

    def Status(self, request: coordinator_pb2.StatusRequest,
               context: grpc.ServicerContext) -> coordinator_pb2.StatusResponse:
        mesh = self.mesh
        response = coordinator_pb2.StatusResponse(model=self.model_name, incarnation=mesh.incarnation,
                                                  recoveries=mesh.recoveries, ready=mesh.ready,
                                                  speculative=str(self.generator.speculative),
                                                  context_tokens=self.generator.context_tokens,
                                                  session_tokens=self.generator.session_tokens,
                                                  vocab_size=mesh.config.vocab_size,
                                                  max_prompt_bytes=self.generator.tokenizer.max_input_bytes
                                                  if self.generator.tokenizer is not None else 0)
        if mesh.plan is not None:
            response.plan.CopyFrom(dag.to_proto(mesh.plan))
        for rank in mesh.ranks:
            p = rank.plan
            response.stages.add(rank=p.rank, address=p.address, layer_start=p.layer_start, layer_end=p.layer_end,
                                backend=rank.backend, device=rank.device, healthy=rank.healthy,
                                param_bytes=rank.param_bytes)
        sessions = list(self.generator.sessions.values())
        response.active_sessions = len(sessions)
        # Session ids are other users' business: a client sees how many there are, a mesh member (an operator
        # with the mesh token or a role certificate) sees which.
        if self.security.caller_roles(context) & MESH:
            for info in sessions:
                response.sessions.add(session_id=info.session_id, tokens=info.tokens, epoch=info.epoch)
        return response


class _Ended(Exception):
    """A call of GenerateStreams ended with a status other than OK (Generate aborted it)."""

    def __init__(self, status: grpc.Status) -> None:
        super().__init__(status.details)
        self.code = status.code
        details = dict(status.trailing_metadata or ()).get("grpc-status-details-bin")
        self.status = details if isinstance(details, bytes) else status_pb2.Status(
            code=status.code.value[0], message=status.details).SerializeToString()


class _Multiplexed:
    """What Generate uses of its ServicerContext, for a call of GenerateStreams: it waits without a thread (Waits),
    it is active while its stream is, and aborting it ends only it."""

    yields_waits = True

    def __init__(self, stream_active: Callable[[], bool]) -> None:
        self._stream_active = stream_active

    def is_active(self) -> bool:
        return self._stream_active()

    def abort_with_status(self, status: grpc.Status) -> None:
        raise _Ended(status)
