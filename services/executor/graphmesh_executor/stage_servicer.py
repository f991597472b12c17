"""gRPC translation of the stage protocol (StageService) over StageRuntime, and the boundary pusher."""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar, cast

import grpc
import numpy as np

from graphmesh import channels, dtypes, security, tensors
from graphmesh import plan as dag
from graphmesh.errors import GraphmeshError, InvalidArgument, Unavailable, from_rpc_error, rpc
from graphmesh.links import LinkError, LinkOpener
from graphmesh.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from graphmesh_executor import transport
from graphmesh_executor.boundary_link import BoundaryLink, KvWrite, LinkListener
from graphmesh_executor.executable import DeviceValue
from graphmesh_executor.fencing import AuthorityState, Outcome, SessionPhase
from graphmesh_executor.kv_push import KvPusher, KvSource
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_types import Boundary, BoundaryValue, Sampling, StageSpec, StepRow
from graphmesh_executor.transport import Choice, DeviceSender
from graphmesh_server import telemetry

log = logging.getLogger("graphmesh.executor.stage")
R = TypeVar("R")

_OUTCOMES = {stage_pb2.EPOCH_OUTCOME_COMMITTED: Outcome.COMMITTED, stage_pb2.EPOCH_OUTCOME_ABORTED: Outcome.ABORTED}
_AUTHORITY = {AuthorityState.NONE: stage_pb2.AUTHORITY_STATE_NONE, AuthorityState.ACTIVE: stage_pb2.AUTHORITY_STATE_ACTIVE,
              AuthorityState.POISONED: stage_pb2.AUTHORITY_STATE_POISONED,
              AuthorityState.TERMINAL: stage_pb2.AUTHORITY_STATE_TERMINAL}
_PHASE = {SessionPhase.IDLE: stage_pb2.SESSION_PHASE_IDLE, SessionPhase.IN_TXN: stage_pb2.SESSION_PHASE_IN_TXN,
          SessionPhase.INDETERMINATE: stage_pb2.SESSION_PHASE_INDETERMINATE}
_OUTCOME_PB = {Outcome.NONE: stage_pb2.EPOCH_OUTCOME_UNSPECIFIED, Outcome.COMMITTED: stage_pb2.EPOCH_OUTCOME_COMMITTED,
               Outcome.ABORTED: stage_pb2.EPOCH_OUTCOME_ABORTED,
               Outcome.INDETERMINATE: stage_pb2.EPOCH_OUTCOME_INDETERMINATE}


class BoundaryPusher:
    """Pushes boundary bundles to the next ranks: over a boundary link (boundary_link.py) to each rank that has a
    listener, else with PushBoundary over one cached channel per address (TLS with this executor's certificate
    when it has one). A bundle goes out on the engine's thread when an open link can take it without blocking,
    else from one of a few sender threads per address: a next rank that stops reading must not stop this one
    computing (its pushes fail at their deadline instead). gRPC pushes
    are blocking calls there: a future call would need no thread of ours, but grpc starts a thread to poll for it
    whenever no other future call is in flight, one thread started per bundle at low load."""

    SENDERS = 4  # per address: bundles in flight to one next rank at once

    def __init__(self, tls: security.Tls | None = None, device: str = "cpu") -> None:
        self._senders: dict[str, tuple[stage_pb2_grpc.StageServiceStub, ThreadPoolExecutor]] = {}
        self._links: dict[str, BoundaryLink] = {}
        self._opener = LinkOpener()
        self._lock = threading.Lock()
        self.tls = tls
        self.links = tls is None  # links are plain TCP: a TLS mesh keeps its boundaries on gRPC
        # The transport per pair of ranks (transport.py): chosen by each next rank when a link opens.
        self.device = device
        self.transports: dict[str, Choice] = {}  # by next rank's address: what Status reports
        self._device: dict[str, tuple[BoundaryLink, DeviceSender]] = {}  # links whose receiver chose CUDA IPC
        self._strikes: dict[str, int] = {}  # failed device pushes in a row, by address
        self._chained: weakref.WeakSet[BoundaryLink] = weakref.WeakSet()  # links that carried a chained push
        self._queued: weakref.WeakSet[BoundaryLink] = weakref.WeakSet()  # links that carried a queued run

    def __call__(self, address: str, incarnation: int, boundary: Boundary, timeout_s: float,
                 delivered: Callable[[Exception | None], None]) -> None:
        if any(isinstance(v, DeviceValue) for v in boundary.values.values()):
            if self._push_chained(address, incarnation, boundary, timeout_s, delivered):
                return
            boundary = _on_host(boundary)  # the link that mapped this GPU is gone: the bundle goes as any other
        if self.links and self._push_now(address, incarnation, boundary, timeout_s, delivered):
            return
        with self._lock:
            if address not in self._senders:
                channel = channels.channel(address, self.tls)
                self._senders[address] = (stage_pb2_grpc.StageServiceStub(telemetry.traced(channel)),
                                          ThreadPoolExecutor(self.SENDERS, thread_name_prefix=f"push-{address}"))
            stub, senders = self._senders[address]
        senders.submit(self._send, stub, address, incarnation, boundary, timeout_s, delivered,
                       telemetry.current_context())

    def on_device(self, address: str) -> bool:
        """Whether a bundle to `address` may stay on the GPU (a DeviceValue): the open link there maps this GPU's
        memory, its receiver having chosen CUDA IPC."""
        return self._device_link(address) is not None

    def _device_link(self, address: str) -> tuple[BoundaryLink, DeviceSender] | None:
        """The open link to `address` that maps this GPU, and its sender, read together (a link opened meanwhile has
        a sender of its own)."""
        with self._lock:
            link = self._links.get(address)
            device = self._device.get(address)
        return device if link is not None and link.broken is None and device is not None and device[0] is link else None

    def _push_chained(self, address: str, incarnation: int, boundary: Boundary, timeout_s: float,
                      delivered: Callable[[Exception | None], None]) -> bool:
        """Sends a bundle of device values on the caller's thread (the engine's, which queued the runs that made
        them) as a DEVICE_CHAINED frame: its copy into the link's slot is queued behind those runs and nothing
        waits for them. False (nothing sent) where no open link maps this GPU or every slot is in flight."""
        device = self._device_link(address)
        if device is None:
            return False
        link = device[0]
        with telemetry.span("stage.push_boundary", step=boundary.step_id, iteration=boundary.iteration, chained=True):
            request = self._request(incarnation, boundary, data=False)
            request.trace_context.update(telemetry.carrier(telemetry.current_context()))
            return self._push_on(link, address, boundary, request, timeout_s, delivered, chained=True)

    def queue(self, address: str, incarnation: int, boundary: Boundary, bundles: int, timeout_s: float,
              delivered: Callable[[Exception | None], None]) -> transport.QueuedRun | None:
        """Sends `boundary`, of device values, as the first of a decode run's `bundles` to `address` (a DEVICE_QUEUED
        frame on the engine's thread), the later ones to go through the returned QueuedRun on the device alone. None
        (nothing sent) unless the open link there maps this GPU, its receiver computes on it too and this process
        may queue runs (transport.queued_runs), or where every slot is in flight. On GPUs of their own, ranks gain
        more from another micro-batch in between than from a run queued whole (which holds each rank's stream)."""
        device = self._device_link(address)
        if device is None or not device[1].same_gpu or not transport.queued_runs(self.device):
            return None
        link, sender = device
        with telemetry.span("stage.push_boundary", step=boundary.step_id, iteration=boundary.iteration, queued=bundles):
            request = self._request(incarnation, boundary, data=False)
            request.trace_context.update(telemetry.carrier(telemetry.current_context()))
            try:
                queued = sender.queue(request, list(boundary.values.values()), bundles)
            except Exception as e:  # a CUDA error copying into the slot: the link's GPU path failed
                self._device_failed(link, address, Unavailable(
                    f"a queued run could not start in a CUDA IPC slot: {type(e).__name__}: {e}", transport.DEVICE_FAILED))
                return None
            if queued is None:
                return None
            payload, run = queued

            def answered(error: Exception | None) -> None:
                self._answered(link, address, error)
                delivered(error)
            if link.push([payload], timeout_s, answered, kind=transport.DEVICE_QUEUED):
                if link not in self._queued:
                    self._queued.add(link)
                    log.info("decode runs queued on the device over a link", extra={"address": address})
                return run
            run.release()  # never announced: nothing will read the slot
            return None

    def _answered(self, link: BoundaryLink, address: str, error: Exception | None) -> None:
        """A push through the link's GPU path was answered: a success clears the address's strikes."""
        if error is None:
            self._strikes.pop(address, None)
        elif isinstance(error, GraphmeshError) and error.reason == transport.DEVICE_FAILED:
            self._device_failed(link, address, error)

    def _device_failed(self, link: BoundaryLink, address: str, error: GraphmeshError) -> None:
        """The link's GPU path failed: the strike is counted and the link broken, so the next push opens a new link,
        mapped anew."""
        self._strikes[address] = self._strikes.get(address, 0) + 1
        link.fail(error)

    def _push_now(self, address: str, incarnation: int, boundary: Boundary, timeout_s: float,
                  delivered: Callable[[Exception | None], None]) -> bool:
        """Sends the bundle on the caller's thread (the engine's) when the open link to `address` can take it
        without blocking; False (nothing sent) otherwise. A sender thread must take the GIL from the engine to
        send, and the engine is then usually building its next micro-batch: on the H200 host a hop took 0.59 ms
        (median) when the sender's engine went straight on to another iteration, 0.29 ms when it idled."""
        with self._lock:
            link = self._links.get(address)
            device = self._device.get(address)
        if link is None or link.broken is not None:
            return False
        if device is not None and device[0] is link and _nbytes(boundary) >= transport.DEVICE_MIN_BYTES:
            return False  # for the GPU path, from a sender thread
        with telemetry.span("stage.push_boundary", step=boundary.step_id, iteration=boundary.iteration):
            request = self._request(incarnation, boundary, data=False)
            request.trace_context.update(telemetry.carrier(telemetry.current_context()))
            return link.push_now(transport.push_parts(request, _arrays(boundary)), timeout_s, delivered)

    @staticmethod
    def _request(incarnation: int, boundary: Boundary, data: bool = True) -> stage_pb2.PushBoundaryRequest:
        """The bundle as PushBoundary takes it; without the tensors' bytes (`data` False) for a link, which sends
        them after the message (transport.py)."""
        request = stage_pb2.PushBoundaryRequest(header=stage_pb2.FencingHeader(incarnation=incarnation),
                                                step_id=boundary.step_id, iteration=boundary.iteration,
                                                route_id=boundary.route_id, schema_identity=boundary.schema_identity,
                                                wave=boundary.wave)
        for role, value in boundary.values.items():
            tensor = tensors.to_proto(_array(value)) if data else tensor_pb2.Tensor(
                dtype=dtypes.to_proto(dtypes.from_numpy(value.dtype)), shape=value.shape)
            request.tensors.add(role=dag.role_proto(role), tensor=tensor)
        return request

    def _send(self, stub: stage_pb2_grpc.StageServiceStub, address: str, incarnation: int, boundary: Boundary,
              timeout_s: float, delivered: Callable[[Exception | None], None], context: telemetry.Context) -> None:
        try:
            with telemetry.span("stage.push_boundary", parent=context, step=boundary.step_id,
                                iteration=boundary.iteration):
                link = self._link(stub, address, timeout_s) if self.links else None
                if link is not None:
                    request = self._request(incarnation, boundary, data=False)
                    request.trace_context.update(telemetry.carrier(telemetry.current_context()))
                    if self._push_on(link, address, boundary, request, timeout_s, delivered):
                        return
                    link = self._link(stub, address, timeout_s)  # broke since: nothing was sent, so send it anew
                    if link is not None and self._push_on(link, address, boundary, request, timeout_s, delivered):
                        return
                if address not in self.transports:
                    self._chosen(address, Choice(transport.GRPC, "a TLS mesh" if not self.links else
                                                 "the next rank has no boundary link listener"))
                stub.PushBoundary(self._request(incarnation, boundary), timeout=timeout_s)
        except grpc.RpcError as e:
            delivered(from_rpc_error(e))
            return
        except Exception as e:  # a bundle that cannot even be sent fails its step, not the sender
            delivered(e)
            return
        delivered(None)

    def _push_on(self, link: BoundaryLink, address: str, boundary: Boundary, request: stage_pb2.PushBoundaryRequest,
                 timeout_s: float, delivered: Callable[[Exception | None], None], chained: bool = False) -> bool:
        """BoundaryLink.push of `boundary` (`request`: its message without the tensors' bytes), through the link's
        GPU buffers where its receiver chose CUDA IPC and the bundle is large enough (transport.py); a TCP frame
        on the same link otherwise. `chained`: a DEVICE_CHAINED frame or nothing (False)."""
        with self._lock:
            device = self._device.get(address)
        sender = device[1] if device is not None and device[0] is link else None
        values = list(boundary.values.values())
        try:
            framed = sender.frame(request, values, chained) if sender is not None else None
        except Exception as e:  # a CUDA error copying into the slot: the link's GPU path failed
            failed = Unavailable(f"a bundle could not be put in a CUDA IPC slot: {type(e).__name__}: {e}",
                                 transport.DEVICE_FAILED)
            self._device_failed(link, address, failed)
            delivered(failed)
            return True
        if sender is None or framed is None:
            return not chained and link.push(transport.push_parts(request, _arrays(boundary)), timeout_s, delivered)
        payload, slot = framed

        def answered(error: Exception | None) -> None:
            sender.release(slot)
            self._answered(link, address, error)
            delivered(error)
        if link.push([payload], timeout_s, answered, kind=transport.DEVICE_CHAINED if chained else transport.DEVICE_PUSH):
            if chained and link not in self._chained:
                self._chained.add(link)
                log.info("decode runs run ahead over a link", extra={"address": address})
            return True
        sender.release(slot)
        return False

    def _chosen(self, address: str, choice: Choice) -> None:
        if self.transports.get(address) != choice:
            log.info("boundary transport chosen", extra={"address": address, "transport": transport.NAMES[
                choice.transport], "reason": choice.reason})
        self.transports[address] = choice

    def _link(self, stub: stage_pb2_grpc.StageServiceStub, address: str, timeout_s: float) -> BoundaryLink | None:
        """The open link to `address`, opening one if there is none; None when that rank has no link listener (or
        opening one failed: then this bundle goes by gRPC, and the next tries again)."""
        with self._lock:
            link = self._links.get(address)
            if link is not None and link.broken is None:
                return link
        if not self._opener.may_have_link(address):
            return None
        try:
            end = transport.local_end(self.device)
            opened = self._opener.open(stub, address, min(timeout_s, 5.0), stage_pb2.OpenBoundaryLinkRequest(sender=end))
            if opened is None:
                return None
            link = BoundaryLink.connect(opened[0], opened[1].ticket, min(timeout_s, 5.0))
            choice = Choice(opened[1].transport or transport.TCP, opened[1].transport_reason or "an older receiver")
            if choice.transport == transport.CUDA_IPC and self._strikes.get(address, 0) >= transport.DEVICE_STRIKES:
                choice = Choice(transport.TCP, f"the GPU path failed {self._strikes[address]} times in a row")
        except (OSError, GraphmeshError, ValueError, LinkError) as e:  # LinkError: closed before it answered
            log.warning("boundary link failed to open: pushing over gRPC", extra={"address": address, "error": str(e)})
            return None
        sender = None
        if choice.transport == transport.CUDA_IPC:
            try:
                sender = DeviceSender(self.device, end.gpu_uuid, same_gpu=opened[1].receiver.gpu_uuid == end.gpu_uuid)
            except Exception as e:  # no stream on the device: this link carries TCP frames
                choice = Choice(transport.TCP, f"the GPU path could not start: {type(e).__name__}: {e}")
        with self._lock:
            old = self._links.get(address)
            if old is not None and old.broken is None:  # another thread opened one meanwhile
                keep, spare = old, link
            else:
                keep, spare = link, None
                self._links[address] = link
                if sender is not None:
                    self._device[address] = (link, sender)
                else:
                    self._device.pop(address, None)
        if spare is None:
            self._chosen(address, choice)
        if spare is not None:
            spare.fail(Unavailable("a spare boundary link", "BOUNDARY_LINK_SPARE"))
        log.info("boundary link open", extra={"address": address, "link": keep.address})
        return keep


class StageServicer(stage_pb2_grpc.StageServiceServicer):
    def __init__(self, runtime: StageRuntime, kv_pusher: KvPusher | None = None) -> None:
        self.runtime = runtime
        self.kv_pusher = kv_pusher or KvPusher()
        self.link: LinkListener | None = None  # where previous ranks open boundary links; None: PushBoundary only
        self.pusher: BoundaryPusher | None = None  # this rank's: Status reports its transports

    @rpc
    def Install(self, request: stage_pb2.InstallRequest, context: grpc.ServicerContext) -> stage_pb2.InstallResponse:
        s = request.stage
        spec = StageSpec(s.model, s.layer_start, s.layer_end, s.first, s.last, s.weights or "f32",
                         s.max_context_tokens, s.kvstore_address, s.kv_block_tokens or 16, s.dtype)
        plan = dag.from_proto(request.plan) if request.HasField("plan") else None
        load_ms = self.runtime.install(request.incarnation, request.rank, request.world_size, spec, plan)
        return stage_pb2.InstallResponse(backend=self.runtime.backend, device=self.runtime.device,
                                         param_bytes=self.runtime.param_bytes, load_ms=load_ms,
                                         model_identity=self.runtime.model_identity,
                                         kv_pool_blocks=self.runtime.pool.lendable, dtype=self.runtime.dtype,
                                         gpu_uuid=transport.gpu_uuid(self.runtime.device),
                                         queues_runs=self.runtime.device.startswith("cuda")
                                         and transport.queued_runs(self.runtime.device))

    @rpc
    def ExecuteStep(self, request: stage_pb2.ExecuteStepRequest,
                    context: grpc.ServicerContext) -> stage_pb2.ExecuteStepResponse:
        timeout_s = (request.boundary_timeout_ms or 30_000) / 1000.0
        rows = step_rows(request.rows)
        with telemetry.span("stage.execute", step=request.step_id, incarnation=request.incarnation,
                            rank=self.runtime.rank, rows=len(rows), tokens=sum(len(r.token_ids) for r in rows)):
            result = self.runtime.execute_step(request.incarnation, request.step_id, rows,
                                               request.output == stage_pb2.OUTPUT_KIND_LOGITS, timeout_s,
                                               request.decode_steps, frozenset(request.active_groups), request.alone)
        response = stage_pb2.ExecuteStepResponse(compute_us=result.compute_us, computed_tokens=result.computed_tokens,
                                                 waves=[stage_pb2.WaveReport(wave=w, group=g, worked=worked)
                                                        for w, g, worked in result.waves])
        for i, length in enumerate(result.kv_lengths):
            row = response.rows.add(token=result.tokens[i] if result.tokens else 0, kv_length=length,
                                    tokens=result.run_tokens[i] if result.run_tokens else (),
                                    accepted_tokens=result.accepted[i] if result.accepted else 0)
            lp = result.logprobs[i] if result.logprobs else None
            if lp is not None:
                row.logprob = lp.logprob
                row.top_logprobs.extend(stage_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top)
        if result.logits is not None:
            response.logits.CopyFrom(tensors.to_proto(result.logits))
        return response

    @rpc
    def AbortStep(self, request: stage_pb2.AbortStepRequest,
                  context: grpc.ServicerContext) -> stage_pb2.AbortStepResponse:
        self.runtime.abort_step(request.incarnation, request.step_id, step_rows(request.rows))
        return stage_pb2.AbortStepResponse()

    @rpc
    def PushBoundary(self, request: stage_pb2.PushBoundaryRequest,
                     context: grpc.ServicerContext) -> stage_pb2.PushBoundaryResponse:
        self.accept_push(request, [tensors.from_proto(t.tensor) for t in request.tensors])
        return stage_pb2.PushBoundaryResponse()

    def accept_push(self, request: stage_pb2.PushBoundaryRequest, arrays: Sequence[BoundaryValue]) -> None:
        """A pushed bundle, from PushBoundary or a boundary link: its message and its tensors' values in order."""
        values: dict[str, BoundaryValue] = {dag.role_of(t.role): array for t, array in zip(request.tensors, arrays)}
        if len(values) != len(request.tensors):  # a role twice: fails the route's check, as any bad bundle
            values[""] = np.zeros((0,), np.float64)
        boundary = Boundary(request.step_id, request.iteration, request.route_id, values, request.schema_identity,
                            request.wave)
        with telemetry.span("stage.accept_boundary", parent=telemetry.context_of(dict(request.trace_context)),
                            step=request.step_id, iteration=request.iteration):
            self.runtime.accept_boundary(request.header.incarnation, boundary)

    @rpc
    def OpenBoundaryLink(self, request: stage_pb2.OpenBoundaryLinkRequest,
                         context: grpc.ServicerContext) -> stage_pb2.OpenBoundaryLinkResponse:
        if self.link is None:
            raise Unavailable("this executor has no boundary link listener: push over PushBoundary",
                              "NO_BOUNDARY_LINK")
        receiver = transport.local_end(self.runtime.device)
        choice = transport.choose(request.sender, receiver) if request.HasField("sender") else \
            Choice(transport.TCP, "the sender did not describe its end")
        if request.HasField("sender"):  # a boundary pusher (row copies open links too, and describe no end)
            log.info("boundary link offered", extra={"transport": transport.NAMES[choice.transport],
                                                     "reason": choice.reason, "sender_device": request.sender.device})
        return stage_pb2.OpenBoundaryLinkResponse(address=self.link.address, ticket=self.link.ticket(),
                                                  receiver=receiver, transport=choice.transport,
                                                  transport_reason=choice.reason)

    @rpc
    def Commit(self, request: stage_pb2.CommitRequest, context: grpc.ServicerContext) -> stage_pb2.CommitResponse:
        h = request.header
        return stage_pb2.CommitResponse(kv_length=self.runtime.commit(h.incarnation, h.session_id, h.epoch))

    @rpc
    def Abort(self, request: stage_pb2.AbortRequest, context: grpc.ServicerContext) -> stage_pb2.AbortResponse:
        h = request.header
        return stage_pb2.AbortResponse(kv_length=self.runtime.abort(h.incarnation, h.session_id, h.epoch,
                                                                     request.commit_epoch))

    @rpc
    def ResolveEpoch(self, request: stage_pb2.ResolveEpochRequest,
                     context: grpc.ServicerContext) -> stage_pb2.ResolveEpochResponse:
        h = request.header
        outcome = _OUTCOMES.get(request.outcome)
        if outcome is None:
            raise InvalidArgument("ResolveEpoch needs COMMITTED or ABORTED", "BAD_OUTCOME")
        return stage_pb2.ResolveEpochResponse(kv_length=self.runtime.resolve(h.incarnation, h.session_id, h.epoch,
                                                                             outcome))

    @rpc
    def ReleaseSession(self, request: stage_pb2.ReleaseSessionRequest,
                       context: grpc.ServicerContext) -> stage_pb2.ReleaseSessionResponse:
        h = request.header
        return stage_pb2.ReleaseSessionResponse(released=self.runtime.release(h.incarnation, h.session_id,
                                                                              *request.session_ids))

    @rpc
    def ShareSessionKv(self, request: stage_pb2.ShareSessionKvRequest,
                       context: grpc.ServicerContext) -> stage_pb2.ShareSessionKvResponse:
        h = request.header
        return stage_pb2.ShareSessionKvResponse(kv_length=self.runtime.share_kv(
            h.incarnation, h.session_id, request.donor_session_id, list(request.token_ids)))

    @rpc
    def ReadSessionKv(self, request: stage_pb2.ReadSessionKvRequest,
                      context: grpc.ServicerContext) -> Iterator[stage_pb2.ReadSessionKvResponse]:
        h = request.header
        rows = self.runtime.read_kv(h.incarnation, h.session_id, request.from_row, request.to_row)
        yield from tensors.chunk_messages(stage_pb2.ReadSessionKvResponse, "kv", rows)

    @rpc
    def WriteSessionKv(self, request_iterator: Iterator[stage_pb2.WriteSessionKvRequest],
                       context: grpc.ServicerContext) -> stage_pb2.WriteSessionKvResponse:
        assembler: tensors.ChunkAssembler | None = None
        first: stage_pb2.WriteSessionKvRequest | None = None
        rows = None
        for message in request_iterator:
            if assembler is None:
                first, assembler = message, self._kv_assembler(message)
            done = assembler.feed(message.rows)
            if done is not None:
                rows = done[1]
        if assembler is None or first is None or rows is None:
            raise InvalidArgument("WriteSessionKv carried no rows", "EMPTY_STREAM")
        assembler.close()
        h = first.header
        length = self.runtime.write_kv(h.incarnation, h.session_id, first.start_row, rows, list(first.token_ids))
        return stage_pb2.WriteSessionKvResponse(kv_length=length)

    @rpc
    def PushSessionKv(self, request: stage_pb2.PushSessionKvRequest,
                      context: grpc.ServicerContext) -> stage_pb2.PushSessionKvResponse:
        h = request.header
        with telemetry.span("stage.push_kv", session=h.session_id, destination=request.destination_address,
                            from_row=request.from_row, to_row=request.to_row):
            rt, start, end = self.runtime, request.from_row, request.to_row
            pieces = rt.read_kv_pieces(h.incarnation, h.session_id, start, end)  # checked now, read as they go
            rows = KvSource((end - start, rt.layers, 2, rt.kv_dim),
                            lambda: rt.read_kv(h.incarnation, h.session_id, start, end), pieces)
            tokens = rt.committed_tokens(h.incarnation, h.session_id, start, end)
            remaining = context.time_remaining()
            timeout = remaining if remaining is not None and remaining < 1e9 else 120.0
            length = self.kv_pusher.push(request.destination_address, request.destination_header, start, rows, tokens,
                                         timeout)
        return stage_pb2.PushSessionKvResponse(bytes=rows.nbytes, kv_length=length, token_ids=len(tokens))

    def _kv_assembler(self, first: stage_pb2.WriteSessionKvRequest) -> tensors.ChunkAssembler:
        """The buffer for a WriteSessionKv stream, refused before anything is allocated when the stream's
        incarnation is not the current one, and sized to at most the rows the session's context can still
        take: a header announcing 64 GiB of rows must not make the executor allocate them."""
        rt = self.runtime
        rt.authority.check(first.header.incarnation)  # again in write_kv, under the lock, before any row is used
        spec = rt.spec
        if spec is None:  # installed, then torn down since the check
            raise InvalidArgument("this executor holds no stage", "NOT_INSTALLED")
        limit = spec.max_context_tokens or (rt.config.max_position if rt.config else 0)
        row_bytes = (spec.layer_end - spec.layer_start) * 2 * rt.kv_dim * 4  # f32 K and V of every layer
        return tensors.ChunkAssembler(max_bytes=max(0, limit - first.start_row) * row_bytes)

    def open_kv_write(self, first: stage_pb2.WriteSessionKvRequest) -> KvWrite:
        """A row copy arriving over a link: its first message (header, start row, token ids, the rows' name, dtype
        and shape) checked as WriteSessionKv's rows are, the session's blocks reserved; its pieces then go
        straight into them."""
        rt, head, h = self.runtime, first.rows, first.header
        rt.authority.check(h.incarnation)
        shape = tensors.check_shape(head.shape)
        rt.check_kv_rows(dtypes.from_proto(head.dtype), shape)
        n = shape[0]
        if head.name != "kv" or n == 0:
            raise InvalidArgument(f"a row copy brings {n} rows named {head.name!r}; it needs rows named 'kv'",
                                  "BAD_KV_ROWS")
        write = rt.begin_write_kv(h.incarnation, h.session_id, first.start_row, n, list(first.token_ids))
        return KvWrite(write.pieces, n * rt.kv_dim * 4,
                       lambda j, piece: write.put(j, piece.view(np.float32).reshape(n, rt.kv_dim)),
                       lambda: stage_pb2.WriteSessionKvResponse(kv_length=write.finish()))

    @rpc
    def Fence(self, request: stage_pb2.FenceRequest, context: grpc.ServicerContext) -> stage_pb2.FenceResponse:
        self.runtime.fence(request.incarnation, request.reason, request.terminal)
        return stage_pb2.FenceResponse(state=_AUTHORITY[self.runtime.authority.state])

    @rpc
    def InjectFault(self, request: stage_pb2.InjectFaultRequest,
                    context: grpc.ServicerContext) -> stage_pb2.InjectFaultResponse:
        self.runtime.inject_fault(_FAULTS.get(request.kind, ""), request.count)
        return stage_pb2.InjectFaultResponse()

    @rpc
    def Status(self, request: stage_pb2.StageServiceStatusRequest,
               context: grpc.ServicerContext) -> stage_pb2.StageServiceStatusResponse:
        rt, a = self.runtime, self.runtime.authority
        response = stage_pb2.StageServiceStatusResponse(state=_AUTHORITY[a.state], incarnation=a.incarnation,
                                                 poison_cause=a.cause, rank=rt.rank, backend=rt.backend,
                                                 device=rt.device, model_identity=rt.model_identity, kv_dim=rt.kv_dim)
        if rt.spec is not None:
            s = rt.spec
            response.stage.CopyFrom(stage_pb2.StageSpec(model=s.model, layer_start=s.layer_start, layer_end=s.layer_end,
                                                        first=s.first, last=s.last,
                                                        weights=s.weights, max_context_tokens=s.max_context_tokens,
                                                        kvstore_address=s.kvstore_address,
                                                        kv_block_tokens=s.kv_block_tokens, dtype=rt.dtype))
        for address, choice in sorted((self.pusher.transports if self.pusher else {}).items()):
            response.links.add(address=address, transport=choice.transport, reason=choice.reason)
        for session_id, session in rt.sessions():
            t = session.txn
            response.sessions.add(session_id=session_id, phase=_PHASE[t.phase], epoch=t.epoch,
                                  last_outcome=_OUTCOME_PB[t.last_outcome], kv_length=t.kv_length,
                                  kv_capacity=len(rt.pool.table(session_id)) * rt.pool.block_tokens)
        return response


def step_rows(rows: Iterable[stage_pb2.StepRow]) -> list[StepRow]:
    return [StepRow(r.session_id, r.epoch, r.commit_epoch, r.start_position, list(r.token_ids),
                    Sampling(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p, r.sampling.seed,
                             r.sampling.logprobs, r.sampling.top_logprobs),
                    tensors.from_proto(r.encoder_input) if r.HasField("encoder_input") else None,
                    tuple(r.encoded_offsets), r.allowed_tokens, r.prediction_target.proposed, r.commit_length,
                    r.decode_steps)
            for r in rows]

_FAULTS = {stage_pb2.FAULT_KIND_ARCH_FAILURE: "arch", stage_pb2.FAULT_KIND_CORRUPT_BOUNDARY: "corrupt",
           stage_pb2.FAULT_KIND_DEVICE_FAILURE: "device"}


def add_stage_service(server: grpc.Server, runtime: StageRuntime, kv_pusher: KvPusher | None = None) -> StageServicer:
    servicer = StageServicer(runtime, kv_pusher)
    stage_pb2_grpc.add_StageServiceServicer_to_server(servicer, server)
    return servicer


def listen_for_links(servicer: StageServicer, host: str, port: int, max_frame_bytes: int,
                     advertise: str = "") -> LinkListener:
    """Opens the executor's boundary link listener: previous ranks push to `servicer` through it."""
    servicer.link = LinkListener(host, port, servicer.accept_push, max_frame_bytes, advertise, servicer.open_kv_write)
    servicer.link.device_receiver = transport.receiver_factory(servicer.runtime.device)
    return servicer.link


def _nbytes(boundary: Boundary) -> int:
    return sum(math.prod(v.shape) * v.dtype.itemsize for v in boundary.values.values())


def _array(value: BoundaryValue) -> np.ndarray:
    if isinstance(value, DeviceValue):  # never: a bundle of device values goes chained or is read to the host first
        raise TypeError("a device value where a host array was expected")
    return value


def _arrays(boundary: Boundary) -> list[np.ndarray]:
    return [_array(v) for v in boundary.values.values()]


def _on_host(boundary: Boundary) -> Boundary:
    """`boundary` with its device values read to the host (waiting for the runs, and copies, that make them)."""
    def read(value: BoundaryValue) -> np.ndarray:
        if not isinstance(value, DeviceValue):
            return value
        if value.ready is not None:
            value.ready.synchronize()
        return cast(np.ndarray, value.tensor.cpu().numpy())
    return replace(boundary, values={role: read(v) for role, v in boundary.values.items()})
