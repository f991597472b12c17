"""The closed op set: one spec per op (arity, attributes, type inference).

GraphBuilder, graph validation and every backend read this table; an op that
is not here does not exist. Shapes are static. Results of each op are defined
by the numpy backend (graphmesh_executor.backends.numpy_backend).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphmesh import dtypes
from graphmesh.dtypes import FLOAT_DTYPES


class OpError(ValueError):
    """A node whose inputs or attributes break its op's spec."""


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Attr:
    kind: str  # int float bool str ints floats dtype tensor
    default: Any = None  # None: required

    @property
    def required(self) -> bool:
        return self.default is None


Infer = Callable[[list[TensorType], dict[str, Any]], TensorType]


@dataclass(frozen=True)
class OpSpec:
    name: str
    min_inputs: int
    max_inputs: int  # -1: variadic
    infer: Infer
    attrs: dict[str, Attr] = field(default_factory=dict)
    doc: str = ""


def _fail(msg: str) -> OpError:
    return OpError(msg)


def _axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        raise _fail(f"{what} {axis} out of range for rank {rank}")
    return axis % rank if rank else 0


def _float(t: TensorType, what: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise _fail(f"{what} must be a float tensor, got {t}")


def _float_3d(op: str, layout: str, **named: TensorType) -> None:
    """Attention's q, k and v (or pools): float tensors of three axes laid out as `layout`."""
    for what, t in named.items():
        _float(t, what)
        if len(t.shape) != 3:
            raise _fail(f"{op} {what} must be {layout}, got {t}")


def _integer(t: TensorType, what: str) -> None:
    if t.dtype not in ("i64", "i32"):
        raise _fail(f"{what} must be i64 or i32, got {t}")


def broadcast_shapes(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    out: list[int] = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x != y and 1 not in (x, y):
            raise _fail(f"shapes {list(a)} and {list(b)} do not broadcast")
        out.append(max(x, y) if 0 not in (x, y) else 0)
    return tuple(reversed(out))


def _unary(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    _float(ins[0], "input")
    return ins[0]


def _binary(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a, b = ins
    if a.dtype != b.dtype:
        raise _fail(f"operands have different dtypes: {a} and {b}")
    if a.dtype == "bool":
        raise _fail("arithmetic on bool tensors")
    return TensorType(a.dtype, broadcast_shapes(a.shape, b.shape))


def _gelu(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    if attrs["approximate"] not in ("none", "tanh"):
        raise _fail(f"gelu approximate must be 'none' or 'tanh', got {attrs['approximate']!r}")
    return _unary(ins, attrs)


def _matmul(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    a, b = ins
    _float(a, "matmul lhs")
    if a.dtype != b.dtype:
        raise _fail(f"matmul operands have different dtypes: {a} and {b}")
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise _fail(f"matmul needs rank >= 2 operands, got {a} and {b}")
    m, k = a.shape[-2:][::-1] if attrs["transpose_a"] else a.shape[-2:]
    k2, n = b.shape[-2:][::-1] if attrs["transpose_b"] else b.shape[-2:]
    if k != k2:
        raise _fail(f"matmul contraction mismatch: {a} x {b} ({k} vs {k2})")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return TensorType(a.dtype, (*batch, m, n))


def _reduce(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x = ins[0]
    rank = len(x.shape)
    axes = sorted({_axis(a, rank) for a in attrs["axes"]}) if attrs["axes"] else list(range(rank))
    if attrs["keepdims"]:
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return TensorType(x.dtype, shape)


def _reduce_float(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    _float(ins[0], "input")
    return _reduce(ins, attrs)


def _softmax(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    _float(ins[0], "input")
    _axis(attrs["axis"], len(ins[0].shape))
    return ins[0]


def _layer_norm(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x = ins[0]
    _float(x, "input")
    if not x.shape:
        raise _fail("layer_norm of a scalar")
    for w in ins[1:]:
        if w.shape != (x.shape[-1],) or w.dtype != x.dtype:
            raise _fail(f"norm weight must be {x.dtype}[{x.shape[-1]}], got {w}")
    return x


def _gather(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    table, idx = ins
    _integer(idx, "gather indices")
    axis = _axis(attrs["axis"], len(table.shape))
    return TensorType(table.dtype, (*table.shape[:axis], *idx.shape, *table.shape[axis + 1:]))


def _reshape(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x = ins[0]
    shape = list(attrs["shape"])
    count = math.prod(x.shape)
    if shape.count(-1) > 1:
        raise _fail(f"reshape {shape}: at most one -1")
    if any(d < -1 for d in shape):
        raise _fail(f"reshape {shape}: negative dimension")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or count % known:
            raise _fail(f"cannot reshape {x} to {shape}")
        shape[shape.index(-1)] = count // known
    if math.prod(shape) != count:
        raise _fail(f"cannot reshape {x} ({count} elements) to {shape}")
    return TensorType(x.dtype, tuple(shape))


def _transpose(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x = ins[0]
    perm = list(attrs["perm"])
    if sorted(perm) != list(range(len(x.shape))):
        raise _fail(f"transpose perm {perm} is not a permutation of {len(x.shape)} axes")
    return TensorType(x.dtype, tuple(x.shape[p] for p in perm))


def _concat(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    first = ins[0]
    axis = _axis(attrs["axis"], len(first.shape))
    total = 0
    for t in ins:
        if t.dtype != first.dtype or len(t.shape) != len(first.shape):
            raise _fail(f"concat operands differ: {first} and {t}")
        if any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != axis):
            raise _fail(f"concat operands differ off axis {axis}: {first} and {t}")
        total += t.shape[axis]
    return TensorType(first.dtype, tuple(total if i == axis else d for i, d in enumerate(first.shape)))


def _slice(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x = ins[0]
    axis = _axis(attrs["axis"], len(x.shape))
    start, end = attrs["start"], attrs["end"]
    if not 0 <= start <= end <= x.shape[axis]:
        raise _fail(f"slice [{start}, {end}) out of range for axis {axis} of {x}")
    return TensorType(x.dtype, tuple(end - start if i == axis else d for i, d in enumerate(x.shape)))


def _cast(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    try:
        return TensorType(dtypes.check(attrs["dtype"]), ins[0].shape)
    except dtypes.DTypeError as e:
        raise _fail(str(e)) from e


def _constant(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    value = attrs["value"]
    if not isinstance(value, np.ndarray):
        raise _fail("constant value must be a tensor")
    return TensorType(dtypes.from_numpy(value.dtype), tuple(value.shape))


def _rope(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, pos = ins
    _float(x, "rope input")
    _integer(pos, "rope positions")
    if len(x.shape) != 3 or pos.shape != (x.shape[0],):
        raise _fail(f"rope wants x [seq, heads, head_dim] and positions [seq], got {x} and {pos}")
    rot = attrs["rotary_dim"] or x.shape[2]
    if rot % 2 or rot > x.shape[2]:
        raise _fail(f"rotary_dim {rot} must be even and <= head_dim {x.shape[2]}")
    if attrs["style"] not in ("half", "interleaved"):
        raise _fail(f"rope style must be 'half' or 'interleaved', got {attrs['style']!r}")
    inv_freq = attrs["inv_freq"]
    if inv_freq and len(inv_freq) != rot // 2:
        raise _fail(f"rope inv_freq has {len(inv_freq)} frequencies; rotary_dim {rot} wants {rot // 2}")
    if not all(math.isfinite(f) for f in (*inv_freq, attrs["scale"])):
        raise _fail("rope inv_freq and scale must be finite")
    return x


def _attention(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    q, k, v = ins[:3]
    _float_3d("attention", "[seq, heads, head_dim]", q=q, k=k, v=v)
    if k.shape != v.shape or q.dtype != k.dtype or k.dtype != v.dtype:
        raise _fail(f"attention k and v differ: {k} and {v}")
    if q.shape[2] != k.shape[2]:
        raise _fail(f"attention head_dim differs: q {q}, k {k}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise _fail(f"attention query heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    if attrs["causal"]:
        if len(ins) != 4:
            raise _fail("causal attention needs q_positions as its 4th input")
        _integer(ins[3], "q_positions")
        if ins[3].shape != (q.shape[0],):
            raise _fail(f"q_positions must be [{q.shape[0]}], got {ins[3]}")
    elif len(ins) != 3:
        raise _fail("non-causal attention takes exactly q, k, v")
    if attrs["window"] and not attrs["causal"]:
        raise _fail("a sliding window needs causal attention (it counts back from each query's position)")
    _window_softcap(attrs)
    return q


def _window_softcap(attrs: dict[str, Any]) -> None:
    if attrs["window"] < 0:
        raise _fail(f"attention window {attrs['window']} must be >= 0 (0: no window)")
    if not math.isfinite(attrs["softcap"]) or attrs["softcap"] < 0:
        raise _fail(f"attention softcap {attrs['softcap']} must be finite and >= 0 (0: no cap)")


def _kv_write(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    cache, rows, pos = ins
    if cache.dtype != rows.dtype or cache.shape[1:] != rows.shape[1:] or not cache.shape:
        raise _fail(f"kv_write rows {rows} do not fit cache {cache}")
    if rows.shape[0] > cache.shape[0]:
        raise _fail(f"kv_write of {rows.shape[0]} rows into a cache of {cache.shape[0]}")
    _integer(pos, "kv_write position")
    if pos.shape not in ((), (1,)):
        raise _fail(f"kv_write position must be a scalar or [1], got {pos}")
    return cache


def _kv_scatter(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    pool, rows, slots = ins
    if pool.dtype != rows.dtype or not pool.shape or pool.shape[1:] != rows.shape[1:]:
        raise _fail(f"kv_scatter rows {rows} do not fit pool {pool}")
    _integer(slots, "kv_scatter slots")
    if slots.shape != rows.shape[:1]:
        raise _fail(f"kv_scatter needs one slot per row: slots {slots} for rows {rows}")
    return pool


def _paged_attention(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    q, k_pool, v_pool, table, token_seq, positions = ins
    _float_3d("paged_attention", "[rows, heads, head_dim]", q=q, k_pool=k_pool, v_pool=v_pool)
    if k_pool.shape != v_pool.shape or q.dtype != k_pool.dtype or k_pool.dtype != v_pool.dtype:
        raise _fail(f"paged_attention pools differ: {k_pool} and {v_pool} (q {q})")
    if q.shape[2] != k_pool.shape[2] or k_pool.shape[1] == 0 or q.shape[1] % k_pool.shape[1]:
        raise _fail(f"paged_attention heads do not group: q {q}, pool {k_pool}")
    block = attrs["block_size"]
    if block < 1 or k_pool.shape[0] % block:
        raise _fail(f"pool of {k_pool.shape[0]} rows is not a whole number of blocks of {block}")
    for t, what in ((table, "block_table"), (token_seq, "token_seq"), (positions, "q_positions")):
        _integer(t, what)
    if len(table.shape) != 2 or token_seq.shape != (q.shape[0],) or positions.shape != (q.shape[0],):
        raise _fail(f"paged_attention wants block_table [seqs, blocks], token_seq and q_positions [{q.shape[0]}]; "
                    f"got {table}, {token_seq}, {positions}")
    if attrs["decode"] and table.shape[0] != q.shape[0]:
        raise _fail(f"a decode paged_attention has one query per sequence: {q.shape[0]} queries, {table.shape[0]} rows")
    _window_softcap(attrs)
    return q


def _top_k(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x = ins[0]
    if not x.shape or not 1 <= attrs["k"] <= x.shape[-1]:
        raise _fail(f"top_k k={attrs['k']} out of range for {x}")
    return TensorType("i64", (*x.shape[:-1], attrs["k"]))


def _take_along_axis(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, idx = ins
    _integer(idx, "indices")
    axis = _axis(attrs["axis"], len(x.shape))
    if len(idx.shape) != len(x.shape) or any(a != b for i, (a, b) in enumerate(zip(x.shape, idx.shape)) if i != axis):
        raise _fail(f"take_along_axis indices {idx} do not match {x} off axis {axis}")
    return TensorType(x.dtype, idx.shape)


def _grouped_matmul(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, w, ids = ins
    _float(x, "grouped_matmul input")
    _integer(ids, "expert ids")
    if len(x.shape) != 2 or len(w.shape) != 3 or ids.shape != (x.shape[0],) or w.shape[1] != x.shape[1]:
        raise _fail(f"grouped_matmul wants x [M,K], w [E,K,N], ids [M]; got {x}, {w}, {ids}")
    if w.dtype != x.dtype:
        raise _fail(f"grouped_matmul dtypes differ: {x} and {w}")
    return TensorType(x.dtype, (x.shape[0], w.shape[2]))


def _argmax(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x = ins[0]
    axis = _axis(attrs["axis"], len(x.shape))
    return TensorType("i64", tuple(d for i, d in enumerate(x.shape) if i != axis))


def _sample(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    logits, temperature, top_k, top_p, seed = ins
    _float(logits, "logits")
    if len(logits.shape) != 2:
        raise _fail(f"sample wants logits [batch, vocab], got {logits}")
    # One setting for every row (a scalar or [1]), or one per row ([batch]); see sample_row's draw rule.
    for t, want, what in ((temperature, "f32", "temperature"), (top_k, "i64", "top_k"),
                          (top_p, "f32", "top_p"), (seed, "i64", "seed")):
        if t.dtype != want or t.shape not in ((), (1,), (logits.shape[0],)):
            raise _fail(f"sample {what} must be a {want} scalar or [{logits.shape[0]}], got {t}")
    return TensorType("i64", (logits.shape[0],))


# GGUF block layouts: (elements per block, bytes per block); the K-quants' super-blocks of 256
QUANT_BLOCKS: dict[str, tuple[int, int]] = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "q4_k": (256, 144),
                                            "q6_k": (256, 210)}


# How dequant_matmul multiplies: "f32", x by the weight's exact dequantized values; "q8", x's rows quantized to int8
# in blocks of 32 first (d = amax / 127, codes rounded to the nearest even), each block's dot product with q4_0, q4_1
# or q8_0 codes exact in integers and scaled by d_w * d_x (plus q4_1's min times d_x * sum(codes)): llama.cpp's
# arithmetic for those blocks. Other schemes multiply f32 rows either way.
ACTIVATIONS = ("f32", "q8")
Q8_SCHEMES = ("q4_0", "q4_1", "q8_0")


def q8_rows(scheme: str, activations: str) -> bool:
    """Whether a dequant_matmul over `scheme` blocks quantizes its rows to int8 (see ACTIVATIONS)."""
    return activations == "q8" and scheme in Q8_SCHEMES


def packed_shape(scheme: str, n: int, k: int) -> tuple[int, int]:
    block, size = QUANT_BLOCKS[scheme]
    return (n, k // block * size)


def _dequant_matmul(ins: list[TensorType], attrs: dict[str, Any]) -> TensorType:
    x, packed = ins
    scheme, n, k = attrs["scheme"], attrs["n"], attrs["k"]
    if scheme not in QUANT_BLOCKS:
        raise _fail(f"unknown quantization scheme {scheme!r}; expected one of {sorted(QUANT_BLOCKS)}")
    _float(x, "dequant_matmul input")
    if not x.shape or x.shape[-1] != k:
        raise _fail(f"dequant_matmul input {x} does not end in k={k}")
    if k % QUANT_BLOCKS[scheme][0]:
        raise _fail(f"k={k} is not a multiple of the {scheme} block size")
    if packed.dtype != "u8" or packed.shape != packed_shape(scheme, n, k):
        raise _fail(f"packed {scheme} weight for [{n}, {k}] must be u8{list(packed_shape(scheme, n, k))}, got {packed}")
    if attrs["activations"] not in ACTIVATIONS:
        raise _fail(f"dequant_matmul activations must be one of {ACTIVATIONS}, got {attrs['activations']!r}")
    if attrs["activations"] == "q8" and x.dtype != "f32":
        raise _fail(f"dequant_matmul with int8 activations takes f32 rows, got {x}")
    return TensorType(x.dtype, (*x.shape[:-1], n))


_F = Attr("float")
UNARY = ("neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "silu")
BINARY = ("add", "sub", "mul", "div", "pow")

SPECS: dict[str, OpSpec] = {}


def _register(*specs: OpSpec) -> None:
    for s in specs:
        SPECS[s.name] = s


_register(
    *(OpSpec(name, 1, 1, _unary) for name in UNARY),
    OpSpec("gelu", 1, 1, _gelu, {"approximate": Attr("str", "none")}),
    *(OpSpec(name, 2, 2, _binary) for name in BINARY),
    OpSpec("matmul", 2, 2, _matmul, {"transpose_a": Attr("bool", False), "transpose_b": Attr("bool", False)}),
    OpSpec("sum", 1, 1, _reduce, {"axes": Attr("ints", ()), "keepdims": Attr("bool", False)}),
    OpSpec("mean", 1, 1, _reduce_float, {"axes": Attr("ints", ()), "keepdims": Attr("bool", False)}),
    OpSpec("max", 1, 1, _reduce, {"axes": Attr("ints", ()), "keepdims": Attr("bool", False)}),
    OpSpec("softmax", 1, 1, _softmax, {"axis": Attr("int", -1)}),
    OpSpec("layer_norm", 3, 3, _layer_norm, {"eps": Attr("float", 1e-5)}),
    OpSpec("rms_norm", 2, 2, _layer_norm, {"eps": Attr("float", 1e-6)}),
    OpSpec("gather", 2, 2, _gather, {"axis": Attr("int", 0)}),
    OpSpec("reshape", 1, 1, _reshape, {"shape": Attr("ints")}),
    OpSpec("transpose", 1, 1, _transpose, {"perm": Attr("ints")}),
    OpSpec("concat", 1, -1, _concat, {"axis": Attr("int", 0)}),
    OpSpec("slice", 1, 1, _slice, {"axis": Attr("int"), "start": Attr("int"), "end": Attr("int")}),
    OpSpec("cast", 1, 1, _cast, {"dtype": Attr("dtype")}),
    OpSpec("constant", 0, 0, _constant, {"value": Attr("tensor")}),
    # inv_freq (empty: theta ** (-2i / rotary_dim)) and scale (multiplies cos and sin) carry the scaled variants
    # (llama3, linear, YaRN, longrope), made on the host from the model's config (graphmesh.models.rope).
    OpSpec("rope", 2, 2, _rope, {"theta": Attr("float", 10000.0), "style": Attr("str", "half"),
                                 "rotary_dim": Attr("int", 0), "inv_freq": Attr("floats", ()),
                                 "scale": Attr("float", 1.0)}),
    # window: a query at position p sees keys at positions p - window < j <= p (0: every key up to p), as
    # transformers' sliding-window mask; softcap: scores (after scale) become softcap * tanh(score / softcap)
    # before the mask and softmax (Gemma 2), 0: none.
    OpSpec("attention", 3, 4, _attention, {"causal": Attr("bool", True), "scale": Attr("float", 0.0),
                                           "window": Attr("int", 0), "softcap": Attr("float", 0.0)}),
    OpSpec("kv_write", 3, 3, _kv_write),
    OpSpec("kv_scatter", 3, 3, _kv_scatter),
    OpSpec("paged_attention", 6, 6, _paged_attention, {"block_size": Attr("int"), "scale": Attr("float", 0.0),
                                                       "decode": Attr("bool", False), "window": Attr("int", 0),
                                                       "softcap": Attr("float", 0.0)}),
    OpSpec("top_k", 1, 1, _top_k, {"k": Attr("int")}),
    OpSpec("take_along_axis", 2, 2, _take_along_axis, {"axis": Attr("int", -1)}),
    OpSpec("grouped_matmul", 3, 3, _grouped_matmul),
    OpSpec("argmax", 1, 1, _argmax, {"axis": Attr("int", -1)}),
    OpSpec("sample", 5, 5, _sample),
    OpSpec("dequant_matmul", 2, 2, _dequant_matmul, {"scheme": Attr("str"), "n": Attr("int"), "k": Attr("int"),
                                                     "activations": Attr("str", "f32")}),
)

_KIND_CHECK: dict[str, Callable[[Any], bool]] = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "ints": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v),
    "floats": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v),
    "dtype": lambda v: isinstance(v, str),
    "tensor": lambda v: isinstance(v, np.ndarray),
}


def resolve_attrs(op: str, attrs: dict[str, Any]) -> dict[str, Any]:
    """Checks attributes against the spec and fills in defaults."""
    spec = SPECS.get(op)
    if spec is None:
        raise _fail(f"unknown op {op!r}")
    unknown = set(attrs) - set(spec.attrs)
    if unknown:
        raise _fail(f"op {op!r} has no attribute(s) {sorted(unknown)}; it takes {sorted(spec.attrs) or 'none'}")
    out: dict[str, Any] = {}
    for name, attr in spec.attrs.items():
        if name not in attrs:
            if attr.required:
                raise _fail(f"op {op!r} needs attribute {name!r} ({attr.kind})")
            out[name] = attr.default
            continue
        value = attrs[name]
        if not _KIND_CHECK[attr.kind](value):
            raise _fail(f"op {op!r} attribute {name!r} must be {attr.kind}, got {value!r}")
        out[name] = float(value) if attr.kind == "float" else tuple(value) if attr.kind in ("ints", "floats") else value
    return out


def infer(op: str, inputs: Sequence[TensorType], attrs: dict[str, Any]) -> TensorType:
    """Type of the result of `op` on `inputs`; raises OpError naming what is wrong."""
    spec = SPECS.get(op)
    if spec is None:
        raise _fail(f"unknown op {op!r}")
    n = len(inputs)
    if n < spec.min_inputs or (spec.max_inputs >= 0 and n > spec.max_inputs):
        want = f"{spec.min_inputs}" if spec.min_inputs == spec.max_inputs else (
            f"{spec.min_inputs}+" if spec.max_inputs < 0 else f"{spec.min_inputs}-{spec.max_inputs}")
        raise _fail(f"op {op!r} takes {want} inputs, got {n}")
    return spec.infer(list(inputs), attrs)
