"""Python client of the executor: ExecutorClient (one channel) and RemoteExecutable (one executable on it).

RemoteExecutable has the ExecutableGraph methods with their meaning; arrays
in and out are numpy. A failed call raises the graphmesh.errors type of its
status; "not supported" answers False or None and never raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from graphmesh import dtypes, errors, tensors
from graphmesh.channels import ChannelClient, open_channel
from graphmesh.v1 import executor_pb2, executor_pb2_grpc, graph_pb2, tensor_pb2

_RNG_BACKENDS = {"splitmix": executor_pb2.RNG_BACKEND_SPLITMIX, "zero": executor_pb2.RNG_BACKEND_ZERO}
_FORMATS = {"": executor_pb2.CHECKPOINT_FORMAT_UNSPECIFIED, "gguf": executor_pb2.CHECKPOINT_FORMAT_GGUF,
            "safetensors": executor_pb2.CHECKPOINT_FORMAT_SAFETENSORS}

R = TypeVar("R")
M = TypeVar("M", executor_pb2.SetParamsRequest, executor_pb2.BindHandleRequest)


@dataclass(frozen=True)
class IoSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    index: int


@dataclass(frozen=True)
class MoeStats:
    resident_expert_calls: int
    offloaded_expert_calls: int
    resident_tokens: int
    offloaded_tokens: int


def _specs(items: Iterable[executor_pb2.IoSpec]) -> list[IoSpec]:
    return [IoSpec(s.name, dtypes.from_proto(s.type.dtype), tuple(s.type.shape), s.index) for s in items]


def _add_named(field: RepeatedCompositeFieldContainer[tensor_pb2.NamedTensor], inputs: Mapping[str, npt.ArrayLike]) -> None:
    for name, value in inputs.items():
        _fill(field.add(name=name).tensor, value)


def _chunk_requests(name: str, array: np.ndarray, make: Callable[[], M]) -> Iterator[M]:
    """The tensor as requests of <= 1 MiB chunks (the layout of tensors.to_chunks). Fields are set in place:
    passing a message to a constructor copies it about 50x slower than this (upb protobuf, 1 MiB)."""
    view = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
    for offset in range(0, max(len(view), 1), tensors.CHUNK_BYTES):
        request = make()
        if offset == 0:
            request.chunk.name = name
            request.chunk.dtype = dtypes.to_proto(dtypes.from_numpy(array.dtype))
            request.chunk.shape.extend(array.shape)
        request.chunk.offset_bytes = offset
        request.chunk.data = view[offset:offset + tensors.CHUNK_BYTES].tobytes()
        yield request


def _fill(tensor: tensor_pb2.Tensor, array: npt.ArrayLike) -> None:
    tensor.CopyFrom(tensors.to_proto(np.asarray(array)))  # CopyFrom, not a constructor argument: see _chunk_requests


def _extent(extent: tuple[int, int]) -> executor_pb2.ActiveExtent:
    return executor_pb2.ActiveExtent(actual=extent[0], upper=extent[1])


class ExecutorClient(ChannelClient):
    """A channel to one executor. Every call has a deadline of `timeout` seconds. credentials: TLS
    (graphmesh.security.credentials(ca, cert, key)); token: a bearer token sent with every call."""

    def __init__(self, address: str, *, timeout: float = 30.0, credentials: grpc.ChannelCredentials | None = None,
                 metadata: Sequence[tuple[str, str]] = (), token: str = "") -> None:
        super().__init__(address, open_channel(address, credentials), timeout, metadata, token)
        self.stub = executor_pb2_grpc.ExecutorServiceStub(self.channel)

    def call(self, method: Callable[..., R], request: Any) -> R:
        """One call with this client's deadline and metadata; a failed status raises its graphmesh error."""
        try:
            return method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def stream(self, method: Callable[..., Iterable[R]], request: Any) -> Iterator[R]:
        """Iterates a server stream (or a bidi stream fed by `request`, an iterator), mapping failures."""
        try:
            yield from method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def capabilities(self) -> executor_pb2.GetCapabilitiesResponse:
        return self.call(self.stub.GetCapabilities, executor_pb2.GetCapabilitiesRequest())

    def compile(self, graph: graph_pb2.Graph, executable_id: str = "") -> RemoteExecutable:
        request = executor_pb2.CompileRequest(executable_id=executable_id)
        request.graph.CopyFrom(graph)
        r = self.call(self.stub.Compile, request)
        return RemoteExecutable(self, r.executable_id, _specs(r.inputs), _specs(r.params), _specs(r.outputs))

    def executable(self, executable_id: str) -> RemoteExecutable:
        """A handle on an executable compiled earlier (its io specs are unknown here)."""
        return RemoteExecutable(self, executable_id)


class RemoteExecutable:
    """One executable on an executor, addressed by id."""

    def __init__(self, client: ExecutorClient, executable_id: str, inputs: Sequence[IoSpec] = (),
                 params: Sequence[IoSpec] = (), outputs: Sequence[IoSpec] = ()) -> None:
        self.client = client
        self.id = executable_id
        self.inputs = list(inputs)
        self.params = list(params)
        self.outputs = list(outputs)
        self._stub = client.stub

    def __repr__(self) -> str:
        return f"RemoteExecutable({self.id!r} on {self.client.address})"

    def _same_executor(self, other: RemoteExecutable) -> bool:
        # ids name executables of one executor only: another executor's id would address the wrong one
        return other.client.address == self.client.address

    # -- params ----------------------------------------------------------------------------------------
    def set_params(self, params: Mapping[str, npt.ArrayLike]) -> list[str]:
        """Streams many params in one SetParams call; each keeps its dtype (f32 is set_param)."""
        arrays = {name: np.asarray(array) for name, array in params.items()}
        for array in arrays.values():
            dtypes.from_numpy(array.dtype)  # here, not inside the request stream where grpc would hide it as CANCELLED

        def requests() -> Iterator[executor_pb2.SetParamsRequest]:
            for name, array in arrays.items():
                yield from _chunk_requests(name, array, lambda: executor_pb2.SetParamsRequest(executable_id=self.id))
        return list(self.client.call(self._stub.SetParams, requests()).names)

    def set_param(self, name: str, data: np.ndarray) -> None:
        self.set_params({name: np.asarray(data, dtype=np.float32)})

    def set_param_typed(self, name: str, data: np.ndarray) -> None:
        self.set_params({name: data})

    def load_params(self, path: str, name_map: Mapping[str, str] | None = None, fmt: str = "") -> list[str]:
        """Has the executor read the params from `path` under its --model-root."""
        r = self.client.call(self._stub.LoadParams, executor_pb2.LoadParamsRequest(
            executable_id=self.id, path=path, format=_FORMATS[fmt], name_map=dict(name_map or {})))
        return list(r.names)

    def finalize_params(self) -> list[str]:
        """Names of the declared params never set (they read as zeros)."""
        return list(self.client.call(self._stub.FinalizeParams,
                                     executor_pb2.FinalizeParamsRequest(executable_id=self.id)).missing)

    def copy_params_from(self, other: RemoteExecutable) -> list[str] | None:
        if not self._same_executor(other):
            return None
        r = self.client.call(self._stub.CopyParamsFrom, executor_pb2.CopyParamsFromRequest(
            executable_id=self.id, source_executable_id=other.id))
        return list(r.names) if r.supported else None

    def clone(self, clone_id: str = "") -> RemoteExecutable | None:
        r = self.client.call(self._stub.Clone, executor_pb2.CloneRequest(executable_id=self.id, clone_id=clone_id))
        return RemoteExecutable(self.client, r.clone_id, self.inputs, self.params, self.outputs) if r.supported else None

    def release(self) -> bool:
        return self.client.call(self._stub.Release, executor_pb2.ReleaseRequest(executable_id=self.id)).released

    # -- running ---------------------------------------------------------------------------------------
    def _request(self, inputs: Mapping[str, npt.ArrayLike], read_indices: Sequence[int] | None = None, typed: bool = False,
                 extent: tuple[int, int] | None = None,
                 kv_row_feed: tuple[int, int, int] | None = None) -> executor_pb2.RunRequest:
        request = executor_pb2.RunRequest(executable_id=self.id, typed_outputs=typed)
        if read_indices is not None:
            request.outputs.indices.extend(read_indices)
        _add_named(request.inputs, inputs)
        if extent is not None:
            request.active_extent.CopyFrom(_extent(extent))
        if kv_row_feed is not None:
            src_row, dst_row, row_elems = kv_row_feed
            request.kv_row_feed.CopyFrom(executor_pb2.KvRowFeed(src_row=src_row, dst_row=dst_row, row_elems=row_elems))
        return request

    def _outputs(self, response: executor_pb2.RunResponse, typed: bool) -> list[np.ndarray]:
        return [self.read_output(o.index, typed) if o.streamed else tensors.from_proto(o.tensor)
                for o in response.outputs]

    def run(self, inputs: Mapping[str, npt.ArrayLike], read_indices: Sequence[int] | None = None, typed: bool = False,
            extent: tuple[int, int] | None = None, kv_row_feed: tuple[int, int, int] | None = None) -> list[np.ndarray]:
        """Runs once; outputs at read_indices (all when None, none when empty), f32 unless typed. kv_row_feed is
        (src, dst, row_elems)."""
        request = self._request(inputs, read_indices, typed, extent, kv_row_feed)
        return self._outputs(self.client.call(self._stub.Run, request), typed)

    def read_output(self, index: int, typed: bool = False) -> np.ndarray:
        """Streams output `index` of the last run."""
        answers = self.client.stream(self._stub.ReadOutput, executor_pb2.ReadOutputRequest(
            executable_id=self.id, index=index, typed=typed))
        return tensors.assemble(a.chunk for a in answers)[0][1]

    def run_read_outputs(self, inputs: Mapping[str, npt.ArrayLike], read_indices: Sequence[int]) -> list[np.ndarray]:
        return self.run(inputs, read_indices)

    def run_typed(self, inputs: Mapping[str, npt.ArrayLike]) -> list[np.ndarray]:
        return self.run(inputs, typed=True)

    def run_slots(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        request = executor_pb2.RunRequest(executable_id=self.id)
        for x in inputs:
            _fill(request.slot_inputs.add(), x)
        return self._outputs(self.client.call(self._stub.Run, request), typed=False)

    def run_pipelined(self, input_sets: Sequence[Mapping[str, npt.ArrayLike]]) -> list[list[np.ndarray]]:
        """Runs each input set in order over one bidirectional stream."""
        requests = (executor_pb2.RunPipelinedRequest(run=self._request(inputs)) for inputs in input_sets)
        return [[tensors.from_proto(o.tensor) for o in r.run.outputs]
                for r in self.client.stream(self._stub.RunPipelined, requests)]

    def commit_no_wait(self, inputs: Mapping[str, npt.ArrayLike]) -> None:
        request = executor_pb2.CommitNoWaitRequest(executable_id=self.id)
        _add_named(request.inputs, inputs)
        self.client.call(self._stub.CommitNoWait, request)

    def sync_pending(self) -> int:
        return self.client.call(self._stub.SyncPending, executor_pb2.SyncPendingRequest(executable_id=self.id)).completed

    def read_output_row(self, index: int, row: int, row_inner: int) -> np.ndarray | None:
        r = self.client.call(self._stub.ReadOutputRow, executor_pb2.ReadOutputRowRequest(
            executable_id=self.id, output_index=index, row=row, row_inner=row_inner))
        return tensors.from_proto(r.row) if r.supported else None

    def set_active_extent(self, extent: tuple[int, int] | None) -> bool:
        """(actual, upper), or None to clear; True when the backend skips the padded rows."""
        request = executor_pb2.SetActiveExtentRequest(executable_id=self.id)
        if extent is not None:
            request.extent.CopyFrom(_extent(extent))
        return self.client.call(self._stub.SetActiveExtent, request).honored

    def set_rng(self, seed: int, backend: str = "splitmix") -> None:
        if backend not in _RNG_BACKENDS:
            raise errors.InvalidArgument(f"unknown rng backend {backend!r}; expected one of {sorted(_RNG_BACKENDS)}",
                                         "BAD_RNG")
        self.client.call(self._stub.SetRng, executor_pb2.SetRngRequest(
            executable_id=self.id, rng=executor_pb2.RngOptions(seed=seed, backend=_RNG_BACKENDS[backend])))

    def rng(self) -> tuple[int, str]:
        """(seed, backend name)."""
        r = self.client.call(self._stub.GetRng, executor_pb2.GetRngRequest(executable_id=self.id)).rng
        return r.seed, next(name for name, value in _RNG_BACKENDS.items() if value == r.backend)

    # -- handles ---------------------------------------------------------------------------------------
    def bind_handle(self, name: str, data: np.ndarray, resident: bool = False) -> bool:
        array = np.asarray(data)
        dtypes.from_numpy(array.dtype)  # here, not inside the request stream where grpc would hide it as CANCELLED
        requests = _chunk_requests(name, array, lambda: executor_pb2.BindHandleRequest(executable_id=self.id,
                                                                                         resident=resident))
        return self.client.call(self._stub.BindHandle, requests).supported

    def prepare_resident_handle(self, name: str) -> bool:
        """Input `name` becomes a handle on the device, zeros unless bound; False where there is no device."""
        return self.client.call(self._stub.PrepareResidentHandle, executor_pb2.PrepareResidentHandleRequest(
            executable_id=self.id, name=name)).supported

    def stage_bound_handles(self) -> list[str] | None:
        """Every bound handle becomes the device's; the names that were not, or None where there is no device."""
        r = self.client.call(self._stub.StageBoundHandles, executor_pb2.StageBoundHandlesRequest(executable_id=self.id))
        return list(r.staged) if r.supported else None

    def run_feed_handle(self, inputs: Mapping[str, npt.ArrayLike], handle: str, output_index: int) -> np.ndarray:
        """Runs, stores output `output_index` as `handle` on the executor, and returns that output (f32)."""
        request = executor_pb2.RunFeedHandleRequest(executable_id=self.id, handle_name=handle, output_index=output_index)
        _add_named(request.inputs, inputs)
        return tensors.from_proto(self.client.call(self._stub.RunFeedHandle, request).output)

    def read_handle(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The handle's contents, or rows [start, end) along axis 0."""
        start, end = rows or (0, 0)
        answers = self.client.stream(self._stub.ReadHandle, executor_pb2.ReadHandleRequest(
            executable_id=self.id, name=name, row_start=start, row_end=end))
        return tensors.assemble(a.chunk for a in answers)[0][1]

    def write_handle_rows(self, name: str, row_start: int, rows: np.ndarray) -> bool:
        request = executor_pb2.WriteHandleRowsRequest(executable_id=self.id, name=name, row_start=row_start)
        _fill(request.rows, rows)
        return self.client.call(self._stub.WriteHandleRows, request).supported

    def has_handle(self, name: str) -> tuple[bool, bool]:
        """(bound, resident)."""
        r = self.client.call(self._stub.HasHandle, executor_pb2.HasHandleRequest(executable_id=self.id, name=name))
        return r.bound, r.resident

    def set_handle_feed(self, handle: str, output_index: int) -> bool:
        return self.client.call(self._stub.SetHandleFeed, executor_pb2.SetHandleFeedRequest(
            executable_id=self.id, handle_name=handle, output_index=output_index)).supported

    def register_kv_row_feed(self, handle: str, output_index: int) -> bool:
        return self.client.call(self._stub.RegisterKvRowFeed, executor_pb2.RegisterKvRowFeedRequest(
            executable_id=self.id, handle_name=handle, output_index=output_index)).supported

    def feed_kv_row(self, src_row: int, dst_row: int, row_elems: int) -> bool:
        return self.client.call(self._stub.FeedKvRow, executor_pb2.FeedKvRowRequest(
            executable_id=self.id, feed=executor_pb2.KvRowFeed(src_row=src_row, dst_row=dst_row,
                                                               row_elems=row_elems))).supported

    def copy_resident_kv_rows_from(self, src: RemoteExecutable, from_row: int, to_row: int, outgoing_upper: int,
                                   kv_dim: int, n_layers: int) -> bool:
        if not self._same_executor(src):
            return False
        return self.client.call(self._stub.CopyResidentKvRows, executor_pb2.CopyResidentKvRowsRequest(
            executable_id=self.id, source_executable_id=src.id, from_row=from_row, to_row=to_row,
            outgoing_upper=outgoing_upper, kv_dim=kv_dim, n_layers=n_layers)).supported

    def seed_resident_kv_prefix_from(self, src: RemoteExecutable, prefix_tokens: int, outgoing_upper: int, kv_dim: int,
                                     n_layers: int) -> bool:
        if not self._same_executor(src):
            return False
        return self.client.call(self._stub.SeedResidentKvPrefix, executor_pb2.SeedResidentKvPrefixRequest(
            executable_id=self.id, source_executable_id=src.id, prefix_tokens=prefix_tokens,
            outgoing_upper=outgoing_upper, kv_dim=kv_dim, n_layers=n_layers)).supported

    # -- MoE -------------------------------------------------------------------------------------------
    def set_moe_resident_experts(self, mask: Sequence[bool]) -> bool:
        return self.client.call(self._stub.SetMoeResidency, executor_pb2.SetMoeResidencyRequest(
            executable_id=self.id, merged=executor_pb2.BoolList(values=mask))).supported

    def set_moe_resident_experts_per_layer(self, masks: Sequence[Sequence[bool]]) -> bool:
        per_layer = executor_pb2.MoePerLayerMasks(layers=[executor_pb2.BoolList(values=m) for m in masks])
        return self.client.call(self._stub.SetMoeResidency, executor_pb2.SetMoeResidencyRequest(
            executable_id=self.id, per_layer=per_layer)).supported

    def enable_moe_topk_capture(self, num_experts: int) -> bool:
        return self.client.call(self._stub.EnableMoeTopkCapture, executor_pb2.EnableMoeTopkCaptureRequest(
            executable_id=self.id, num_experts=num_experts)).supported

    def take_moe_topk_capture(self) -> list[list[int]] | None:
        """Expert ids chosen by each captured router since the last take, in execution order."""
        r = self.client.call(self._stub.TakeMoeTopkCapture, executor_pb2.TakeMoeTopkCaptureRequest(executable_id=self.id))
        return [list(layer.ids) for layer in r.layers] if r.captured else None

    def take_moe_residency_stats(self) -> MoeStats | None:
        r = self.client.call(self._stub.TakeMoeResidencyStats,
                             executor_pb2.TakeMoeResidencyStatsRequest(executable_id=self.id))
        s = r.stats
        return MoeStats(s.resident_expert_calls, s.offloaded_expert_calls, s.resident_tokens,
                        s.offloaded_tokens) if r.supported else None
