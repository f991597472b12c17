"""torch backend: one torch kernel per op, on CPU or CUDA (`--backend torch --device cpu|cuda[:n]`).

f16/bf16 run natively (torch has CPU and CUDA kernels for every op used here); rope upcasts
half inputs on CPU, where each elementwise step would otherwise round. Sampling runs on the
host in float64 (executable.sample_row) so every backend picks the same token.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from graphmesh import dtypes
from graphmesh.errors import FailedPrecondition, InvalidArgument, OutOfRange
from graphmesh.graph import Graph
from graphmesh.ops import QUANT_BLOCKS, TensorType
from graphmesh_executor.executable import Capabilities, Executable, Kernel, RunContext, sample_row, uniform

Tensor = torch.Tensor
TORCH_DTYPES: dict[str, torch.dtype] = {
    "f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "i64": torch.int64, "i32": torch.int32, "u8": torch.uint8, "bool": torch.bool,
}
_HALF = (torch.float16, torch.bfloat16)
_BF16 = dtypes.to_numpy("bf16")
# Tensor attributes: a kv_write cache the executable hands over for an in-place write, the converted
# forms of a packed weight, and values derived from a tensor that every layer reads (the positions),
# each computed once. They live exactly as long as the tensor, which is never written in place.
_DONATED = "_graphmesh_donated"
_CONVERTED = "_graphmesh_converted"
_MEMO = "_graphmesh_memo"


def configure(threads: int | None) -> None:
    """Intra-op threads for this process: executors sharing a machine must not oversubscribe its cores."""
    if threads:
        torch.set_num_threads(threads)


def _up(x: Tensor) -> Tensor:
    return x.float() if x.dtype in _HALF and x.device.type == "cpu" else x


def _memo(t: Tensor, key: Hashable, make: Callable[[], Any]) -> Any:
    # 30 layers read the same positions tensor: derive rope tables and host-side values (a device sync
    # on CUDA) once per run, not once per layer.
    memo = t.__dict__.setdefault(_MEMO, {})
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _span(t: Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, on the host."""
    return _memo(t, "span", lambda: tuple(torch.stack(torch.aminmax(t)).tolist()))  # type: ignore[no-any-return]


def _check_indices(idx: Tensor, bound: int, what: str) -> None:
    if idx.numel():
        lo, hi = _span(idx)  # checked on the host: a bad index on CUDA would kill the context
        if lo < 0 or hi >= bound:
            raise OutOfRange(f"{what} index {hi if hi >= bound else lo} outside [0, {bound})", "INDEX_OUT_OF_RANGE")


def _elementwise(fn: Any) -> Kernel:
    return lambda ctx, xs, a: fn(*xs)


def _div(x: Tensor, y: Tensor) -> Tensor:
    return torch.div(x, y) if x.is_floating_point() else torch.div(x, y, rounding_mode="trunc")


def _matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, w = xs
    return torch.matmul(x.mT if a["transpose_a"] else x, w.mT if a["transpose_b"] else w)


def _reduce(fn: Any) -> Kernel:
    def kernel(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
        x = xs[0]
        dims = sorted({d % x.ndim for d in a["axes"]}) if a["axes"] else list(range(x.ndim))
        return fn(x, dim=dims, keepdim=a["keepdims"]).to(x.dtype)  # torch sums ints into i64
    return kernel


def _gather(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    table, idx = xs
    axis = a["axis"] % table.ndim
    _check_indices(idx, table.shape[axis], "gather")
    rows = table.index_select(axis, idx.reshape(-1).long())
    return rows.reshape(*table.shape[:axis], *idx.shape, *table.shape[axis + 1:])


def _rope_table(pos: Tensor, theta: float, rot: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    inv_freq = theta ** (-torch.arange(0, rot, 2, dtype=torch.float64, device=pos.device) / rot)
    angles = pos.to(torch.float64)[:, None, None] * inv_freq  # [S, 1, rot/2]; float64 keeps far positions exact
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rope(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, pos = xs
    rot = a["rotary_dim"] or x.shape[2]
    y = _up(x)
    cos, sin = _memo(pos, ("rope", a["theta"], rot, y.dtype), lambda: _rope_table(pos, a["theta"], rot, y.dtype))
    if a["style"] == "half":
        x1, x2 = y[..., : rot // 2], y[..., rot // 2 : rot]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    else:
        x1, x2 = y[..., 0:rot:2], y[..., 1:rot:2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    return torch.cat([rotated, y[..., rot:]], -1).to(x.dtype)


def _attention(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    q, k, v = xs[:3]  # [S, H, D]
    mask = None
    if a["causal"] and q.shape[0]:
        pos = xs[3]
        lo, hi = _span(pos)
        keys = min(k.shape[0], hi + 1)  # rows past every query's position are padding: never read them
        k, v = k[:keys], v[:keys]
        if lo + 1 < keys:  # some query sees fewer keys than remain (prefill); a decode step needs no mask
            mask = _memo(pos, ("mask", keys), lambda: torch.arange(keys, device=q.device)[None, :] <= pos[:, None])
    if q.shape[0] == 1:
        # Decode: two small matmuls per kv head group; SDPA's dispatch costs more than the math here
        # (measured 1.65 ms vs 0.12 ms on CPU for 32 heads over 400 keys). One query needs no mask.
        hq, d = q.shape[1:]
        hkv = k.shape[1]
        qg, kh, vh = _up(q).reshape(hkv, hq // hkv, d), _up(k).permute(1, 2, 0), _up(v).transpose(0, 1)
        scores = torch.matmul(qg, kh) * (a["scale"] or d**-0.5)  # [Hkv, G, keys]
        p = torch.softmax(scores.float() if scores.dtype in _HALF else scores, -1).to(vh.dtype)
        return torch.matmul(p, vh).reshape(1, hq, d).to(q.dtype)  # [Hkv, G, D] -> [1, Hq, D]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=a["scale"] or None, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def _kv_write(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    cache, rows, pos = xs
    start: int = _memo(pos, "start", lambda: int(pos.reshape(-1)[0]))
    if start < 0 or start + rows.shape[0] > cache.shape[0]:
        raise OutOfRange(f"kv_write of rows [{start}, {start + rows.shape[0]}) into a cache of "
                         f"{cache.shape[0]} rows", "ROW_OUT_OF_RANGE")
    # Functional unless the executable donated the cache: a handle replaced by this very output after the run.
    out = cache if cache.__dict__.pop(_DONATED, False) else cache.clone()
    out[start : start + rows.shape[0]] = rows
    out.__dict__.pop(_MEMO, None)  # written in place: nothing derived from it before still holds
    return out


def _top_k(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    # A stable descending sort puts equal values in index order; torch.topk does not promise that.
    return torch.sort(xs[0], dim=-1, descending=True, stable=True).indices[..., : a["k"]]


def _take_along_axis(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, idx = xs
    _check_indices(idx, x.shape[a["axis"]], "take_along_axis")
    return torch.gather(x, a["axis"], idx.long())


def _grouped_matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, w, ids = xs
    _check_indices(ids, w.shape[0], "expert")
    out = x.new_empty((x.shape[0], w.shape[2]))
    for e in torch.unique(ids).tolist():  # one matmul per expert present, never a gathered [M, K, N] weight copy
        rows = ids == e
        out[rows] = x[rows] @ w[e]
    return out


def _sample(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    logits = xs[0]
    t, k, p, s = (x.reshape(-1)[0].item() for x in xs[1:])
    if t <= 0.0:  # greedy needs no host copy of the logits; argmax picks the first maximum like numpy
        return torch.argmax(logits, dim=-1)
    rows = logits.to("cpu", torch.float64).numpy()
    tokens = [sample_row(row, t, int(k), p, uniform(ctx.rng, int(s), b)) for b, row in enumerate(rows)]
    return torch.tensor(tokens, dtype=torch.int64, device=logits.device)


def _unpack(packed: Tensor, scheme: str, n: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """GGUF blocks [n, k/32 * block_bytes] u8 -> codes q [n, k/32, 32], scale d and zero z [n, k/32, 1] (f32).

    A weight is q * d for q8_0 and (q - 8) * d + z for q4 (z = 0 for q4_0, m + 8d for q4_1): the form
    torch's int4 kernel computes.
    """
    block, size = QUANT_BLOCKS[scheme]
    b = packed.reshape(n, k // block, size)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if scheme == "q8_0":
        return b[..., 2:].contiguous().view(torch.int8), d, torch.zeros_like(d)
    qs = b[..., -16:]
    q = torch.cat([qs & 0x0F, qs >> 4], -1)  # low nibbles are elements 0..15
    z = b[..., 2:4].contiguous().view(torch.float16).float() + 8 * d if scheme == "q4_1" else torch.zeros_like(d)
    return q, d, z


def dequantize(packed: Tensor, scheme: str, n: int, k: int) -> Tensor:
    """GGUF blocks -> f32 [n, k]."""
    q, d, z = _unpack(packed, scheme, n, k)
    return ((q.float() - (0.0 if scheme == "q8_0" else 8.0)) * d + z).reshape(n, k)


def _int4pack(packed: Tensor, scheme: str, n: int, k: int) -> tuple[Tensor, Tensor]:
    """q4_0/q4_1 blocks -> torch's CPU int4 layout and its bf16 (scale, zero) pairs [k/32, n, 2]."""
    q, d, z = _unpack(packed, scheme, n, k)
    scales = torch.cat([d, z], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 8), scales


def _dequant_matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, packed = xs
    scheme, n, k = a["scheme"], a["n"], a["k"]
    converted: dict[Any, Any] = packed.__dict__.setdefault(_CONVERTED, {})
    # The packed int4 kernel is fast only with bf16 activations (f32/f16 take a slow path there), and it
    # needs n % 16 == 0; everything else multiplies by the weight dequantized once to x's dtype.
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and scheme in ("q4_0", "q4_1") and n % 16 == 0:
        if "int4" not in converted:
            converted["int4"] = _int4pack(packed, scheme, n, k)
        w, scales = converted["int4"]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, k), w, 32, scales)
        return y.reshape(*x.shape[:-1], n)
    if x.dtype not in converted:
        converted[x.dtype] = dequantize(packed, scheme, n, k).to(x.dtype)
    return F.linear(x, converted[x.dtype])


KERNELS: dict[str, Kernel] = {
    "neg": _elementwise(torch.neg),
    "exp": _elementwise(torch.exp),
    "log": _elementwise(torch.log),
    "sqrt": _elementwise(torch.sqrt),
    "rsqrt": _elementwise(torch.rsqrt),
    "tanh": _elementwise(torch.tanh),
    "sigmoid": _elementwise(torch.sigmoid),
    "relu": _elementwise(torch.relu),
    "silu": _elementwise(F.silu),
    "gelu": lambda ctx, xs, a: F.gelu(xs[0], approximate=a["approximate"]),
    "add": _elementwise(torch.add),
    "sub": _elementwise(torch.sub),
    "mul": _elementwise(torch.mul),
    "div": _elementwise(_div),
    "pow": _elementwise(torch.pow),
    "matmul": _matmul,
    "sum": _reduce(torch.sum),
    "mean": _reduce(torch.mean),
    "max": _reduce(torch.amax),
    "softmax": lambda ctx, xs, a: torch.softmax(xs[0], dim=a["axis"]),
    "layer_norm": lambda ctx, xs, a: F.layer_norm(xs[0], xs[0].shape[-1:], xs[1], xs[2], a["eps"]),
    "rms_norm": lambda ctx, xs, a: F.rms_norm(xs[0], xs[0].shape[-1:], xs[1], a["eps"]),
    "gather": _gather,
    "reshape": lambda ctx, xs, a: xs[0].reshape(a["shape"]),
    "transpose": lambda ctx, xs, a: xs[0].permute(a["perm"]),
    "concat": lambda ctx, xs, a: torch.cat(xs, dim=a["axis"]),
    "slice": lambda ctx, xs, a: xs[0].narrow(a["axis"], a["start"], a["end"] - a["start"]),
    "cast": lambda ctx, xs, a: xs[0].to(TORCH_DTYPES[a["dtype"]]),
    # Executable folds constants once at compile time (its _constants); this entry only declares the op.
    "constant": lambda ctx, xs, a: torch.from_numpy(np.array(a["value"])),
    "rope": _rope,
    "attention": _attention,
    "kv_write": _kv_write,
    "top_k": _top_k,
    "take_along_axis": _take_along_axis,
    "grouped_matmul": _grouped_matmul,
    "argmax": lambda ctx, xs, a: torch.argmax(xs[0], dim=a["axis"]),
    "sample": _sample,
    "dequant_matmul": _dequant_matmul,
}


class TorchExecutable(Executable[Tensor]):
    backend = "torch"
    # Handles stay torch tensors on the executable's device between runs (GPU memory on cuda).
    capabilities = Capabilities(resident_handles=True)
    kernels = KERNELS

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
                        if n.op == "kv_write" and n.inputs[0] in graph.inputs and n.name in graph.outputs
                        and readers[n.inputs[0]] == 1 and n.inputs[0] not in graph.outputs}

    def _from_host(self, array: np.ndarray) -> Tensor:
        owned = np.array(array, order="C")  # a copy: in-place KV writes must never reach the caller's array
        if owned.dtype == _BF16:
            return torch.from_numpy(owned.view(np.int16)).view(torch.bfloat16).to(self._device)
        return torch.from_numpy(owned).to(self._device)

    def _to_host(self, value: Tensor) -> np.ndarray:
        # A copy: handles may later be written in place, and callers keep what they read.
        host = value.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        if host.dtype == torch.bfloat16:
            return host.view(torch.int16).numpy().view(_BF16)
        return host.numpy()

    def _zeros(self, t: TensorType) -> Tensor:
        return torch.zeros(t.shape, dtype=TORCH_DTYPES[t.dtype], device=self._device)

    @torch.inference_mode()
    def _copy_rows(self, dst: Tensor, dst_start: int, src: Tensor, src_start: int, n: int) -> Tensor:
        out = dst.clone()
        out[dst_start : dst_start + n] = src[src_start : src_start + n]
        return out

    def _cast(self, value: Tensor, dtype: str) -> Tensor:
        return value.to(TORCH_DTYPES[dtype])

    def _gather_inputs(self, inputs: dict[str, np.ndarray]) -> dict[str, Tensor]:
        # A run that fails after the in-place write leaves rows from `pos` on written: rows past the
        # session's committed length, which attention masks and the retried run overwrites.
        env = super()._gather_inputs(inputs)
        for handle, output in self._donors.items():
            if self._prefix_feeds.get(handle) == output and handle in self._handles and handle not in inputs:
                alias = env[handle].detach()  # a new tensor object over the same storage carries the mark
                alias.__dict__[_DONATED] = True
                env[handle] = alias
        return env

    @torch.inference_mode()
    def _execute(self, env: dict[str, Tensor]) -> list[Tensor]:
        return super()._execute(env)

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
            value.__dict__.pop(_MEMO, None)
            self._handles[handle] = value
            self._resident.add(handle)
        return True
