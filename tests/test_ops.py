"""Op conformance: every op of graphmesh.ops.SPECS on every available backend.

tinygrad's helper_test_op, for a closed op set: random inputs of several shapes and dtypes
go through a one-op graph on each backend and are compared with a float64 reference written
here (numpy float64 formulas or loops, never the numpy backend's kernels), within the
tolerance of the output dtype. Integer and bool outputs must match exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from graphmesh import dtypes, ops
from graphmesh.checkpoints import dequantize_packed
from graphmesh.errors import OutOfRange
from graphmesh.graph import GraphBuilder, GraphError, parse
from graphmesh.ops import OpError
from graphmesh.v1 import graph_pb2
from graphmesh_executor.backends import compile_graph, executable_class
from graphmesh_executor.executable import Executable, RngOptions, uniform
from tests.conftest import backend_targets
from tests.test_paged_ops import paged_ref

BACKENDS = backend_targets()

# Per output dtype: (rtol, atol). Inputs are rounded to their dtype before the float64
# reference sees them, so these bound only the backend's compute and output rounding.
TOL: dict[str, tuple[float, float]] = {
    "f64": (1e-10, 1e-10),
    "f32": (1e-5, 1e-5),
    "f16": (1e-2, 1e-2),
    "bf16": (2e-2, 2e-2),
}
# Ops that sum many products (or exp then normalise) get this multiple of the table.
LOOSE: dict[str, float] = {"matmul": 10.0, "attention": 10.0, "paged_attention": 10.0, "grouped_matmul": 10.0,
                           "dequant_matmul": 10.0, "layer_norm": 3.0, "rms_norm": 3.0, "softmax": 3.0, "sum": 3.0, "mean": 3.0}
FLOATS = ("f32", "f16", "bf16", "f64")
INTS = ("i64", "i32")

rng = np.random.default_rng(20240601)
# The case tables below loop over shapes of several ranks.
shape: tuple[int, ...]
tshape: tuple[int, ...]
ishape: tuple[int, ...]
xshape: tuple[int, ...]


@dataclass(eq=False)
class Case:
    op: str
    inputs: list[np.ndarray]
    want: np.ndarray  # float64 for float outputs, exact otherwise
    attrs: dict[str, Any] = field(default_factory=dict)
    label: str = ""


CASES: list[Case] = []


def case(op: str, inputs: list[np.ndarray], want: Any, label: str = "", **attrs: Any) -> None:
    shapes = "x".join(str(list(a.shape)).replace(" ", "") for a in inputs)
    kinds = ",".join(sorted({dtypes.from_numpy(a.dtype) for a in inputs}))
    CASES.append(Case(op, inputs, np.asarray(want), attrs, f"{op}-{kinds}-{shapes}-{label}-{len(CASES)}"))


def rand(shape: tuple[int, ...], dtype: str = "f32", lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    if dtype in INTS or dtype == "u8":
        return np.asarray(rng.integers(int(lo), int(hi), shape)).astype(dtypes.to_numpy(dtype))
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    return np.asarray(rng.uniform(lo, hi, shape)).astype(dtypes.to_numpy(dtype))


def f64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64)


# -- elementwise ----------------------------------------------------------------------------------------
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


UNARY_REF: dict[str, tuple[Callable[[np.ndarray], np.ndarray], float, float]] = {
    "neg": (lambda x: -x, -2, 2),
    "exp": (np.exp, -3, 3),
    "log": (np.log, 0.05, 5),
    "sqrt": (np.sqrt, 0, 5),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), 0.05, 5),
    "tanh": (np.tanh, -3, 3),
    "sigmoid": (_sigmoid, -6, 6),
    "relu": (lambda x: np.where(x > 0, x, 0.0), -2, 2),
    "silu": (lambda x: x * _sigmoid(x), -6, 6),
}
SHAPES = [(), (7,), (3, 5), (2, 3, 4), (0, 3)]

for op, (fn, lo, hi) in UNARY_REF.items():
    for dt in FLOATS:
        for shape in SHAPES:
            x = rand(shape, dt, lo, hi)
            case(op, [x], fn(f64(x)))
for dt in FLOATS:
    for shape in SHAPES[1:4]:
        x = rand(shape, dt, -4, 4)
        x64 = f64(x)
        case("gelu", [x], 0.5 * x64 * (1 + _erf(x64 / math.sqrt(2))), approximate="none")
        case("gelu", [x], 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3))),
             approximate="tanh")
x = rand((4,))
case("gelu", [x], 0.5 * f64(x) * (1 + _erf(f64(x) / math.sqrt(2))), label="default-attr")

BINARY_REF: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power}
PAIRS = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (2, 3)), ((5,), ()), ((0, 2), (2,))]

for op, fn2 in BINARY_REF.items():
    for dt in FLOATS:
        for sa, sb in PAIRS:
            if op == "pow":
                a, b = rand(sa, dt, 0.5, 2.0), rand(sb, dt, -2, 2)
            elif op == "div":
                b = rand(sb, dt, 0.5, 2.0) * np.where(rand(sb, "bool"), 1, -1).astype(dtypes.to_numpy(dt))
                a = rand(sa, dt)
            else:
                a, b = rand(sa, dt), rand(sb, dt)
            case(op, [a, b], fn2(f64(a), f64(b)))
    for dt in INTS:
        for sa, sb in PAIRS[:3]:
            if op == "pow":
                a, b = rand(sa, dt, 0, 6), rand(sb, dt, 0, 4)
                case(op, [a, b], np.power(a.astype(np.int64), b.astype(np.int64)).astype(a.dtype))
            elif op == "div":  # integer division truncates toward zero, like C
                a = rand(sa, dt, -50, 50)
                b = rand(sb, dt, 1, 9) * np.where(rand(sb, "bool"), 1, -1).astype(a.dtype)
                case(op, [a, b], np.trunc(f64(a) / f64(b)).astype(a.dtype))
            else:
                a, b = rand(sa, dt, -50, 50), rand(sb, dt, -50, 50)
                case(op, [a, b], fn2(a.astype(np.int64), b.astype(np.int64)).astype(a.dtype))

# -- matmul and reductions ------------------------------------------------------------------------------
MATMULS = [((3, 4), (4, 5), False, False), ((2, 3, 4), (4, 5), False, False), ((2, 1, 3, 4), (3, 4, 5), False, False),
           ((4, 3), (4, 5), True, False), ((3, 4), (5, 4), False, True), ((2, 4, 3), (2, 5, 4), True, True),
           ((1, 16), (16, 32), False, False)]
for dt in FLOATS:
    for sa, sb, ta, tb in MATMULS:
        a, b = rand(sa, dt), rand(sb, dt)
        a64, b64 = f64(a), f64(b)
        want = np.matmul(np.swapaxes(a64, -1, -2) if ta else a64, np.swapaxes(b64, -1, -2) if tb else b64)
        case("matmul", [a, b], want, transpose_a=ta, transpose_b=tb)

AXES: list[tuple[int, ...]] = [(), (0,), (-1,), (0, 2), (1, -1)]
REDUCE_REF: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "mean": np.mean, "max": np.max}
for op, fn in REDUCE_REF.items():
    for dt in FLOATS + (INTS if op != "mean" else ()):
        for axes in AXES:
            for keep in (False, True):
                x = rand((2, 3, 4), dt, -20 if dt in INTS else -2, 20 if dt in INTS else 2)
                want = fn(f64(x), axis=tuple(a % 3 for a in axes) or None, keepdims=keep)
                case(op, [x], want if dt in FLOATS else want.astype(x.dtype), axes=axes, keepdims=keep)
        x = rand((), dt, 1, 5)
        case(op, [x], f64(x) if dt in FLOATS else x, label="scalar")
x = rand((3, 4))
case("sum", [x], f64(x).sum(axis=0), label="dup-axes", axes=(0, -2))  # (0, -2) name one axis of a rank-2 input

for dt in FLOATS:
    for shape, axis in (((5,), -1), ((3, 7), -1), ((3, 7), 0), ((2, 3, 4), 1)):
        x = rand(shape, dt, -5, 5)
        e = np.exp(f64(x) - f64(x).max(axis=axis, keepdims=True))
        case("softmax", [x], e / e.sum(axis=axis, keepdims=True), axis=axis)
    for shape, eps in (((8,), 1e-5), ((4, 8), 1e-5), ((2, 3, 16), 1e-3)):
        x, g, b = rand(shape, dt), rand(shape[-1:], dt, 0.5, 1.5), rand(shape[-1:], dt)
        x64 = f64(x)
        mu = x64.mean(-1, keepdims=True)
        var = ((x64 - mu) ** 2).mean(-1, keepdims=True)
        case("layer_norm", [x, g, b], (x64 - mu) / np.sqrt(var + eps) * f64(g) + f64(b), eps=eps)
        case("rms_norm", [x, g], x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * f64(g), eps=eps)

# -- indexing and layout --------------------------------------------------------------------------------
def gather_ref(table: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    ax = axis % table.ndim
    out = np.empty((*table.shape[:ax], *idx.shape, *table.shape[ax + 1:]), table.dtype)
    for o in np.ndindex(*out.shape):
        out[o] = table[(*o[:ax], idx[o[ax:ax + idx.ndim]], *o[ax + idx.ndim:])]
    return out


def transpose_ref(x: np.ndarray, perm: tuple[int, ...]) -> np.ndarray:
    out = np.empty([x.shape[p] for p in perm], x.dtype)
    for o in np.ndindex(*out.shape):
        src = [0] * x.ndim
        for a, p in enumerate(perm):
            src[p] = o[a]
        out[o] = x[tuple(src)]
    return out


for table_dt in ("f32", "f16", "bf16", "f64", "i64", "bool"):
    for idx_dt in INTS:
        for tshape, ishape, axis in (((10, 4), (3,), 0), ((10, 4), (2, 3), 0), ((3, 10), (4,), -1),
                                     ((10, 4), (), 0), ((2, 5, 3), (2, 2), 1)):
            table = rand(tshape, table_dt, -9, 9)
            idx = rand(ishape, idx_dt, 0, tshape[axis])
            case("gather", [table, idx], gather_ref(table, idx, axis), axis=axis)

for dt in ("f32", "bf16", "i64", "bool"):
    x = rand((2, 3, 4), dt, -9, 9)
    for shape in ((6, 4), (-1,), (4, -1, 2), (1, 24)):
        want = x.reshape(shape)
        case("reshape", [x], want, shape=shape)
    for perm in ((2, 0, 1), (1, 0, 2), (0, 1, 2)):
        case("transpose", [x], transpose_ref(x, perm), perm=perm)
x = rand((1,))
case("reshape", [x], f64(x).reshape(()), label="to-scalar", shape=())

for dt in ("f32", "f16", "i32", "bool"):
    a, b, c = rand((3, 4), dt, -9, 9), rand((2, 4), dt, -9, 9), rand((0, 4), dt, -9, 9)
    for parts, axis in (([a], 0), ([a, b], 0), ([a, c, b], 0), ([a, rand((3, 2), dt, -9, 9)], -1)):
        rows = np.concatenate(parts, axis=axis)
        case("concat", parts, rows, axis=axis)
    x = rand((5, 4), dt, -9, 9)
    for axis, start, end in ((0, 1, 3), (-1, 0, 4), (1, 2, 2), (0, 4, 5)):
        want = x[start:end] if axis == 0 else x[:, start:end]
        case("slice", [x], want, axis=axis, start=start, end=end)

ALL_DTYPES = ("f64", "f32", "f16", "bf16", "i64", "i32", "u8", "bool")
for src in ALL_DTYPES:
    for dst in ALL_DTYPES:
        if src == "bool":
            x = rand((6,), "bool")
        elif src == "u8" or dst == "u8":
            x = rand((6,), src, 0, 200)
        else:
            x = rand((6,), src, -100, 100)
        if src in FLOATS:
            x[:2] = 0  # zeros and whole numbers: bool and int results then test truncation, not luck
            x[2] = 3
        if dst == "bool":
            want = x != 0
        elif dst in FLOATS:
            want = f64(x)
        else:
            want = np.trunc(f64(x)).astype(dtypes.to_numpy(dst))
        case("cast", [x], want, label=f"to-{dst}", dtype=dst)

for dt in ALL_DTYPES:
    for shape in ((), (3,), (2, 2)):
        value = rand(shape, dt, 0, 9)
        case("constant", [], value, label=dt, value=value)


# -- transformer ops ------------------------------------------------------------------------------------
def rope_ref(x: np.ndarray, pos: np.ndarray, theta: float, style: str, rotary_dim: int,
             inv_freq: tuple[float, ...] = (), scale: float = 1.0) -> np.ndarray:
    """HF rotate_half for "half", GPT-J complex pairs for "interleaved"; dims past rotary_dim pass through.
    inv_freq replaces theta's frequencies and scale multiplies cos and sin (the scaled variants)."""
    x64 = f64(x)
    rot = rotary_dim or x.shape[2]
    inv = np.array(inv_freq, np.float64) if inv_freq else 1.0 / theta ** (np.arange(0, rot, 2) / rot)
    freqs = pos.astype(np.float64)[:, None] * inv[None, :]  # [S, rot/2]
    out = x64.copy()
    if style == "half":
        emb = np.concatenate([freqs, freqs], -1)[:, None, :]
        xr = x64[..., :rot]
        rotated = np.concatenate([-xr[..., rot // 2:], xr[..., : rot // 2]], -1)
        out[..., :rot] = (xr * np.cos(emb) + rotated * np.sin(emb)) * scale
    else:
        z = (x64[..., 0:rot:2] + 1j * x64[..., 1:rot:2]) * np.exp(1j * freqs)[:, None, :] * scale
        out[..., 0:rot:2], out[..., 1:rot:2] = z.real, z.imag
    return out


for dt in FLOATS:
    for style in ("half", "interleaved"):
        for (s, h, d), rotary_dim, theta, pdt, base in (((5, 2, 8), 0, 10000.0, "i64", 0), ((4, 3, 8), 4, 500000.0, "i32", 7),
                                                       ((3, 1, 16), 0, 10000.0, "i64", 3000)):
            x = rand((s, h, d), dt)
            pos = (base + rng.permutation(s)).astype(dtypes.to_numpy(pdt))
            case("rope", [x, pos], rope_ref(x, pos, theta, style, rotary_dim), theta=theta, style=style,
                 rotary_dim=rotary_dim)
x, pos = rand((2, 2, 4)), np.array([1, 2])
case("rope", [x, pos], rope_ref(x, pos, 10000.0, "half", 0), label="defaults")
# scaled variants: given frequencies (whole head and partial) and a cos/sin factor, in both styles; their own
# generator, so the cases after them draw what they drew before
scaled_rng = np.random.default_rng(38)
for dt in FLOATS:
    for style in ("half", "interleaved"):
        for (s, h, d), rotary_dim, inv_freq, scale in (((5, 2, 8), 0, (1.0, 0.3, 0.01, 1e-4), 0.8),
                                                      ((4, 3, 12), 8, (0.9, 0.05, 0.002, 3e-5), 1.2)):
            x = scaled_rng.uniform(-2.0, 2.0, (s, h, d)).astype(dtypes.to_numpy(dt))
            pos = (4000 + scaled_rng.permutation(s)).astype(np.int64)
            case("rope", [x, pos], rope_ref(x, pos, 10000.0, style, rotary_dim, inv_freq, scale), style=style,
                 rotary_dim=rotary_dim, inv_freq=inv_freq, scale=scale, label=f"{dt}-{style}-scaled-{d}")


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray | None, scale: float) -> np.ndarray:
    """Per query and head: softmax over the visible keys only (j <= pos[i] when causal)."""
    sq, hq, d = q.shape
    group = hq // k.shape[1]
    scale = scale or 1.0 / math.sqrt(d)
    out = np.zeros((sq, hq, d))
    for i in range(sq):
        keys = range(k.shape[0]) if pos is None else range(int(pos[i]) + 1)
        for h in range(hq):
            s = np.array([f64(q[i, h]) @ f64(k[j, h // group]) * scale for j in keys])
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = sum(pj * f64(v[j, h // group]) for pj, j in zip(p, keys))
    return out


for dt in FLOATS:
    # (Sq, Sk, Hq, Hkv, D, positions or None, scale); NaN rows past every query's position are padding
    # the kernel must not read (decode over a bucketed cache).
    for sq, sk, hq, hkv, d, positions, scale in (
        (5, 5, 4, 2, 8, [0, 1, 2, 3, 4], 0.0),
        (1, 8, 4, 2, 8, [4], 0.0),
        (3, 8, 2, 2, 8, [3, 4, 5], 0.0),
        (3, 6, 4, 1, 4, [2, 0, 5], 0.5),
        (4, 6, 2, 2, 8, None, 0.3),
        (2, 3, 6, 3, 4, None, 0.0),
    ):
        q, k, v = rand((sq, hq, d), dt), rand((sk, hkv, d), dt), rand((sk, hkv, d), dt)
        ins = [q, k, v]
        if positions is not None:
            pos = np.array(positions, np.int64 if sq != 3 else np.int32)
            k[max(positions) + 1:] = np.nan
            v[max(positions) + 1:] = np.nan
            ins.append(pos)
        case("attention", ins, attention_ref(q, k, v, pos if positions is not None else None, scale),
             causal=positions is not None, scale=scale)

for dt in ("f32", "f16", "bf16", "f64", "i64"):
    for cshape, rshape, pos in (((6, 2, 4), (2, 2, 4), np.array(3)), ((6, 2, 4), (1, 2, 4), np.array([0], np.int32)),
                                ((6, 2, 4), (6, 2, 4), np.array([0])), ((5, 8), (1, 8), np.array([4], np.int32))):
        cache, rows = rand(cshape, dt, -9, 9), rand(rshape, dt, -9, 9)
        want = cache.copy()
        start = int(pos.reshape(-1)[0])
        want[start:start + rows.shape[0]] = rows
        case("kv_write", [cache, rows, pos], want)

# kv_scatter: row r goes to pool row slots[r] (any order, any rows of the pool); every other row keeps its value.
for dt in ("f32", "f16", "bf16", "f64", "i64"):
    for pshape, slots in (((10, 2, 4), np.array([7, 0, 4])), ((6, 8), np.array([5], np.int32)),
                          ((8, 3), np.arange(8)[::-1].copy()), ((5, 4), np.zeros(0, np.int64))):
        pool, rows = rand(pshape, dt, -9, 9), rand((len(slots), *pshape[1:]), dt, -9, 9)
        want = pool.copy()
        for r, slot in enumerate(slots):
            want[slot] = rows[r]
        case("kv_scatter", [pool, rows, slots], want)


def paged_attention_ref(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, table: np.ndarray,
                        token_seq: np.ndarray, pos: np.ndarray, block: int, scale: float) -> np.ndarray:
    """The float64 reference of tests/test_paged_ops.py: per query, softmax over its own sequence's keys 0..pos[i],
    each found through the block table."""
    return paged_ref([q, k_pool, v_pool, table, token_seq, pos], block, scale)


for dt in FLOATS:
    # (heads, kv heads, head dim, block, pool blocks, block table, (sequence, first position, tokens) chunks,
    #  decode, scale, index dtype, shuffled). Pool rows no query may see (unwritten block tails, blocks no
    # sequence owns, the table's padding) hold large finite garbage: a kernel that lets one through is wrong.
    for hq, hkv, d, block, n_blocks, tbl, chunks, decode, scale, idx_dt, shuffle in (
        (4, 2, 8, 4, 8, [[3, 1, 6], [0, 5, 7]], [(0, 5, 3), (1, 9, 1)], False, 0.0, "i64", False),
        (2, 2, 8, 4, 12, [[11, 2, 9], [4, 0, 0], [7, 8, 1]], [(0, 11, 1), (1, 0, 1), (2, 6, 1)], True, 0.5, "i64",
         False),
        (4, 1, 4, 2, 9, [[8, 0, 3, 5], [2, 2, 2, 2]], [(0, 0, 6), (1, 1, 1)], False, 0.3, "i32", True),
    ):
        table = np.array(tbl).astype(dtypes.to_numpy(idx_dt))
        token_seq = np.concatenate([np.full(n, s) for s, _, n in chunks]).astype(dtypes.to_numpy(idx_dt))
        pos = np.concatenate([np.arange(p0, p0 + n) for _, p0, n in chunks]).astype(dtypes.to_numpy(idx_dt))
        if shuffle:  # token order is free: a kernel must not assume a sequence's tokens are adjacent
            order = rng.permutation(len(pos))
            token_seq, pos = token_seq[order], pos[order]
        k_pool, v_pool = rand((n_blocks * block, hkv, d), "f64", -30, 30), rand((n_blocks * block, hkv, d), "f64", -30, 30)
        for s in set(token_seq.tolist()):
            live = [int(table[s, j // block]) * block + j % block for j in range(int(pos[token_seq == s].max()) + 1)]
            k_pool[live], v_pool[live] = rand((len(live), hkv, d), "f64"), rand((len(live), hkv, d), "f64")
        q, k_pool, v_pool = rand((len(pos), hq, d), dt), k_pool.astype(dtypes.to_numpy(dt)), v_pool.astype(dtypes.to_numpy(dt))
        case("paged_attention", [q, k_pool, v_pool, table, token_seq, pos],
             paged_attention_ref(q, k_pool, v_pool, table, token_seq, pos, block, scale), block_size=block,
             decode=decode, scale=scale)


# -- selection, MoE, sampling ---------------------------------------------------------------------------
def descending(row: np.ndarray) -> list[int]:
    """Indices by value, descending; equal values keep the lower index first."""
    return sorted(range(len(row)), key=lambda j: (-row[j], j))


def topk_ref(x: np.ndarray, k: int) -> np.ndarray:
    rows = f64(x).reshape(-1, x.shape[-1])
    return np.array([descending(r)[:k] for r in rows], np.int64).reshape(*x.shape[:-1], k)


for dt in FLOATS + INTS:
    for shape, width in (((8,), 3), ((3, 8), 1), ((3, 8), 8), ((2, 2, 5), 2)):
        x = rand(shape, dt, -3, 3)
        x = np.round(x) if dt in FLOATS else x  # whole numbers in a small range: plenty of ties
        case("top_k", [x], topk_ref(x, width), k=width)


def take_ref(x: np.ndarray, idx: np.ndarray, axis: int) -> np.ndarray:
    grid: list[np.ndarray] = list(np.indices(idx.shape))
    grid[axis] = idx.astype(np.int64)
    return x[tuple(grid)]


for dt in ("f32", "bf16", "f64", "i64"):
    for idx_dt in INTS:
        for tshape, ishape, axis in (((3, 5), (3, 2), -1), ((4, 3), (2, 3), 0), ((2, 3, 4), (2, 3, 6), 2)):
            x = rand(tshape, dt, -9, 9)
            idx = rand(ishape, idx_dt, 0, tshape[axis])
            want = take_ref(x, idx, axis)
            case("take_along_axis", [x, idx], want, axis=axis)

for dt in FLOATS:
    for m, kdim, n, e, idx_dt in ((6, 4, 5, 3, "i64"), (5, 8, 3, 4, "i32"), (1, 4, 4, 2, "i64")):
        x, w = rand((m, kdim), dt), rand((e, kdim, n), dt)
        ids = rand((m,), idx_dt, 0, e)
        case("grouped_matmul", [x, w, ids], np.stack([f64(x[r]) @ f64(w[ids[r]]) for r in range(m)]))
    x, w = rand((4, 4), dt), rand((3, 4, 2), dt)
    case("grouped_matmul", [x, w, np.full(4, 2)], f64(x) @ f64(w[2]), label="one-expert")


def argmax_ref(x: np.ndarray, axis: int) -> np.ndarray:
    moved = np.moveaxis(f64(x), axis, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    return np.array([min(j for j in range(len(r)) if r[j] == r.max()) for r in rows], np.int64).reshape(moved.shape[:-1])


for dt in FLOATS + INTS:
    for shape, axis in (((3, 5), -1), ((3, 5), 0), ((2, 3, 4), 1), ((7,), 0)):
        x = rand(shape, dt, -3, 3)
        x = np.round(x) if dt in FLOATS else x
        case("argmax", [x], argmax_ref(x, axis), axis=axis)


def sample_ref(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int) -> np.ndarray:
    """Inverse-CDF draw over the tempered, top-k and nucleus-trimmed distribution, one uniform per row."""
    out = []
    for b, row in enumerate(f64(logits)):
        if temperature <= 0:
            out.append(int(np.flatnonzero(row == row.max())[0]))
            continue
        z = row / temperature
        order = descending(z)[:top_k] if top_k > 0 else descending(z)
        w = np.exp(z[order] - z[order[0]])
        w /= w.sum()
        if 0 < top_p < 1:
            keep = next((i + 1 for i, c in enumerate(np.cumsum(w)) if c >= top_p), len(w))
            order, w = order[:keep], w[:keep] / w[:keep].sum()
        target = uniform(RngOptions(), seed, b) * np.cumsum(w)[-1]
        out.append(next((t for t, c in zip(order, np.cumsum(w)) if c > target), order[-1]))
    return np.array(out, np.int64)


def sample_inputs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int) -> list[np.ndarray]:
    return [logits, np.array(temperature, np.float32), np.array([top_k], np.int64), np.array(top_p, np.float32),
            np.array(seed, np.int64)]


for dt in FLOATS:
    for temperature, top_k, top_p, seed in ((0.0, 0, 1.0, 1), (1.0, 1, 1.0, 2), (0.8, 0, 1.0, 3), (1.3, 5, 1.0, 4),
                                            (1.0, 0, 0.7, 5), (0.7, 4, 0.9, 6), (-1.0, 3, 0.5, 7)):
        logits = rand((6, 12), dt, -3, 3)
        t32, p32 = float(np.float32(temperature)), float(np.float32(top_p))
        case("sample", sample_inputs(logits, temperature, top_k, top_p, seed), sample_ref(logits, t32, top_k, p32, seed),
             label=f"t{temperature}-k{top_k}-p{top_p}")


def quantize(w: np.ndarray, scheme: str) -> tuple[np.ndarray, np.ndarray]:
    """GGUF blocks of w [n, k] as u8 [n, k/32 * block bytes], and the float64 weights they decode to.

    Block layouts: q8_0 = d f16, 32 x int8; q4_0 = d f16, 16 bytes of nibbles (low nibble = element j,
    high nibble = element j + 16), value (q - 8) * d; q4_1 = d f16, m f16, nibbles, value q * d + m.
    """
    n, k = w.shape
    blocks = f64(w).reshape(n, k // 32, 32)

    def f16_bytes(a: np.ndarray) -> np.ndarray:
        return a.astype("<f2").reshape(n, k // 32, 1).view(np.uint8)

    if scheme == "q8_0":
        d = (np.abs(blocks).max(-1) / 127).astype(np.float16)
        inv = np.where(d > 0, 1 / np.maximum(f64(d), 1e-30), 0.0)
        q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
        raw = np.concatenate([f16_bytes(d), q.view(np.uint8)], -1)
        return raw.reshape(n, -1), q * f64(d)[..., None]
    if scheme == "q4_0":
        signed_max = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]
        d = (signed_max / -8).astype(np.float16)
        inv = np.where(d != 0, 1 / np.where(d != 0, f64(d), 1.0), 0.0)
        q = np.clip(np.floor(blocks * inv[..., None] + 8.5), 0, 15).astype(np.uint8)
        head, decoded = f16_bytes(d), (q - 8.0) * f64(d)[..., None]
    else:
        lo, hi = blocks.min(-1), blocks.max(-1)
        d, m = ((hi - lo) / 15).astype(np.float16), lo.astype(np.float16)
        inv = np.where(d > 0, 1 / np.where(d > 0, f64(d), 1.0), 0.0)
        q = np.clip(np.rint((blocks - f64(m)[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
        head, decoded = np.concatenate([f16_bytes(d), f16_bytes(m)], -1), q * f64(d)[..., None] + f64(m)[..., None]
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return np.concatenate([head, nibbles], -1).reshape(n, -1), decoded.reshape(n, k)


def k_quant_blocks(scheme: str, n: int, k: int) -> np.ndarray:
    """Well-formed K-quant super-blocks of w [n, k] (u8 [n, k/256 * block bytes]): f16 d (and dmin) small and
    positive, any 6-bit scales, mins and codes (q4_k: d, dmin, 12 scale bytes, 128 of nibbles; q6_k: 128 bytes
    of low nibbles, 64 of high bits, 16 int8 scales, d)."""
    nb = k // 256
    d = rng.uniform(0.0005, 0.002, (n, nb, 2 if scheme == "q4_k" else 1)).astype("<f2").view(np.uint8)
    codes = rng.integers(0, 256, (n, nb, 140 if scheme == "q4_k" else 208)).astype(np.uint8)
    return np.concatenate([d, codes] if scheme == "q4_k" else [codes, d], -1).reshape(n, -1)


for scheme in ("q4_0", "q4_1", "q8_0"):
    for dt in FLOATS:
        for xshape, n in (((3, 64), 5), ((2, 2, 64), 16), ((1, 64), 32), ((4, 32), 48)):
            kdim = xshape[-1]
            packed, w = quantize(rand((n, kdim), "f32", -1, 1), scheme)
            x = rand(xshape, dt)
            case("dequant_matmul", [x, packed], f64(x) @ w.reshape(n, kdim).T, scheme=scheme, n=n, k=kdim)
for scheme in ("q4_k", "q6_k"):  # the reference: gguf's own dequantization of the super-blocks, in float64
    for dt in FLOATS:
        for xshape, n in (((3, 256), 5), ((2, 2, 512), 16), ((1, 256), 50)):
            kdim = xshape[-1]
            packed = k_quant_blocks(scheme, n, kdim)
            w = f64(dequantize_packed(packed, scheme, n, kdim))
            x = rand(xshape, dt)
            case("dequant_matmul", [x, packed], f64(x) @ w.T, scheme=scheme, n=n, k=kdim)


# -- the tests ------------------------------------------------------------------------------------------
def test_every_op_has_cases() -> None:
    assert {c.op for c in CASES} == set(ops.SPECS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_lowers_every_op(backend: str) -> None:
    assert set(ops.SPECS) <= set(executable_class(backend.partition(":")[0]).kernels)


def compile_on(target: str, g: GraphBuilder) -> Executable[Any]:
    name, _, device = target.partition(":")
    return compile_graph(parse(g.build()), name, device or "cpu")


def run_op(backend: str, op: str, inputs: list[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    """Runs a one-op graph; checks that the result has the type GraphBuilder inferred."""
    g = GraphBuilder(op)
    values = [g.input(f"x{i}", a.shape, dtypes.from_numpy(a.dtype)) for i, a in enumerate(inputs)]
    out = g.node(op, values, **attrs)
    g.output(out)
    ex = compile_on(backend, g)
    (got,) = ex.run({f"x{i}": a for i, a in enumerate(inputs)}, typed=True)
    assert got.dtype == dtypes.to_numpy(out.dtype), f"{op} returned {got.dtype}, inferred {out.dtype}"
    assert got.shape == out.shape, f"{op} returned shape {got.shape}, inferred {out.shape}"
    return got


@pytest.mark.parametrize("c", CASES, ids=[c.label for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_op(backend: str, c: Case) -> None:
    got = run_op(backend, c.op, c.inputs, c.attrs)
    out_dtype = dtypes.from_numpy(got.dtype)
    if out_dtype in TOL:
        rtol, atol = TOL[out_dtype]
        scale = LOOSE.get(c.op, 1.0)
        np.testing.assert_allclose(f64(got), f64(c.want), rtol=rtol * scale, atol=atol * scale, err_msg=c.label)
    else:
        np.testing.assert_array_equal(got, c.want.astype(got.dtype), err_msg=c.label)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_write_leaves_its_cache_input_unchanged(backend: str) -> None:
    g = GraphBuilder("kv")
    cache, rows, pos = g.input("cache", (4, 3)), g.input("rows", (1, 3)), g.input("pos", (), "i64")
    written = g.kv_write(cache, rows, pos)
    after = g.mul(cache, 1.0)  # declared after kv_write, so it runs after it
    g.output(written, after)
    ex = compile_on(backend, g)
    c = rand((4, 3))
    w, a = ex.run({"cache": c, "rows": np.ones((1, 3), np.float32), "pos": np.array(2)})
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(w[2], 1.0)


# Runtime index errors: out-of-range indices are an OutOfRange error on every backend, never garbage.
OOR: list[tuple[str, list[np.ndarray], dict[str, Any]]] = [
    ("gather", [rand((5, 2)), np.array([1, 5])], {}),
    ("gather", [rand((5, 2)), np.array([-1], np.int32)], {}),
    ("take_along_axis", [rand((2, 3)), np.array([[0], [3]])], {}),
    ("grouped_matmul", [rand((2, 4)), rand((3, 4, 2)), np.array([0, 3])], {}),
    ("kv_write", [rand((4, 3)), rand((2, 3)), np.array(3)], {}),
    ("kv_write", [rand((4, 3)), rand((1, 3)), np.array([-1])], {}),
    ("kv_scatter", [rand((4, 3)), rand((2, 3)), np.array([1, 4])], {}),
    ("kv_scatter", [rand((4, 3)), rand((1, 3)), np.array([-1], np.int32)], {}),
    # a pool of 2 blocks of 4 rows: block id 2, position 8 of a 2-block table, sequence 1 of a 1-row table
    ("paged_attention", [rand((1, 2, 4)), rand((8, 2, 4)), rand((8, 2, 4)), np.array([[0, 2]]), np.array([0]),
                         np.array([5])], {"block_size": 4}),
    ("paged_attention", [rand((1, 2, 4)), rand((8, 2, 4)), rand((8, 2, 4)), np.array([[0, 1]]), np.array([0]),
                         np.array([8])], {"block_size": 4, "decode": True}),
    ("paged_attention", [rand((1, 2, 4)), rand((8, 2, 4)), rand((8, 2, 4)), np.array([[0, 1]]), np.array([1]),
                         np.array([3])], {"block_size": 4}),
]


@pytest.mark.parametrize("op,inputs,attrs", OOR, ids=[f"{o}-{i}" for i, (o, _, _) in enumerate(OOR)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_index_out_of_range(backend: str, op: str, inputs: list[np.ndarray], attrs: dict[str, Any]) -> None:
    with pytest.raises(OutOfRange):
        run_op(backend, op, inputs, attrs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_distribution(backend: str) -> None:
    """Each row draws its own uniform: many rows of the same logits give the token frequencies."""
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.tile(np.log(probs), (3000, 1)).astype(np.float32)
    for top_k, top_p, want in ((0, 1.0, probs), (2, 1.0, np.array([0, 0, 3 / 7, 4 / 7])),
                               (0, 0.5, np.array([0, 0, 3 / 7, 4 / 7])), (1, 1.0, np.array([0, 0, 0, 1.0]))):
        for seed in (11, 12):
            tokens = run_op(backend, "sample", sample_inputs(logits, 1.0, top_k, top_p, seed), {})
            freq = np.bincount(tokens, minlength=4) / len(tokens)
            sigma = np.sqrt(want * (1 - want) / len(tokens))
            assert np.all(np.abs(freq - want) <= 5 * sigma + 1e-12), (top_k, top_p, seed, freq)
    a = run_op(backend, "sample", sample_inputs(logits[:50], 1.0, 0, 1.0, 11), {})
    b = run_op(backend, "sample", sample_inputs(logits[:50], 1.0, 0, 1.0, 12), {})
    assert (a != b).any()  # the seed matters


# -- spec errors: GraphBuilder raises OpError at the author's line; parse() raises GraphError -------------
def x_(shape: tuple[int, ...], dtype: str = "f32") -> tuple[tuple[int, ...], str]:
    return shape, dtype


SPEC_ERRORS: list[tuple[str, list[tuple[tuple[int, ...], str]], dict[str, Any]]] = [
    ("add", [x_((3,))], {}),
    ("sample", [x_((1, 4)), x_((), "f32"), x_((), "i64"), x_((), "f32")], {}),
    ("attention", [x_((2, 2, 4)), x_((2, 2, 4))], {}),
    ("concat", [], {}),
    ("relu", [x_((3,)), x_((3,))], {}),
    ("relu", [x_((3,))], {"alpha": 1.0}),
    ("softmax", [x_((3,))], {"axis": "last"}),
    ("reshape", [x_((2, 3))], {}),
    ("slice", [x_((2, 3))], {"start": 0, "end": 1}),
    ("gelu", [x_((3,))], {"approximate": "fast"}),
    ("exp", [x_((3,), "i64")], {}),
    ("add", [x_((3,)), x_((4,))], {}),
    ("add", [x_((3,)), x_((3,), "f16")], {}),
    ("add", [x_((3,), "bool"), x_((3,), "bool")], {}),
    ("matmul", [x_((3, 4)), x_((5, 6))], {}),
    ("matmul", [x_((4,)), x_((4, 2))], {}),
    ("sum", [x_((2, 3))], {"axes": (2,)}),
    ("softmax", [x_((2, 3))], {"axis": 2}),
    ("layer_norm", [x_((2, 4)), x_((3,)), x_((4,))], {}),
    ("rms_norm", [x_((2, 4)), x_((4,), "f16")], {}),
    ("gather", [x_((5, 2)), x_((3,), "f32")], {}),
    ("reshape", [x_((2, 3))], {"shape": (4,)}),
    ("reshape", [x_((2, 3))], {"shape": (-1, -1)}),
    ("transpose", [x_((2, 3))], {"perm": (0, 0)}),
    ("concat", [x_((2, 3)), x_((2, 4))], {"axis": 0}),
    ("concat", [x_((2, 3)), x_((2, 3), "f16")], {}),
    ("slice", [x_((2, 3))], {"axis": 1, "start": 2, "end": 4}),
    ("cast", [x_((2,))], {"dtype": "f8"}),
    ("rope", [x_((3, 2, 8)), x_((2,), "i64")], {}),
    ("rope", [x_((3, 2, 8)), x_((3,), "i64")], {"rotary_dim": 3}),
    ("rope", [x_((3, 2, 8)), x_((3,), "i64")], {"style": "neox"}),
    ("rope", [x_((3, 16)), x_((3,), "i64")], {}),
    ("rope", [x_((3, 2, 8)), x_((3,), "i64")], {"inv_freq": (1.0, 0.5)}),
    ("rope", [x_((3, 2, 8)), x_((3,), "i64")], {"scale": math.inf}),
    ("attention", [x_((2, 3, 4)), x_((5, 2, 4)), x_((5, 2, 4)), x_((2,), "i64")], {}),
    ("attention", [x_((2, 2, 4)), x_((5, 2, 4)), x_((5, 2, 4))], {}),
    ("attention", [x_((2, 2, 4)), x_((5, 2, 4)), x_((5, 2, 4)), x_((3,), "i64")], {}),
    ("attention", [x_((2, 2, 4)), x_((5, 2, 8)), x_((5, 2, 8)), x_((2,), "i64")], {}),
    ("attention", [x_((2, 2, 4)), x_((5, 2, 4)), x_((5, 2, 4)), x_((2,), "i64")], {"causal": False}),
    ("kv_write", [x_((4, 3)), x_((5, 3)), x_((), "i64")], {}),
    ("kv_write", [x_((4, 3)), x_((1, 2)), x_((), "i64")], {}),
    ("kv_write", [x_((4, 3)), x_((1, 3)), x_((2,), "i64")], {}),
    ("kv_scatter", [x_((4, 3)), x_((2, 2)), x_((2,), "i64")], {}),
    ("kv_scatter", [x_((4, 3)), x_((2, 3), "f16"), x_((2,), "i64")], {}),
    ("kv_scatter", [x_((4, 3)), x_((2, 3)), x_((3,), "i64")], {}),
    ("kv_scatter", [x_((4, 3)), x_((2, 3)), x_((2,), "f32")], {}),
    ("paged_attention", [x_((2, 4, 8)), x_((8, 3, 8)), x_((8, 3, 8)), x_((1, 2), "i64"), x_((2,), "i64"),
                         x_((2,), "i64")], {"block_size": 4}),
    ("paged_attention", [x_((2, 4, 8)), x_((10, 2, 8)), x_((10, 2, 8)), x_((1, 2), "i64"), x_((2,), "i64"),
                         x_((2,), "i64")], {"block_size": 4}),
    ("paged_attention", [x_((2, 4, 8)), x_((8, 2, 8)), x_((8, 2, 8), "f16"), x_((1, 2), "i64"), x_((2,), "i64"),
                         x_((2,), "i64")], {"block_size": 4}),
    ("paged_attention", [x_((2, 4, 8)), x_((8, 2, 8)), x_((8, 2, 8)), x_((1, 2), "f32"), x_((2,), "i64"),
                         x_((2,), "i64")], {"block_size": 4}),
    ("paged_attention", [x_((2, 4, 8)), x_((8, 2, 8)), x_((8, 2, 8)), x_((1, 2), "i64"), x_((3,), "i64"),
                         x_((2,), "i64")], {"block_size": 4}),
    ("paged_attention", [x_((2, 4, 8)), x_((8, 2, 8)), x_((8, 2, 8)), x_((1, 2), "i64"), x_((2,), "i64"),
                         x_((2,), "i64")], {"block_size": 4, "decode": True}),
    ("paged_attention", [x_((2, 4, 8)), x_((8, 2, 8)), x_((8, 2, 8)), x_((1, 2), "i64"), x_((2,), "i64"),
                         x_((2,), "i64")], {}),
    ("top_k", [x_((3, 4))], {"k": 5}),
    ("top_k", [x_((3, 4))], {"k": 0}),
    ("take_along_axis", [x_((3, 4)), x_((2, 2), "i64")], {}),
    ("grouped_matmul", [x_((3, 4)), x_((2, 5, 6)), x_((3,), "i64")], {}),
    ("grouped_matmul", [x_((3, 4)), x_((2, 4, 6)), x_((2,), "i64")], {}),
    ("argmax", [x_((3, 4))], {"axis": 2}),
    ("sample", [x_((4,)), x_((), "f32"), x_((), "i64"), x_((), "f32"), x_((), "i64")], {}),
    ("sample", [x_((1, 4)), x_((), "f64"), x_((), "i64"), x_((), "f32"), x_((), "i64")], {}),
    ("dequant_matmul", [x_((2, 64)), x_((5, 36), "u8")], {"scheme": "q4_2", "n": 5, "k": 64}),
    ("dequant_matmul", [x_((2, 48)), x_((5, 27), "u8")], {"scheme": "q4_0", "n": 5, "k": 48}),
    ("dequant_matmul", [x_((2, 64)), x_((5, 35), "u8")], {"scheme": "q4_0", "n": 5, "k": 64}),
    ("dequant_matmul", [x_((2, 64)), x_((5, 68), "f32")], {"scheme": "q8_0", "n": 5, "k": 64}),
    ("dequant_matmul", [x_((2, 32)), x_((5, 36), "u8")], {"scheme": "q4_0", "n": 5, "k": 64}),
]


def _attr_proto(kind: str, value: Any) -> graph_pb2.AttrValue:
    if isinstance(value, bool):
        return graph_pb2.AttrValue(b=value)
    if isinstance(value, int):
        return graph_pb2.AttrValue(i=value)
    if isinstance(value, float):
        return graph_pb2.AttrValue(f=value)
    if isinstance(value, tuple) and kind == "floats":
        return graph_pb2.AttrValue(floats=graph_pb2.FloatList(values=value))
    if isinstance(value, tuple):
        return graph_pb2.AttrValue(ints=graph_pb2.IntList(values=value))
    if kind == "dtype":
        return graph_pb2.AttrValue(dtype=dtypes.to_proto(value)) if value in dtypes.DTYPE_NAMES else graph_pb2.AttrValue()
    return graph_pb2.AttrValue(s=value)


@pytest.mark.parametrize("op,inputs,attrs", [
    pytest.param(*e, id=f"{e[0]}-{i}") for i, e in enumerate(SPEC_ERRORS)])
def test_spec_errors(op: str, inputs: list[tuple[tuple[int, ...], str]], attrs: dict[str, Any]) -> None:
    g = GraphBuilder("bad")
    values = [g.input(f"x{i}", shape, dt) for i, (shape, dt) in enumerate(inputs)]
    with pytest.raises(OpError):
        g.node(op, values, **attrs)
    # The same node arriving as a proto (another client, or a hand-written graph) fails validation.
    proto = g._proto
    node = proto.nodes.add(name="bad", op=op, inputs=[v.name for v in values])
    for key, value in attrs.items():
        spec = ops.SPECS[op].attrs.get(key)
        node.attrs[key].CopyFrom(_attr_proto(spec.kind if spec else "", value))
    proto.outputs.append("bad")
    with pytest.raises(GraphError, match="bad"):
        parse(proto)


def test_builder_rejects_an_unknown_op() -> None:
    with pytest.raises(OpError):
        GraphBuilder("g").node("softplus", [])


def test_parse_rejects_an_unknown_op_and_a_wrong_declared_type() -> None:
    g = GraphBuilder("g")
    x = g.input("x", (3,))
    g.output(g.relu(x))
    proto = g.build()
    proto.nodes[0].type.shape[:] = [4]
    with pytest.raises(GraphError, match="declares"):
        parse(proto)
    proto.nodes[0].op = "softplus"
    with pytest.raises(GraphError, match="unknown op"):
        parse(proto)


def test_scalar_operands_become_constants_of_the_other_dtype() -> None:
    g = GraphBuilder("g")
    x = g.input("x", (3,), "f16")
    y = g.mul(x, 2.0)
    assert y.dtype == "f16"
    g.output(y)
    ex = compile_on(BACKENDS[0], g)
    (got,) = ex.run({"x": np.array([1, 2, 3], np.float16)}, typed=True)
    np.testing.assert_array_equal(got, np.array([2, 4, 6], np.float16))
