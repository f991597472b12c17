"""mlx backend against the numpy reference: every op on random inputs, then a Llama-style block decoding."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from graphmesh import dtypes  # noqa: E402
from graphmesh.errors import InvalidArgument, OutOfRange  # noqa: E402
from graphmesh.graph import GraphBuilder, parse  # noqa: E402
from graphmesh.ops import SPECS, packed_shape  # noqa: E402
from graphmesh_executor.backends import compile_graph  # noqa: E402
from graphmesh_executor.backends.mlx_backend import TOLERANCES, MlxExecutable, launch_env, repack  # noqa: E402
from graphmesh_executor.backends.numpy_backend import dequantize  # noqa: E402
from graphmesh_executor.executable import Executable, RngOptions  # noqa: E402

rng = np.random.default_rng(7)


def rand(shape: tuple[int, ...], dtype: str = "f32", low: float | None = None, high: float = 1.0) -> np.ndarray:
    x = rng.standard_normal(shape) if low is None else rng.uniform(low, high, shape)
    return x.astype(dtypes.to_numpy(dtype))


def ints(shape: tuple[int, ...], high: int, dtype: str = "i64") -> np.ndarray:
    return rng.integers(0, high, shape).astype(dtypes.to_numpy(dtype))


def gguf_blocks(scheme: str, n: int, k: int) -> np.ndarray:
    """Random but well-formed GGUF blocks: finite f16 scales, any quant bits."""
    nb = k // 32
    d = rng.uniform(0.001, 0.05, (n, nb, 1)).astype(np.float16).view(np.uint8)
    if scheme == "q8_0":
        return np.concatenate([d, rng.integers(0, 256, (n, nb, 32)).astype(np.uint8)], -1).reshape(packed_shape(scheme, n, k))
    qs = rng.integers(0, 256, (n, nb, 16)).astype(np.uint8)
    if scheme == "q4_0":
        return np.concatenate([d, qs], -1).reshape(packed_shape(scheme, n, k))
    m = rng.uniform(-0.1, 0.1, (n, nb, 1)).astype(np.float16).view(np.uint8)
    return np.concatenate([d, m, qs], -1).reshape(packed_shape(scheme, n, k))


def build(op: str, inputs: list[np.ndarray], **attrs: Any) -> Any:
    g = GraphBuilder(op)
    values = [g.input(f"x{i}", a.shape, dtypes.from_numpy(a.dtype)) for i, a in enumerate(inputs)]
    g.output(g.node(op, values, **attrs))
    return parse(g.build())


def run_both(op: str, inputs: list[np.ndarray], **attrs: Any) -> tuple[np.ndarray, np.ndarray]:
    graph = build(op, inputs, **attrs)
    feed = {f"x{i}": a for i, a in enumerate(inputs)}
    want = compile_graph(graph, "numpy").run(feed, typed=True)[0]
    got = compile_graph(graph, "mlx").run(feed, typed=True)[0]
    return want, got


def assert_matches(want: np.ndarray, got: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    name = dtypes.from_numpy(want.dtype)
    if name in TOLERANCES:
        rtol, atol = TOLERANCES[name]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)
    else:
        np.testing.assert_array_equal(got, want)


S, H, HKV, D = 5, 4, 2, 16
BLOCK = 4
TABLE = np.array([[5, 1, 3], [0, 2, 4]])  # two sequences' blocks in a pool of 6 blocks of BLOCK rows


def paged(dt: str, decode: bool) -> list[np.ndarray]:
    """paged_attention inputs: a 3-token prompt chunk of sequence 0 and a decode of sequence 1, or (decode) one
    query per sequence; q, then the K and V pools, block table, each query's sequence and position."""
    token_seq, pos = (np.array([0, 1]), np.array([6, 11])) if decode else (np.array([0, 0, 0, 1]), np.array([4, 5, 6, 9]))
    pools = [rand((6 * BLOCK, HKV, D), dt) for _ in range(2)]
    return [rand((len(pos), H, D), dt), *pools, TABLE, token_seq, pos]


CASES: list[tuple[str, Any, dict[str, Any]]] = [
    *((name, lambda dt: [rand((3, 7), dt)], {}) for name in ("neg", "exp", "tanh", "sigmoid", "relu", "silu")),
    *((name, lambda dt: [rand((3, 7), dt, 0.1, 4.0)], {}) for name in ("log", "sqrt", "rsqrt")),
    ("gelu", lambda dt: [rand((3, 7), dt)], {"approximate": "none"}),
    ("gelu", lambda dt: [rand((3, 7), dt)], {"approximate": "tanh"}),
    *((name, lambda dt: [rand((3, 7), dt), rand((7,), dt)], {}) for name in ("add", "sub", "mul")),
    ("div", lambda dt: [rand((3, 7), dt), rand((3, 1), dt, 0.5, 2.0)], {}),
    ("pow", lambda dt: [rand((3, 7), dt, 0.1, 3.0), rand((3, 7), dt, -2.0, 2.0)], {}),
    ("matmul", lambda dt: [rand((2, 6, 24), dt), rand((24, 9), dt)], {}),
    ("matmul", lambda dt: [rand((24, 6), dt), rand((2, 9, 24), dt)], {"transpose_a": True, "transpose_b": True}),
    ("sum", lambda dt: [rand((3, 4, 5), dt)], {"axes": (0, 2)}),
    ("mean", lambda dt: [rand((3, 4, 5), dt)], {"axes": (-1,), "keepdims": True}),
    ("max", lambda dt: [rand((3, 4, 5), dt)], {}),
    ("softmax", lambda dt: [rand((3, 11), dt) * 4], {"axis": 0}),
    ("layer_norm", lambda dt: [rand((4, 32), dt), rand((32,), dt), rand((32,), dt)], {"eps": 1e-5}),
    ("rms_norm", lambda dt: [rand((4, 32), dt), rand((32,), dt)], {"eps": 1e-6}),
    ("gather", lambda dt: [rand((10, 6), dt), ints((2, 3), 10)], {}),
    ("gather", lambda dt: [rand((4, 10), dt), ints((3,), 10, "i32")], {"axis": 1}),
    ("reshape", lambda dt: [rand((4, 6), dt)], {"shape": (2, -1, 3)}),
    ("transpose", lambda dt: [rand((2, 3, 4), dt)], {"perm": (2, 0, 1)}),
    ("concat", lambda dt: [rand((2, 3), dt), rand((4, 3), dt), rand((1, 3), dt)], {"axis": 0}),
    ("slice", lambda dt: [rand((4, 9), dt)], {"axis": 1, "start": 2, "end": 7}),
    ("cast", lambda dt: [rand((4, 5), dt) * 3], {"dtype": "i32"}),
    ("cast", lambda dt: [rand((4, 5), dt)], {"dtype": "f16"}),
    ("cast", lambda dt: [ints((4, 5), 9)], {"dtype": "f64"}),
    ("rope", lambda dt: [rand((S, H, D), dt), ints((S,), 5000)], {"style": "half"}),
    ("rope", lambda dt: [rand((S, H, D), dt), ints((S,), 5000)], {"style": "interleaved", "rotary_dim": 8,
                                                                  "theta": 500000.0}),
    ("attention", lambda dt: [rand((S, H, D), dt), rand((8, HKV, D), dt), rand((8, HKV, D), dt),
                              np.array([2, 3, 4, 5, 6])], {}),
    ("attention", lambda dt: [rand((S, H, D), dt), rand((8, HKV, D), dt), rand((8, HKV, D), dt),
                              np.array([6, 0, 3, 1, 2], np.int32)], {"scale": 0.3}),
    ("attention", lambda dt: [rand((S, H, D), dt), rand((7, H, D), dt), rand((7, H, D), dt)], {"causal": False}),
    ("kv_write", lambda dt: [rand((8, HKV, D), dt), rand((3, HKV, D), dt), np.array(4)], {}),
    ("kv_write", lambda dt: [rand((8, HKV, D), dt), rand((1, HKV, D), dt), np.array([7], np.int32)], {}),
    ("kv_scatter", lambda dt: [rand((12, HKV, D), dt), rand((3, HKV, D), dt), np.array([7, 0, 11])], {}),
    ("kv_scatter", lambda dt: [rand((6, 8), dt), rand((6, 8), dt), np.array([5, 4, 3, 2, 1, 0], np.int32)], {}),
    ("paged_attention", lambda dt: paged(dt, False), {"block_size": BLOCK}),
    ("paged_attention", lambda dt: paged(dt, True), {"block_size": BLOCK, "decode": True, "scale": 0.3}),
    ("top_k", lambda dt: [rand((3, 40), dt)], {"k": 5}),
    ("take_along_axis", lambda dt: [rand((3, 8), dt), ints((3, 4), 8)], {"axis": 1}),
    ("grouped_matmul", lambda dt: [rand((7, 12), dt), rand((4, 12, 5), dt), np.array([3, 0, 3, 1, 0, 3, 2])], {}),
    ("argmax", lambda dt: [rand((3, 9, 4), dt)], {"axis": 1}),
    *(("dequant_matmul", lambda dt, s=s: [rand((3, 64), dt), gguf_blocks(s, 24, 64)], {"scheme": s, "n": 24, "k": 64})
      for s in ("q4_0", "q4_1", "q8_0")),
]
# integer arithmetic, including numpy's truncating integer division
INT_CASES: list[tuple[str, list[np.ndarray], dict[str, Any]]] = [
    ("add", [ints((4, 5), 100) - 50, ints((5,), 100) - 50], {}),
    ("mul", [ints((4, 5), 100, "i32"), ints((4, 5), 100, "i32")], {}),
    ("div", [ints((4, 5), 200) - 100, ints((4, 5), 9) + 1], {}),
    ("div", [np.array([7, -7, 6, -6, 2**40 + 1]), np.array([2, 2, -4, -4, 3])], {}),
    ("pow", [ints((4, 5), 6, "i32"), ints((4, 5), 4, "i32")], {}),
    ("sum", [ints((4, 5), 100)], {"axes": (1,)}),
    ("max", [ints((4, 5), 100, "i32")], {"keepdims": True}),
    ("top_k", [np.array([[3, 1, 3, 2, 3, 1]])], {"k": 4}),  # ties: lowest index first, as numpy's stable sort
    ("argmax", [np.array([[1.0, 5.0, 5.0, 2.0]], np.float32)], {}),
]


def test_every_op_is_covered() -> None:
    assert {op for op, _, _ in CASES} == set(SPECS) - {"constant", "sample"}  # those two have their own tests
    assert set(MlxExecutable.kernels) == set(SPECS)


@pytest.mark.parametrize("op,make,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("dt", ["f32", "f64", "f16", "bf16"])
def test_op_matches_numpy(op: str, make: Any, attrs: dict[str, Any], dt: str) -> None:
    want, got = run_both(op, make(dt), **attrs)
    assert_matches(want, got)


@pytest.mark.parametrize("op,inputs,attrs", INT_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(INT_CASES)])
def test_integer_op_matches_numpy(op: str, inputs: list[np.ndarray], attrs: dict[str, Any]) -> None:
    want, got = run_both(op, inputs, **attrs)
    assert_matches(want, got)


def test_constant_and_scalar_lifting() -> None:
    g = GraphBuilder("c")
    x = g.input("x", (2, 3), "f64")
    g.output(g.add(g.mul(x, 0.1), g.constant(np.arange(3, dtype=np.float64) / 3)))
    graph = parse(g.build())
    feed = {"x": rand((2, 3), "f64")}
    want = compile_graph(graph, "numpy").run(feed, typed=True)[0]
    got = compile_graph(graph, "mlx").run(feed, typed=True)[0]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-14)  # pure f64 arithmetic is exact on mlx-cpu


def test_rope_at_long_positions_keeps_float64_angles() -> None:
    # mx.fast.rope forms angles in f32 and misses by ~2e-3 here; the written-out rope must not
    x = rand((4, 2, 64))
    want, got = run_both("rope", [x, np.array([8191, 30000, 65535, 5])])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_attention_never_reads_cache_rows_past_the_last_query() -> None:
    # rows from max(q_positions)+1 on are stale or unwritten cache: NaN there must not leak through a 0 weight
    k, v = rand((8, HKV, D)), rand((8, HKV, D))
    k[5:], v[5:] = np.nan, np.inf
    want, got = run_both("attention", [rand((2, H, D)), k, v, np.array([3, 4])])
    assert np.isfinite(got).all()
    assert_matches(want, got)


@pytest.mark.parametrize("op,inputs,attrs", [
    ("gather", [rand((5, 3)), np.array([1, 5])], {}),
    ("gather", [rand((5, 3)), np.array([-1])], {}),
    ("take_along_axis", [rand((2, 3)), np.array([[0], [3]])], {}),
    ("grouped_matmul", [rand((2, 4)), rand((2, 4, 3)), np.array([0, 2])], {}),
    ("kv_write", [rand((4, 2)), rand((2, 2)), np.array(3)], {}),
    ("kv_scatter", [rand((4, 2)), rand((2, 2)), np.array([0, 4])], {}),
    ("paged_attention", [rand((1, H, D)), rand((8, HKV, D)), rand((8, HKV, D)), np.array([[0, 2]]), np.array([0]),
                         np.array([5])], {"block_size": BLOCK}),  # block 2 of a pool of 2
    ("paged_attention", [rand((1, H, D)), rand((8, HKV, D)), rand((8, HKV, D)), np.array([[0, 1]]), np.array([0]),
                         np.array([8])], {"block_size": BLOCK, "decode": True}),  # position past the table
])
def test_out_of_range_indices_raise_like_numpy(op: str, inputs: list[np.ndarray], attrs: dict[str, Any]) -> None:
    graph = build(op, inputs, **attrs)
    feed = {f"x{i}": a for i, a in enumerate(inputs)}
    for backend in ("numpy", "mlx"):
        with pytest.raises(OutOfRange):
            compile_graph(graph, backend).run(feed)


def test_sample_draws_the_same_token_as_numpy() -> None:
    g = GraphBuilder("s")
    logits = g.input("logits", (3, 50))
    g.output(g.sample(logits, g.input("t", (), "f32"), g.input("k", (), "i64"), g.input("p", (), "f32"),
                      g.input("seed", (), "i64")))
    graph = parse(g.build())
    for temperature, top_k, top_p in ((0.0, 0, 1.0), (0.8, 10, 0.9), (1.3, 0, 1.0)):
        for draw in range(5):
            feed = {"logits": rand((3, 50)) * 3, "t": np.array(temperature, np.float32), "k": np.array(top_k),
                    "p": np.array(top_p, np.float32), "seed": np.array(draw)}
            outs = []
            for backend in ("numpy", "mlx"):
                exe = compile_graph(graph, backend)
                exe.set_rng(RngOptions(seed=11))
                outs.append(exe.run(feed, typed=True)[0])
            np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("scheme", ["q4_0", "q4_1", "q8_0"])
def test_repack_reproduces_gguf_blocks_in_mlx_affine_layout(scheme: str) -> None:
    n, k = 16, 96
    packed = gguf_blocks(scheme, n, k)
    w, scales, biases, bits = repack(packed, scheme, n, k)
    dense = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=bits))
    np.testing.assert_array_equal(dense, dequantize(packed, scheme, n, k))  # bit-exact
    x = rand((2, k))
    y = np.array(mx.quantized_matmul(mx.array(x), w, scales, biases, transpose=True, group_size=32, bits=bits))
    np.testing.assert_allclose(y, x.astype(np.float64) @ dequantize(packed, scheme, n, k).T.astype(np.float64),
                               rtol=1e-5, atol=1e-5)


def test_dequant_param_cache_follows_the_param() -> None:
    n, k = 8, 64
    g = GraphBuilder("dq")
    x = g.input("x", (1, k))
    g.output(g.dequant_matmul(x, g.param("w", packed_shape("q4_1", n, k), "u8"), "q4_1", n, k))
    exe = compile_graph(parse(g.build()), "mlx")
    feed = {"x": rand((1, k))}
    for _ in range(3):  # a replaced param must never be served from the old one's cache entry
        packed = gguf_blocks("q4_1", n, k)
        exe.set_param_typed("w", packed)
        got = exe.run(feed)[0]
        np.testing.assert_allclose(got, feed["x"] @ dequantize(packed, "q4_1", n, k).T, rtol=1e-5, atol=1e-5)


def test_kv_write_leaves_its_input_untouched() -> None:
    # kv_write may update in place only when nothing else holds the cache; a bound handle read back must not change
    g = GraphBuilder("kv")
    cache = g.input("cache", (6, 2))
    g.output(g.kv_write(cache, g.input("rows", (1, 2)), g.input("pos", (), "i64")))
    exe = compile_graph(parse(g.build()), "mlx")
    before = rand((6, 2))
    exe.bind_handle("cache", before)
    out = exe.run({"rows": np.ones((1, 2), np.float32), "pos": np.array(2)})[0]
    np.testing.assert_array_equal(exe.read_handle("cache"), before)
    assert np.array_equal(out[2], [1, 1]) and np.array_equal(np.delete(out, 2, 0), np.delete(before, 2, 0))


def test_fed_kv_write_in_place_keeps_other_readers_of_the_old_cache() -> None:
    # The fed handle is written in place only when kv_write is its one reader; here `sum` reads it too, after
    # kv_write in the plan, and must see the old rows. Then, with sampling forcing evaluation mid-run, the fed
    # handle must still advance exactly as numpy's.
    g = GraphBuilder("kvr")
    cache, rows, pos = g.input("past_k_0", (6, 2)), g.input("rows", (1, 2)), g.input("pos", (), "i64")
    written = g.kv_write(cache, rows, pos)
    g.output(g.sum(g.mul(written, 1.0)), written, g.sum(cache))
    graphs = [parse(g.build())]
    g = GraphBuilder("kvs")
    cache, rows, pos = g.input("past_k_0", (6, 2)), g.input("rows", (1, 2)), g.input("pos", (), "i64")
    written = g.kv_write(cache, rows, pos)
    logits = g.reshape(g.sum(written, axes=(1,)), (1, 6))
    token = g.sample(logits, g.input("t", (), "f32"), g.input("k", (), "i64"), g.input("p", (), "f32"),
                     g.input("seed", (), "i64"))
    g.output(token, written)
    graphs.append(parse(g.build()))
    for graph in graphs:
        start = rand((6, 2))
        exes = {b: compile_graph(graph, b) for b in ("numpy", "mlx")}
        for exe in exes.values():
            exe.bind_handle("past_k_0", start)
            exe.set_handle_feed("past_k_0", 1)
        for step in range(4):
            feed = {"rows": rand((1, 2)), "pos": np.array(step), "t": np.array(0.7, np.float32), "k": np.array(0),
                    "p": np.array(1.0, np.float32), "seed": np.array(step)}
            feed = {k: v for k, v in feed.items() if k in graph.inputs}
            want, got = (exes[b].run(feed, typed=True) for b in ("numpy", "mlx"))
            for w, o in zip(want, got):
                np.testing.assert_allclose(o, w, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(exes["mlx"].read_handle("past_k_0"), exes["numpy"].read_handle("past_k_0"))


def test_devices() -> None:
    graph = build("neg", [rand((2,))])
    with pytest.raises(InvalidArgument):
        MlxExecutable(graph, "cuda:0")
    if not mx.is_available(mx.gpu):
        with pytest.raises(Exception, match="no GPU"):
            MlxExecutable(graph, "metal")


# -- a Llama-style block ---------------------------------------------------------------------------------------
E, F, V, CACHE = 32, 48, 40, 16


def llama_block(seq: int) -> Any:
    """One decoder layer plus head: rms_norm, q/k/v/o and MLP matmuls with transpose_b, rope, GQA attention over
    KV handles written by kv_write. Outputs: logits, past_k_0, past_v_0 (the stage's feed layout)."""
    g = GraphBuilder(f"block{seq}")
    tokens, positions = g.input("tokens", (seq,), "i64"), g.input("positions", (seq,), "i64")
    start = g.input("start", (), "i64")
    past_k, past_v = g.input("past_k_0", (CACHE, HKV, D)), g.input("past_v_0", (CACHE, HKV, D))
    p = {name: g.param(name, shape) for name, shape in (
        ("emb", (V, E)), ("ln1", (E,)), ("wq", (H * D, E)), ("wk", (HKV * D, E)), ("wv", (HKV * D, E)),
        ("wo", (E, H * D)), ("ln2", (E,)), ("gate", (F, E)), ("up", (F, E)), ("down", (E, F)), ("lnf", (E,)),
        ("head", (V, E)))}
    h = g.gather(p["emb"], tokens)
    n = g.rms_norm(h, p["ln1"], eps=1e-5)
    q = g.rope(g.reshape(g.matmul(n, p["wq"], transpose_b=True), (seq, H, D)), positions)
    k = g.rope(g.reshape(g.matmul(n, p["wk"], transpose_b=True), (seq, HKV, D)), positions)
    v = g.reshape(g.matmul(n, p["wv"], transpose_b=True), (seq, HKV, D))
    kc, vc = g.kv_write(past_k, k, start), g.kv_write(past_v, v, start)
    att = g.reshape(g.attention(q, kc, vc, positions), (seq, H * D))
    h = g.add(h, g.matmul(att, p["wo"], transpose_b=True))
    n = g.rms_norm(h, p["ln2"], eps=1e-5)
    mlp = g.mul(g.silu(g.matmul(n, p["gate"], transpose_b=True)), g.matmul(n, p["up"], transpose_b=True))
    h = g.add(h, g.matmul(mlp, p["down"], transpose_b=True))
    g.output(g.matmul(g.rms_norm(h, p["lnf"], eps=1e-5), p["head"], transpose_b=True), kc, vc)
    return parse(g.build())


def prepared(graph: Any, backend: str, weights: dict[str, np.ndarray]) -> Executable[Any]:
    exe = compile_graph(graph, backend)
    for name, value in weights.items():
        exe.set_param(name, value)
    assert exe.finalize_params() == []
    exe.set_handle_feed("past_k_0", 1)
    exe.set_handle_feed("past_v_0", 2)
    return exe


def test_llama_block_prefill_then_decode_matches_numpy() -> None:
    prefill, decode = llama_block(4), llama_block(1)
    weights = {name: rand(t.shape) * (0.3 if name.startswith("ln") else 0.2) + (1.0 if name.startswith("ln") else 0.0)
               for name, t in prefill.params.items()}
    exes = {b: (prepared(prefill, b, weights), prepared(decode, b, weights)) for b in ("numpy", "mlx")}
    prompt = np.array([3, 17, 8, 30])
    logits = {}
    for b, (pre, _) in exes.items():
        logits[b] = pre.run({"tokens": prompt, "positions": np.arange(4), "start": np.array(0)}, read_indices=[0])[0]
    np.testing.assert_allclose(logits["mlx"], logits["numpy"], rtol=1e-4, atol=1e-4)
    for pre, dec in exes.values():  # hand the prefilled KV to the decode executable, as a bucket change would
        dec.bind_handle("past_k_0", pre.read_handle("past_k_0"), resident=True)
        dec.bind_handle("past_v_0", pre.read_handle("past_v_0"), resident=True)
    token = int(np.argmax(logits["numpy"][-1]))
    for pos in range(4, 10):
        feed = {"tokens": np.array([token]), "positions": np.array([pos]), "start": np.array(pos)}
        for b, (_, dec) in exes.items():
            logits[b] = dec.run(feed, read_indices=[0])[0]
        np.testing.assert_allclose(logits["mlx"], logits["numpy"], rtol=1e-4, atol=1e-4)
        for name in ("past_k_0", "past_v_0"):
            np.testing.assert_allclose(exes["mlx"][1].read_handle(name), exes["numpy"][1].read_handle(name),
                                       rtol=1e-5, atol=1e-5)
        token = int(np.argmax(logits["numpy"][0]))
    assert np.abs(exes["mlx"][1].read_handle("past_k_0")[10:]).max() == 0.0  # rows past the sequence untouched


AVX512 = "fpu sse2 avx2 fma avx512f avx512bw avx512dq avx512vl"


@pytest.mark.parametrize("libs,flags,want", [
    ("blis,openblas", AVX512, {"LD_PRELOAD": "blis", "BLIS_ARCH_TYPE": "skx"}),
    ("blis", "fpu sse2 avx2 fma", {"LD_PRELOAD": "blis"}),  # BLIS identifies CPUs without AVX-512 itself
    ("openblas", AVX512, {"LD_PRELOAD": "openblas", "OPENBLAS_CORETYPE": "SkylakeX"}),
    ("openblas", "fpu sse2 avx2 fma avx512f", {"LD_PRELOAD": "openblas", "OPENBLAS_CORETYPE": "Haswell"}),
    ("openblas", "fpu sse2", {"LD_PRELOAD": "openblas"}),
    ("", AVX512, {}),
])
def test_launch_env_preloads_a_blas_and_names_its_kernels(tmp_path: Any, libs: str, flags: str,
                                                          want: dict[str, str]) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: {flags}\n")
    paths = {name: str(tmp_path / f"lib{name}.so") for name in ("blis", "openblas")}
    for name in filter(None, libs.split(",")):
        (tmp_path / f"lib{name}.so").write_bytes(b"")
    env = launch_env(str(cpuinfo), blis=paths["blis"], openblas=paths["openblas"])
    assert env == {k: paths.get(v, v) for k, v in want.items()}
