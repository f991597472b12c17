"""torch backend: graphs run on CPU or CUDA (`--backend torch --device cpu|cuda[:n]`), one kernel per op of
torch_ops.py (attention and the KV ops: torch_attention.py). Sampling runs on the host in float64
(executable.sample_rows) so every backend picks the same token.

A graph runs as a plan of slots (one list index per value, freed after its last reader), not through the base
class's dict interpreter: decode of a 30-layer model is ~800 kernel calls, and Python overhead per call is what a
decode step on CPU pays besides reading the weights. The plan fuses pairs of nodes where one kernel serves both and
joins products that read one input (a layer's q, k and v) into one.

On CUDA, graphs whose host-side decisions can be made from their host inputs run static and are captured as CUDA
graphs: cuda_graphs.py.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import numpy as np
import torch

from graphmesh import dtypes
from graphmesh.errors import FailedPrecondition, InvalidArgument
from graphmesh.graph import Graph, Node
from graphmesh.ops import TensorType
from graphmesh_executor.backends import cpu_kernels, cuda_kernels
from graphmesh_executor.backends.cuda_graphs import CudaGraphs
from graphmesh_executor.backends.torch_attention import DONATED, ROW_KERNEL_RUN, kv_scatter_pair
from graphmesh_executor.backends.torch_ops import (
    BF16,
    CONVERTED,
    JOINED,
    KERNELS,
    JoinedWeight,
    add_rms_norm,
    joined_matmul,
    joined_weight,
    rope_pair,
    rows_form,
    silu_mul,
    tallied_grouped_matmul,
)
from graphmesh_executor.backends.torch_tensors import MEMO, TORCH_DTYPES, Tensor
from graphmesh_executor.executable import (
    Capabilities,
    DeviceValue,
    Executable,
    ExtentCut,
    HostOutput,
    Kernel,
    RunContext,
    conform,
)


def _numpy(host: Tensor) -> np.ndarray:
    """A host tensor as numpy, sharing its memory (numpy has no bfloat16 of its own: its bits as ml_dtypes')."""
    return host.view(torch.int16).numpy().view(BF16) if host.dtype == torch.bfloat16 else host.numpy()


NUMPY_DTYPES = {t: dtypes.to_numpy(name) for name, t in TORCH_DTYPES.items()}


def _to_host_later(value: Tensor) -> HostOutput:
    """A CUDA tensor copied, behind the work on the stream, into pinned memory (a captured graph's next replay
    overwrites its outputs); the result waits for an event after the copy, so the thread that launched the work
    is free to launch more while the device runs it. A host tensor is its own output."""
    if not value.is_cuda:
        return HostOutput(_numpy(value))
    pinned = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    pinned.copy_(value, non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()

    def wait() -> np.ndarray:
        done.synchronize()  # type: ignore[no-untyped-call]  # releases the GIL while the device works
        return _numpy(pinned)
    return HostOutput(wait=wait)


def configure(threads: int | None) -> None:
    """Intra-op threads for this process: executors sharing a machine must not oversubscribe its cores."""
    if threads:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class _Step:
    kernel: Kernel
    args: tuple[int, ...]  # slots read
    attrs: dict[str, Any]
    out: int  # slot written
    free: tuple[int, ...]  # slots whose last reader this is
    pair: int = -1  # a second slot written: the kernel returns (out's value, pair's value)


_BOTH_LAYOUTS = 8 << 20  # elements of a weight kept in both layouts (an LM head), see TorchExecutable._lay_out


class TorchExecutable(CudaGraphs):
    backend = "torch"
    # Handles stay torch tensors on the executable's device between runs (GPU memory on cuda).
    capabilities = Capabilities(resident_handles=True, active_extent=True)
    kernels = KERNELS
    # Run pairs of nodes as one kernel (see _fusions); None: on CUDA where the Triton kernels are, on the host where
    # cpu_kernels are (a C call for a pair, or torch's two ops in one step: a plan step fewer either way, the same
    # bits as apart).
    fuse_pairs: bool | None = None

    @classmethod
    def capabilities_on(cls, device: str) -> Capabilities:
        # CUDA queues work: commit_no_wait and run_pipelined return before it is done. On the host, torch's
        # kernels finish before they return, so they run one after another.
        return replace(cls.capabilities, async_pipeline=device.startswith("cuda"))

    def __init__(self, graph: Graph, device: str = "cpu") -> None:
        try:
            self._device = torch.device(device)
        except RuntimeError as e:
            raise InvalidArgument(f"bad torch device {device!r}: {e}", "UNKNOWN_DEVICE") from e
        if self._device.type not in ("cpu", "cuda"):
            raise InvalidArgument(f"torch backend runs on cpu or cuda[:n], not {device!r}", "UNKNOWN_DEVICE")
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise FailedPrecondition(f"device {device!r}: torch sees no CUDA device", "DEVICE_UNAVAILABLE")
        super().__init__(graph, device)
        # kv_write nodes that may write their cache input in place: the input is read by that node alone,
        # and the node is an output. Donated only while a prefix feed stores that output back into the handle.
        readers = Counter(name for node in graph.nodes for name in node.inputs)
        self._donors = {n.inputs[0]: graph.outputs.index(n.name) for n in graph.nodes
                        if n.op in ("kv_write", "kv_scatter") and n.inputs[0] in graph.inputs and n.name in graph.outputs
                        and readers[n.inputs[0]] == 1 and n.inputs[0] not in graph.outputs}
        # Weights read only as W in x @ W.T get the layout their product reads fastest (_weight_order): f32 ones
        # cpu_kernels' panels, others W.T contiguous (a view of the declared shape) for MKL's one-row product.
        self._transposed = {n.inputs[1] for n in graph.nodes if n.op == "matmul" and n.attrs["transpose_b"]
                            and not n.attrs["transpose_a"] and n.inputs[1] in graph.params
                            and len(graph.params[n.inputs[1]].shape) == 2 and readers[n.inputs[1]] == 1
                            and n.inputs[0] != n.inputs[1]} if self._device.type == "cpu" else set()
        # Packed weights read only by dequant_matmul of f32 rows on the host get the panel form of cpu_kernels at
        # lay-out, so that no request waits for it (bf16 rows take torch's int4 kernel): (scheme, n, k, activations)
        # by param.
        self._panelled = {n.inputs[1]: (n.attrs["scheme"], n.attrs["n"], n.attrs["k"], n.attrs["activations"])
                          for n in graph.nodes
                          if n.op == "dequant_matmul" and n.inputs[1] in graph.params and readers[n.inputs[1]] == 1
                          and graph.type_of(n.inputs[0]).dtype == "f32"
                          and cpu_kernels.packs(n.attrs["scheme"], n.attrs["k"])} \
            if self._device.type == "cpu" and cpu_kernels.library() is not None else {}
        # Weights joined for one product (see _joins): the panels are the joined weight's, made at the join.
        self._join_groups = self._joins(graph)
        self._joined_weights = {node.inputs[1] for members in self._join_groups for node in graph.nodes
                                if node.name in members}
        self._join_partners = {node.inputs[1]: [n.inputs[1] for n in graph.nodes if n.name in members]
                               for members in self._join_groups for node in graph.nodes if node.name in members}
        for name in self._joined_weights:
            self._panelled.pop(name, None)
        self._joins_made = False  # set by finalize_params: from then on a member set on its own is read alone
        # Experts are tallied on the device by the plan's grouped products; capturing top-k ids
        # (enable_moe_topk_capture) takes the base interpreter, which reads them back.
        grouped = [n for n in graph.nodes if n.op == "grouped_matmul"]
        self._expert_tally = torch.zeros(
            (len(grouped), 2, max(graph.type_of(n.inputs[1]).shape[0] for n in grouped)), dtype=torch.long,
            device=self._device) if grouped else None
        self._slots, self._steps = self._plan(graph)
        self._host_checks = self._static_checks(graph) if self._device.type == "cuda" else None
        # cuda_graphs.CudaGraphs' state (typed there)
        self._staging = {}  # by the host inputs' names
        self._static_key = None  # this run's capture key when it runs static
        self._captures = {}
        self._seen = {}

    # -- the plan --------------------------------------------------------------------------------------
    def _plan(self, graph: Graph) -> tuple[dict[str, int], list[_Step]]:
        names = [*graph.inputs, *graph.params, *(n.name for n in graph.nodes)]
        joins = {members[0]: members for members in self._join_groups}
        names += [f"{first}+joined" for first in joins]
        slots = {name: i for i, name in enumerate(names)}
        keep = set(graph.outputs) | set(graph.params)
        joined = {name for members in joins.values() for name in members}
        fused = self._fusions(graph)
        absorbed = {other.name for _, other in fused.values()}
        ordinals = {n.name: i for i, n in enumerate(n for n in graph.nodes if n.op == "grouped_matmul")}
        steps = []
        for i, node in enumerate(graph.nodes):
            if node.op == "constant" or (node.name in joined and node.name not in joins) or node.name in absorbed:
                continue  # a constant is folded; a joined matmul runs with the first of its group, a fused node at its pair's
            if node.name in joins:
                steps += self._joined_steps(graph, i, [n for n in graph.nodes if n.name in joins[node.name]], slots)
                continue
            if node.name in fused:
                steps.append(self._fused_step(i, node, *fused[node.name], slots, keep))
                continue
            free = tuple(slots[n] for n in dict.fromkeys(node.inputs) if self._last_use.get(n) == i and n not in keep)
            kernel, attrs = self.kernels[node.op], node.attrs
            if node.op == "grouped_matmul":
                kernel, attrs = tallied_grouped_matmul, {**attrs, "ordinal": ordinals[node.name]}
            steps.append(_Step(kernel, tuple(slots[n] for n in node.inputs), attrs, slots[node.name], free))
        return slots, steps

    def _fusions(self, graph: Graph) -> dict[str, tuple[str, Node]]:
        """Pairs of nodes that run as one kernel (a Triton kernel on CUDA, see cuda_kernels; on the host a C call of
        cpu_kernels or one plan step), by the node whose place the kernel takes: ("add_rms_norm", the rms_norm reading
        that add's sum), ("silu_mul", the silu whose output only that mul reads), ("rope_pair", the rope before it) or
        ("kv_scatter_pair", the kv_scatter before it). A layer of a Llama has two of the first and one of each other:
        six launches fewer on CUDA, six steps of Python fewer on the host."""
        fuse = self.fuse_pairs
        if fuse is None:  # no tensors: whether the kernels may run at all
            fuse = cuda_kernels.usable() if self._device.type == "cuda" else \
                self._device.type == "cpu" and cpu_kernels.library() is not None
        if not fuse:
            return {}
        readers: dict[str, list[Node]] = {}
        for node in graph.nodes:
            for name in dict.fromkeys(node.inputs):
                readers.setdefault(name, []).append(node)
        producer = {node.name: node for node in graph.nodes}
        fused: dict[str, tuple[str, Node]] = {}
        for node in graph.nodes:
            if node.op == "add" and all(graph.type_of(x).shape == graph.type_of(node.name).shape for x in node.inputs):
                norm = next((r for r in readers.get(node.name, []) if r.op == "rms_norm" and r.inputs[0] == node.name
                             and r.inputs[1] in graph.params), None)
                if norm is not None and len(graph.type_of(node.name).shape) == 2:
                    fused[node.name] = ("add_rms_norm", norm)
            elif node.op == "mul" and len(graph.type_of(node.name).shape) == 2:
                silu = producer.get(node.inputs[0])
                if (silu is not None and silu.op == "silu" and len(readers[silu.name]) == 1 and silu.name not in graph.outputs
                        and node.inputs[1] != silu.name
                        and graph.type_of(silu.inputs[0]).shape == graph.type_of(node.inputs[1]).shape):
                    fused[node.name] = ("silu_mul", silu)
        # Same-op pairs in graph order: a layer's rope of q then of k (same positions and attributes), and its
        # kv_scatter of k then of v (same slots), each at the second's place.
        index = {node.name: i for i, node in enumerate(graph.nodes)}
        series: dict[tuple[str, ...], list[Node]] = {}
        for node in graph.nodes:
            if node.op == "rope":
                series.setdefault(("rope_pair", node.inputs[1], repr(sorted(node.attrs.items()))), []).append(node)
            elif node.op == "kv_scatter":
                series.setdefault(("kv_scatter_pair", node.inputs[2]), []).append(node)
        for (kind, *_), nodes in series.items():
            i = 0
            while i + 1 < len(nodes):
                first, second = nodes[i], nodes[i + 1]
                if self._pairable(first, second, index, producer, readers) and first.inputs[0] != second.inputs[0]:
                    fused[second.name] = (kind, first)
                    i += 2
                else:
                    i += 1
        return fused

    @staticmethod
    def _pairable(first: Node, second: Node, index: dict[str, int], producer: dict[str, Node],
                  readers: dict[str, list[Node]]) -> bool:
        """Whether `first` may run at `second`'s place: nothing `second` reads comes from it, and nothing reads its
        output before that place."""
        if any(index[r.name] <= index[second.name] for r in readers.get(first.name, [])):
            return False
        todo = [name for name in second.inputs if name in producer]
        while todo:  # second's ancestors after first: none may be first
            node = producer[todo.pop()]
            if node is first:
                return False
            if index[node.name] > index[first.name]:
                todo += [name for name in node.inputs if name in producer]
        return True

    def _fused_step(self, i: int, node: Node, kind: str, other: Node, slots: dict[str, int], keep: set[str]) -> _Step:
        """The step of a fused pair (see _fusions) at `node`'s place: the add, or the second of the others. It frees
        what no later node reads (what only the absorbed node read, earlier, included)."""
        pair, attrs = slots[other.name], node.attrs
        if kind == "add_rms_norm":
            names, kernel, attrs = [*node.inputs, other.inputs[1]], cast(Kernel, add_rms_norm), other.attrs
        elif kind == "rope_pair":
            names, kernel = [node.inputs[0], other.inputs[0], node.inputs[1]], cast(Kernel, rope_pair)
        elif kind == "kv_scatter_pair":
            names, kernel = [*node.inputs, *other.inputs[:2]], cast(Kernel, kv_scatter_pair)
        else:
            names, pair, kernel, attrs = [other.inputs[0], node.inputs[1]], -1, silu_mul, {}
        free = tuple(slots[n] for n in dict.fromkeys(names) if self._last_use.get(n, i) <= i and n not in keep)
        return _Step(kernel, tuple(slots[n] for n in names), attrs, slots[node.name], free, pair)

    def _joins(self, graph: Graph) -> list[tuple[str, ...]]:
        """Groups of matmul nodes that run as one: x @ W_i.T over the same activations x [rows, k], each W_i a 2-d
        param of one dtype that nothing else reads, run as x @ [W_1; W_2; ...].T. A Llama layer's q, k, v and its
        gate, up are two products instead of five. On CUDA a decode step's GPU time is mostly kernel launches; on
        the host, f32 and packed products through cpu_kernels (dequant_matmul groups of one scheme and k) cost
        ~15 us of Python and ctypes a call, and a SmolLM2 decode step makes 90 fewer."""
        host = self._device.type == "cpu" and cpu_kernels.library() is not None
        if self._device.type != "cuda" and not host:
            return []
        readers = Counter(name for node in graph.nodes for name in node.inputs)
        groups: dict[tuple[str, str, int, str, str], list[str]] = {}
        for node in graph.nodes:
            if node.op == "dequant_matmul":
                if not host or not cpu_kernels.packs(node.attrs["scheme"], node.attrs["k"]):
                    continue
                scheme = node.attrs["scheme"]
            elif node.op == "matmul" and node.attrs["transpose_b"] and not node.attrs["transpose_a"]:
                scheme = ""
            else:
                continue
            x, w = node.inputs
            t = graph.params.get(w)
            if t is None or len(t.shape) != 2 or readers[w] != 1 or len(graph.type_of(x).shape) != 2:
                continue
            if host and (graph.type_of(x).dtype != "f32" or (not scheme and t.dtype != "f32")):
                continue  # the host kernels take f32 rows, and f32 or packed weights
            groups.setdefault((x, t.dtype, t.shape[1], scheme, node.attrs.get("activations", "")), []).append(node.name)
        return [tuple(members) for members in groups.values() if len(members) > 1]

    def _joined_steps(self, graph: Graph, i: int, members: list[Node], slots: dict[str, int]) -> list[_Step]:
        """The product of a group (see _joins) at its first member's place, and each member's output as a view of
        it. The activations are freed there when no other node reads them later."""
        x = members[0].inputs[0]
        later = {j for j, n in enumerate(graph.nodes) if j >= i and x in n.inputs}
        places = {j for j, n in enumerate(graph.nodes) if n.name in {m.name for m in members}}
        free = (slots[x],) if later <= places and x not in graph.outputs else ()
        out = slots[f"{members[0].name}+joined"]
        packed = {"scheme": members[0].attrs["scheme"], "k": members[0].attrs["k"],
                  "activations": members[0].attrs["activations"]} if members[0].op == "dequant_matmul" else {}
        steps = [_Step(joined_matmul, (slots[x], *(slots[m.inputs[1]] for m in members)), packed, out, free)]
        start = 0
        for m in members:
            n = m.attrs["n"] if m.op == "dequant_matmul" else graph.params[m.inputs[1]].shape[0]
            steps.append(_Step(self.kernels["slice"], (out,), {"axis": 1, "start": start, "end": start + n},
                               slots[m.name], ()))
            start += n
        return steps

    def _run_plan(self, env: dict[str, Tensor], ctx: RunContext, steps: list[_Step] | None = None) -> list[Tensor]:
        values: list[Any] = [None] * len(self._slots)
        slots = self._slots
        for name, value in env.items():
            values[slots[name]] = value
        for name, value in self._constants.items():
            values[slots[name]] = value
        for name, t in self.graph.params.items():
            values[slots[name]] = self._params[name] if name in self._params else self._zeros(t)
        for step in steps or self._steps:
            if step.pair < 0:
                values[step.out] = step.kernel(ctx, [values[j] for j in step.args], step.attrs)
            else:
                values[step.out], values[step.pair] = step.kernel(ctx, [values[j] for j in step.args], step.attrs)
            for j in step.free:
                values[j] = None
        return [values[slots[name]] for name in self.graph.outputs]

    def _weight_order(self, name: str) -> Literal["C", "F"]:
        """The host layout of a weight read as W in x @ W.T: [n, k] rows where cpu_kernels' f32 product runs (it
        reads them as panels made from those rows, for any number of rows), else [k, n] for MKL's one-row product."""
        if name not in self._transposed:
            return "C"
        return "C" if self._param_type(name).dtype == "f32" and cpu_kernels.library() is not None else "F"

    def _lay_out(self, name: str) -> None:
        if name in self._panelled:
            cpu_kernels.panels(self._params[name], *self._panelled[name])
        if name in self._transposed:
            weight = self._params[name]
            if self._weight_order(name) == "C":
                weight = self._params[name] = weight.contiguous()
                # A joined weight's panels are the whole's, made at the join. One set on its own after the join
                # (ExecutorService.SetParam) breaks it: from then on every member is read alone (joined_matmul)
                # and needs panels of its own, or torch's product would serve it with other bits.
                if name not in self._joined_weights:
                    cpu_kernels.fpanels(weight)
                elif self._joins_made:
                    for member in self._join_partners[name]:
                        if member in self._params:
                            cpu_kernels.fpanels(self._params[member])
            else:
                if not weight.mT.is_contiguous():
                    weight = self._params[name] = weight.mT.contiguous().mT
                if weight.numel() >= _BOTH_LAYOUTS:
                    # The [k, n] layout that makes MKL's one-row product fast makes a batch of rows slow (SmolLM2's
                    # 49152x576 head, 1 core: 8.6 vs 17.6 ms for 1 row, but 73 vs 51 ms for 16): a big weight keeps
                    # a second form for several rows (see rows_form).
                    rows = rows_form(weight)
                    if rows is not None:
                        weight.__dict__[CONVERTED] = {"rows": rows}
        self._forget_captures()

    def set_param(self, name: str, data: np.ndarray) -> None:
        super().set_param(name, data)
        self._lay_out(name)

    def set_param_typed(self, name: str, data: np.ndarray) -> None:
        # Straight into the column-major form _lay_out wants on the host: one copy instead of two. A re-plan sets
        # every new layer's weights from standby ones this way (~0.1 s for 19 of SmolLM2's layers).
        order = self._weight_order(name) if self._device.type == "cpu" else "C"
        self._params[name] = self._from_host(conform(data, self._param_type(name), f"param {name!r}"), order)
        self._lay_out(name)

    def copy_params_from(self, src: Executable[Any]) -> list[str]:
        self._forget_captures()
        return super().copy_params_from(src)

    def finalize_params(self) -> list[str]:
        self._joins_made = True
        for members in self._join_groups:
            nodes = [node for node in self.graph.nodes if node.name in members]
            self._join(tuple(node.inputs[1] for node in nodes))
            joined = joined_weight([self._params[node.inputs[1]] for node in nodes if node.inputs[1] in self._params])
            if joined is not None and nodes[0].op == "dequant_matmul":  # the panels a decode reads (see _lay_out)
                cpu_kernels.panels(joined.whole, nodes[0].attrs["scheme"], joined.whole.shape[0], nodes[0].attrs["k"],
                                   nodes[0].attrs["activations"])
            elif joined is not None and nodes[0].inputs[1] in self._transposed and \
                    self._weight_order(nodes[0].inputs[1]) == "C":
                cpu_kernels.fpanels(joined.whole)
        return super().finalize_params()

    def _join(self, names: tuple[str, ...]) -> None:
        """Replaces the weights `names` by row views of one tensor holding them all (executables that copy params
        from this one share it); nothing when one is missing or they are joined already."""
        if any(name not in self._params for name in names) or joined_weight([self._params[n] for n in names]) is not None:
            return
        whole = torch.cat([self._params[name] for name in names])
        views, start = [], 0
        for name in names:
            views.append(whole.narrow(0, start, self._params[name].shape[0]))
            start += views[-1].shape[0]
        for name, view in zip(names, views):
            self._params[name] = view
        views[0].__dict__[JOINED] = JoinedWeight(whole, tuple((v.data_ptr(), tuple(v.shape)) for v in views))
        self._forget_captures()

    def clone(self) -> Executable[Tensor]:
        twin = super().clone()
        assert isinstance(twin, TorchExecutable)
        twin._staging, twin._captures, twin._seen, twin._static_key = {}, {}, {}, None
        twin._expert_tally = None if self._expert_tally is None else torch.zeros_like(self._expert_tally)
        return twin

    def _from_host(self, array: np.ndarray, order: Literal["C", "F"] = "C") -> Tensor:
        owned = np.array(array, order=order)  # a copy: in-place KV writes must never reach the caller's array
        host = torch.from_numpy(owned.view(np.int16)).view(torch.bfloat16) if owned.dtype == BF16 else \
            torch.from_numpy(owned)
        if self._device.type == "cuda":
            # From pinned memory the copy is queued behind the work already on the stream; from pageable memory
            # CUDA waits for that work first, so a commit_no_wait would wait for the run before it.
            return host.pin_memory().to(self._device, non_blocking=True)
        return host

    def _to_host(self, value: Tensor) -> np.ndarray:
        # A copy: handles may later be written in place, and callers keep what they read.
        return _numpy(value.detach().to("cpu", memory_format=torch.contiguous_format, copy=True))

    def _zeros(self, t: TensorType) -> Tensor:
        return torch.zeros(t.shape, dtype=TORCH_DTYPES[t.dtype], device=self._device)

    def zeros_like_inputs(self, names: Sequence[str]) -> list[Tensor]:
        types = [self._handle_type(name) for name in names]
        if self._device.type != "cpu" or len({t.dtype for t in types}) != 1:
            return super().zeros_like_inputs(names)
        # On the host, one calloc'd block viewed as every handle: it is bigger than glibc's largest mmap threshold,
        # so it comes from fresh mmap pages that the kernel zeroes when first touched. torch.zeros memsets all of a
        # re-plan's ~0.5 GB pool up front instead: ~0.2 s, on the recovery's critical path.
        sizes = [math.prod(t.shape) for t in types]
        raw = np.zeros(sum(sizes), np.int16 if types[0].dtype == "bf16" else dtypes.to_numpy(types[0].dtype))
        arena = torch.from_numpy(raw)
        if types[0].dtype == "bf16":
            arena = arena.view(torch.bfloat16)
        views, at = [], 0
        for t, n in zip(types, sizes):
            views.append(arena[at:at + n].view(t.shape))
            at += n
        return views

    @torch.inference_mode()
    def _copy_rows(self, dst: Tensor, dst_start: int, src: Tensor, src_start: int, n: int) -> Tensor:
        out = dst.clone()
        out[dst_start : dst_start + n] = src[src_start : src_start + n]
        return out

    def _cast(self, value: Tensor, dtype: str) -> Tensor:
        return value.to(TORCH_DTYPES[dtype])

    def _pad_rows(self, value: Tensor, rows: int) -> Tensor:
        return torch.cat([value, value.new_zeros((rows - value.shape[0], *value.shape[1:]))])

    @torch.inference_mode()
    def take_rows(self, value: Tensor, rows: np.ndarray) -> np.ndarray:
        taken = value.index_select(0, torch.from_numpy(np.asarray(rows, np.int64)).to(value.device))
        if taken.device.type == "cpu" and taken.dtype != torch.bfloat16:
            return taken.numpy()  # index_select made a new tensor: nothing else holds it, no second copy
        return self._to_host(taken)

    def host_view(self, value: Tensor) -> np.ndarray | None:
        if value.device.type != "cpu" or value.dtype != torch.float32 or not value.is_contiguous():
            return None
        return value.numpy()

    def replays_rows(self, rows: int) -> bool:
        # A CUDA decode, and prompt chunks whose runs all take the row kernel (torch_attention.rows_fit).
        return self._device.type == "cuda" and (rows == 1 or (rows <= ROW_KERNEL_RUN and self.reads_own_blocks()))

    def reads_own_blocks(self) -> bool:
        # On CUDA a decode and a prompt's short runs take the row kernel, a long run a flash kernel over its own
        # blocks (torch_attention); only the static decode of a head size the kernel does not serve reads the table.
        queries = [self.graph.type_of(n.inputs[0]) for n in self.graph.nodes if n.op == "paged_attention"]
        return self._device.type == "cuda" and all(cuda_kernels.paged_serves(q.shape[-1], q.dtype) for q in queries)

    @torch.inference_mode()
    def put_rows(self, value: Tensor, rows: np.ndarray, data: np.ndarray) -> Tensor:
        idx = torch.from_numpy(np.asarray(rows, np.int64)).to(value.device)
        # A view of the caller's array, strided or not: index_copy_ is the copy (the rows of a seed or a migration
        # were copied twice more before it).
        src = torch.from_numpy(data) if data.dtype != BF16 else self._from_host(data)
        value.index_copy_(0, idx, src.to(value.device, value.dtype))
        value.__dict__.pop(MEMO, None)
        return value

    def _gather_inputs(self, inputs: dict[str, np.ndarray]) -> dict[str, Tensor]:
        # A run that fails after the in-place write leaves rows from `pos` on written: rows past the
        # session's committed length, which attention masks and the retried run overwrites.
        self._check_input_names(inputs)
        self._static_key = None
        static = self._host_checks is not None and self._topk_capture_width is None
        env = self._gather_static(inputs) if static else None
        if env is None:
            env = super()._gather_inputs(inputs)
        for handle, output in self._donors.items():
            if self._prefix_feeds.get(handle) == output and handle in self._handles and handle not in inputs:
                alias = env[handle].detach()  # a new tensor object over the same storage carries the mark
                alias.__dict__[DONATED] = True
                env[handle] = alias
        return env

    @torch.inference_mode()
    def _execute(self, env: dict[str, Tensor], cut: ExtentCut | None = None) -> list[Tensor]:
        if self._topk_capture_width is not None:
            return super()._execute(env, cut)
        ctx = RunContext(self._rng, self._extent, light=self._light, tally=self._expert_tally)
        if cut is not None:  # cut to the active extent: eager (a capture is of one shape), the same slots
            if cut.plan is None:
                cut.plan = self._plan(cut.graph)[1]
            return self._run_plan(env, ctx, cut.plan)
        if self._static_key is not None:
            return self._run_static(env, self._static_key)
        try:
            return self._run_plan(env, ctx)
        finally:
            if self._device.type == "cpu":
                cpu_kernels.rest_helper()

    def _flush_expert_tally(self) -> None:
        if self._expert_tally is None:
            return
        tally = self._expert_tally.to("cpu", copy=True).numpy()  # waits for the runs that added to it
        self._expert_tally.zero_()  # in place: captured graphs add to this very tensor
        for ordinal, (tokens, calls) in enumerate(tally):
            self._tally_experts(ordinal, tokens, calls)

    def sync_pending(self) -> int:
        """Waits for the runs commit_no_wait queued (on CUDA they are still running when it returns)."""
        if self._device.type == "cuda" and self._pending:
            torch.cuda.current_stream(self._device).synchronize()  # type: ignore[no-untyped-call]
        return super().sync_pending()

    @torch.inference_mode()
    def run_pipelined(self, input_sets: Sequence[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        """On CUDA every run is queued before any is waited for: each one's outputs are copied, behind it on the
        stream, into pinned host buffers (the next run overwrites the outputs of a captured graph), and one wait
        at the end covers them all. Elsewhere, runs one after another."""
        if self._device.type != "cuda":
            return super().run_pipelined(input_sets)
        staged = []
        for inputs in input_sets:
            self.run(inputs, read_indices=[])
            assert self._last_outputs is not None
            copies = []
            for out in self._last_outputs:
                pinned = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                copies.append(pinned.copy_(out, non_blocking=True))
            staged.append(copies)
        torch.cuda.current_stream(self._device).synchronize()  # type: ignore[no-untyped-call]
        return [[_numpy(c).astype(np.float32, copy=False) for c in copies] for copies in staged]

    def run_async(self, inputs: dict[str, np.ndarray], index: int, extent: tuple[int, int] | None = None,
                  light: bool = False) -> HostOutput:
        """On CUDA the output is copied, behind the run on the stream, into pinned host memory (a captured graph's
        next replay overwrites its outputs), and an event after the copy is what the result waits for: the thread
        that launched the run is free to launch the next while the device works (a rank's other micro-batch)."""
        if self._device.type != "cuda":
            return super().run_async(inputs, index, extent, light)
        self._check_output_index(index)
        self._run_env(self._gather_inputs(inputs), list(inputs), extent, light)
        assert self._last_outputs is not None
        return _to_host_later(self._last_outputs[index])

    def run_fed(self, input_sets: Sequence[dict[str, np.ndarray]], feed: str, rows: int,
                extent: tuple[int, int] | None = None, light: bool = False) -> np.ndarray:
        """On CUDA the runs queue behind each other: each one's `feed` is copied on the device from the output
        before it, queued after that run's host inputs and before the run, and one wait at the end reads every
        run's output. A decode run reads nothing back between its iterations, so the GPU never waits for the
        host there (a host round trip per iteration left it idle for the host's part of each). Not in inference
        mode, as run(): a staging area made here is copied into in place by later runs."""
        if self._device.type != "cuda":
            return super().run_fed(input_sets, feed, rows, extent, light)
        kept: list[Tensor] = []
        for inputs in input_sets:
            env = self._gather_inputs(inputs)
            if kept:
                target = env[feed]
                target[:rows].copy_(self._last_outputs[0][:rows])  # type: ignore[index]
                target.__dict__.pop(MEMO, None)
            self._run_env(env, list(inputs), extent, light)
            assert self._last_outputs is not None
            kept.append(self._last_outputs[0].clone())  # a captured graph's next replay overwrites its outputs
        return self._to_host(torch.stack(kept))

    def keeps_on_device(self) -> bool:
        return self._device.type == "cuda"

    def run_on_device(self, inputs: dict[str, np.ndarray], index: int, fed: dict[str, DeviceValue],
                      extent: tuple[int, int] | None = None, light: bool = False,
                      host: bool = False) -> tuple[DeviceValue, HostOutput | None]:
        """The stream waits for each fed value's event and copies it into its input after the host inputs are
        staged; the output is cloned behind the run (a captured graph's next replay overwrites it). Nothing here
        waits for the device. Each fed tensor is marked as used by this stream, so that its memory is not handed
        out again before the stream has read it. (On the CPU, where tests drive it, the copies are plain.)"""
        self._check_output_index(index)
        cuda = self._device.type == "cuda"
        stream = torch.cuda.current_stream(self._device) if cuda else None
        env = self._gather_inputs(inputs)
        for name, value in fed.items():
            tensor = value.on(stream)
            if stream is not None:
                tensor.record_stream(stream)
            target = env[name]
            target[:tensor.shape[0]].copy_(tensor, non_blocking=cuda)
            target.__dict__.pop(MEMO, None)
        self._run_env(env, list(inputs), extent, light)
        assert self._last_outputs is not None
        kept = self._last_outputs[index].clone()
        return DeviceValue(kept, NUMPY_DTYPES[kept.dtype], tuple(kept.shape)), _to_host_later(kept) if host else None

    def host_async(self, values: list[DeviceValue]) -> HostOutput:
        stream = torch.cuda.current_stream(self._device) if self._device.type == "cuda" else None
        return _to_host_later(torch.stack([v.on(stream) for v in values]))

    @torch.inference_mode()
    def feed_kv_row(self, src_row: int, dst_row: int, row_elems: int) -> bool:
        """The base method with the row copied on the device, into the handle in place, not through the host."""
        if self._last_outputs is None or row_elems <= 0:
            return super().feed_kv_row(src_row, dst_row, row_elems)  # raises the right error
        plan = []
        for handle, index in self._row_feeds.items():
            t = self.graph.inputs[handle]
            out = self._last_outputs[index].reshape(-1, row_elems)
            if not (0 <= src_row < out.shape[0] and 0 <= dst_row < math.prod(t.shape) // row_elems):
                return super().feed_kv_row(src_row, dst_row, row_elems)  # raises OutOfRange; nothing was written
            plan.append((handle, out[src_row], self._handles[handle] if handle in self._handles else self._zeros(t)))
        for handle, row, value in plan:
            value = value.contiguous()  # a fed-back output may be a strided view
            value.view(-1, row_elems)[dst_row] = row
            value.__dict__.pop(MEMO, None)
            self._handles[handle] = value
            self._mark_resident(handle)
        return True
