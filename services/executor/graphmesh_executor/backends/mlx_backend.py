"""mlx backend: CPU on Linux, Metal on macOS. One short kernel per op, numpy semantics.

mx.fast kernels are used where they match the numpy definition (rms_norm, layer_norm,
scaled_dot_product_attention). rope is written out: mx.fast.rope takes per-row positions but forms its
angles in float32, which drifts from numpy by ~2e-4 at position 4k and ~2e-3 at 30k; here the cos/sin
tables come from numpy in float64, so every position matches to the compute dtype's rounding.

Dtypes (GetCapabilitiesResponse.dtypes = MlxExecutable.dtypes):
- f32: native. f16/bf16: elementwise ops, reductions and matmul native (mlx accumulates in f32: at most
  ~1 ulp from numpy); softmax, norms, gelu, attention, rope and the dequantized matmul compute in f32 and
  round once, as numpy does.
- f64: native on CPU for storage, matmul, arithmetic, log, tanh, pow, sqrt and reductions. mlx evaluates
  exp and erf at float32 accuracy even for f64 and reduces its fast norms in f32, so exp, sigmoid, silu,
  gelu, softmax, layer_norm, rms_norm and attention on f64 run the numpy reference kernel on the host (a
  sync per such node: f64 graphs are for checking, not speed). Metal has no f64: a graph with any f64
  value runs on the CPU stream there.
TOLERANCES gives (rtol, atol) against the numpy backend per dtype.

Start this backend's process with launch_env(): mlx-cpu's bundled reference BLAS is slow. A preloaded BLAS
with its kernels named makes a [64, 576] x [576, 1536]^T f32 matmul ~25-35x faster, and BLIS (preferred
when installed) makes a one-row [1, 576] x [1536, 576]^T ~3x faster, where OpenBLAS 0.3.21 barely helps.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np

from graphmesh import dtypes
from graphmesh.checkpoints import dequantize_packed
from graphmesh.errors import FailedPrecondition, InvalidArgument, OutOfRange
from graphmesh.graph import Graph
from graphmesh.ops import QUANT_BLOCKS, TensorType, q8_rows
from graphmesh_executor.backends.numpy_backend import KERNELS as NUMPY_KERNELS
from graphmesh_executor.backends.numpy_backend import paged_rows
from graphmesh_executor.executable import Capabilities, Executable, ExtentCut, Kernel, RunContext, sample_rows
from graphmesh_server.serving import cpu_flags

PRELOAD = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"  # Debian libopenblas0-pthread
BLIS = "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4"  # Debian libblis4-pthread
_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}


def launch_env(cpuinfo: str = "/proc/cpuinfo", blis: str = BLIS, openblas: str = PRELOAD) -> dict[str, str]:
    """Environment for an mlx executor process: a BLAS preloaded under mlx's cblas_sgemm, its kernels named.

    mlx calls sgemm even for one row. OpenBLAS 0.3.21 packs the whole weight on every such call, BLIS does not:
    decode matvecs run 2-3x faster on BLIS (the helper report has the table), prefill-sized ones about the same.
    Both libraries fail to identify this VM's CPU ("Intel Xeon Processor": OpenBLAS falls back to Prescott code,
    BLIS to haswell), so the kernels are named from the CPU flags.
    """
    flags = cpu_flags(cpuinfo)
    if os.path.exists(blis):
        return {"LD_PRELOAD": blis, **({"BLIS_ARCH_TYPE": "skx"} if _AVX512 <= flags else {})}
    if os.path.exists(openblas):
        core = "SkylakeX" if _AVX512 <= flags else "Haswell" if {"avx2", "fma"} <= flags else None
        return {"LD_PRELOAD": openblas, **({"OPENBLAS_CORETYPE": core} if core else {})}
    return {}


# (rtol, atol) against the numpy backend; halves are within 1 ulp (2^-10, 2^-7) of numpy's single rounding
TOLERANCES: dict[str, tuple[float, float]] = {"f64": (1e-12, 1e-12), "f32": (1e-5, 1e-5), "f16": (1e-3, 1e-5),
                                              "bf16": (8e-3, 1e-4)}

Array = mx.array
_MX: dict[str, mx.Dtype] = {"f64": mx.float64, "f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16,
                            "i64": mx.int64, "i32": mx.int32, "u8": mx.uint8, "bool": mx.bool_}
_INTS = (mx.int64, mx.int32, mx.uint8)
_HALF = (mx.float16, mx.bfloat16)


def to_mx(array: np.ndarray) -> Array:
    # mx.array turns float64 into float32 unless told the dtype
    return mx.array(array, dtype=_MX[dtypes.from_numpy(array.dtype)])


def _evaluated(value: Array) -> Array:
    mx.eval(value)
    return value


def to_numpy(value: Array) -> np.ndarray:
    if value.dtype == mx.bfloat16:  # numpy's buffer protocol has no bf16
        return np.array(value.view(mx.uint16)).view(dtypes.to_numpy("bf16"))
    return np.array(value)


def _indices(idx: Array, bound: int, what: str) -> np.ndarray:
    """The indices on the host, checked: mlx does not bound-check gathers."""
    host = to_numpy(idx).astype(np.int64)
    if host.size and (host.min() < 0 or host.max() >= bound):
        bad = int(host.max()) if host.max() >= bound else int(host.min())
        raise OutOfRange(f"{what} index {bad} outside [0, {bound})", "INDEX_OUT_OF_RANGE")
    return host


def _scalar(x: Array) -> float:
    return float(to_numpy(x).reshape(-1)[0])


def _in_f32(fn: Kernel) -> Kernel:
    """numpy computes f16/bf16 in f32 and rounds once; mlx's half softmax, norms and gelu round inside (~10 ulps)."""
    def kernel(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
        if xs[0].dtype not in _HALF:
            return fn(ctx, xs, a)
        return fn(ctx, [x.astype(mx.float32) if x.dtype in _HALF else x for x in xs], a).astype(xs[0].dtype)
    return kernel


def _f64_on_host(op: str, fn: Kernel) -> Kernel:
    """f64 through the numpy reference kernel: mlx-cpu accepts f64 but evaluates exp and erf, and reduces its
    fast norms, at float32 accuracy (~1e-7 relative), far from the 1e-10 an f64 graph is checked against."""
    def kernel(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
        if xs[0].dtype != mx.float64:
            return fn(ctx, xs, a)
        return to_mx(NUMPY_KERNELS[op](ctx, [to_numpy(x) for x in xs], a))
    return kernel


def _unary(fn: Any) -> Kernel:
    return lambda ctx, xs, a: fn(xs[0])


def _gelu(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x = xs[0]
    if a["approximate"] == "tanh":
        return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + mx.erf(x / math.sqrt(2.0)))


def _div(a: Array, b: Array) -> Array:
    if a.dtype not in _INTS:
        return a / b
    q = mx.floor_divide(a, b)  # numpy casts the true quotient to int: round toward zero, exactly
    return mx.where((q < 0) & (q * b != a), q + 1, q)


def _matmul(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x, w = xs
    x = mx.swapaxes(x, -1, -2) if a["transpose_a"] else x
    w = mx.swapaxes(w, -1, -2) if a["transpose_b"] else w
    return x @ w


def _reduce(fn: Any) -> Kernel:
    def kernel(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
        x = xs[0]
        axes = sorted({ax % x.ndim for ax in a["axes"]}) if a["axes"] and x.ndim else None  # (-1, 1) may name one axis
        return fn(x, axis=axes, keepdims=a["keepdims"]).astype(x.dtype)
    return kernel


def _gather(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    table, idx = xs
    _indices(idx, table.shape[a["axis"]], "gather")
    return mx.take(table, idx, axis=a["axis"])


def _slice(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    index: list[slice] = [slice(None)] * xs[0].ndim
    index[a["axis"]] = slice(a["start"], a["end"])
    return xs[0][tuple(index)]


@functools.lru_cache(maxsize=16)
def _rope_table(positions: bytes, theta: float, rot: int, dtype: str, inv_freq: tuple[float, ...] = (),
                scale: float = 1.0) -> tuple[Array, Array]:
    """cos, sin [S, 1, rot/2] from float64 angles; every layer of a run reuses the same positions. inv_freq and
    scale: a scaled variant's frequencies and cos/sin factor (the rope op's attributes)."""
    pos = np.frombuffer(positions, np.int64).astype(np.float64)
    freqs = np.array(inv_freq, np.float64) if inv_freq else theta ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
    angles = pos[:, None, None] * freqs[None, None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return mx.array(cos, dtype=_MX[dtype]), mx.array(sin, dtype=_MX[dtype])


def _rope(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x, pos = xs
    seq, heads, dim = x.shape
    rot = a["rotary_dim"] or dim
    compute = "f64" if x.dtype == mx.float64 else "f32"
    cos, sin = _rope_table(to_numpy(pos).astype(np.int64).tobytes(), a["theta"], rot, compute, a["inv_freq"],
                           a["scale"])
    y = x.astype(_MX[compute])
    if a["style"] == "half":
        x1, x2 = y[..., : rot // 2], y[..., rot // 2 : rot]
        rotated = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = y[..., 0:rot:2], y[..., 1:rot:2]
        rotated = mx.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(seq, heads, rot)
    out = rotated if rot == dim else mx.concatenate([rotated, y[..., rot:]], axis=-1)
    return out.astype(x.dtype)


def _visible(pos: np.ndarray, keys: int, window: int) -> np.ndarray:
    """[*pos.shape, keys]: whether a query at pos sees each key: up to its position, and within `window` (0: none)."""
    j = np.arange(keys)
    seen = j <= pos[..., None]
    return seen & (j > pos[..., None] - window) if window else seen


def _sdpa(q: Array, k: Array, v: Array, scale: float, mask: Array | None, softcap: float) -> Array:
    """mx.fast.scaled_dot_product_attention over [B, H, S, D], or with softcap > 0 (Gemma 2's soft-capped scores,
    which sdpa has no form of) the same written out: kv head h // (Hq / Hkv) for query head h, as sdpa maps it."""
    if not softcap:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    group = q.shape[1] // k.shape[1]
    k, v = (mx.repeat(t, group, axis=1) if group > 1 else t for t in (k, v))
    scores = (q @ k.transpose(0, 1, 3, 2)) * scale
    scores = mx.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-np.inf, scores.dtype))
    return mx.softmax(scores, axis=-1) @ v


def _attention(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    q, k, v = xs[:3]
    scale = a["scale"] or 1.0 / math.sqrt(q.shape[2])
    mask = None
    if a["causal"]:
        pos = to_numpy(xs[3]).astype(np.int64)
        keys = min(k.shape[0], int(pos.max()) + 1) if pos.size else 0  # rows past every query are masked: skip them
        k, v = k[:keys], v[:keys]
        # some query sees fewer than all kept keys (a row of a prefill, or a window)
        if pos.size and (pos.min() < keys - 1 or (a["window"] and keys > a["window"])):
            mask = mx.array(_visible(pos, keys, a["window"]))  # [Sq, keys]
    # halves in f32 as numpy does (mlx's half sdpa is ~100 ulps off), after the cut so only live rows convert;
    # [S, H, D] -> [1, H, S, D]; sdpa maps query head h to kv head h // (Hq / Hkv), as numpy's grouping does
    qkv = [(t.astype(mx.float32) if t.dtype in _HALF else t).transpose(1, 0, 2)[None] for t in (q, k, v)]
    out = _sdpa(qkv[0], qkv[1], qkv[2], scale, mask, a["softcap"])
    return out[0].transpose(1, 0, 2).astype(q.dtype)


_DONATED: set[int] = set()  # ids of the handle arrays a run lets kv_write/kv_scatter update in place (see MlxExecutable)


def _kv_write(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    cache, rows, pos = xs
    start = int(_scalar(pos))
    if start < 0 or start + rows.shape[0] > cache.shape[0]:
        raise OutOfRange(f"kv_write of rows [{start}, {start + rows.shape[0]}) into a cache of "
                         f"{cache.shape[0]} rows", "ROW_OUT_OF_RANGE")
    if id(cache) in _DONATED:
        # Rebinding the handle's own array object leaves its old buffer referenced by this update alone, so mlx
        # writes the rows in place even when the run evaluates (in-graph sampling) while the handle is held.
        cache[start : start + rows.shape[0]] = rows
        return cache
    # Functional; still in place if the old array is gone by evaluation time (the feed replaced it before the read).
    return mx.slice_update(cache, rows, mx.array([start]), axes=(0,))


def _kv_scatter(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    pool, rows, slots = xs
    host = _indices(slots, pool.shape[0], "kv_scatter slot")
    if not host.size:
        return pool
    if np.unique(host).size < host.size:  # mlx scatters duplicates in no set order; numpy's last write wins
        keep = np.sort(host.size - 1 - np.unique(host[::-1], return_index=True)[1])
        host, rows = host[keep], mx.take(rows, mx.array(keep), axis=0)
    idx = mx.array(host)
    if id(pool) in _DONATED:  # as _kv_write: rebinding the handle's own array object lets mlx write in place
        pool[idx] = rows
        return pool
    out = mx.array(pool)  # a new array object over the same value: the assignment below leaves `pool` as it was
    out[idx] = rows
    return out


def _paged_attention(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    q, k_pool, v_pool = xs[:3]
    block, t, d, hkv = a["block_size"], q.shape[0], q.shape[2], k_pool.shape[1]
    # mlx does not bound-check gathers, so the table and positions come to the host even for decode; decode
    # skips only token_seq (it promises token_seq[t] == t).
    table = _indices(xs[3], k_pool.shape[0] // block, "block_table block")
    seq = np.arange(t) if a["decode"] else _indices(xs[4], table.shape[0], "token_seq sequence")
    pos = _indices(xs[5], table.shape[1] * block, "q_positions position")
    scale, window, softcap = a["scale"] or 1.0 / math.sqrt(d), a["window"], a["softcap"]
    if t == 0:
        return mx.zeros(q.shape, q.dtype)

    def keys_of(rows: np.ndarray) -> tuple[Array, Array]:
        # halves in f32 as numpy does, after the gather so only live rows convert; [N, keys] -> [N, Hkv, keys, D]
        kv = [mx.take(p, mx.array(rows.reshape(-1)), axis=0).reshape(*rows.shape, hkv, d) for p in (k_pool, v_pool)]
        k, v = ((x.astype(mx.float32) if x.dtype in _HALF else x).transpose(0, 2, 1, 3) for x in kv)
        return k, v

    qf = q.astype(mx.float32) if q.dtype in _HALF else q
    if a["decode"]:
        # One query per sequence: one batched sdpa over every sequence's keys up to the longest, the rest masked.
        keys = int(pos.max()) + 1
        k, v = keys_of(np.stack([paged_rows(table, s, keys, block) for s in range(t)]))
        hides = pos.min() < keys - 1 or (window and keys > window)
        mask = mx.array(_visible(pos, keys, window))[:, None, None, :] if hides else None
        out = _sdpa(qf[:, :, None, :], k, v, scale, mask, softcap)[:, :, 0, :]
        return out.astype(q.dtype)
    # Prefill or mixed: one sdpa per sequence over its own keys, causal by position; sdpa maps query head h to
    # kv head h // (Hq / Hkv), as numpy's grouping does.
    order = np.argsort(seq, kind="stable")
    seqs, starts = np.unique(seq[order], return_index=True)
    parts = []
    for s, lo, hi in zip(seqs.tolist(), starts.tolist(), [*starts[1:].tolist(), t]):
        tokens, p = order[lo:hi], pos[order[lo:hi]]
        keys = int(p.max()) + 1
        k, v = keys_of(paged_rows(table, s, keys, block)[None])
        hides = p.min() < keys - 1 or (window and keys > window)
        mask = mx.array(_visible(p, keys, window)) if hides else None  # [n, keys]
        qs = mx.take(qf, mx.array(tokens), axis=0).transpose(1, 0, 2)[None]  # [1, Hq, n, D]
        parts.append(_sdpa(qs, k, v, scale, mask, softcap)[0].transpose(1, 0, 2))
    out = mx.take(mx.concatenate(parts, axis=0), mx.array(np.argsort(order)), axis=0)
    return out.astype(q.dtype)


def _take_along_axis(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x, idx = xs
    _indices(idx, x.shape[a["axis"]], "take_along_axis")
    return mx.take_along_axis(x, idx, axis=a["axis"])


def _grouped_matmul(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    # One matmul per expert over its rows: mx.gather_mm would do it in one call, but on CPU it takes f32 only.
    x, w, ids = xs
    expert = _indices(ids, w.shape[0], "expert")
    order = np.argsort(expert, kind="stable")
    experts, starts = np.unique(expert[order], return_index=True)
    grouped = mx.take(x, mx.array(order), axis=0)
    ends = [*starts[1:].tolist(), len(order)]
    parts = [grouped[s:t] @ w[int(e)] for e, s, t in zip(experts.tolist(), starts.tolist(), ends)]
    if not parts:
        return mx.zeros((0, w.shape[2]), x.dtype)
    return mx.take(mx.concatenate(parts, axis=0), mx.array(np.argsort(order)), axis=0)


def _sample(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    # On the host in float64 through the shared sample_rows, so every backend draws the same token.
    return mx.array(sample_rows(ctx.rng, *(to_numpy(x) for x in xs)))


def repack(packed: np.ndarray, scheme: str, n: int, k: int) -> tuple[Array, Array, Array, int]:
    """GGUF blocks u8 [n, k/32 * block_bytes] -> mlx affine (w uint32 [n, k*bits/32], scales, biases [n, k/32], bits).

    group_size is 32. q4_1: scale d, bias m. q4_0: (q - 8) d = d q - 8d. q8_0: the int8 q shifted by 128
    to unsigned, bias -128 d. All scales are f16 values, so these biases are exact in f32.
    """
    block, size = QUANT_BLOCKS[scheme]
    b = packed.reshape(n, k // block, size)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]  # [n, nb]
    if scheme == "q8_0":
        q = (b[..., 2:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return mx.array(q.reshape(n, -1).view(np.uint32)), mx.array(d), mx.array(-128.0 * d), 8
    qs = b[..., -16:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # GGUF: low nibbles are elements 0..15, high 16..31
    nibbles = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # mlx: element i at bits 4*(i % 8) of word i/8
    bias = -8.0 * d if scheme == "q4_0" else b[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
    return mx.array(nibbles.reshape(n, -1).view(np.uint32)), mx.array(d), mx.array(bias), 4


_WEIGHTS: dict[tuple[int, bool], Any] = {}  # id(packed param) -> its repacked or dequantized form


def _cached(packed: Array, dense: bool, scheme: str, n: int, k: int) -> Any:
    """Repacks (and on CPU dequantizes) a packed param once; the entry goes when the param array does."""
    key = (id(packed), dense)
    if key not in _WEIGHTS and QUANT_BLOCKS[scheme][0] != 32:  # K-quants: mlx has no such groups, dense only
        _WEIGHTS[key] = mx.contiguous(mx.array(dequantize_packed(to_numpy(packed), scheme, n, k)).T)
        weakref.finalize(packed, _WEIGHTS.pop, key, None)
    if key not in _WEIGHTS:
        w, scales, biases, bits = repack(to_numpy(packed), scheme, n, k)
        # dense [k, n] contiguous: OpenBLAS 0.3.21 runs x @ w_kn ~2x faster than x @ w_nk.T for one row
        _WEIGHTS[key] = (mx.contiguous(mx.dequantize(w, scales, biases, group_size=32, bits=bits).T) if dense
                         else (w, scales, biases, bits))
        weakref.finalize(packed, _WEIGHTS.pop, key, None)
    return _WEIGHTS[key]


def _dequant_matmul(ctx: RunContext, xs: list[Array], a: dict[str, Any]) -> Array:
    x, packed = xs
    if q8_rows(a["scheme"], a["activations"]):
        # mlx has no int8-activation product: numpy's reference computes it (correct, not fast)
        return mx.array(NUMPY_KERNELS["dequant_matmul"](ctx, [np.array(x), np.array(packed)], a))
    compute = mx.float64 if x.dtype == mx.float64 else mx.float32  # numpy: f32 weights, halves computed in f32
    if mx.default_device() == mx.gpu and compute == mx.float32 and QUANT_BLOCKS[a["scheme"]][0] == 32:
        w, scales, biases, bits = _cached(packed, False, a["scheme"], a["n"], a["k"])
        y = mx.quantized_matmul(x.astype(compute), w, scales, biases, transpose=True, group_size=32, bits=bits)
    else:
        # mlx's CPU quantized_matmul is 2-3x slower than an OpenBLAS f32 matmul of the dequantized weight
        y = x.astype(compute) @ _cached(packed, True, a["scheme"], a["n"], a["k"]).astype(compute)
    return y.astype(x.dtype)


KERNELS: dict[str, Kernel] = {
    "neg": _unary(mx.negative),
    "exp": _f64_on_host("exp", _unary(mx.exp)),
    "log": _unary(mx.log),
    "sqrt": _unary(mx.sqrt),
    "rsqrt": _unary(mx.rsqrt),
    "tanh": _unary(mx.tanh),
    "sigmoid": _f64_on_host("sigmoid", _unary(mx.sigmoid)),
    "relu": _unary(lambda x: mx.maximum(x, 0)),
    "silu": _f64_on_host("silu", _unary(lambda x: x * mx.sigmoid(x))),
    "gelu": _f64_on_host("gelu", _in_f32(_gelu)),
    "add": lambda ctx, xs, a: xs[0] + xs[1],
    "sub": lambda ctx, xs, a: xs[0] - xs[1],
    "mul": lambda ctx, xs, a: xs[0] * xs[1],
    "div": lambda ctx, xs, a: _div(xs[0], xs[1]),
    "pow": lambda ctx, xs, a: mx.power(xs[0], xs[1]),
    "matmul": _matmul,
    "sum": _reduce(mx.sum),
    "mean": _reduce(mx.mean),
    "max": _reduce(mx.max),
    "softmax": _f64_on_host("softmax", _in_f32(lambda ctx, xs, a: mx.softmax(xs[0], axis=a["axis"]))),
    "layer_norm": _f64_on_host("layer_norm", _in_f32(lambda ctx, xs, a: mx.fast.layer_norm(xs[0], xs[1], xs[2], a["eps"]))),
    "rms_norm": _f64_on_host("rms_norm", _in_f32(lambda ctx, xs, a: mx.fast.rms_norm(xs[0], xs[1], a["eps"]))),
    "gather": _gather,
    "reshape": lambda ctx, xs, a: xs[0].reshape(a["shape"]),
    "transpose": lambda ctx, xs, a: xs[0].transpose(a["perm"]),
    "concat": lambda ctx, xs, a: mx.concatenate(xs, axis=a["axis"]),
    "slice": _slice,
    "cast": lambda ctx, xs, a: xs[0].astype(_MX[a["dtype"]]),
    "constant": lambda ctx, xs, a: to_mx(a["value"]),
    "rope": _rope,
    "attention": _f64_on_host("attention", _attention),
    "kv_write": _kv_write,
    "kv_scatter": _kv_scatter,
    "paged_attention": _f64_on_host("paged_attention", _paged_attention),
    "top_k": lambda ctx, xs, a: mx.argsort(-xs[0], axis=-1)[..., : a["k"]].astype(mx.int64),  # mlx sorts stably
    "take_along_axis": _take_along_axis,
    "grouped_matmul": _grouped_matmul,
    "argmax": lambda ctx, xs, a: mx.argmax(xs[0], axis=a["axis"]).astype(mx.int64),
    "sample": _sample,
    "dequant_matmul": _dequant_matmul,
}


class MlxExecutable(Executable[Array]):
    backend = "mlx"
    # Handles stay mlx arrays between runs (unified memory on Metal) and fed kv_writes/kv_scatters update them in place.
    capabilities = Capabilities(resident_handles=True, active_extent=True)
    kernels = KERNELS
    dtypes: ClassVar[tuple[str, ...]] = ("f64", "f32", "f16", "bf16")

    def __init__(self, graph: Graph, device: str = "cpu") -> None:
        kind = device.split(":")[0]
        if kind not in ("cpu", "gpu", "metal"):
            raise InvalidArgument(f"mlx device must be cpu, gpu or metal, got {device!r}", "UNKNOWN_DEVICE")
        if kind != "cpu" and not mx.is_available(mx.gpu):
            raise FailedPrecondition(f"mlx device {device!r}: this mlx build has no GPU (Metal)", "DEVICE_UNAVAILABLE")
        f64 = any(t.dtype == "f64" for t in (*graph.inputs.values(), *graph.params.values(), *(n.type for n in graph.nodes)))
        self._stream = mx.cpu if kind == "cpu" or f64 else mx.gpu  # Metal has no f64
        super().__init__(graph, device)
        # kv_write/kv_scatter nodes that may update their cache (pool) handle in place, as the torch backend's: the
        # cache is an input read by that node alone, and the node is an output (donated only while a feed stores it back).
        readers: dict[str, int] = {}
        for node in graph.nodes:
            for name in node.inputs:
                readers[name] = readers.get(name, 0) + 1
        self._donors = {n.inputs[0]: graph.outputs.index(n.name) for n in graph.nodes
                        if n.op in ("kv_write", "kv_scatter") and n.inputs[0] in graph.inputs and n.name in graph.outputs
                        and readers[n.inputs[0]] == 1 and n.inputs[0] not in graph.outputs}

    def _execute(self, env: dict[str, Array], cut: ExtentCut | None = None) -> list[Array]:
        donated = [id(env[h]) for h, out in self._donors.items()
                   if self._prefix_feeds.get(h) == out and h in self._handles and env.get(h) is self._handles[h]
                   and sum(v is env[h] for v in self._handles.values()) == 1]
        _DONATED.update(donated)
        try:
            with mx.stream(self._stream):
                return super()._execute(env, cut)
        finally:
            _DONATED.difference_update(donated)  # the arrays live through the run, so their ids stay theirs

    def run(self, inputs: dict[str, np.ndarray], read_indices: Sequence[int] | None = None, typed: bool = False,
            extent: tuple[int, int] | None = None, light: bool = False) -> list[np.ndarray]:
        outs = super().run(inputs, read_indices, typed, extent, light)
        # Outputs nobody read (fed handles off the read path) must not stay lazy and chain graphs across runs.
        mx.eval(self._last_outputs or [])
        return outs

    def _from_host(self, array: np.ndarray) -> Array:
        return to_mx(array)

    def _to_host(self, value: Array) -> np.ndarray:
        return to_numpy(value)

    # What these return may be kept as a handle and read by a later call, on another of the server's threads: mlx
    # evaluates a lazy array only on a stream of the thread that built it, so they come back evaluated (as run's
    # outputs do).
    def _zeros(self, t: TensorType) -> Array:
        return _evaluated(mx.zeros(t.shape, _MX[t.dtype]))

    def _copy_rows(self, dst: Array, dst_start: int, src: Array, src_start: int, n: int) -> Array:
        return _evaluated(mx.slice_update(dst, src[src_start : src_start + n], mx.array([dst_start]), axes=(0,)))

    def _cast(self, value: Array, dtype: str) -> Array:
        return _evaluated(value.astype(_MX[dtype]))

    def _pad_rows(self, value: Array, rows: int) -> Array:
        return _evaluated(mx.concatenate([value, mx.zeros((rows - value.shape[0], *value.shape[1:]), value.dtype)]))
