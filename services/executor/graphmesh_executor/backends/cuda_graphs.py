"""The torch backend's static runs on CUDA and their capture as CUDA graphs (TorchExecutable's part for them).

A graph whose host-side decisions can all be made from its host inputs (index bounds, the KV write row, greedy
sampling) runs "static" kernels that never read device values on the host, and from its second run with the same
handles is captured as a CUDA graph and replayed: inputs are copied into static buffers (one pinned staging area
per set of input names), KV handles are written in place, outputs are the graph's own buffers. A decode step is
then one replay instead of ~800 launches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphmesh import dtypes
from graphmesh.errors import OutOfRange
from graphmesh.graph import Graph, Node
from graphmesh_executor.backends import cuda_kernels, torch_attention
from graphmesh_executor.backends.torch_tensors import MEMO, TORCH_DTYPES, Tensor
from graphmesh_executor.executable import Executable, RunContext, conform

HostCheck = Callable[[dict[str, np.ndarray]], bool]
_MAX_CAPTURES = 8  # per executable: one per session whose decode runs on it, oldest dropped first


@dataclass(frozen=True)
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    outputs: list[Tensor]


@dataclass
class _Staging:
    """A static run's host inputs, all in one pinned buffer and its device twin: one copy per run moves them all
    (one pin and one copy per input cost a 1.1B stage ~0.2-0.5 ms a run), and the device views are the addresses a
    captured graph reads. Two pinned buffers, taken in turn: a run's inputs are written while the copy out of the
    other (queued behind the run before) waits, so queued runs (Executable.run_fed) never wait for the device."""

    host: list[dict[str, np.ndarray]]  # per pinned buffer, views of it, one per input
    device: dict[str, Tensor]  # the same bytes' views on the device
    pinned: list[Tensor]  # u8
    on_device: Tensor  # u8
    copied: list[Any]  # per pinned buffer, a torch.cuda.Event: its last copy out, which must land before it is rewritten
    turn: int = 0  # the pinned buffer the next run takes


def _host_op(node: Node, x: np.ndarray | None) -> np.ndarray | None:
    """slice or reshape of a host value, as the node does it on the device."""
    if x is None:
        return None
    if node.op == "reshape":
        return x.reshape(node.attrs["shape"])
    index = [slice(None)] * x.ndim
    index[node.attrs["axis"] % x.ndim] = slice(node.attrs["start"], node.attrs["end"])
    return x[tuple(index)]


def _host_check(node: Node, value: Callable[[dict[str, np.ndarray]], np.ndarray | None], graph: Graph) -> HostCheck:
    """What the node's kernel would check or decide on the device values, done on the host inputs: raises the
    kernel's error, or returns False when the run cannot be static (a value is missing, sampling is not greedy)."""
    def check(inputs: dict[str, np.ndarray]) -> bool:
        x = value(inputs)
        if x is None:
            return False
        if node.op == "sample":
            return bool((x <= 0.0).all())
        if node.op == "kv_write":
            start, rows, capacity = int(x.reshape(-1)[0]), graph.type_of(node.inputs[1]).shape[0], \
                graph.type_of(node.inputs[0]).shape[0]
            if start < 0 or start + rows > capacity:
                raise OutOfRange(f"kv_write of rows [{start}, {start + rows}) into a cache of {capacity} rows",
                                 "ROW_OUT_OF_RANGE")
            return True
        shape = graph.type_of(node.inputs[0]).shape
        bound = shape[0] if node.op == "kv_scatter" else shape[node.attrs["axis"] % len(shape)]
        _host_bounds(x, bound, {"gather": "gather", "kv_scatter": "kv_scatter slot"}.get(node.op, "take_along_axis"))
        return True
    return check


def _host_bounds(x: np.ndarray, bound: int, what: str) -> None:
    if x.size and (x.min() < 0 or x.max() >= bound):
        bad = x.max() if x.max() >= bound else x.min()
        raise OutOfRange(f"{what} index {bad} outside [0, {bound})", "INDEX_OUT_OF_RANGE")


def _paged_check(node: Node, values: list[Callable[[dict[str, np.ndarray]], np.ndarray | None]],
                 graph: Graph) -> HostCheck:
    """paged_attention's index checks on the host inputs; a decode runs static, and prompt chunks whose every run
    takes the row kernel (torch_attention.rows_fit): neither reads a host value."""
    pool_rows, (seqs, blocks) = graph.type_of(node.inputs[1]).shape[0], graph.type_of(node.inputs[3]).shape
    bounds = ((pool_rows // node.attrs["block_size"], "block_table block"), (seqs, "token_seq sequence"),
              (blocks * node.attrs["block_size"], "q_positions position"))

    def check(inputs: dict[str, np.ndarray]) -> bool:
        xs = [value(inputs) for value in values]
        if any(x is None for x in xs):
            return False
        for x, (bound, what) in zip(xs, bounds):
            _host_bounds(x, bound, what)  # type: ignore[arg-type]
        q = graph.type_of(node.inputs[0])
        return bool(node.attrs["decode"]) or (cuda_kernels.paged_serves(q.shape[-1], q.dtype)
                                              and torch_attention.rows_fit(xs[1], xs[2]))  # type: ignore[arg-type]
    return check


class CudaGraphs(Executable[Tensor]):
    """Static runs and CUDA graph capture; TorchExecutable sets up the state below and runs the plan."""

    cuda_graphs = True  # capture static runs on CUDA; False runs the same static kernels eagerly
    _device: torch.device
    _donors: dict[str, int]
    _host_checks: list[HostCheck] | None
    _staging: dict[tuple[str, ...], _Staging]
    _static_key: tuple[Any, ...] | None
    _captures: dict[tuple[Any, ...], _Captured]
    _seen: dict[tuple[Any, ...], int]
    _expert_tally: Tensor | None

    def _run_plan(self, env: dict[str, Tensor], ctx: RunContext, steps: list[Any] | None = None) -> list[Tensor]:
        raise NotImplementedError

    def _static_checks(self, graph: Graph) -> list[HostCheck] | None:
        """Host-side stand-ins for every host read the kernels make, or None when some value they need is not
        a host input seen through slices and reshapes (then the graph always runs eagerly)."""
        nodes = {n.name: n for n in graph.nodes}

        def host(name: str) -> Callable[[dict[str, np.ndarray]], np.ndarray | None] | None:
            if name in graph.inputs:
                return lambda inputs: np.asarray(inputs[name]) if name in inputs else None
            node = nodes.get(name)
            if node is None or node.op not in ("slice", "reshape"):
                return None
            inner = host(node.inputs[0])
            if inner is None:
                return None
            return lambda inputs: _host_op(node, inner(inputs))

        def within(name: str, bound: int) -> bool:
            """Whether index `name` lies in [0, bound) whatever the inputs (MoE's expert ids and the gather that
            repeats its rows): top-k ids over at most `bound` columns, or a constant, through slices and reshapes."""
            node = nodes.get(name)
            while node is not None and node.op in ("slice", "reshape"):
                node = nodes.get(node.inputs[0])
            if node is not None and node.op == "top_k":
                return graph.type_of(node.inputs[0]).shape[-1] <= bound
            if node is not None and node.op == "constant":
                value = np.asarray(node.attrs["value"])
                return bool(value.size == 0 or (value.min() >= 0 and value.max() < bound))
            return False

        checks: dict[tuple[Any, ...], HostCheck] = {}  # one per distinct check: every layer reads the same indices
        for node in graph.nodes:
            if node.op == "grouped_matmul":  # its torch fallback reads the experts' row counts back
                if not (within(node.inputs[2], graph.type_of(node.inputs[1]).shape[0])
                        and cuda_kernels.products_serve(graph.type_of(node.inputs[0]).dtype)):
                    return None
                continue
            if node.op in ("gather", "take_along_axis"):
                shape = graph.type_of(node.inputs[0]).shape
                if within(node.inputs[1], shape[node.attrs["axis"] % len(shape)]):
                    continue
            if node.op == "paged_attention":
                values = [host(name) for name in node.inputs[3:]]
                if any(v is None for v in values):
                    return None
                key: tuple[Any, ...] = (node.op, *node.inputs[3:], graph.type_of(node.inputs[1]).shape,
                                        node.attrs["block_size"], node.attrs["decode"])
                checks.setdefault(key, _paged_check(node, values, graph))  # type: ignore[arg-type]
            if node.op in ("gather", "take_along_axis", "kv_write", "kv_scatter", "sample"):
                index = node.inputs[2 if node.op in ("kv_write", "kv_scatter") else 1]
                value = host(index)
                if value is None:
                    return None
                if node.op in ("kv_write", "kv_scatter") and (node.name not in graph.outputs or
                                              self._donors.get(node.inputs[0]) != graph.outputs.index(node.name)):
                    return None  # only a donated cache may be written in place
                key = (node.op, index, graph.type_of(node.inputs[0]).shape, graph.type_of(node.inputs[1]).shape,
                       node.attrs.get("axis"))
                checks.setdefault(key, _host_check(node, value, graph))
        return list(checks.values())

    def _gather_static(self, inputs: dict[str, np.ndarray]) -> dict[str, Tensor] | None:
        """env for a static run, its host inputs copied to the device in one transfer (and self._static_key set),
        or None when this run must be eager: a host check declines, a cache is not donated, or an input reads as
        zeros. The host checks raise the kernels' errors."""
        if self._host_checks is None or not all(check(inputs) for check in self._host_checks):
            return None
        if any(self._donors.get(h) != i for h, i in self._prefix_feeds.items()):
            return None  # a fed output that is not the handle itself would move the handle into the graph's pool
        if any(h in inputs or self._prefix_feeds.get(h) != i for h, i in self._donors.items()):
            return None  # static kv_write writes in place: only a cache that its output replaces anyway
        if any(name not in inputs and name not in self._handles for name in self.graph.inputs):
            return None
        names = tuple(name for name in self.graph.inputs if name in inputs)
        staging = self._staging.get(names) or self._stage(names)
        k, staging.turn = staging.turn, 1 - staging.turn
        staging.copied[k].synchronize()  # the copy out of this buffer two runs ago has landed
        for name in names:
            np.copyto(staging.host[k][name], conform(inputs[name], self.graph.inputs[name], f"input {name!r}"))
        staging.on_device.copy_(staging.pinned[k], non_blocking=True)
        staging.copied[k].record()
        env: dict[str, Tensor] = {}
        for name in self.graph.inputs:
            if name in inputs:
                env[name] = staging.device[name]
                env[name].__dict__.pop(MEMO, None)  # rope tables and masks of the last run were derived from old values
            else:
                env[name] = self._handles[name]
        # A capture reads its inputs by address: this staging area's, and the handles'.
        self._static_key = (names, *(env[name].data_ptr() for name in self.graph.inputs if name not in inputs))
        return env

    def _stage(self, names: tuple[str, ...]) -> _Staging:
        """The staging area of runs fed exactly `names` (each input 16-byte aligned in one buffer)."""
        types = [self.graph.inputs[name] for name in names]
        sizes = [math.prod(t.shape) * dtypes.to_numpy(t.dtype).itemsize for t in types]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + -(-size // 16) * 16)
        pinned = [torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        on_device = torch.empty(offsets[-1], dtype=torch.uint8, device=self._device)
        host: list[dict[str, np.ndarray]] = [{}, {}]
        device = {}
        for name, t, at, size in zip(names, types, offsets, sizes):
            for views, buffer in zip(host, pinned):
                views[name] = buffer.numpy()[at:at + size].view(dtypes.to_numpy(t.dtype)).reshape(t.shape)
            device[name] = on_device[at:at + size].view(TORCH_DTYPES[t.dtype]).view(t.shape)
        staging = self._staging[names] = _Staging(host, device, pinned, on_device,
                                                  [torch.cuda.Event() for _ in range(2)])  # type: ignore[no-untyped-call]
        return staging

    def _run_static(self, env: dict[str, Tensor], key: tuple[Any, ...]) -> list[Tensor]:
        ctx = RunContext(self._rng, self._extent, {"static": True}, tally=self._expert_tally)
        if not self.cuda_graphs:
            return self._run_plan(env, ctx)
        captured = self._captures.get(key)
        if captured is not None:
            captured.graph.replay()
            return list(captured.outputs)
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] < 2:  # a one-off run (a prefill) is not worth a capture
            return self._run_plan(env, ctx)
        stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            outs = self._run_plan(env, ctx)  # this run's work, and the warm-up a capture needs first
            graph = torch.cuda.CUDAGraph()
            # thread_local: other executables may run on other threads of the server meanwhile.
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                for value in env.values():
                    value.__dict__.pop(MEMO, None)
                captured_outs = self._run_plan(env, ctx)
        torch.cuda.current_stream(self._device).wait_stream(stream)
        for value in env.values():
            value.__dict__.pop(MEMO, None)
        if len(self._captures) >= _MAX_CAPTURES:
            self._captures.pop(next(iter(self._captures)))
        self._captures[key] = _Captured(graph, captured_outs)
        self._seen.pop(key)
        return outs

    def _forget_captures(self) -> None:
        """Captured graphs read params by address: any param change drops them."""
        self._captures, self._seen = {}, {}
