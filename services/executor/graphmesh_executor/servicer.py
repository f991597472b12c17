"""ExecutorService over gRPC: proto in, one Executable call, proto out.

The ExecutableGraph semantics live in graphmesh_executor.executable and the
locking in graphmesh_executor.registry; this module only translates. Every
exception becomes a gRPC status in one place (`to_status`, applied by the
`rpc` decorator), so a bad request gets a clear status and the server keeps
serving.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import numpy as np

from graphmesh import dtypes, tensors
from graphmesh.channels import MAX_MESSAGE_BYTES
from graphmesh.dtypes import DTypeError
from graphmesh.errors import InvalidArgument, ResourceExhausted, rpc
from graphmesh.graph import parse
from graphmesh.ops import TensorType
from graphmesh.tensors import TensorError
from graphmesh.v1 import executor_pb2, executor_pb2_grpc, graph_pb2, tensor_pb2
from graphmesh_executor import weights
from graphmesh_executor.executable import Executable, RngOptions
from graphmesh_executor.registry import ExecutableRegistry
from graphmesh_server import serving

log = logging.getLogger("graphmesh.executor")

INLINE_OUTPUT_BYTES = 2 << 20  # Run answers inline up to this total; larger outputs are fetched with ReadOutput
MESSAGE_SLACK_BYTES = 64 << 10  # room for the non-tensor fields of a message under the size cap

_BACKENDS = {"numpy": executor_pb2.BACKEND_NUMPY, "torch": executor_pb2.BACKEND_TORCH, "mlx": executor_pb2.BACKEND_MLX}
_RNG_BACKENDS = {executor_pb2.RNG_BACKEND_SPLITMIX: "splitmix", executor_pb2.RNG_BACKEND_ZERO: "zero"}
_FORMATS = {executor_pb2.CHECKPOINT_FORMAT_UNSPECIFIED: "", executor_pb2.CHECKPOINT_FORMAT_GGUF: "gguf",
            executor_pb2.CHECKPOINT_FORMAT_SAFETENSORS: "safetensors"}


def _type(dtype: str, shape: Iterable[int]) -> graph_pb2.TensorType:
    return graph_pb2.TensorType(dtype=dtypes.to_proto(dtype), shape=list(shape))


def _specs(types: Iterable[tuple[str, TensorType]]) -> list[executor_pb2.IoSpec]:
    return [executor_pb2.IoSpec(name=name, type=_type(t.dtype, t.shape), index=i) for i, (name, t) in enumerate(types)]


def _named(items: Iterable[tensor_pb2.NamedTensor]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for item in items:
        if item.name in out:
            raise InvalidArgument(f"input {item.name!r} is given twice", "DUPLICATE_INPUT")
        try:
            out[item.name] = tensors.from_proto(item.tensor)
        except (TensorError, DTypeError) as e:
            raise type(e)(f"input {item.name!r}: {e}") from e
    return out


def _run_inputs(exe: Executable[Any], request: executor_pb2.RunRequest) -> dict[str, np.ndarray]:
    if request.inputs or not request.slot_inputs:
        return _named(request.inputs)
    if len(request.slot_inputs) > len(exe.input_names):  # run_slots: inputs by position
        raise InvalidArgument(f"{len(request.slot_inputs)} slot inputs for a graph of {len(exe.input_names)} inputs",
                              "TOO_MANY_INPUTS")
    return {name: tensors.from_proto(t) for name, t in zip(exe.input_names, request.slot_inputs)}


CHECKED_RUN_BYTES = 1 << 30  # runs that may allocate less than this are not checked against the host's memory
_largest: dict[int, int] = {}  # id of a live graph -> its largest buffer's bytes (graphs are unhashable)


def _admit(exe: Executable[Any], given: Iterable[str]) -> None:
    """Refuses a run, before anything is allocated, that needs more memory than the host has available: the zeros
    of the inputs it is not given (and are bound to no handle), and its largest buffer. A graph with a 128 GiB
    input, run without it, raised the backend's allocation failure (torch's RuntimeError: INTERNAL), or, where
    the kernel lets a process overcommit, got its zeros and went on to fill them."""
    graph = exe.graph
    largest = _largest.get(id(graph))
    if largest is None:
        largest = _largest[id(graph)] = max((tensors.nbytes(n.type.dtype, n.type.shape) for n in graph.nodes),
                                            default=0)
        weakref.finalize(graph, _largest.pop, id(graph), None)
    names = set(given)
    zeros = sum(tensors.nbytes(t.dtype, t.shape) for name, t in graph.inputs.items()
                if name not in names and not exe.has_handle(name)[0])
    if zeros + largest < CHECKED_RUN_BYTES:
        return
    available = serving.available_memory_bytes()
    if available is not None and zeros + largest > available:
        raise ResourceExhausted(f"this run needs {zeros} bytes of zeros for the inputs it was not given and {largest} "
                                f"bytes for its largest buffer; the host has {available} bytes available",
                                "RUN_TOO_LARGE")


def _extent(message: executor_pb2.ActiveExtent) -> tuple[int, int]:
    return message.actual, message.upper


def _response(outs: list[np.ndarray], indices: Iterable[int], run_us: float, inline_limit: int,
              stream_rest: bool) -> executor_pb2.RunResponse:
    """A run's outputs, inline up to `inline_limit` bytes; past it left for ReadOutput, or refused."""
    response = executor_pb2.RunResponse(run_us=run_us)
    inline = 0
    for index, out in zip(indices, outs):
        item = response.outputs.add(index=index)
        item.type.dtype = dtypes.to_proto(dtypes.from_numpy(out.dtype))
        item.type.shape.extend(out.shape)
        if inline + out.nbytes <= inline_limit:
            item.tensor.CopyFrom(tensors.to_proto(out))
            inline += out.nbytes
        elif stream_rest:
            item.streamed = True
        else:
            raise ResourceExhausted(f"output {index} ({out.nbytes} bytes) does not fit a RunPipelined answer "
                                    f"of at most {inline_limit} bytes; use Run and ReadOutput", "OUTPUT_TOO_LARGE")
    return response


def _staged(staged: list[str] | None) -> executor_pb2.StageBoundHandlesResponse:
    return executor_pb2.StageBoundHandlesResponse(supported=staged is not None, staged=staged or [])


def _captured(captured: list[list[int]] | None) -> executor_pb2.TakeMoeTopkCaptureResponse:
    return executor_pb2.TakeMoeTopkCaptureResponse(
        captured=captured is not None, layers=[executor_pb2.ExpertIds(ids=ids) for ids in captured or []])


def _held(bound: bool, resident: bool) -> executor_pb2.HasHandleResponse:
    return executor_pb2.HasHandleResponse(bound=bound, resident=resident)


class _ForExecutable(Protocol):
    DESCRIPTOR: Any
    executable_id: str


Q = TypeVar("Q", bound=_ForExecutable)
R = TypeVar("R")


def _on_executable(request_type: type[Q], answer: Callable[[Executable[Any], Q], R]
                   ) -> Callable[..., R]:
    """The handler of the RPCs whose whole work is one call on the request's executable, under its lock. (Its
    arguments are `...`: mypy matches a class attribute against the generated base's methods only so.)"""
    def handler(self: ExecutorServicer, request: Q, context: grpc.ServicerContext) -> R:
        with self.registry.use(request.executable_id) as exe:
            return answer(exe, request)
    handler.__name__ = request_type.DESCRIPTOR.name.removesuffix("Request")  # the method name statuses carry
    return rpc(handler)


class ExecutorServicer(executor_pb2_grpc.ExecutorServiceServicer):
    def __init__(self, registry: ExecutableRegistry, *, model_root: Path | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, max_param_bytes: int = tensors.MAX_TENSOR_BYTES) -> None:
        self.registry = registry
        self.model_root = model_root
        self.max_message_bytes = max_message_bytes
        self.max_param_bytes = max_param_bytes

    # -- executables -----------------------------------------------------------------------------------
    @rpc
    def GetCapabilities(self, request: executor_pb2.GetCapabilitiesRequest,
                        context: grpc.ServicerContext) -> executor_pb2.GetCapabilitiesResponse:
        cls = self.registry.executable_class
        return executor_pb2.GetCapabilitiesResponse(
            backend=_BACKENDS[self.registry.backend], device=self.registry.device,
            capabilities=executor_pb2.Capabilities(**asdict(cls.capabilities_on(self.registry.device))),
            ops=sorted(cls.kernels),
            dtypes=[dtypes.to_proto(d) for d in dtypes.DTYPE_NAMES], max_message_bytes=self.max_message_bytes)

    @rpc
    def Compile(self, request: executor_pb2.CompileRequest, context: grpc.ServicerContext) -> executor_pb2.CompileResponse:
        started = time.perf_counter()
        graph = parse(request.graph)
        executable_id, exe = self.registry.compile(graph, request.executable_id)
        ms = (time.perf_counter() - started) * 1e3
        log.info("compiled", extra={"executable_id": executable_id, "graph": graph.name, "nodes": len(graph.nodes),
                                    "ms": round(ms, 2)})
        return executor_pb2.CompileResponse(
            executable_id=executable_id, inputs=_specs(graph.inputs.items()), params=_specs(graph.params.items()),
            outputs=_specs(zip(graph.outputs, exe.output_types)),
            capabilities=executor_pb2.Capabilities(**asdict(exe.capabilities_on(exe.device))), compile_ms=ms)

    @rpc
    def Release(self, request: executor_pb2.ReleaseRequest, context: grpc.ServicerContext) -> executor_pb2.ReleaseResponse:
        return executor_pb2.ReleaseResponse(released=self.registry.release(request.executable_id))

    @rpc
    def Clone(self, request: executor_pb2.CloneRequest, context: grpc.ServicerContext) -> executor_pb2.CloneResponse:
        clone_id = self.registry.clone(request.executable_id, request.clone_id)
        return executor_pb2.CloneResponse(supported=clone_id is not None, clone_id=clone_id or "")

    # -- params ----------------------------------------------------------------------------------------
    def _receive(self, messages: Iterator[Any], exe: Executable[Any], first: Any,
                 take: Callable[[str, np.ndarray], Any]) -> tuple[list[str], int]:
        """Reassembles the chunk stream of SetParams/BindHandle; `take` consumes each finished tensor."""
        assembler = tensors.ChunkAssembler(self.max_param_bytes)
        names: list[str] = []
        received = declared = 0
        for message in itertools.chain([first], messages):
            if message.executable_id and message.executable_id != first.executable_id:
                raise InvalidArgument(f"one stream addresses executables {first.executable_id!r} and "
                                      f"{message.executable_id!r}", "MIXED_EXECUTABLES")
            chunk = message.chunk
            if chunk.name:
                declared += tensors.nbytes(dtypes.from_proto(chunk.dtype), tensors.check_shape(chunk.shape))
                if declared > self.max_param_bytes:
                    raise ResourceExhausted(f"tensor {chunk.name!r} brings this stream to {declared} bytes, over this "
                                            f"executor's --max-param-bytes of {self.max_param_bytes}", "TOO_MANY_BYTES")
            done = assembler.feed(chunk)  # reading chunk.data copies 1 MiB each time: only the assembler reads it
            if done is not None:
                take(*done)
                names.append(done[0])
                received += done[1].nbytes
        assembler.close()
        return names, received

    @rpc
    def SetParams(self, request_iterator: Iterator[executor_pb2.SetParamsRequest],
                  context: grpc.ServicerContext) -> executor_pb2.SetParamsResponse:
        first = next(request_iterator, None)
        if first is None:
            raise InvalidArgument("empty SetParams stream", "EMPTY_STREAM")
        with self.registry.use(first.executable_id) as exe:
            def take(name: str, array: np.ndarray) -> None:
                (exe.set_param if array.dtype == np.float32 else exe.set_param_typed)(name, array)
            names, received = self._receive(request_iterator, exe, first, take)
        return executor_pb2.SetParamsResponse(names=names, bytes_received=received)

    @rpc
    def LoadParams(self, request: executor_pb2.LoadParamsRequest,
                   context: grpc.ServicerContext) -> executor_pb2.LoadParamsResponse:
        started = time.perf_counter()
        with self.registry.use(request.executable_id) as exe:
            target = weights.resolve_under_root(self.model_root, request.path)
            weights.check_format(target, _FORMATS.get(request.format, ""))
            names, loaded = weights.load_params(exe, target, request.name_map)
        return executor_pb2.LoadParamsResponse(names=names, bytes_loaded=loaded,
                                               load_ms=(time.perf_counter() - started) * 1e3)

    FinalizeParams = _on_executable(
        executor_pb2.FinalizeParamsRequest,
        lambda exe, r: executor_pb2.FinalizeParamsResponse(missing=exe.finalize_params()))

    @rpc
    def CopyParamsFrom(self, request: executor_pb2.CopyParamsFromRequest,
                       context: grpc.ServicerContext) -> executor_pb2.CopyParamsFromResponse:
        with self.registry.use_pair(request.executable_id, request.source_executable_id) as (dst, src):
            return executor_pb2.CopyParamsFromResponse(supported=True, names=dst.copy_params_from(src))

    # -- running ---------------------------------------------------------------------------------------
    def _run(self, request: executor_pb2.RunRequest, inline_limit: int, stream_rest: bool) -> executor_pb2.RunResponse:
        with self.registry.use(request.executable_id) as exe:
            inputs = _run_inputs(exe, request)
            _admit(exe, inputs)
            extent = _extent(request.active_extent) if request.HasField("active_extent") else None
            started = time.perf_counter()
            selected = list(request.outputs.indices) if request.HasField("outputs") else None
            outs = exe.run(inputs, selected, request.typed_outputs, extent)
            if request.HasField("kv_row_feed"):
                feed = request.kv_row_feed
                exe.feed_kv_row(feed.src_row, feed.dst_row, feed.row_elems)
            run_us = (time.perf_counter() - started) * 1e6
            return _response(outs, range(len(outs)) if selected is None else selected, run_us, inline_limit, stream_rest)

    @rpc
    def Run(self, request: executor_pb2.RunRequest, context: grpc.ServicerContext) -> executor_pb2.RunResponse:
        return self._run(request, INLINE_OUTPUT_BYTES, stream_rest=True)

    @rpc
    def ReadOutput(self, request: executor_pb2.ReadOutputRequest,
                   context: grpc.ServicerContext) -> Iterator[executor_pb2.ReadOutputResponse]:
        with self.registry.use(request.executable_id) as exe:
            out = exe.read_output(request.index, request.typed)
            yield from tensors.chunk_messages(executor_pb2.ReadOutputResponse, exe.graph.outputs[request.index], out)

    @rpc
    def RunPipelined(self, request_iterator: Iterator[executor_pb2.RunPipelinedRequest],
                     context: grpc.ServicerContext) -> Iterator[executor_pb2.RunPipelinedResponse]:
        # Only the last run's outputs stay readable, so every answer of the stream is inline. Plain runs of one
        # executable (named inputs, every output as f32) go to run_pipelined together: on CUDA they are all queued
        # before any is waited for; any other request runs on its own.
        limit = self.max_message_bytes - MESSAGE_SLACK_BYTES
        requests = [r.run for r in request_iterator]
        plain = all(r.executable_id == requests[0].executable_id and not r.slot_inputs and not r.typed_outputs
                    and not r.HasField("outputs") and not r.HasField("active_extent") and not r.HasField("kv_row_feed")
                    for r in requests)
        if not requests or not plain:
            for request in requests:
                yield executor_pb2.RunPipelinedResponse(run=self._run(request, limit, stream_rest=False))
            return
        with self.registry.use(requests[0].executable_id) as exe:
            input_sets = [_named(r.inputs) for r in requests]
            for inputs in input_sets:
                _admit(exe, inputs)
            started = time.perf_counter()
            runs = exe.run_pipelined(input_sets)
            run_us = (time.perf_counter() - started) * 1e6 / len(requests)
        for outs in runs:
            yield executor_pb2.RunPipelinedResponse(run=_response(outs, range(len(outs)), run_us, limit,
                                                                  stream_rest=False))

    @rpc
    def CommitNoWait(self, request: executor_pb2.CommitNoWaitRequest,
                     context: grpc.ServicerContext) -> executor_pb2.CommitNoWaitResponse:
        with self.registry.use(request.executable_id) as exe:
            inputs = _named(request.inputs)
            _admit(exe, inputs)
            exe.commit_no_wait(inputs)
        return executor_pb2.CommitNoWaitResponse()

    SyncPending = _on_executable(
        executor_pb2.SyncPendingRequest,
        lambda exe, r: executor_pb2.SyncPendingResponse(completed=exe.sync_pending()))

    @rpc
    def ReadOutputRow(self, request: executor_pb2.ReadOutputRowRequest,
                      context: grpc.ServicerContext) -> executor_pb2.ReadOutputRowResponse:
        with self.registry.use(request.executable_id) as exe:
            row = exe.read_output_row(request.output_index, request.row, request.row_inner)
        return executor_pb2.ReadOutputRowResponse(supported=True, row=tensors.to_proto(row))

    @rpc
    def SetActiveExtent(self, request: executor_pb2.SetActiveExtentRequest,
                        context: grpc.ServicerContext) -> executor_pb2.SetActiveExtentResponse:
        extent = _extent(request.extent) if request.HasField("extent") else None
        with self.registry.use(request.executable_id) as exe:
            return executor_pb2.SetActiveExtentResponse(honored=exe.set_active_extent(extent))

    @rpc
    def SetRng(self, request: executor_pb2.SetRngRequest, context: grpc.ServicerContext) -> executor_pb2.SetRngResponse:
        if request.rng.backend not in _RNG_BACKENDS:
            raise InvalidArgument(f"rng backend {request.rng.backend} is not one of SPLITMIX, ZERO", "BAD_RNG")
        with self.registry.use(request.executable_id) as exe:
            exe.set_rng(RngOptions(request.rng.seed, _RNG_BACKENDS[request.rng.backend]))
        return executor_pb2.SetRngResponse()

    @rpc
    def GetRng(self, request: executor_pb2.GetRngRequest, context: grpc.ServicerContext) -> executor_pb2.GetRngResponse:
        with self.registry.use(request.executable_id) as exe:
            rng = exe.rng()
        backend = next(k for k, v in _RNG_BACKENDS.items() if v == rng.backend)
        return executor_pb2.GetRngResponse(rng=executor_pb2.RngOptions(seed=rng.seed, backend=backend))

    # -- handles ---------------------------------------------------------------------------------------
    @rpc
    def BindHandle(self, request_iterator: Iterator[executor_pb2.BindHandleRequest],
                   context: grpc.ServicerContext) -> executor_pb2.BindHandleResponse:
        first = next(request_iterator, None)
        if first is None:
            raise InvalidArgument("empty BindHandle stream", "EMPTY_STREAM")
        supported = []
        with self.registry.use(first.executable_id) as exe:
            self._receive(request_iterator, exe, first,
                          lambda name, array: supported.append(exe.bind_handle(name, array, first.resident)))
        if not supported:
            raise InvalidArgument("BindHandle stream carried no tensor", "EMPTY_STREAM")
        return executor_pb2.BindHandleResponse(supported=all(supported))

    PrepareResidentHandle = _on_executable(
        executor_pb2.PrepareResidentHandleRequest,
        lambda exe, r: executor_pb2.PrepareResidentHandleResponse(supported=exe.prepare_resident_handle(r.name)))

    StageBoundHandles = _on_executable(
        executor_pb2.StageBoundHandlesRequest,
        lambda exe, r: _staged(exe.stage_bound_handles()))

    @rpc
    def RunFeedHandle(self, request: executor_pb2.RunFeedHandleRequest,
                      context: grpc.ServicerContext) -> executor_pb2.RunFeedHandleResponse:
        limit = self.max_message_bytes - MESSAGE_SLACK_BYTES
        with self.registry.use(request.executable_id) as exe:
            inputs = _named(request.inputs)
            _admit(exe, inputs)
            out = exe.run_feed_handle(inputs, request.handle_name, request.output_index)
        if out.nbytes > limit:  # the handle is fed: only the answer does not fit
            raise ResourceExhausted(f"output {request.output_index} ({out.nbytes} bytes) does not fit a RunFeedHandle "
                                    f"answer of at most {limit} bytes; use SetHandleFeed, Run and ReadOutput",
                                    "OUTPUT_TOO_LARGE")
        return executor_pb2.RunFeedHandleResponse(output=tensors.to_proto(out))

    @rpc
    def ReadHandle(self, request: executor_pb2.ReadHandleRequest,
                   context: grpc.ServicerContext) -> Iterator[executor_pb2.ReadHandleResponse]:
        rows = None if request.row_start == request.row_end == 0 else (request.row_start, request.row_end)
        with self.registry.use(request.executable_id) as exe:
            yield from tensors.chunk_messages(executor_pb2.ReadHandleResponse, request.name,
                                              exe.read_handle(request.name, rows))

    @rpc
    def WriteHandleRows(self, request: executor_pb2.WriteHandleRowsRequest,
                        context: grpc.ServicerContext) -> executor_pb2.WriteHandleRowsResponse:
        rows = tensors.from_proto(request.rows)
        with self.registry.use(request.executable_id) as exe:
            return executor_pb2.WriteHandleRowsResponse(supported=exe.write_handle_rows(request.name, request.row_start,
                                                                                        rows))

    HasHandle = _on_executable(
        executor_pb2.HasHandleRequest,
        lambda exe, r: _held(*exe.has_handle(r.name)))

    SetHandleFeed = _on_executable(
        executor_pb2.SetHandleFeedRequest,
        lambda exe, r: executor_pb2.SetHandleFeedResponse(supported=exe.set_handle_feed(r.handle_name,
                                                                                        r.output_index)))

    RegisterKvRowFeed = _on_executable(
        executor_pb2.RegisterKvRowFeedRequest,
        lambda exe, r: executor_pb2.RegisterKvRowFeedResponse(supported=exe.register_kv_row_feed(r.handle_name,
                                                                                                 r.output_index)))

    FeedKvRow = _on_executable(
        executor_pb2.FeedKvRowRequest,
        lambda exe, r: executor_pb2.FeedKvRowResponse(supported=exe.feed_kv_row(r.feed.src_row, r.feed.dst_row,
                                                                                r.feed.row_elems)))

    @rpc
    def CopyResidentKvRows(self, request: executor_pb2.CopyResidentKvRowsRequest,
                           context: grpc.ServicerContext) -> executor_pb2.CopyResidentKvRowsResponse:
        r = request
        with self.registry.use_pair(r.executable_id, r.source_executable_id) as (dst, src):
            ok = dst.copy_resident_kv_rows_from(src, r.from_row, r.to_row, r.outgoing_upper, r.kv_dim, r.n_layers)
        return executor_pb2.CopyResidentKvRowsResponse(supported=ok)

    @rpc
    def SeedResidentKvPrefix(self, request: executor_pb2.SeedResidentKvPrefixRequest,
                             context: grpc.ServicerContext) -> executor_pb2.SeedResidentKvPrefixResponse:
        r = request
        with self.registry.use_pair(r.executable_id, r.source_executable_id) as (dst, src):
            ok = dst.seed_resident_kv_prefix_from(src, r.prefix_tokens, r.outgoing_upper, r.kv_dim, r.n_layers)
        return executor_pb2.SeedResidentKvPrefixResponse(supported=ok)

    # -- MoE -------------------------------------------------------------------------------------------
    @rpc
    def SetMoeResidency(self, request: executor_pb2.SetMoeResidencyRequest,
                        context: grpc.ServicerContext) -> executor_pb2.SetMoeResidencyResponse:
        which = request.WhichOneof("mask")
        if which is None:
            raise InvalidArgument("SetMoeResidency needs a merged or a per_layer mask", "BAD_MASK")
        with self.registry.use(request.executable_id) as exe:
            if which == "merged":
                ok = exe.set_moe_resident_experts(list(request.merged.values))
            else:
                ok = exe.set_moe_resident_experts_per_layer([list(m.values) for m in request.per_layer.layers])
        return executor_pb2.SetMoeResidencyResponse(supported=ok)

    EnableMoeTopkCapture = _on_executable(
        executor_pb2.EnableMoeTopkCaptureRequest,
        lambda exe, r: executor_pb2.EnableMoeTopkCaptureResponse(supported=exe.enable_moe_topk_capture(r.num_experts)))

    TakeMoeTopkCapture = _on_executable(
        executor_pb2.TakeMoeTopkCaptureRequest,
        lambda exe, r: _captured(exe.take_moe_topk_capture()))

    TakeMoeResidencyStats = _on_executable(
        executor_pb2.TakeMoeResidencyStatsRequest,
        lambda exe, r: executor_pb2.TakeMoeResidencyStatsResponse(
            supported=True, stats=executor_pb2.MoeResidencyStats(**asdict(exe.take_moe_residency_stats()))))
