"""numpy backend: the reference. Plain kernels, one per op; f16/bf16 compute in f32."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from graphmesh import dtypes
from graphmesh.checkpoints import dequantize_packed
from graphmesh.errors import OutOfRange
from graphmesh.ops import QUANT_BLOCKS, q8_rows
from graphmesh_executor.executable import Capabilities, Executable, Kernel, RunContext, sample_rows

Array = np.ndarray
_erf = np.frompyfunc(math.erf, 1, 1)
_HALF = (np.dtype(np.float16), dtypes.to_numpy("bf16"))


def _up(x: Array) -> Array:
    return x.astype(np.float32) if x.dtype in _HALF else x


def _elementwise(fn: Any) -> Kernel:
    def kernel(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
        return np.asarray(fn(*(_up(x) for x in xs))).astype(xs[0].dtype, copy=False)
    return kernel


def _gelu(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x = _up(xs[0])
    if a["approximate"] == "tanh":
        y = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    else:
        y = 0.5 * x * (1.0 + np.asarray(_erf(x / math.sqrt(2.0))).astype(x.dtype))
    return y.astype(xs[0].dtype)


def _matmul(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x, w = _up(xs[0]), _up(xs[1])
    x = np.swapaxes(x, -1, -2) if a["transpose_a"] else x
    w = np.swapaxes(w, -1, -2) if a["transpose_b"] else w
    return np.matmul(x, w).astype(xs[0].dtype, copy=False)


def _reduce(fn: Any) -> Kernel:
    def kernel(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
        axes = tuple(sorted({ax % xs[0].ndim for ax in a["axes"]})) if a["axes"] else None  # the spec allows -1 and 1 together
        return np.asarray(fn(_up(xs[0]), axis=axes, keepdims=a["keepdims"])).astype(xs[0].dtype)
    return kernel


def _softmax(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x = _up(xs[0])
    e = np.exp(x - x.max(axis=a["axis"], keepdims=True))
    return (e / e.sum(axis=a["axis"], keepdims=True)).astype(xs[0].dtype)


def _layer_norm(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x = _up(xs[0])
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return ((x - mu) / np.sqrt(var + a["eps"]) * _up(xs[1]) + _up(xs[2])).astype(xs[0].dtype)


def _rms_norm(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x = _up(xs[0])
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + a["eps"]) * _up(xs[1])).astype(xs[0].dtype)


def _check_indices(idx: Array, bound: int, what: str) -> None:
    if idx.size and (idx.min() < 0 or idx.max() >= bound):
        raise OutOfRange(f"{what} index {int(idx.max()) if idx.max() >= bound else int(idx.min())} "
                         f"outside [0, {bound})", "INDEX_OUT_OF_RANGE")


def _gather(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    table, idx = xs
    _check_indices(idx, table.shape[a["axis"]], "gather")
    return np.take(table, idx, axis=a["axis"])


def _rope(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x, pos = xs
    rot = a["rotary_dim"] or x.shape[2]
    # inv_freq given: a scaled variant's frequencies, made on the host from the model's config
    inv_freq = np.array(a["inv_freq"], np.float64) if a["inv_freq"] else \
        a["theta"] ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    angles = pos.astype(np.float64)[:, None, None] * inv_freq[None, None, :]  # [S, 1, rot/2]
    cos, sin = np.cos(angles), np.sin(angles)
    if a["scale"] != 1.0:  # YaRN / longrope attention factor
        cos, sin = cos * a["scale"], sin * a["scale"]
    y = _up(x).astype(np.float64)
    out = y.copy()
    if a["style"] == "half":
        x1, x2 = y[..., : rot // 2], y[..., rot // 2 : rot]
        out[..., : rot // 2] = x1 * cos - x2 * sin
        out[..., rot // 2 : rot] = x2 * cos + x1 * sin
    else:
        x1, x2 = y[..., 0:rot:2], y[..., 1:rot:2]
        out[..., 0:rot:2] = x1 * cos - x2 * sin
        out[..., 1:rot:2] = x2 * cos + x1 * sin
    return out.astype(x.dtype)


def _capped(scores: Array, softcap: float) -> Array:
    """Gemma 2's attention logit soft-capping (0: none): softcap * tanh(score / softcap), after the scale."""
    return softcap * np.tanh(scores / softcap) if softcap else scores


def _attention(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    q, k, v = (_up(t) for t in xs[:3])
    sq, hq, d = q.shape
    hkv = k.shape[1]
    scale = a["scale"] or 1.0 / math.sqrt(d)
    if a["causal"]:
        pos = xs[3].astype(np.int64)
        keys = min(k.shape[0], int(pos.max()) + 1) if pos.size else 0  # rows past every query are masked: skip them
        k, v = k[:keys], v[:keys]
    qg = q.reshape(sq, hkv, hq // hkv, d).transpose(1, 2, 0, 3)  # [Hkv, G, Sq, D]
    scores = _capped(np.einsum("hgqd,khd->hgqk", qg, k) * scale, a["softcap"])
    if a["causal"]:
        j = np.arange(k.shape[0])[None, :]
        visible = (j <= pos[:, None]) & ((j > pos[:, None] - a["window"]) if a["window"] else True)
        scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("hgqk,khd->qhgd", p, v).reshape(sq, hq, d)
    return out.astype(xs[0].dtype)


def _kv_write(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    cache, rows, pos = xs
    start = int(pos.reshape(-1)[0])
    if start < 0 or start + rows.shape[0] > cache.shape[0]:
        raise OutOfRange(f"kv_write of rows [{start}, {start + rows.shape[0]}) into a cache of "
                         f"{cache.shape[0]} rows", "ROW_OUT_OF_RANGE")
    out = cache.copy()
    out[start : start + rows.shape[0]] = rows
    return out


def _kv_scatter(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    pool, rows, slots = xs
    _check_indices(slots, pool.shape[0], "kv_scatter slot")
    out = pool.copy()
    out[slots.astype(np.int64)] = rows
    return out


def paged_rows(table: Array, seq: int, keys: int, block: int) -> Array:
    """Pool rows of logical positions 0..keys-1 of sequence `seq`: block_table[seq, j // block] * block + j % block."""
    j = np.arange(keys)
    return table[seq, j // block].astype(np.int64) * block + j % block


def _paged_attention(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    q, k_pool, v_pool = (_up(t) for t in xs[:3])
    table, token_seq, pos = (x.astype(np.int64) for x in xs[3:])
    block = a["block_size"]
    _check_indices(table, k_pool.shape[0] // block, "block_table block")
    _check_indices(token_seq, table.shape[0], "token_seq sequence")
    _check_indices(pos, table.shape[1] * block, "q_positions position")
    t, hq, d = q.shape
    hkv = k_pool.shape[1]
    scale = a["scale"] or 1.0 / math.sqrt(d)
    out = np.zeros_like(q)
    for i in range(t):  # one query at a time: the plainest statement of what every backend must compute
        rows = paged_rows(table, int(token_seq[i]), int(pos[i]) + 1, block)
        if a["window"]:  # the keys of positions pos - window + 1 .. pos
            rows = rows[max(0, int(pos[i]) + 1 - a["window"]):]
        k, v = k_pool[rows], v_pool[rows]  # [keys, Hkv, D]
        qg = q[i].reshape(hkv, hq // hkv, d)
        scores = _capped(np.einsum("hgd,khd->hgk", qg, k) * scale, a["softcap"])
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[i] = np.einsum("hgk,khd->hgd", p, v).reshape(hq, d)
    return out.astype(xs[0].dtype)


def _top_k(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    return np.argsort(-_up(xs[0]), axis=-1, kind="stable")[..., : a["k"]].astype(np.int64)


def _take_along_axis(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x, idx = xs
    _check_indices(idx, x.shape[a["axis"]], "take_along_axis")
    return np.take_along_axis(x, idx.astype(np.int64), axis=a["axis"])


def _grouped_matmul(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x, w, ids = _up(xs[0]), _up(xs[1]), xs[2]
    _check_indices(ids, w.shape[0], "expert")
    out = np.zeros((x.shape[0], w.shape[2]), x.dtype)
    for e in np.unique(ids):
        rows = ids == e
        out[rows] = x[rows] @ w[e]
    return out.astype(xs[0].dtype)


def _argmax(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    return np.argmax(xs[0], axis=a["axis"]).astype(np.int64)


def _sample(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    return sample_rows(ctx.rng, *xs)


def _blocks(packed: Array, scheme: str, n: int, k: int) -> tuple[Array, Array, Array | None]:
    """A 32-element scheme's blocks [n, k/32 * block_bytes] u8 as their scales d f16 [n, k/32], codes int16
    [n, k/32, 32] (q4_0's less 8: the value is code * d) and q4_1's minimums m f16 [n, k/32] (code * d + m; None
    for the other schemes)."""
    b = packed.reshape(n, k // 32, -1)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    if scheme == "q8_0":
        return d, b[..., 2:].copy().view(np.int8).astype(np.int16), None
    qs = b[..., -16:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)  # low nibbles are elements 0..15
    if scheme == "q4_0":
        return d, q - 8, None
    return d, q, b[..., 2:4].copy().view(np.float16)[..., 0]


def dequantize(packed: Array, scheme: str, n: int, k: int) -> Array:
    """GGUF blocks [n, k/32 * block_bytes] u8 -> f32 [n, k] (K-quants: super-blocks of 256, gguf's dequantization)."""
    if QUANT_BLOCKS[scheme][0] != 32:
        return dequantize_packed(packed, scheme, n, k)
    d, q, m = _blocks(packed, scheme, n, k)
    w = q.astype(np.float32) * d.astype(np.float32)[..., None]
    return (w if m is None else w + m.astype(np.float32)[..., None]).reshape(n, k)


def _dequant_matmul(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    if q8_rows(a["scheme"], a["activations"]):
        return _q8_matmul(xs[0], xs[1], a["scheme"], a["n"], a["k"])
    w = dequantize(xs[1], a["scheme"], a["n"], a["k"])
    return (_up(xs[0]) @ w.T).astype(xs[0].dtype)


def quantize_q8(x: Array) -> tuple[Array, Array]:
    """f32 rows [r, k] as int8 blocks of 32 (graphmesh.ops.ACTIVATIONS): codes [r, k/32, 32] and scales [r, k/32],
    each step an f32 operation as the kernels take it."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    return np.rint(xb * inv[..., None]), d


def _q8_matmul(x: Array, packed: Array, scheme: str, n: int, k: int) -> Array:
    """x @ w.T with x's rows quantized to int8 blocks: each block's integer dot product (exact in float64), scaled
    by d_w * d_x, summed in float64 (the reference the kernels' f32 sums are held to)."""
    codes, dx = quantize_q8(x.reshape(-1, k))
    d, q, m = _blocks(packed, scheme, n, k)
    dw, w = d.astype(np.float64), q.astype(np.float64)
    out = np.zeros((codes.shape[0], n))
    for j in range(k // 32):
        out += (codes[:, j] @ w[:, j].T) * dw[:, j] * dx[:, j, None].astype(np.float64)
        if m is not None:
            out += (dx[:, j].astype(np.float64) * codes[:, j].sum(-1))[:, None] * m[:, j].astype(np.float64)
    return out.reshape(*x.shape[:-1], n).astype(x.dtype)


def _concat(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    return np.concatenate(xs, axis=a["axis"])


def _slice(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    index = [slice(None)] * xs[0].ndim
    index[a["axis"]] = slice(a["start"], a["end"])
    return xs[0][tuple(index)]


def _pow(x: Array, y: Array) -> Array:
    return np.power(x, y)


# This backend's kernel of every op of graphmesh.ops: every backend's table has the same keys, in one order
# (test_executor_service checks the op sets agree). Where two tables read alike (an op whose kernel is the module's
# own _<op>) the functions behind the names are still each backend's own: parallel tables, not copies.
KERNELS: dict[str, Kernel] = {
    "neg": _elementwise(np.negative),
    "exp": _elementwise(np.exp),
    "log": _elementwise(np.log),
    "sqrt": _elementwise(np.sqrt),
    "rsqrt": _elementwise(lambda x: 1.0 / np.sqrt(x)),
    "tanh": _elementwise(np.tanh),
    "sigmoid": _elementwise(lambda x: 1.0 / (1.0 + np.exp(-x))),
    "relu": _elementwise(lambda x: np.maximum(x, 0)),
    "silu": _elementwise(lambda x: x / (1.0 + np.exp(-x))),
    "gelu": _gelu,
    "add": _elementwise(np.add),
    "sub": _elementwise(np.subtract),
    "mul": _elementwise(np.multiply),
    "div": _elementwise(np.divide),
    "pow": _elementwise(_pow),
    "matmul": _matmul,
    "sum": _reduce(np.sum),
    "mean": _reduce(np.mean),
    "max": _reduce(np.max),
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "gather": _gather,
    "reshape": lambda ctx, xs, a: xs[0].reshape(a["shape"]),
    "transpose": lambda ctx, xs, a: np.transpose(xs[0], a["perm"]),
    "concat": _concat,
    "slice": _slice,
    "cast": lambda ctx, xs, a: xs[0].astype(dtypes.to_numpy(a["dtype"])),
    "constant": lambda ctx, xs, a: a["value"],
    "rope": _rope,
    "attention": _attention,
    "kv_write": _kv_write,
    "kv_scatter": _kv_scatter,
    "paged_attention": _paged_attention,
    "top_k": _top_k,
    "take_along_axis": _take_along_axis,
    "grouped_matmul": _grouped_matmul,
    "argmax": _argmax,
    "sample": _sample,
    "dequant_matmul": _dequant_matmul,
}


class NumpyExecutable(Executable[Array]):
    backend = "numpy"
    capabilities = Capabilities(active_extent=True)
    kernels = KERNELS

    def _from_host(self, array: Array) -> Array:
        return np.asarray(array, order="C")  # ascontiguousarray would turn a 0-d array into shape (1,)

    def _to_host(self, value: Array) -> Array:
        return value

    def host_view(self, value: Array) -> Array | None:
        return value if value.dtype == np.float32 and value.flags.c_contiguous else None

    def _copy_rows(self, dst: Array, dst_start: int, src: Array, src_start: int, n: int) -> Array:
        out = dst.copy()
        out[dst_start : dst_start + n] = src[src_start : src_start + n]
        return out

    def _cast(self, value: Array, dtype: str) -> Array:
        return value.astype(dtypes.to_numpy(dtype))
