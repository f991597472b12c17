"""torch backend: one torch kernel per op, on CPU or CUDA (`--backend torch --device cpu|cuda[:n]`).

f16/bf16 run natively (torch has CPU and CUDA kernels for every op used here); rope upcasts
half inputs on CPU, where each elementwise step would otherwise round. Sampling runs on the
host in float64 (executable.sample_rows) so every backend picks the same token.

A graph runs as a plan of slots (one list index per value, freed after its last reader), not
through the base class's dict interpreter: decode of a 30-layer model is ~800 kernel calls, and
Python overhead per call is what a decode step on CPU pays besides reading the weights.

On CUDA, graphs whose host-side decisions can be made from their host inputs run static and are
captured as CUDA graphs: cuda_graphs.py.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F

from graphmesh import dtypes
from graphmesh.checkpoints import dequantize_packed
from graphmesh.errors import FailedPrecondition, InvalidArgument, OutOfRange
from graphmesh.graph import Graph, Node
from graphmesh.ops import QUANT_BLOCKS, TensorType
from graphmesh_executor.backends import cpu_kernels, cuda_kernels
from graphmesh_executor.backends.cuda_graphs import CudaGraphs
from graphmesh_executor.backends.torch_tensors import MEMO, TORCH_DTYPES, Tensor
from graphmesh_executor.executable import Capabilities, Executable, ExtentCut, Kernel, RunContext, conform, sample_rows

_HALF = (torch.float16, torch.bfloat16)
_BF16 = dtypes.to_numpy("bf16")
# Tensor attributes: a kv_write cache the executable hands over for an in-place write, the converted
# forms of a packed weight, and (MEMO, torch_tensors.py) values derived from a tensor that every layer reads
# (the positions), each computed once. They live exactly as long as the tensor, which is never written in place.
_DONATED = "_graphmesh_donated"
_CONVERTED = "_graphmesh_converted"
_JOINED = "_graphmesh_joined"


def configure(threads: int | None) -> None:
    """Intra-op threads for this process: executors sharing a machine must not oversubscribe its cores."""
    if threads:
        torch.set_num_threads(threads)


def _up(x: Tensor) -> Tensor:
    return x.float() if x.dtype in _HALF and x.device.type == "cpu" else x


def _memo(t: Tensor, key: Hashable, make: Callable[[], Any]) -> Any:
    # 30 layers read the same positions tensor: derive rope tables and host-side values (a device sync
    # on CUDA) once per run, not once per layer.
    memo = t.__dict__.setdefault(MEMO, {})
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _span(t: Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, on the host."""
    return _memo(t, "span", lambda: tuple(torch.stack(torch.aminmax(t)).tolist()))  # type: ignore[no-any-return]


def _static(ctx: RunContext) -> bool:
    """A run whose kernels must not read device values on the host (it may be captured as a CUDA graph):
    the executable checked every index on the host inputs before the run."""
    return bool(ctx.extras.get("static"))


def _check_indices(ctx: RunContext, idx: Tensor, bound: int, what: str) -> None:
    if idx.numel() and not _static(ctx):
        lo, hi = _span(idx)  # checked on the host: a bad index on CUDA would kill the context
        if lo < 0 or hi >= bound:
            raise OutOfRange(f"{what} index {hi if hi >= bound else lo} outside [0, {bound})", "INDEX_OUT_OF_RANGE")


def _elementwise(fn: Any) -> Kernel:
    return lambda ctx, xs, a: fn(*xs)


def _rms_norm(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, w = xs
    if x.is_cpu:
        fused = cpu_kernels.rms_norm(x, w, a["eps"])  # one call, not six kernels
        return fused if fused is not None else F.rms_norm(x, x.shape[-1:], w, a["eps"])
    rows = x.reshape(-1, x.shape[-1])  # a view where x's rows are contiguous (q/k norms: [S, H, D])
    if cuda_kernels.rows_usable(rows) and w.dtype == x.dtype:  # add_rms_norm's bits (see cuda_kernels.rms_norm)
        return cuda_kernels.rms_norm(rows, w, a["eps"]).view(x.shape)
    return F.rms_norm(x, x.shape[-1:], w, a["eps"])


def _add_rms_norm(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """An add and the rms_norm of its sum (TorchExecutable._fusions): one kernel where the rows allow, else the two."""
    x, y, w = xs
    if cuda_kernels.rows_usable(x, y) and w.dtype == x.dtype:
        return cuda_kernels.add_rms_norm(x, y, w, a["eps"])
    total = x + y
    return total, _rms_norm(ctx, [total, w], a)


def _silu_mul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    """silu(gate) * up (TorchExecutable._fusions): one kernel where the rows allow, else the two."""
    gate, up = xs
    return cuda_kernels.silu_mul(gate, up) if cuda_kernels.rows_usable(gate, up) else F.silu(gate) * up


def _rope_pair(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """Two rope nodes at the same positions (TorchExecutable._fusions: a layer's k, then its q): one launch where
    the Triton kernel serves both, else each alone."""
    x, y, pos = xs
    rot = a["rotary_dim"] or x.shape[2]
    if (a["style"] == "half" and rot == x.shape[2] == y.shape[2] and cuda_kernels.rope_half_usable(x)
            and cuda_kernels.rope_half_usable(y)):
        cos, sin = _half_table(pos, a, rot, torch.float32)
        return cuda_kernels.rope_half_pair(x, y, cos, sin)
    return _rope(ctx, [x, pos], a), _rope(ctx, [y, pos], a)


def _kv_scatter_pair(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """Two kv_scatters to the same slots (TorchExecutable._fusions: a layer's v pool, then its k pool): one launch
    where the Triton kernel serves both, else each alone."""
    v_pool, v_rows, slots, k_pool, k_rows = xs
    if not cuda_kernels.scatter_pair_usable(k_pool, v_pool, k_rows, v_rows):
        return _kv_scatter(ctx, [v_pool, v_rows, slots], a), _kv_scatter(ctx, [k_pool, k_rows, slots], a)
    _check_indices(ctx, slots, min(k_pool.shape[0], v_pool.shape[0]), "kv_scatter slot")
    k_out, v_out = _writable(ctx, k_pool), _writable(ctx, v_pool)
    cuda_kernels.scatter_pair(k_out, v_out, k_rows, v_rows, slots)
    return v_out, k_out


def _div(x: Tensor, y: Tensor) -> Tensor:
    return torch.div(x, y) if x.is_floating_point() else torch.div(x, y, rounding_mode="trunc")


def _invariant(x: Tensor, w: Tensor) -> bool:
    """Whether x @ W.T takes cuda_kernels' product: f32 rows on CUDA, whose bits must not depend on the rows beside
    them (cuBLAS picks its kernel by the row count). Other dtypes keep cuBLAS: they promise no such bits."""
    return x.dtype == torch.float32 and x.dim() == 2 and cuda_kernels.product_usable(x, w)


def _device_xwt(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T off the host: the batch-invariant product for f32 rows on CUDA, else torch's."""
    return cuda_kernels.matmul_xwt(x, w) if _invariant(x, w) else torch.matmul(x, w.mT)


def _matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, w = xs
    if a["transpose_b"] and not a["transpose_a"] and _invariant(x, w):
        return cuda_kernels.matmul_xwt(x, w)
    if a["transpose_b"] and not a["transpose_a"] and x.dim() == 2:
        if cpu_kernels.has_fpanels(w) and cpu_kernels.usable(x, w):  # an f32 weight laid out (_lay_out): any rows
            return cpu_kernels.matmul_xwt(x, w, ctx.light)
        forms = w.__dict__.get(_CONVERTED, {})  # the other layouts of a weight (see TorchExecutable._lay_out)
        if x.shape[0] > 1 and "rows" in forms:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), forms["rows"], None, "none", [], "")
    return torch.matmul(x.mT if a["transpose_a"] else x, w.mT if a["transpose_b"] else w)


@dataclass(frozen=True)
class _Joined:
    """Weights laid one after another in one tensor, so that a product reads them at once (see TorchExecutable._joins):
    the params are row views of `whole`, and the first carries this record."""

    whole: Tensor  # [sum of n_i, k]
    parts: tuple[tuple[int, tuple[int, ...]], ...]  # (address, shape) of each view, to tell them from other tensors


def _joined(weights: Sequence[Tensor]) -> _Joined | None:
    joined: _Joined | None = weights[0].__dict__.get(_JOINED)
    if joined is None or joined.parts != tuple((w.data_ptr(), tuple(w.shape)) for w in weights):
        return None
    return joined


def _joined_matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    """x @ [W_1; W_2; ...].T (see TorchExecutable._joins); `a` holds the packed weights' scheme and k, if packed."""
    x, *weights = xs
    joined = _joined(weights)
    if x.is_cpu:
        # cpu_kernels sums each output alone, in one order whatever rows of the weight a call covers: one call
        # over the joined weight gives every member's exact bits for a third of the calls. Where the kernels do
        # not serve the rows, or a member was set on its own since the join, each member runs as it would alone
        # (a member set on its own gets its own panels, see _lay_out), so its bits do not change either.
        if joined is not None and "scheme" in a and cpu_kernels.packed_usable(x, joined.whole, a["scheme"]):
            return cpu_kernels.matmul_xwt_packed(x, joined.whole, a["scheme"], joined.whole.shape[0], ctx.light)
        if joined is not None and "scheme" not in a and cpu_kernels.has_fpanels(joined.whole) \
                and cpu_kernels.usable(x, joined.whole):
            return cpu_kernels.matmul_xwt(x, joined.whole, ctx.light)
        if "scheme" in a:
            return torch.cat([_dequant_matmul(ctx, [x, w], {**a, "n": w.shape[0]}) for w in weights], -1)
        return torch.cat([_matmul(ctx, [x, w], {"transpose_a": False, "transpose_b": True}) for w in weights], -1)
    if joined is None:  # a param was set on its own since the join (ExecutorService.SetParam): one product each
        return torch.cat([_device_xwt(x, w) for w in weights], -1)
    return _device_xwt(x, joined.whole)


def _rows_form(weight: Tensor) -> Tensor | None:
    """A big f32 weight [n, k] prepacked for oneDNN's x @ W.T over several rows, or None where oneDNN is absent.
    SmolLM2's 49152x576 head on one core, its weights cold in cache as in a forward pass: 17.5 vs 31.6 ms for 8
    rows, 25 vs 44 ms for 16, where MKL's one-row product still wins (6.7 ms); the sums are the same as MKL's."""
    if weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16)  # type: ignore[no-any-return]
    except (RuntimeError, AttributeError):
        return None


def _reduce(fn: Any) -> Kernel:
    def kernel(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
        x = xs[0]
        dims = sorted({d % x.ndim for d in a["axes"]}) if a["axes"] else list(range(x.ndim))
        return fn(x, dim=dims, keepdim=a["keepdims"]).to(x.dtype)  # torch sums ints into i64
    return kernel


def _gather(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    table, idx = xs
    axis = a["axis"] % table.ndim
    _check_indices(ctx, idx, table.shape[axis], "gather")
    rows = table.index_select(axis, idx.reshape(-1).long())
    return rows.reshape(*table.shape[:axis], *idx.shape, *table.shape[axis + 1:])


def _rope_table(pos: Tensor, a: dict[str, Any], rot: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [S, 1, rot/2] of the rope attributes `a`: theta's frequencies, or a scaled variant's inv_freq
    (made on the host from the model's config) and its cos/sin factor."""
    if a["inv_freq"]:
        inv_freq = _inv_freq(tuple(a["inv_freq"]), pos.device)
    else:
        inv_freq = a["theta"] ** (-torch.arange(0, rot, 2, dtype=torch.float64, device=pos.device) / rot)
    angles = pos.to(torch.float64)[:, None, None] * inv_freq  # [S, 1, rot/2]; float64 keeps far positions exact
    cos, sin = angles.cos(), angles.sin()
    if a["scale"] != 1.0:  # YaRN / longrope attention factor
        cos, sin = cos * a["scale"], sin * a["scale"]
    return cos.to(dtype), sin.to(dtype)


@functools.lru_cache(maxsize=64)
def _inv_freq(values: tuple[float, ...], device: torch.device) -> Tensor:
    """A scaled rope's frequencies on `device`, made once: no host-to-device copy may run while a CUDA graph is
    captured, and the eager run before a capture makes them."""
    return torch.tensor(values, dtype=torch.float64, device=device)


def _rope_key(a: dict[str, Any], rot: int) -> tuple[Any, ...]:
    return a["theta"], a["inv_freq"], a["scale"], rot


def _half_table(pos: Tensor, a: dict[str, Any], rot: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin over the whole head, sin signed so that rope = x * cos + roll(x, rot/2) * sin; made once a run
    for these positions (a stage's layers all rotate at them)."""
    def make() -> tuple[Tensor, Tensor]:
        cos, sin = _rope_table(pos, a, rot, dtype)
        return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    return _memo(pos, ("rope-half", *_rope_key(a, rot), dtype), make)  # type: ignore[no-any-return]


def _rope(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, pos = xs
    rot = a["rotary_dim"] or x.shape[2]
    y = _up(x)
    if a["style"] == "half" and rot == x.shape[2]:
        # Four kernels instead of ten; the same products and sums as the halves below (the sign is exact).
        triton_rope = cuda_kernels.rope_half_usable(x)  # one kernel, not three: GPU time is kernel count there
        dtype = torch.float32 if triton_rope else y.dtype
        cos, sin = _half_table(pos, a, rot, dtype)
        if triton_rope:
            return cuda_kernels.rope_half(x, cos, sin)
        if y.is_cuda:  # three kernels, not four
            return torch.addcmul(y * cos, y.roll(rot // 2, -1), sin)
        fused = cpu_kernels.rope_half(y, cos, sin)  # the same bits in one call instead of four
        return (fused if fused is not None else y * cos + y.roll(rot // 2, -1) * sin).to(x.dtype)
    cos, sin = _memo(pos, ("rope", *_rope_key(a, rot), y.dtype), lambda: _rope_table(pos, a, rot, y.dtype))
    if a["style"] == "half":
        x1, x2 = y[..., : rot // 2], y[..., rot // 2 : rot]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    else:
        x1, x2 = y[..., 0:rot:2], y[..., 1:rot:2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    return torch.cat([rotated, y[..., rot:]], -1).to(x.dtype)


def _visible(pos: Tensor, keys: int, window: int) -> Tensor:
    """[*pos.shape, keys]: whether a query at `pos` sees each key: up to its position, and within `window` (0: none)."""
    j = torch.arange(keys, device=pos.device)
    seen = j <= pos[..., None]
    return seen & (j > pos[..., None] - window) if window else seen


def _explicit_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float, softcap: float
                        ) -> Tensor:
    """q [S, Hq, D], k and v [K, Hkv, D], visible [S, K] (None: every key) -> [S, Hq, D], the scores written out:
    SDPA has no soft-cap (Gemma 2)."""
    s, hq, d = q.shape
    hkv = k.shape[1]
    qg = _up(q).reshape(s, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, S, D]
    scores = torch.matmul(qg, _up(k).permute(1, 2, 0)[:, None]) * scale  # [Hkv, G, S, K]
    scores = scores.float() if scores.dtype in _HALF else scores
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    vh = _up(v).transpose(0, 1)[:, None]  # [Hkv, 1, K, D]
    out = torch.matmul(torch.softmax(scores, -1).to(vh.dtype), vh)  # [Hkv, G, S, D]
    return out.permute(2, 0, 1, 3).reshape(s, hq, d).to(q.dtype)


def _attention(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    q, k, v = xs[:3]  # [S, H, D]
    window, softcap = a["window"], a["softcap"]
    mask = None
    causal = False  # the mask is exactly SDPA's lower triangle: its flash kernel, not a masked one (~1.5x on CPU)
    hide = None  # decode: keys past the query's position (or before its window), on the device
    if a["causal"] and q.shape[0] and _static(ctx):
        # No host read of the positions: every cache row is read and rows past each query's position are
        # masked, so one captured graph serves every position.
        pos, keys = xs[3], k.shape[0]
        visible: Tensor = _memo(pos, ("static-mask", keys, window), lambda: _visible(pos, keys, window))
        mask, hide = visible, _memo(pos, ("static-hide", keys, window), lambda: ~visible[0])
        # Rows past every query are padding that may hold anything (NaN included): a zero weight times NaN is
        # NaN, so they are zeroed, not only masked.
        pad = _memo(pos, ("static-pad", keys), lambda: (torch.arange(keys, device=q.device) > pos.max())[:, None, None])
        k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
    elif a["causal"] and q.shape[0]:
        pos = xs[3]
        lo, hi = _span(pos)
        keys = min(k.shape[0], hi + 1)  # rows past every query's position are padding: never read them
        k, v = k[:keys], v[:keys]
        if window and hi - window + 1 > 0:  # some query's window starts past key 0
            mask = _memo(pos, ("mask", keys, window), lambda: _visible(pos, keys, window))
            hide = ~mask[0] if q.shape[0] == 1 else None
        elif lo + 1 < keys:  # some query sees fewer keys than remain (prefill); a decode step needs no mask
            causal = lo == 0 and keys == q.shape[0] and _memo(pos, "iota", lambda: bool(
                torch.equal(pos, torch.arange(keys, dtype=pos.dtype, device=pos.device))))
            if not causal:
                mask = _memo(pos, ("mask", keys), lambda: torch.arange(keys, device=q.device)[None, :] <= pos[:, None])
    scale = a["scale"] or q.shape[2] ** -0.5
    if q.shape[0] == 1:
        # Decode: two small matmuls per kv head group; SDPA's dispatch costs more than the math here
        # (measured 1.65 ms vs 0.12 ms on CPU for 32 heads over 400 keys). One query needs no causal mask.
        hq, d = q.shape[1:]
        hkv = k.shape[1]
        qg, kh, vh = _up(q).reshape(hkv, hq // hkv, d), _up(k).permute(1, 2, 0), _up(v).transpose(0, 1)
        scores = torch.matmul(qg, kh) * scale  # [Hkv, G, keys]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if hide is not None:
            scores.masked_fill_(hide, -math.inf)
        p = torch.softmax(scores.float() if scores.dtype in _HALF else scores, -1).to(vh.dtype)
        return torch.matmul(p, vh).reshape(1, hq, d).to(q.dtype)  # [Hkv, G, D] -> [1, Hq, D]
    if softcap:
        if causal:
            mask = _memo(xs[3], ("mask", k.shape[0]), lambda: _visible(xs[3], k.shape[0], 0))
        return _explicit_attention(q, k, v, mask, scale, softcap)
    # A batch axis of 1: torch's CPU flash kernel takes 4-d inputs only (3-d ones fall back to the math path, 3-4x slower).
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=causal, scale=a["scale"] or None,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def _kv_write(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    cache, rows, pos = xs
    if _static(ctx):
        # The executable checked the row range on the host, and writes its donated caches in place.
        idx = pos.reshape(-1)[:1]
        if rows.shape[0] > 1:
            idx = idx + torch.arange(rows.shape[0], device=pos.device)
        cache.__dict__.pop(_DONATED, None)
        cache.__dict__.pop(MEMO, None)
        return cache.index_copy_(0, idx, rows)
    start: int = _memo(pos, "start", lambda: int(pos.reshape(-1)[0]))
    if start < 0 or start + rows.shape[0] > cache.shape[0]:
        raise OutOfRange(f"kv_write of rows [{start}, {start + rows.shape[0]}) into a cache of "
                         f"{cache.shape[0]} rows", "ROW_OUT_OF_RANGE")
    # Functional unless the executable donated the cache: a handle replaced by this very output after the run.
    out = cache if cache.__dict__.pop(_DONATED, False) else cache.clone()
    out[start : start + rows.shape[0]] = rows
    out.__dict__.pop(MEMO, None)  # written in place: nothing derived from it before still holds
    return out


def _writable(ctx: RunContext, pool: Tensor) -> Tensor:
    """The pool a kv_scatter writes: in place when the executable donated it (the handle this output replaces) or
    the run is static; a pool is the whole KV of every session on the stage, far too big to copy per layer per step."""
    out = pool if pool.__dict__.pop(_DONATED, False) or _static(ctx) else pool.clone()
    out.__dict__.pop(MEMO, None)  # written in place: nothing derived from it before still holds
    return out


def _kv_scatter(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    pool, rows, slots = xs
    _check_indices(ctx, slots, pool.shape[0], "kv_scatter slot")
    out = _writable(ctx, pool)
    # Every layer scatters to the same slots: their index form is made once a run (a kernel on CUDA).
    index = _memo(slots, "index", lambda: slots.reshape(-1).long())
    return out.index_copy_(0, index, rows if rows.dtype == out.dtype else rows.to(out.dtype))


def _paged_rows(table: Tensor, blocks: int) -> Tensor:
    """Pool block ids of the first `blocks` blocks of every sequence, flattened [B * blocks]; once a run."""
    return _memo(table, ("paged-rows", blocks), lambda: table[:, :blocks].reshape(-1).long())  # type: ignore[no-any-return]


def _paged_attention(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    q, k_pool, v_pool, table, token_seq, pos = xs
    block, (t, hq, d), hkv = a["block_size"], q.shape, k_pool.shape[1]
    scale, window, softcap = a["scale"] or d**-0.5, a["window"], a["softcap"]
    _check_indices(ctx, table, k_pool.shape[0] // block, "block_table block")
    _check_indices(ctx, token_seq, table.shape[0], "token_seq sequence")
    _check_indices(ctx, pos, table.shape[1] * block, "q_positions position")
    k_blocks, v_blocks = k_pool.view(-1, block, hkv, d), v_pool.view(-1, block, hkv, d)
    if a["decode"] and not _static(ctx) and cpu_kernels.attention_usable(q, k_pool, v_pool):
        return cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, pos, block, scale, window,
                                                  softcap)  # in place, no copies
    if a["decode"] and cuda_kernels.paged_decode_usable(q, k_pool, v_pool):
        return cuda_kernels.paged_decode_attention(q, k_pool, v_pool, table, pos, block, scale, window,
                                                   softcap)  # one kernel, no copies
    if a["decode"]:
        # One query per sequence: gather every sequence's blocks (whole-block copies) and run one batched
        # attention with keys past each query masked. Static runs read every block of the table (no host read).
        blocks = table.shape[1] if _static(ctx) else -(-(_span(pos)[1] + 1) // block)
        ids = _paged_rows(table, blocks)
        keys = blocks * block
        k = k_blocks.index_select(0, ids).view(t, keys, hkv, d)
        v = v_blocks.index_select(0, ids).view(t, keys, hkv, d)
        if q.is_cuda and not softcap:
            # One fused attention kernel where the products below take ~10 (a decode step's GPU time is mostly
            # kernel count): each kv head's group of query heads is that head's query axis, so no kv head is
            # repeated; every (sequence, kv head) is its own problem, whatever the other rows of the batch.
            bias = _memo(pos, ("paged-bias", keys, q.dtype, window),
                         lambda: _hiding_bias(pos, keys, q.dtype, window)[:, None, None])
            attended = F.scaled_dot_product_attention(q.reshape(t, hkv, hq // hkv, d), k.transpose(1, 2),
                                                      v.transpose(1, 2), attn_mask=bias, scale=scale)
            return attended.reshape(t, hq, d)
        hidden = _memo(pos, ("paged-hide", keys, window), lambda: ~_visible(pos, keys, window))
        scores = torch.matmul(q.reshape(t, hkv, hq // hkv, d), k.permute(0, 2, 3, 1)) * scale  # [T, Hkv, G, keys]
        scores = scores.float() if scores.dtype in _HALF else scores
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(hidden[:, None, None, :], -math.inf)
        p = torch.softmax(scores, -1).to(v.dtype)
        return torch.matmul(p, v.permute(0, 2, 1, 3)).reshape(t, hq, d).to(q.dtype)
    # Chunks of prompts (and decodes) mixed: each sequence's queries are one contiguous run of rows.
    runs = _prompt_runs(token_seq, pos)
    if q.is_cuda and cuda_kernels.paged_decode_usable(q, k_pool, v_pool):
        return _rows_attention(q, k_pool, v_pool, table, token_seq, pos, runs, a)
    return torch.cat([_run_attention(q, k_pool, v_pool, table, pos, r, a) for r in runs])


def _run_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, pos: Tensor, run: Run,
                   a: dict[str, Any]) -> Tensor:
    """One sequence's run of query rows over its blocks: a causal kernel when the run is the sequence from 0."""
    seq, start, end, keys, from_zero = run
    block, (hkv, d) = a["block_size"], k_pool.shape[1:]
    scale, window, softcap = a["scale"] or d**-0.5, a["window"], a["softcap"]
    ids = table[seq, :-(-keys // block)].long()
    k = k_pool.view(-1, block, hkv, d).index_select(0, ids).reshape(-1, hkv, d)[:keys]
    v = v_pool.view(-1, block, hkv, d).index_select(0, ids).reshape(-1, hkv, d)[:keys]
    qs, ps = q[start:end], pos[start:end]
    causal = from_zero and end - start > 1 and not (window and keys > window)
    mask = None if causal or (from_zero and not window) else _visible(ps, keys, window)
    if softcap:
        return _explicit_attention(qs, k, v, _visible(ps, keys, window) if causal else mask, scale, softcap)
    # A batch axis of 1: torch's CPU flash kernel takes 4-d inputs only.
    o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != hkv)
    return o[0].transpose(0, 1)


# Runs of at most this many query rows take the row kernel on CUDA (each row over its own keys, as a decode row);
# longer ones a flash kernel of their own, which reads each key once per tile of queries instead of once per row.
ROW_KERNEL_RUN = 256


def _rows_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, token_seq: Tensor, pos: Tensor,
                    runs: list[Run], a: dict[str, Any]) -> Tensor:
    """A mixed step on CUDA (decodes and prompt chunks of any lengths): every row of a short run is a query of the
    paged row kernel over its sequence's table row, all in one launch, whatever the batch; each long run is one
    flash call. A row's path depends on its own run alone, so a row's bits do not depend on the other rows."""
    def layout() -> tuple[Tensor, Tensor | None, list[Run]]:
        long = [r for r in runs if r[2] - r[1] > ROW_KERNEL_RUN]
        rows = None
        if long:
            rows = torch.tensor([i for r in runs if r[2] - r[1] <= ROW_KERNEL_RUN for i in range(r[1], r[2])],
                                dtype=torch.long, device=q.device)
        seqs = token_seq.long() if rows is None else token_seq.index_select(0, rows).long()
        return table.index_select(0, seqs), rows, long
    row_table, rows, long = _memo(token_seq, ("row-table", id(pos), id(table)), layout)
    kernel = {"block": a["block_size"], "scale": a["scale"] or q.shape[2] ** -0.5, "window": a["window"],
              "softcap": a["softcap"]}
    if rows is None:
        return cuda_kernels.paged_decode_attention(q, k_pool, v_pool, row_table, pos, **kernel)
    out = torch.empty_like(q)
    if rows.numel():
        out.index_copy_(0, rows, cuda_kernels.paged_decode_attention(q.index_select(0, rows), k_pool, v_pool,
                                                                      row_table, pos.index_select(0, rows), **kernel))
    for r in long:
        out[r[1]:r[2]] = _run_attention(q, k_pool, v_pool, table, pos, r, a)
    return out


def _hiding_bias(pos: Tensor, keys: int, dtype: torch.dtype, window: int = 0) -> Tensor:
    """[*pos.shape, keys]: 0 where a query at `pos` sees the key, -inf past it (and before its window). SDPA's fused
    CUDA kernels take it additive, in q's dtype, made once a run: a boolean mask is converted inside every layer's
    call."""
    hide = ~_visible(pos, keys, window)
    return torch.zeros(hide.shape, dtype=dtype, device=pos.device).masked_fill_(hide, -math.inf)


Run = tuple[int, int, int, int, bool]  # (sequence, first row, end row, keys, its rows are positions 0.. in order)


def _prompt_runs(token_seq: Tensor, pos: Tensor) -> list[Run]:
    """The runs of adjacent rows of one sequence; once a run, not once a layer (a host read: a sync on CUDA)."""
    def split() -> list[Run]:
        seqs, positions = token_seq.tolist(), pos.tolist()
        runs: list[Run] = []
        start = 0
        while start < len(seqs):
            end = start
            while end < len(seqs) and seqs[end] == seqs[start]:
                end += 1
            keys = max(positions[start:end]) + 1
            from_zero = positions[start] == 0 and positions[end - 1] == end - start - 1 and keys == end - start
            runs.append((seqs[start], start, end, keys, from_zero))
            start = end
        return runs
    return _memo(token_seq, ("prompt-runs", id(pos)), split)  # type: ignore[no-any-return]


def _top_k(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    # A stable descending sort puts equal values in index order; torch.topk does not promise that.
    return torch.sort(xs[0], dim=-1, descending=True, stable=True).indices[..., : a["k"]]


def _take_along_axis(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, idx = xs
    _check_indices(ctx, idx, x.shape[a["axis"]], "take_along_axis")
    return torch.gather(x, a["axis"], idx.long())


def _grouped_matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    """On CUDA one Triton launch (cuda_kernels.grouped_matmul): no host read, so a step with experts can be
    captured, and a row's bits do not depend on the rows beside it. Elsewhere rows sorted by expert once (a stable
    argsort, one index_select), each present expert's contiguous run of rows times its weight (one matmul each,
    after one host read of the run lengths), then the results put back in row order (index_copy_): never a
    gathered [M, K, N] weight copy."""
    x, w, ids = xs
    _check_indices(ctx, ids, w.shape[0], "expert")
    if cuda_kernels.product_usable(x, w):
        return cuda_kernels.grouped_matmul(x, w, ids)
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order)
    done = x.new_empty((x.shape[0], w.shape[2]))
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=w.shape[0]).tolist()):
        if n:
            done[start:start + n] = rows[start:start + n] @ w[e]
        start += n
    return torch.empty_like(done).index_copy_(0, order, done)


def _tallied_grouped_matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    """grouped_matmul in a plan: the product, then its rows per expert added to ctx.tally on the device (a step
    with experts reads nothing back, so it can be captured; TorchExecutable._flush_expert_tally reads the tally)."""
    out = _grouped_matmul(ctx, xs, a)
    if ctx.tally is not None:
        flat = xs[2].reshape(-1).long()
        experts = xs[1].shape[0]
        tokens = torch.zeros(experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
        ctx.tally[a["ordinal"], 0, :experts] += tokens
        ctx.tally[a["ordinal"], 1, :experts] += tokens > 0
    return out


def _argmax(x: Tensor, axis: int = -1) -> Tensor:
    """torch.argmax (the first maximum, as numpy picks it); host rows over the last axis by the C kernel."""
    fast = cpu_kernels.argmax_rows(x) if x.is_cpu and axis in (-1, x.dim() - 1) else None
    return fast if fast is not None else torch.argmax(x, dim=axis)


def _sample(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    logits = xs[0]
    if _static(ctx):  # the executable runs static only when the host temperatures say greedy
        return _argmax(logits)
    settings = [x.to("cpu").numpy() for x in xs[1:]]
    if (settings[0] <= 0.0).all():  # greedy needs no host copy of the logits
        return _argmax(logits)
    tokens = sample_rows(ctx.rng, logits.to("cpu", torch.float64).numpy(), *settings)
    return torch.from_numpy(tokens).to(logits.device)


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
    """GGUF blocks -> f32 [n, k] (K-quants by gguf's own dequantization, on the host)."""
    if QUANT_BLOCKS[scheme][0] != 32:
        return torch.from_numpy(dequantize_packed(packed.cpu().numpy(), scheme, n, k)).to(packed.device)
    q, d, z = _unpack(packed, scheme, n, k)
    return ((q.float() - (0.0 if scheme == "q8_0" else 8.0)) * d + z).reshape(n, k)


def _int4pack(packed: Tensor, scheme: str, n: int, k: int) -> tuple[Tensor, Tensor]:
    """GGUF blocks -> torch's CPU int4 layout and its bf16 (scale, zero) pairs [k/32, rows, 2].

    q4 gives n rows. q8_0 gives 2n: a code q is 16 * (q >> 4) + (q & 15), two exact nibbles, so rows
    0..n-1 hold the low nibbles (scale d, zero 8d) and rows n..2n-1 the high ones (scale 16d), and the
    product is the sum of the two halves: half the bytes of a bf16 weight, a quarter of f32.
    """
    q, d, z = _unpack(packed, scheme, n, k)
    if scheme == "q8_0":
        codes = q.to(torch.int32)
        q = torch.cat([codes & 0x0F, (codes >> 4) + 8])
        d, z = torch.cat([d, 16 * d]), torch.cat([8 * d, torch.zeros_like(d)])
    scales = torch.cat([d, z], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(q.shape[0], k).to(torch.int32), 8), scales


def _dequant_matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, packed = xs
    scheme, n, k = a["scheme"], a["n"], a["k"]
    if cpu_kernels.packed_usable(x, packed, scheme):
        # f32 rows, a decode's or a prompt chunk's: the kernel reads the blocks in panels, made when the param was
        # set (see TorchExecutable._lay_out) or at the first product of a weight that is not a param. One kernel
        # for every row count keeps a row's bits independent of the rows beside it: a prompt chunk's rows went
        # through MKL over a dequantized copy, another summation order (and a dense copy packing meant to avoid).
        return cpu_kernels.matmul_xwt_packed(x, packed, scheme, n, ctx.light)
    converted: dict[Any, Any] = packed.__dict__.setdefault(_CONVERTED, {})
    # The packed int4 kernel is fast only with bf16 activations (f32/f16 take a slow path there), and it
    # needs n % 16 == 0 and groups of 32 (no K-quant); everything else multiplies by the weight dequantized once
    # to x's dtype.
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and n % 16 == 0 and QUANT_BLOCKS[scheme][0] == 32:
        if x.numel() >= 256 * k:
            # A long prefill: the int4 kernel is a one-row kernel (14.6 ms for 512 x 576 x 1536), while dequantizing
            # on the fly and a bf16 GEMM take 8.3 ms, and nothing dense stays in memory.
            return F.linear(x, dequantize(packed, scheme, n, k).to(torch.bfloat16))
        if "int4" not in converted:
            converted["int4"] = _int4pack(packed, scheme, n, k)
        w, scales = converted["int4"]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, k), w, 32, scales)
        if scheme == "q8_0":
            y = y[:, :n] + y[:, n:]
        return y.reshape(*x.shape[:-1], n)
    if x.dtype not in converted:
        w = dequantize(packed, scheme, n, k).to(x.dtype)
        converted[x.dtype] = w.mT.contiguous().mT if w.device.type == "cpu" else w  # see TorchExecutable._transposed
    if _invariant(x, converted[x.dtype]):
        return cuda_kernels.matmul_xwt(x, converted[x.dtype])
    return F.linear(x, converted[x.dtype])


# This backend's kernel of every op of graphmesh.ops: every backend's table has the same keys, in one order
# (test_executor_service checks the op sets agree). Where two tables read alike (an op whose kernel is the module's
# own _<op>) the functions behind the names are still each backend's own: parallel tables, not copies.
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
    "rms_norm": _rms_norm,
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
    "kv_scatter": _kv_scatter,
    "paged_attention": _paged_attention,
    "top_k": _top_k,
    "take_along_axis": _take_along_axis,
    "grouped_matmul": _grouped_matmul,
    "argmax": lambda ctx, xs, a: _argmax(xs[0], a["axis"]),
    "sample": _sample,
    "dequant_matmul": _dequant_matmul,
}


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
    # Run pairs of nodes as one kernel (see _fusions); None: on CUDA, where the Triton kernels are. On the host the
    # pair runs torch's two ops in one step (the same bits as apart), which tests use to check the plan's wiring.
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
        # lay-out, so that no request waits for it (bf16 rows take torch's int4 kernel): (scheme, n, k) by param.
        self._panelled = {n.inputs[1]: (n.attrs["scheme"], n.attrs["n"], n.attrs["k"]) for n in graph.nodes
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
                kernel, attrs = _tallied_grouped_matmul, {**attrs, "ordinal": ordinals[node.name]}
            steps.append(_Step(kernel, tuple(slots[n] for n in node.inputs), attrs, slots[node.name], free))
        return slots, steps

    def _fusions(self, graph: Graph) -> dict[str, tuple[str, Node]]:
        """Pairs of nodes that run as one Triton kernel on CUDA (see cuda_kernels), by the node whose place the kernel
        takes: ("add_rms_norm", the rms_norm reading that add's sum), ("silu_mul", the silu whose output only that
        mul reads), ("rope_pair", the rope before it) or ("kv_scatter_pair", the kv_scatter before it). A layer of a
        Llama has two of the first and one of each other: six launches fewer."""
        fuse = self.fuse_pairs
        if fuse is None:
            fuse = self._device.type == "cuda" and cuda_kernels.usable()  # no tensors: whether the kernels may run at all
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
            names, kernel, attrs = [*node.inputs, other.inputs[1]], cast(Kernel, _add_rms_norm), other.attrs
        elif kind == "rope_pair":
            names, kernel = [node.inputs[0], other.inputs[0], node.inputs[1]], cast(Kernel, _rope_pair)
        elif kind == "kv_scatter_pair":
            names, kernel = [*node.inputs, *other.inputs[:2]], cast(Kernel, _kv_scatter_pair)
        else:
            names, pair, kernel, attrs = [other.inputs[0], node.inputs[1]], -1, _silu_mul, {}
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
        groups: dict[tuple[str, str, int, str], list[str]] = {}
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
            groups.setdefault((x, t.dtype, t.shape[1], scheme), []).append(node.name)
        return [tuple(members) for members in groups.values() if len(members) > 1]

    def _joined_steps(self, graph: Graph, i: int, members: list[Node], slots: dict[str, int]) -> list[_Step]:
        """The product of a group (see _joins) at its first member's place, and each member's output as a view of
        it. The activations are freed there when no other node reads them later."""
        x = members[0].inputs[0]
        later = {j for j, n in enumerate(graph.nodes) if j >= i and x in n.inputs}
        places = {j for j, n in enumerate(graph.nodes) if n.name in {m.name for m in members}}
        free = (slots[x],) if later <= places and x not in graph.outputs else ()
        out = slots[f"{members[0].name}+joined"]
        packed = {"scheme": members[0].attrs["scheme"], "k": members[0].attrs["k"]} \
            if members[0].op == "dequant_matmul" else {}
        steps = [_Step(_joined_matmul, (slots[x], *(slots[m.inputs[1]] for m in members)), packed, out, free)]
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
                # (ExecutorService.SetParam) breaks it: from then on every member is read alone (_joined_matmul)
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
                    # a second form for several rows (see _rows_form).
                    rows = _rows_form(weight)
                    if rows is not None:
                        weight.__dict__[_CONVERTED] = {"rows": rows}
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
            joined = _joined([self._params[node.inputs[1]] for node in nodes if node.inputs[1] in self._params])
            if joined is not None and nodes[0].op == "dequant_matmul":  # the panels a decode reads (see _lay_out)
                cpu_kernels.panels(joined.whole, nodes[0].attrs["scheme"], joined.whole.shape[0], nodes[0].attrs["k"])
            elif joined is not None and nodes[0].inputs[1] in self._transposed and \
                    self._weight_order(nodes[0].inputs[1]) == "C":
                cpu_kernels.fpanels(joined.whole)
        return super().finalize_params()

    def _join(self, names: tuple[str, ...]) -> None:
        """Replaces the weights `names` by row views of one tensor holding them all (executables that copy params
        from this one share it); nothing when one is missing or they are joined already."""
        if any(name not in self._params for name in names) or _joined([self._params[n] for n in names]) is not None:
            return
        whole = torch.cat([self._params[name] for name in names])
        views, start = [], 0
        for name in names:
            views.append(whole.narrow(0, start, self._params[name].shape[0]))
            start += views[-1].shape[0]
        for name, view in zip(names, views):
            self._params[name] = view
        views[0].__dict__[_JOINED] = _Joined(whole, tuple((v.data_ptr(), tuple(v.shape)) for v in views))
        self._forget_captures()

    def clone(self) -> Executable[Tensor]:
        twin = super().clone()
        assert isinstance(twin, TorchExecutable)
        twin._staging, twin._captures, twin._seen, twin._static_key = {}, {}, {}, None
        twin._expert_tally = None if self._expert_tally is None else torch.zeros_like(self._expert_tally)
        return twin

    def _from_host(self, array: np.ndarray, order: Literal["C", "F"] = "C") -> Tensor:
        owned = np.array(array, order=order)  # a copy: in-place KV writes must never reach the caller's array
        host = torch.from_numpy(owned.view(np.int16)).view(torch.bfloat16) if owned.dtype == _BF16 else \
            torch.from_numpy(owned)
        if self._device.type == "cuda":
            # From pinned memory the copy is queued behind the work already on the stream; from pageable memory
            # CUDA waits for that work first, so a commit_no_wait would wait for the run before it.
            return host.pin_memory().to(self._device, non_blocking=True)
        return host

    def _to_host(self, value: Tensor) -> np.ndarray:
        # A copy: handles may later be written in place, and callers keep what they read.
        host = value.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        if host.dtype == torch.bfloat16:
            return host.view(torch.int16).numpy().view(_BF16)
        return host.numpy()

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

    @torch.inference_mode()
    def put_rows(self, value: Tensor, rows: np.ndarray, data: np.ndarray) -> Tensor:
        idx = torch.from_numpy(np.asarray(rows, np.int64)).to(value.device)
        # A view of the caller's array, strided or not: index_copy_ is the copy (the rows of a seed or a migration
        # were copied twice more before it).
        src = torch.from_numpy(data) if data.dtype != _BF16 else self._from_host(data)
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
                alias.__dict__[_DONATED] = True
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
        return self._run_plan(env, ctx)

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
        return [[(c.view(torch.int16).numpy().view(_BF16) if c.dtype == torch.bfloat16 else c.numpy())
                 .astype(np.float32, copy=False) for c in copies] for copies in staged]

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
