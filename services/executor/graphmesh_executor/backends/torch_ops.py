"""The torch backend's kernel of every op of graphmesh.ops (KERNELS), and the fused pairs TorchExecutable plans:
an add and the norm of its sum, silu and its product, a layer's two ropes, products over joined weights.

f16/bf16 run natively (torch has CPU and CUDA kernels for every op used here); rope upcasts half inputs on CPU,
where each elementwise step would otherwise round. Where the host's C kernels (cpu_kernels) or the Triton kernels
(cuda_kernels) serve an op they run instead of torch's, with the same bits where the tests say so. Attention and
the KV ops are torch_attention.py's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from graphmesh import dtypes
from graphmesh.checkpoints import dequantize_packed
from graphmesh.ops import QUANT_BLOCKS, q8_rows
from graphmesh_executor.backends import cpu_kernels, cuda_kernels
from graphmesh_executor.backends.torch_attention import attention, kv_scatter, kv_write, paged_attention
from graphmesh_executor.backends.torch_tensors import (
    TORCH_DTYPES,
    Tensor,
    check_indices,
    memo,
    static_run,
    upcast,
)
from graphmesh_executor.executable import Kernel, RunContext, sample_rows

BF16 = dtypes.to_numpy("bf16")
# Tensor attributes: the converted forms of a packed weight, and the join a weight is a member of. They live exactly
# as long as the tensor, which is never written in place.
CONVERTED = "_graphmesh_converted"
JOINED = "_graphmesh_joined"


def _elementwise(fn: Any) -> Kernel:
    return lambda ctx, xs, a: fn(*xs)


def _rms_norm(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    """On CUDA, rows that add_rms_norm could take run its kernel alone (cuda_kernels.rms_norm: the same bits, so a
    stage that begins at a layer's norm agrees with one that fused it); others (q/k norms over views of a joined
    product) torch's norm, which reads them in place."""
    x, w = xs
    if x.is_cpu:
        fused = cpu_kernels.rms_norm(x, w, a["eps"])  # one call, not six kernels
        if fused is not None:
            return fused
    elif cuda_kernels.rows_usable(x) and w.dtype == x.dtype:
        return cuda_kernels.rms_norm(x, w, a["eps"])
    return F.rms_norm(x, x.shape[-1:], w, a["eps"])


def add_rms_norm(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """An add and the rms_norm of its sum (TorchExecutable._fusions): one kernel (a C call on the host) where the rows
    allow, else the two."""
    x, y, w = xs
    if x.is_cpu:
        fused = cpu_kernels.add_rms_norm(x, y, w, a["eps"])
        if fused is not None:
            return fused
    elif cuda_kernels.rows_usable(x, y) and w.dtype == x.dtype:
        return cuda_kernels.add_rms_norm(x, y, w, a["eps"])
    total = x + y
    return total, _rms_norm(ctx, [total, w], a)


def silu_mul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    """silu(gate) * up (TorchExecutable._fusions): one kernel where the rows allow, else the two."""
    gate, up = xs
    return cuda_kernels.silu_mul(gate, up) if cuda_kernels.rows_usable(gate, up) else F.silu(gate) * up


def rope_pair(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """Two rope nodes at the same positions (TorchExecutable._fusions: a layer's k, then its q): one launch where
    the Triton kernel serves both, one C call where cpu_kernels does, else each alone."""
    x, y, pos = xs
    rot = a["rotary_dim"] or x.shape[2]
    if a["style"] == "half" and rot == x.shape[2] == y.shape[2]:  # whole heads rotated by halves
        if x.is_cpu:
            pair = cpu_kernels.rope_half_pair(x, y, *half_table(pos, a, rot, torch.float32))
            if pair is not None:
                return pair
        elif cuda_kernels.rope_half_usable(x) and cuda_kernels.rope_half_usable(y):
            return cuda_kernels.rope_half_pair(x, y, *half_table(pos, a, rot, torch.float32))
    return _rope(ctx, [x, pos], a), _rope(ctx, [y, pos], a)


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
        forms = w.__dict__.get(CONVERTED, {})  # the other layouts of a weight (see TorchExecutable._lay_out)
        if x.shape[0] > 1 and "rows" in forms:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), forms["rows"], None, "none", [], "")
    return torch.matmul(x.mT if a["transpose_a"] else x, w.mT if a["transpose_b"] else w)


@dataclass(frozen=True)
class JoinedWeight:
    """Weights laid one after another in one tensor, so that a product reads them at once (see TorchExecutable._joins):
    the params are row views of `whole`, and the first carries this record."""

    whole: Tensor  # [sum of n_i, k]
    parts: tuple[tuple[int, tuple[int, ...]], ...]  # (address, shape) of each view, to tell them from other tensors


def joined_weight(weights: Sequence[Tensor]) -> JoinedWeight | None:
    joined: JoinedWeight | None = weights[0].__dict__.get(JOINED)
    if joined is None or joined.parts != tuple((w.data_ptr(), tuple(w.shape)) for w in weights):
        return None
    return joined


def joined_matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    """x @ [W_1; W_2; ...].T (see TorchExecutable._joins); `a` holds the packed weights' scheme and k, if packed."""
    x, *weights = xs
    joined = joined_weight(weights)
    if x.is_cpu:
        # cpu_kernels sums each output alone, in one order whatever rows of the weight a call covers: one call
        # over the joined weight gives every member's exact bits for a third of the calls. Where the kernels do
        # not serve the rows, or a member was set on its own since the join, each member runs as it would alone
        # (a member set on its own gets its own panels, see _lay_out), so its bits do not change either.
        if joined is not None and "scheme" in a and cpu_kernels.packed_usable(x, joined.whole, a["scheme"]):
            return cpu_kernels.matmul_xwt_packed(x, joined.whole, a["scheme"], joined.whole.shape[0], ctx.light,
                                                 a["activations"])
        if joined is not None and "scheme" not in a and cpu_kernels.has_fpanels(joined.whole) \
                and cpu_kernels.usable(x, joined.whole):
            return cpu_kernels.matmul_xwt(x, joined.whole, ctx.light)
        if "scheme" in a:
            return torch.cat([_dequant_matmul(ctx, [x, w], {**a, "n": w.shape[0]}) for w in weights], -1)
        return torch.cat([_matmul(ctx, [x, w], {"transpose_a": False, "transpose_b": True}) for w in weights], -1)
    if joined is None:  # a param was set on its own since the join (ExecutorService.SetParam): one product each
        return torch.cat([_device_xwt(x, w) for w in weights], -1)
    return _device_xwt(x, joined.whole)


def rows_form(weight: Tensor) -> Tensor | None:
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
    check_indices(ctx, idx, table.shape[axis], "gather")
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


def half_table(pos: Tensor, a: dict[str, Any], rot: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin over the whole head, sin signed so that rope = x * cos + roll(x, rot/2) * sin; made once a run
    for these positions (a stage's layers all rotate at them)."""
    def make() -> tuple[Tensor, Tensor]:
        cos, sin = _rope_table(pos, a, rot, dtype)
        return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
    return memo(pos, ("rope-half", *_rope_key(a, rot), dtype), make)  # type: ignore[no-any-return]


def _rope(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, pos = xs
    rot = a["rotary_dim"] or x.shape[2]
    y = upcast(x)
    if a["style"] == "half" and rot == x.shape[2]:
        # Four kernels instead of ten; the same products and sums as the halves below (the sign is exact).
        triton_rope = cuda_kernels.rope_half_usable(x)  # one kernel, not three: GPU time is kernel count there
        dtype = torch.float32 if triton_rope else y.dtype
        cos, sin = half_table(pos, a, rot, dtype)
        if triton_rope:
            return cuda_kernels.rope_half(x, cos, sin)
        if y.is_cuda:  # three kernels, not four
            return torch.addcmul(y * cos, y.roll(rot // 2, -1), sin)
        fused = cpu_kernels.rope_half(y, cos, sin)  # the same bits in one call instead of four
        return (fused if fused is not None else y * cos + y.roll(rot // 2, -1) * sin).to(x.dtype)
    cos, sin = memo(pos, ("rope", *_rope_key(a, rot), y.dtype), lambda: _rope_table(pos, a, rot, y.dtype))
    if a["style"] == "half":
        x1, x2 = y[..., : rot // 2], y[..., rot // 2 : rot]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    else:
        x1, x2 = y[..., 0:rot:2], y[..., 1:rot:2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    return torch.cat([rotated, y[..., rot:]], -1).to(x.dtype)


def _top_k(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    # A stable descending sort puts equal values in index order; torch.topk does not promise that.
    return torch.sort(xs[0], dim=-1, descending=True, stable=True).indices[..., : a["k"]]


def _take_along_axis(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, idx = xs
    check_indices(ctx, idx, x.shape[a["axis"]], "take_along_axis")
    return torch.gather(x, a["axis"], idx.long())


def _grouped_matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    """On CUDA one Triton launch (cuda_kernels.grouped_matmul): no host read, so a step with experts can be
    captured, and a row's bits do not depend on the rows beside it. Elsewhere rows sorted by expert once (a stable
    argsort, one index_select), each present expert's contiguous run of rows times its weight (one matmul each,
    after one host read of the run lengths), then the results put back in row order (index_copy_): never a
    gathered [M, K, N] weight copy."""
    x, w, ids = xs
    check_indices(ctx, ids, w.shape[0], "expert")
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


def tallied_grouped_matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
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
    if static_run(ctx):  # the executable runs static only when the host temperatures say greedy
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


def _q8_matmul(x: Tensor, packed: Tensor, scheme: str, n: int, k: int) -> Tensor:
    """x @ w.T with x's rows quantized to int8 blocks (graphmesh.ops.ACTIVATIONS) where cpu_kernels cannot run it
    (no compiler, not x86-64, another device): the same quantization, each block's integer dot product exact in
    float64 and the blocks summed there, so within f32 rounding of the kernel, not its bits."""
    rows = x.reshape(-1, k).float().reshape(-1, k // 32, 32)
    d = rows.abs().amax(-1) / 127.0
    codes = torch.round(rows * torch.where(d != 0, 1.0 / d, torch.zeros_like(d)).unsqueeze(-1)).double()
    b = packed.reshape(n, k // 32, -1)
    dw = b[..., 0:2].contiguous().view(torch.float16)[..., 0].double()
    if scheme == "q8_0":
        w = b[..., 2:].contiguous().view(torch.int8).double()
    else:
        qs = b[..., -16:].to(torch.int32)
        w = torch.cat([qs & 0x0F, qs >> 4], -1).double() - (8.0 if scheme == "q4_0" else 0.0)
    dx = d.double()
    out = torch.einsum("rbj,nbj->rnb", codes, w).mul_(dw.unsqueeze(0)).mul_(dx.unsqueeze(1)).sum(-1)
    if scheme == "q4_1":
        m = b[..., 2:4].contiguous().view(torch.float16)[..., 0].double()
        out += (dx * codes.sum(-1)) @ m.T
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def _dequant_matmul(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    x, packed = xs
    scheme, n, k = a["scheme"], a["n"], a["k"]
    if cpu_kernels.packed_usable(x, packed, scheme):
        # f32 rows, a decode's or a prompt chunk's: the kernel reads the blocks in panels, made when the param was
        # set (see TorchExecutable._lay_out) or at the first product of a weight that is not a param. One kernel
        # for every row count keeps a row's bits independent of the rows beside it: a prompt chunk's rows went
        # through MKL over a dequantized copy, another summation order (and a dense copy packing meant to avoid).
        return cpu_kernels.matmul_xwt_packed(x, packed, scheme, n, ctx.light, a["activations"])
    if q8_rows(scheme, a["activations"]):
        return _q8_matmul(x, packed, scheme, n, k)
    converted: dict[Any, Any] = packed.__dict__.setdefault(CONVERTED, {})
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
    "attention": attention,
    "kv_write": kv_write,
    "kv_scatter": kv_scatter,
    "paged_attention": paged_attention,
    "top_k": _top_k,
    "take_along_axis": _take_along_axis,
    "grouped_matmul": _grouped_matmul,
    "argmax": lambda ctx, xs, a: _argmax(xs[0], a["axis"]),
    "sample": _sample,
    "dequant_matmul": _dequant_matmul,
}
