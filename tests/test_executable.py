"""The ExecutableGraph trait through the Python Executable, on every available backend (no gRPC).

Params, handles and feeds, resident KV row copies, RNG policy, MoE residency accounting, and the
bad inputs: each raises its graphmesh.errors type and leaves the executable as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from graphmesh import dtypes
from graphmesh.errors import FailedPrecondition, GraphmeshError, InvalidArgument, NotFound, OutOfRange
from graphmesh.graph import GraphBuilder, Value, parse
from graphmesh.ops import packed_shape
from graphmesh_executor.backends import compile_graph
from graphmesh_executor.executable import Executable, MoeStats, RngOptions
from tests.conftest import backend_targets

BACKENDS = backend_targets()
BF16 = dtypes.to_numpy("bf16")
Exe = Executable[Any]

rng = np.random.default_rng(7)


def compile_(target: str, g: GraphBuilder) -> Exe:
    name, _, device = target.partition(":")
    return compile_graph(parse(g.build()), name, device or "cpu")


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# -- a small graph with params of every kind and a KV-style handle --------------------------------------
def basic(backend: str) -> Exe:
    """y = x @ w + bias (f16 param); cache = kv_write(past, x[0:1], pos); plus typed params passed through."""
    g = GraphBuilder("basic")
    x, past, pos = g.input("x", (2, 3)), g.input("past", (4, 3)), g.input("pos", (1,), "i64")
    w, bias = g.param("w", (3, 3)), g.param("bias", (3,), "f16")
    y = g.add(g.matmul(x, w), g.cast(bias, "f32"))
    cache = g.kv_write(past, g.slice(x, 0, 0, 1), pos)
    g.output(y, cache, g.param("pb", (2,), "bf16"), g.param("pi", (2,), "i32"), g.param("pu", (4,), "u8"))
    return compile_(backend, g)


X = f32(2, 3)
W = f32(3, 3)
BIAS = np.array([0.5, -1.0, 2.0], np.float16)


def loaded(backend: str) -> Exe:
    ex = basic(backend)
    ex.set_param("w", W)
    ex.set_param("bias", BIAS.astype(np.float32))
    return ex


def probe(ex: Exe) -> np.ndarray:
    """The y output on fixed inputs, from a clone (it shares params, not handles or outputs)."""
    return ex.clone().run({"x": X, "pos": np.array([0])}, read_indices=[0])[0]


def state(ex: Exe) -> dict[str, Any]:
    """Everything a failed call must leave as it was."""
    return {"y": probe(ex), "handles": {n: ex.read_handle(n) for n in ex.graph.inputs if ex.has_handle(n)[0]},
            "resident": {n: ex.has_handle(n) for n in ex.graph.inputs}, "missing": ex.finalize_params(),
            "feeds": (dict(ex._prefix_feeds), dict(ex._row_feeds)), "extent": ex._extent, "rng": ex.rng()}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "y":
            np.testing.assert_array_equal(a[key], b[key])
        elif key == "handles":
            assert a[key].keys() == b[key].keys()
            for name in a[key]:
                np.testing.assert_array_equal(a[key][name], b[key][name])
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_param_casts_and_set_param_typed_keeps_dtype(backend: str) -> None:
    ex = loaded(backend)
    assert ex.finalize_params() == ["pb", "pi", "pu"]
    ex.set_param("pb", np.array([1.5, -3.0], np.float32))
    ex.set_param_typed("pi", np.array([7, -9], np.int32))
    ex.set_param_typed("pu", np.array([0, 1, 200, 255], np.uint8))
    assert ex.finalize_params() == []
    y, cache, pb, pi, pu = ex.run({"x": X, "pos": np.array([1])}, typed=True)
    np.testing.assert_allclose(y, X.astype(np.float64) @ W + BIAS, rtol=1e-5, atol=1e-5)
    assert pb.dtype == BF16 and pi.dtype == np.int32 and pu.dtype == np.uint8 and cache.dtype == np.float32
    np.testing.assert_array_equal(pb.astype(np.float32), [1.5, -3.0])
    np.testing.assert_array_equal(pi, [7, -9])
    np.testing.assert_array_equal(pu, [0, 1, 200, 255])
    ex.set_param_typed("bias", np.array([1, 2, 3], np.float16))
    ex.set_param_typed("pb", np.array([0.25, 8], BF16))
    untyped = ex.run({"x": X, "pos": np.array([1])})
    assert all(o.dtype == np.float32 for o in untyped)  # run without typed widens every output to f32
    np.testing.assert_allclose(untyped[0], X.astype(np.float64) @ W + [1, 2, 3], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(untyped[2], [0.25, 8])
    np.testing.assert_array_equal(untyped[4], [0, 1, 200, 255])


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_params_read_as_zeros(backend: str) -> None:
    ex = basic(backend)
    assert ex.finalize_params() == ["w", "bias", "pb", "pi", "pu"]
    y, _, pb, pi, pu = ex.run({"x": X, "pos": np.array([0])}, typed=True)
    assert not y.any() and not pb.astype(np.float32).any() and not pi.any() and not pu.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_params_from(backend: str) -> None:
    src = loaded(backend)
    g = GraphBuilder("other")  # shares w; its bias has another dtype, so it is not copied
    x = g.input("x", (5, 3))
    g.output(g.add(g.matmul(x, g.param("w", (3, 3))), g.param("bias", (3,))))
    dst = compile_(backend, g)
    assert dst.copy_params_from(src) == ["w"]
    assert dst.finalize_params() == ["bias"]
    x5 = f32(5, 3)
    np.testing.assert_allclose(dst.run({"x": x5})[0], x5 @ W, rtol=1e-5, atol=1e-5)
    other = next((b for b in BACKENDS if b != backend), None)
    if other is not None:
        assert compile_(other, g).copy_params_from(src) == []  # another backend: unsupported, not an error


@pytest.mark.parametrize("backend", BACKENDS)
def test_clone_is_independent(backend: str) -> None:
    ex = loaded(backend)
    ex.bind_handle("past", np.ones((4, 3), np.float32))
    ex.set_handle_feed("past", 1)
    twin = ex.clone()
    twin.set_param("w", np.zeros((3, 3), np.float32))
    twin.run({"x": X, "pos": np.array([2])})
    np.testing.assert_array_equal(twin.read_handle("past")[2], X[0])  # the feed came along
    np.testing.assert_array_equal(ex.read_handle("past"), np.ones((4, 3)))
    np.testing.assert_allclose(probe(ex), X.astype(np.float64) @ W + BIAS, rtol=1e-5, atol=1e-5)
    with pytest.raises(FailedPrecondition):
        twin.clone().read_output(0)  # a clone starts without outputs


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_read_indices_slots_and_rows(backend: str) -> None:
    ex = loaded(backend)
    with pytest.raises(FailedPrecondition):
        ex.read_output_row(0, 0, 3)
    past = f32(4, 3)
    outs = ex.run({"x": X, "past": past, "pos": np.array([3])}, read_indices=[1, 0])
    assert [o.shape for o in outs] == [(4, 3), (2, 3)]
    np.testing.assert_array_equal(outs[0][:3], past[:3])
    np.testing.assert_array_equal(outs[0][3], X[0])
    np.testing.assert_array_equal(ex.read_output_row(1, 3, 3), X[0])
    np.testing.assert_array_equal(ex.read_output_row(0, 1, 3), outs[1][1])
    with pytest.raises(OutOfRange):
        ex.read_output_row(1, 4, 3)
    with pytest.raises(OutOfRange):
        ex.run({"x": X}, read_indices=[5])
    assert ex.run({"x": X * 2, "past": past, "pos": np.array([1])}, read_indices=[]) == []  # Some(&[]): none
    np.testing.assert_array_equal(ex.read_output(1)[1], X[0] * 2)  # it ran all the same
    moved: list[int] = []  # what leaves the device: one row, never the whole output or handle
    to_host = ex._to_host

    def spy(value: Any) -> np.ndarray:
        moved.append(int(np.prod(value.shape)))
        return to_host(value)
    ex._to_host = spy  # type: ignore[method-assign]
    ex.bind_handle("past", past)
    np.testing.assert_array_equal(ex.read_output_row(1, 2, 3), ex.read_handle("past", (2, 3))[0])
    assert moved == [3, 3]
    del ex._to_host
    slots = ex.run_slots([X, past, np.array([3])])
    np.testing.assert_array_equal(slots[1], outs[0])
    with pytest.raises(InvalidArgument):
        ex.run_slots([X, past, np.array([3]), X])


@pytest.mark.parametrize("backend", BACKENDS)
def test_commit_no_wait_and_run_pipelined(backend: str) -> None:
    ex = loaded(backend)
    ex.bind_handle("past", np.zeros((4, 3), np.float32))
    ex.set_handle_feed("past", 1)
    for p in range(3):
        ex.commit_no_wait({"x": X + p, "pos": np.array([p])})
    assert ex.sync_pending() == 3
    assert ex.sync_pending() == 0
    np.testing.assert_array_equal(ex.read_handle("past")[:3], np.stack([X[0] + p for p in range(3)]))
    sets = [{"x": X * p, "past": f32(4, 3), "pos": np.array([p])} for p in range(3)]
    pipelined = ex.run_pipelined(sets)
    single = loaded(backend)
    for got, inputs in zip(pipelined, sets):
        for a, b in zip(got, single.run(inputs)):
            np.testing.assert_array_equal(a, b)


def bucketed(backend: str, offset: bool = False) -> Exe:
    """y = reshape(reshape(x @ w, [8, 2, 2]), [8, 4]) (+ a constant [8, 4] when `offset`) and argmax(y) [8]: the
    bucket axis is axis 0 of x, 8 rows; w [4, 4] is not on it."""
    g = GraphBuilder("bucketed")
    x, w = g.input("x", (8, 4)), g.input("w", (4, 4))
    y = g.reshape(g.reshape(g.matmul(x, w), (8, 2, 2)), (8, 4))
    if offset:
        y = g.add(y, g.constant(np.ones((8, 4), np.float32)))
    g.output(y, g.argmax(y))
    return compile_(backend, g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_active_extent(backend: str) -> None:
    ex = loaded(backend)
    assert ex.set_active_extent((3, 4)) is True  # past [4, 3] is on the bucket axis
    assert ex.set_active_extent((1, 5)) is False  # no input has 5 rows: nothing to cut
    ex.set_active_extent((3, 4))
    for bad in ((0, 4), (5, 4), (-1, 2)):
        with pytest.raises(InvalidArgument):
            ex.set_active_extent(bad)
        assert ex._extent == (3, 4)
    ex.run({"x": X}, extent=(1, 4))
    assert ex._extent == (3, 4)  # a per-run extent does not stick
    ex.set_active_extent(None)
    assert ex._extent is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_active_extent_computes_only_the_real_rows(backend: str) -> None:
    """Rows past the extent are not computed: they come back zero, where the whole run gives x @ w there; the real
    rows are the whole run's, bit for bit. A graph the extent cannot cut (a constant of the bucket's 8 rows) says
    so and runs whole."""
    x, w = f32(8, 4), f32(4, 4)
    ex = bucketed(backend)
    whole = ex.run({"x": x, "w": w}, typed=True)
    assert np.abs(whole[0][3:]).min() > 0
    assert ex.set_active_extent((3, 8)) is True
    cut = ex.run({"x": x, "w": w}, typed=True)
    assert [c.shape for c in cut] == [(8, 4), (8,)]  # the declared shapes, padded past the extent
    np.testing.assert_array_equal(cut[0][:3], whole[0][:3])
    np.testing.assert_array_equal(cut[1][:3], whole[1][:3])
    assert not cut[0][3:].any() and not cut[1][3:].any()
    np.testing.assert_array_equal(ex.read_output(0), cut[0])
    ex.set_active_extent(None)
    np.testing.assert_array_equal(ex.run({"x": x, "w": w}, typed=True)[0], whole[0])
    fixed = bucketed(backend, offset=True)
    assert fixed.set_active_extent((3, 8)) is False
    out = fixed.run({"x": x, "w": w}, typed=True)[0]
    np.testing.assert_allclose(out[3:], whole[0][3:] + 1, rtol=1e-6)


# -- sampling and the RNG policy -------------------------------------------------------------------------
def sampler(backend: str, batch: int = 64, vocab: int = 16) -> Exe:
    g = GraphBuilder("sampler")
    g.output(g.sample(g.input("logits", (batch, vocab)), g.input("t", (1,)), g.input("k", (1,), "i64"),
                      g.input("p", (1,)), g.input("seed", (1,), "i64")))
    return compile_(backend, g)


LOGITS = f32(64, 16)


def draw(ex: Exe, seed: int, t: float = 1.0) -> np.ndarray:
    return ex.run({"logits": LOGITS, "t": np.array([t], np.float32), "k": np.array([0]), "p": np.array([1.0], np.float32),
                   "seed": np.array([seed])}, typed=True)[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rng_policy(backend: str) -> None:
    ex = sampler(backend)
    assert ex.rng() == RngOptions(42, "splitmix")
    first = draw(ex, 1)
    np.testing.assert_array_equal(draw(ex, 1), first)  # every run re-seeds from the policy
    np.testing.assert_array_equal(draw(sampler(backend), 1), first)
    assert (draw(ex, 2) != first).any()
    ex.set_rng(RngOptions(seed=7))
    assert ex.rng() == RngOptions(7, "splitmix")
    assert (draw(ex, 1) != first).any()
    for other in BACKENDS:  # same policy and seed: the same tokens on every backend
        twin = sampler(other)
        twin.set_rng(RngOptions(seed=7))
        np.testing.assert_array_equal(draw(twin, 1), draw(ex, 1))
    ex.set_rng(RngOptions(seed=7, backend="zero"))  # u = 0 always takes the most likely token
    np.testing.assert_array_equal(draw(ex, 3), LOGITS.argmax(-1))
    np.testing.assert_array_equal(draw(ex, 3, t=0.0), LOGITS.argmax(-1))
    with pytest.raises(InvalidArgument):
        ex.set_rng(RngOptions(backend="philox"))
    assert ex.rng() == RngOptions(7, "zero")


# -- handles and feeds -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_bind_read_and_write_handle_rows(backend: str) -> None:
    ex = loaded(backend)
    assert ex.has_handle("past") == (False, False)
    with pytest.raises(NotFound):
        ex.read_handle("past")
    past = f32(4, 3)
    device = ex.capabilities.resident_handles  # numpy has no device apart from the host: it binds, and says so
    assert ex.bind_handle("past", past, resident=True) is device
    assert ex.has_handle("past") == (True, device)
    np.testing.assert_array_equal(ex.run({"x": X, "pos": np.array([0])})[1][1:], past[1:])  # the handle fed the input
    explicit = f32(4, 3)
    np.testing.assert_array_equal(ex.run({"x": X, "past": explicit, "pos": np.array([0])})[1][1:], explicit[1:])
    np.testing.assert_array_equal(ex.read_handle("past", (1, 3)), past[1:3])
    rows = f32(2, 3)
    assert ex.write_handle_rows("past", 2, rows)
    np.testing.assert_array_equal(ex.read_handle("past"), np.concatenate([past[:2], rows]))
    ex.bind_handle("past", past)
    assert ex.has_handle("past") == (True, False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_handle_feed_accumulates_kv_rows(backend: str) -> None:
    """kv_write output fed back into its own cache: a decode loop. Earlier results never change afterwards."""
    ex = loaded(backend)
    ex.bind_handle("past", np.zeros((4, 3), np.float32))
    assert ex.set_handle_feed("past", 1)
    seen = []
    for p in range(4):
        seen.append(ex.run({"x": X + p, "pos": np.array([p])}, read_indices=[1])[0])
        seen.append(ex.read_handle("past"))
    want = np.stack([X[0] + p for p in range(4)])
    np.testing.assert_array_equal(ex.read_handle("past"), want)
    for p in range(4):
        for snapshot in seen[2 * p : 2 * p + 2]:
            np.testing.assert_array_equal(snapshot[: p + 1], want[: p + 1])
            assert not snapshot[p + 1 :].any()
    with pytest.raises(InvalidArgument):
        ex.set_handle_feed("past", 0)  # y is [2, 3], the handle [4, 3]
    with pytest.raises(OutOfRange):
        ex.set_handle_feed("past", 9)
    with pytest.raises(NotFound):
        ex.set_handle_feed("nope", 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_read_by_another_node_is_not_overwritten(backend: str) -> None:
    """A fed cache that a second node also reads must reach that node as it was before the write."""
    g = GraphBuilder("two_readers")
    past, row, pos = g.input("past", (3, 2)), g.input("row", (1, 2)), g.input("pos", (), "i64")
    written = g.kv_write(past, row, pos)
    g.output(written, g.sum(past, axes=(0,)))
    ex = compile_(backend, g)
    ex.bind_handle("past", np.ones((3, 2), np.float32))
    ex.set_handle_feed("past", 0)
    for p in range(3):
        _, total = ex.run({"row": np.full((1, 2), 10.0, np.float32), "pos": np.array(p)})
        np.testing.assert_array_equal(total, [3 + 9 * p] * 2)


def concat_decoder(backend: str, upper: int, kv: int = 4, layers: int = 2) -> Exe:
    """The rlx resident-KV convention: output 0 = a logits stand-in, 1+2i / 2+2i = concat(past, new) [upper+1, kv]."""
    g = GraphBuilder(f"decode_{upper}")
    new = g.input("new", (1, kv))
    caches: list[Value] = []
    for i in range(layers):
        for sign, kind in ((1.0, "k"), (-1.0, "v")):
            past = g.input(f"past_{kind}_{i}", (upper, kv))
            caches.append(g.concat([past, g.mul(new, sign * (i + 1))], axis=0))
    g.output(g.sum(caches[0], axes=(0,)), *caches)
    return compile_(backend, g)


def kv_row(layer: int, kind: str, token: int, kv: int = 4) -> np.ndarray:
    return np.full(kv, (1.0 if kind == "k" else -1.0) * (layer + 1) * (token + 1), np.float32)


def decode_steps(ex: Exe, upper: int, tokens: range, kv: int = 4) -> None:
    for t in tokens:
        ex.run({"new": np.full((1, kv), t + 1.0, np.float32)}, read_indices=[0])
        if t < upper:
            assert ex.feed_kv_row(upper, t, kv)


def register_feeds(ex: Exe, layers: int = 2) -> None:
    for i in range(layers):
        assert ex.register_kv_row_feed(f"past_k_{i}", 1 + 2 * i)
        assert ex.register_kv_row_feed(f"past_v_{i}", 2 + 2 * i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_row_feed(backend: str) -> None:
    ex = concat_decoder(backend, 4)
    with pytest.raises(FailedPrecondition):
        ex.feed_kv_row(4, 0, 4)
    register_feeds(ex)
    decode_steps(ex, 4, range(3))
    for i in range(2):
        for kind in "kv":
            h = ex.read_handle(f"past_{kind}_{i}")
            np.testing.assert_array_equal(h[:3], np.stack([kv_row(i, kind, t) for t in range(3)]))
            assert not h[3].any()
    before = state_of_handles(ex)
    for bad in ((5, 0, 4), (4, 4, 4), (-1, 0, 4)):
        with pytest.raises(OutOfRange):
            ex.feed_kv_row(*bad)
    with pytest.raises(InvalidArgument):
        ex.feed_kv_row(4, 0, 0)
    assert_handles_equal(before, state_of_handles(ex))


def state_of_handles(ex: Exe) -> dict[str, np.ndarray]:
    return {n: ex.read_handle(n) for n in ex.graph.inputs if ex.has_handle(n)[0]}


def assert_handles_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_resident_kv_prefix_on_bucket_rollover(backend: str) -> None:
    """Bucket 4 -> 8 at the token that fills row 4: that row exists only in the old bucket's outputs."""
    old = concat_decoder(backend, 4)
    register_feeds(old)
    decode_steps(old, 4, range(5))  # tokens 0..3 fed into rows 0..3; token 4 sits in output row 4
    new = concat_decoder(backend, 8)
    assert new.seed_resident_kv_prefix_from(old, 5, 4, 4, 2)
    for i in range(2):
        for kind in "kv":
            h = new.read_handle(f"past_{kind}_{i}")
            np.testing.assert_array_equal(h[:5], np.stack([kv_row(i, kind, t) for t in range(5)]))
            assert not h[5:].any()
            assert new.has_handle(f"past_{kind}_{i}")[1] is new.capabilities.resident_handles
    register_feeds(new)
    decode_steps(new, 8, range(5, 7))
    np.testing.assert_array_equal(new.read_handle("past_v_1")[:7], np.stack([kv_row(1, "v", t) for t in range(7)]))
    assert old.seed_resident_kv_prefix_from(new, 0, 4, 4, 2)  # nothing to copy: trivially true


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_resident_kv_rows(backend: str) -> None:
    src = concat_decoder(backend, 8)
    register_feeds(src)
    decode_steps(src, 8, range(6))
    dst = concat_decoder(backend, 8)
    for name in dst.graph.inputs:
        if name.startswith("past_"):
            dst.bind_handle(name, np.full((8, 4), 99.0, np.float32))
    assert dst.copy_resident_kv_rows_from(src, 2, 5, 8, 4, 2)
    h = dst.read_handle("past_k_1")
    np.testing.assert_array_equal(h[:2], 99.0)  # rows before from_row stay
    np.testing.assert_array_equal(h[2:5], np.stack([kv_row(1, "k", t) for t in range(2, 5)]))
    assert not h[5:].any()  # rows from to_row on are zeroed
    before = state_of_handles(dst)
    with pytest.raises(OutOfRange):
        dst.copy_resident_kv_rows_from(src, 0, 9, 8, 4, 2)  # past the destination's 8 rows
    small = concat_decoder(backend, 4)
    register_feeds(small)
    decode_steps(small, 4, range(5))
    with pytest.raises(OutOfRange):
        dst.copy_resident_kv_rows_from(small, 0, 6, 4, 4, 2)  # row 5 is neither in small's handles nor its row 4
    assert_handles_equal(before, state_of_handles(dst))
    other = next((b for b in BACKENDS if b != backend), None)
    if other is not None:
        assert not concat_decoder(other, 8).copy_resident_kv_rows_from(src, 0, 2, 8, 4, 2)


# -- MoE -------------------------------------------------------------------------------------------------
T, H, F, E, K = 5, 4, 6, 4, 2


def moe_graph(backend: str, layers: int = 2) -> Exe:
    """Mixtral-style routing: router matmul -> softmax -> top_k -> take_along_axis -> renormalise, then
    gate/up/down grouped_matmuls over each token's K expert slots, weighted and summed back per token."""
    g = GraphBuilder("moe")
    x = g.input("x", (T, H))
    slots = g.constant(np.repeat(np.arange(T), K))  # token of each of the T*K rows
    for layer in range(layers):
        p = f"l{layer}."
        probs = g.softmax(g.matmul(x, g.param(p + "router", (H, E))))
        top = g.top_k(probs, K)
        weights = g.take_along_axis(probs, top)
        weights = g.div(weights, g.sum(weights, axes=(-1,), keepdims=True))
        ids = g.reshape(top, (T * K,))
        rows = g.gather(x, slots)
        gate = g.grouped_matmul(rows, g.param(p + "gate", (E, H, F)), ids)
        up = g.grouped_matmul(rows, g.param(p + "up", (E, H, F)), ids)
        down = g.grouped_matmul(g.mul(g.silu(gate), up), g.param(p + "down", (E, F, H)), ids)
        mixed = g.sum(g.reshape(g.mul(down, g.reshape(weights, (T * K, 1))), (T, K, H)), axes=(1,))
        x = g.add(x, mixed)
    g.output(x)
    return compile_(backend, g)


MOE_PARAMS = {f"l{layer}.{name}": f32(*shape) for layer in range(2)
              for name, shape in (("router", (H, E)), ("gate", (E, H, F)), ("up", (E, H, F)), ("down", (E, F, H)))}
MOE_X = f32(T, H)


def moe_reference(x: np.ndarray, layers: int = 2) -> tuple[np.ndarray, list[list[int]]]:
    """float64 forward and each layer's routed expert ids (token-major, best first)."""
    h = x.astype(np.float64)
    routed = []
    for layer in range(layers):
        p = {k.split(".")[1]: v.astype(np.float64) for k, v in MOE_PARAMS.items() if k.startswith(f"l{layer}.")}
        out = h.copy()
        ids: list[int] = []
        for t in range(T):
            logits = h[t] @ p["router"]
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            top = sorted(range(E), key=lambda e: (-probs[e], e))[:K]
            ids += top
            for e in top:
                act = h[t] @ p["gate"][e]
                out[t] += probs[e] / probs[top].sum() * ((act / (1 + np.exp(-act)) * (h[t] @ p["up"][e])) @ p["down"][e])
        h = out
        routed.append(ids)
    return h, routed


def loaded_moe(backend: str) -> Exe:
    ex = moe_graph(backend)
    for name, value in MOE_PARAMS.items():
        ex.set_param(name, value)
    return ex


def expected_stats(routed: list[list[int]], masks: list[list[bool]]) -> MoeStats:
    stats = MoeStats()
    for ids, mask in zip(routed, masks):
        experts, counts = np.unique(ids, return_counts=True)
        for e, n in zip(experts.tolist(), counts.tolist()):
            for _ in range(3):  # gate, up and down each call the expert once
                if mask[e]:
                    stats.resident_expert_calls += 1
                    stats.resident_tokens += n
                else:
                    stats.offloaded_expert_calls += 1
                    stats.offloaded_tokens += n
    return stats


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_forward_capture_and_residency(backend: str) -> None:
    ex = loaded_moe(backend)
    want, routed = moe_reference(MOE_X)
    assert len(set(routed[0]) | set(routed[1])) > 1  # the fixture must route to several experts
    assert ex.take_moe_topk_capture() is None
    assert ex.enable_moe_topk_capture(E)
    np.testing.assert_allclose(ex.run({"x": MOE_X})[0], want, rtol=1e-4, atol=1e-4)
    assert ex.take_moe_topk_capture() == routed
    assert ex.take_moe_topk_capture() is None  # take drains
    assert ex.take_moe_residency_stats() == expected_stats(routed, [[True] * E] * 2)  # no mask: all resident
    assert ex.take_moe_residency_stats() == MoeStats()

    mask = [True, False, True, False]
    assert ex.set_moe_resident_experts(mask)
    ex.run({"x": MOE_X})
    assert ex.take_moe_residency_stats() == expected_stats(routed, [mask, mask])
    assert ex.take_moe_topk_capture() == routed  # capture stays on until re-enabled with another width
    per_layer = [[False, True, True, True], [True, True, False, False]]
    assert ex.set_moe_resident_experts_per_layer(per_layer)
    ex.enable_moe_topk_capture(E + 1)  # no router has that width: nothing is captured
    ex.run({"x": MOE_X})
    got = ex.take_moe_residency_stats()
    assert got == expected_stats(routed, per_layer)
    assert got.offloaded_expert_calls > 0 and got.resident_expert_calls > 0
    assert ex.take_moe_topk_capture() is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_bad_masks(backend: str) -> None:
    ex = loaded_moe(backend)
    ex.set_moe_resident_experts([True, False, True, False])
    before = ex._moe_masks
    calls: list[Callable[[], object]] = [
        lambda: ex.set_moe_resident_experts([True] * 3),
        lambda: ex.set_moe_resident_experts_per_layer([[True] * E]),
        lambda: ex.set_moe_resident_experts_per_layer([[True] * E, [True] * (E + 1)])]
    for call in calls:
        with pytest.raises(InvalidArgument) as info:
            call()
        assert info.value.reason == "BAD_MASK"
    assert ex._moe_masks == before


# -- bad inputs: the right error, and nothing changed -----------------------------------------------------
def q4_graph(backend: str) -> Exe:
    g = GraphBuilder("q4")
    g.output(g.dequant_matmul(g.input("x", (1, 32)), g.param("wq", packed_shape("q4_0", 2, 32), "u8"), "q4_0", 2, 32))
    return compile_(backend, g)


BAD: list[tuple[str, type[GraphmeshError], str, Callable[[Exe], object]]] = [
    ("feed to an unknown handle", NotFound, "UNKNOWN_HANDLE", lambda ex: ex.set_handle_feed("nope", 1)),
    ("row feed to an unknown handle", NotFound, "UNKNOWN_HANDLE", lambda ex: ex.register_kv_row_feed("nope", 1)),
    ("row feed from a missing output", OutOfRange, "OUTPUT_INDEX_OUT_OF_RANGE", lambda ex: ex.register_kv_row_feed("past", 7)),
    ("bind to an unknown handle", NotFound, "UNKNOWN_HANDLE", lambda ex: ex.bind_handle("nope", X)),
    ("bind of the wrong shape", InvalidArgument, "SHAPE_MISMATCH", lambda ex: ex.bind_handle("past", f32(5, 3))),
    ("bind of the wrong dtype", InvalidArgument, "DTYPE_MISMATCH",
     lambda ex: ex.bind_handle("past", np.zeros((4, 3), np.int64))),
    ("write rows past the end", OutOfRange, "ROW_OUT_OF_RANGE", lambda ex: ex.write_handle_rows("past", 3, f32(2, 3))),
    ("write rows of the wrong width", InvalidArgument, "SHAPE_MISMATCH", lambda ex: ex.write_handle_rows("past", 0, f32(1, 2))),
    ("read rows past the end", OutOfRange, "ROW_OUT_OF_RANGE", lambda ex: ex.read_handle("past", (2, 5))),
    ("extent above upper", InvalidArgument, "BAD_EXTENT", lambda ex: ex.set_active_extent((5, 4))),
    ("per-run extent above upper", InvalidArgument, "BAD_EXTENT", lambda ex: ex.run({"x": X}, extent=(5, 4))),
    ("unknown input", NotFound, "UNKNOWN_INPUT", lambda ex: ex.run({"x": X, "nope": X})),
    ("input of the wrong shape", InvalidArgument, "SHAPE_MISMATCH", lambda ex: ex.run({"x": f32(3, 3)})),
    ("input of the wrong dtype", InvalidArgument, "DTYPE_MISMATCH", lambda ex: ex.run({"x": X, "pos": np.array([0.5])})),
    ("unknown param", NotFound, "UNKNOWN_PARAM", lambda ex: ex.set_param("nope", W)),
    ("param of the wrong shape", InvalidArgument, "SHAPE_MISMATCH", lambda ex: ex.set_param("w", f32(3, 4))),
    ("param of the wrong dtype", InvalidArgument, "DTYPE_MISMATCH",
     lambda ex: ex.set_param_typed("w", np.ones((3, 3), np.int32))),
    ("f32 into a u8 param", InvalidArgument, "DTYPE_MISMATCH", lambda ex: ex.set_param("pu", np.ones(4, np.float32))),
    ("kv_write past the cache", OutOfRange, "ROW_OUT_OF_RANGE", lambda ex: ex.run({"x": X, "pos": np.array([4])})),
    ("unknown rng backend", InvalidArgument, "BAD_RNG", lambda ex: ex.set_rng(RngOptions(backend="mt"))),
    ("row of an output past its end", OutOfRange, "ROW_OUT_OF_RANGE", lambda ex: ex.read_output_row(0, 2, 3)),
]


@pytest.mark.parametrize("what,error,reason,call", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_raises_and_changes_nothing(backend: str, what: str, error: type[GraphmeshError], reason: str,
                                              call: Callable[[Exe], object]) -> None:
    ex = loaded(backend)
    ex.bind_handle("past", f32(4, 3), resident=True)
    ex.set_handle_feed("past", 1)
    ex.set_active_extent((2, 4))
    ex.set_rng(RngOptions(seed=5))
    ex.run({"x": X, "pos": np.array([1])})
    before = state(ex)
    with pytest.raises(error) as info:
        call(ex)
    assert info.value.reason == reason
    assert_same(before, state(ex))


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_param_length_mismatch(backend: str) -> None:
    ex = q4_graph(backend)
    good = np.zeros(packed_shape("q4_0", 2, 32), np.uint8)
    good[:, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)  # d = 0.5
    good[:, 2:] = 0x99  # every nibble 9: each weight (9 - 8) * 0.5
    ex.set_param_typed("wq", good)
    x = f32(1, 32)
    np.testing.assert_allclose(ex.run({"x": x})[0], np.full((1, 2), x.sum() * 0.5), rtol=1e-5, atol=1e-5)
    for bad in (np.zeros((2, 17), np.uint8), np.zeros(36, np.uint8)):
        with pytest.raises(InvalidArgument) as info:
            ex.set_param_typed("wq", bad)
        assert info.value.reason == "SHAPE_MISMATCH"
    np.testing.assert_allclose(ex.run({"x": x})[0], np.full((1, 2), x.sum() * 0.5), rtol=1e-5, atol=1e-5)


# -- torch specifics ---------------------------------------------------------------------------------------
needs_torch = pytest.mark.skipif("torch" not in BACKENDS, reason="the torch backend is not installed")


@needs_torch
def test_torch_device_strings() -> None:
    import torch

    g = GraphBuilder("id")
    g.output(g.neg(g.input("x", (2,))))
    graph = parse(g.build())
    for bad in ("tpu", "cuda:x", "mps"):
        with pytest.raises(InvalidArgument):
            compile_graph(graph, "torch", bad)
    if not torch.cuda.is_available():
        with pytest.raises(FailedPrecondition):
            compile_graph(graph, "torch", "cuda:0")


@needs_torch
def test_torch_writes_a_fed_cache_in_place() -> None:
    """The decode fast path: a kv_write whose output feeds its own cache handle reuses the handle's buffer."""
    ex = loaded("torch")
    ex.bind_handle("past", np.zeros((4, 3), np.float32))
    buffer = ex._handles["past"].data_ptr()
    ex.run({"x": X, "pos": np.array([0])})
    assert ex._last_outputs is not None and ex._last_outputs[1].data_ptr() != buffer  # no feed: a new cache
    ex.set_handle_feed("past", 1)
    ex.run({"x": X, "pos": np.array([0])})
    buffer = ex._handles["past"].data_ptr()
    ex.run({"x": X + 1, "pos": np.array([1])})
    assert ex._handles["past"].data_ptr() == buffer
    np.testing.assert_array_equal(ex.read_handle("past")[:2], [X[0], X[0] + 1])


@needs_torch
def test_torch_configure_threads() -> None:
    import torch

    from graphmesh_executor.backends.torch_backend import configure

    before = torch.get_num_threads()
    try:
        configure(1)
        assert torch.get_num_threads() == 1
        configure(None)  # None keeps the current setting
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif("torch:cuda" not in BACKENDS, reason="needs a CUDA device")
def test_torch_cuda_commit_no_wait_and_run_pipelined_are_asynchronous() -> None:
    """commit_no_wait returns while its work is still queued on the stream, sync_pending waits for it; run_pipelined
    queues every run before it waits, and each run keeps its own outputs (a captured graph reuses its buffers)."""
    import torch

    g = GraphBuilder("heavy")
    y, w = g.input("x", (1024, 1024)), g.param("w", (1024, 1024))
    for _ in range(16):
        y = g.matmul(y, w)
    g.output(g.sum(y), g.slice(y, 0, 0, 2))
    ex = compile_("torch:cuda", g)
    ex.set_param("w", np.eye(1024, dtype=np.float32))
    assert ex.capabilities_on("cuda:0").async_pipeline and not ex.capabilities_on("cpu").async_pipeline
    x = f32(1024, 1024)
    ex.bind_handle("x", x, resident=True)
    ex.run({})  # warm: the static runs before a capture
    ex.run({})
    stream = torch.cuda.current_stream(torch.device("cuda:0"))
    for _ in range(8):
        ex.commit_no_wait({})
    assert not stream.query()  # 8 x 16 matmuls of 1024^2 still on the GPU: the calls did not wait for them
    assert ex.sync_pending() == 8
    assert stream.query()
    sets = [{"x": x * (k + 1)} for k in range(4)]
    pipelined = ex.run_pipelined(sets)
    for got, inputs in zip(pipelined, sets):
        np.testing.assert_allclose(got[1], inputs["x"][:2], rtol=1e-3, atol=1e-3)


@pytest.mark.skipif("torch:cuda" not in BACKENDS, reason="needs a CUDA device")
def test_torch_cuda_keeps_params_and_handles_on_the_device() -> None:
    ex = loaded("torch:cuda")
    ex.bind_handle("past", np.zeros((4, 3), np.float32))
    ex.set_handle_feed("past", 1)
    ex.run({"x": X, "pos": np.array([0])})
    assert ex._params["w"].device.type == "cuda" and ex._handles["past"].device.type == "cuda"
    np.testing.assert_array_equal(ex.read_handle("past")[0], X[0])


@needs_torch
def test_torch_keeps_q4_weights_packed_for_bf16_activations() -> None:
    """bf16 x with n % 16 == 0 runs torch's int4 kernel on a form converted once per param (shared by
    copy_params_from); other dtypes multiply by a weight dequantized once to their dtype."""
    import torch

    from graphmesh_executor.backends.torch_ops import CONVERTED

    def exe(dtype: str) -> Exe:
        g = GraphBuilder(f"q4_{dtype}")
        g.output(g.dequant_matmul(g.input("x", (2, 64), dtype), g.param("wq", packed_shape("q4_1", 16, 64), "u8"),
                                  "q4_1", 16, 64))
        return compile_("torch", g)

    packed = rng.integers(0, 256, packed_shape("q4_1", 16, 64)).astype(np.uint8)
    packed.reshape(16, 2, 20)[..., 0:4] = np.frombuffer(np.array([0.01, -0.05], np.float16).tobytes(), np.uint8)
    src = exe("bf16")
    src.set_param_typed("wq", packed)
    x = f32(2, 64)
    (y,) = src.run({"x": x.astype(BF16)})
    assert set(src._params["wq"].__dict__[CONVERTED]) == {"int4"}
    ref = exe("f32")
    assert ref.copy_params_from(src) == ["wq"]
    (want,) = ref.run({"x": x.astype(BF16).astype(np.float32)})
    np.testing.assert_allclose(y, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    # one param, both forms; unless the f32 rows went through the CPU kernel, which reads the blocks as they are
    from graphmesh_executor.backends import cpu_kernels
    dense = set() if cpu_kernels.library() is not None else {torch.float32}
    assert set(src._params["wq"].__dict__[CONVERTED]) == {"int4", *dense}


def test_torch_runs_fused_pairs_of_nodes_as_one_step_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's fused pairs (TorchExecutable._fusions; one Triton kernel each on CUDA, tested in test_cuda_kernels.py)
    on the host, where a pair runs as one C call (the add and the norm of its sum, the two ropes) or torch's two ops
    in one step (a silu and its product, the two KV writes); the host's default where cpu_kernels run. Every output
    has the bits of the plan without them, and values read again after a fused step are still there (the add's input
    x, the residual sum, the positions)."""
    from graphmesh_executor.backends import cpu_kernels
    from graphmesh_executor.backends.torch_attention import kv_scatter_pair
    from graphmesh_executor.backends.torch_backend import TorchExecutable
    from graphmesh_executor.backends.torch_ops import add_rms_norm, rope_pair, silu_mul

    calls: list[str] = []
    for name in ("add_rms_norm", "rope_half_pair"):  # the C calls, counted where they serve
        def counted(*args: Any, _name: str = name, _f: Any = getattr(cpu_kernels, name)) -> Any:
            out = _f(*args)
            calls.extend([_name] if out is not None else [])
            return out
        monkeypatch.setattr(cpu_kernels, name, counted)

    g = GraphBuilder("pairs")
    x, r, gate, up = g.input("x", (4, 64)), g.input("r", (4, 64)), g.input("gate", (4, 32)), g.input("up", (4, 32))
    q, k, v = g.input("q", (4, 4, 16)), g.input("k", (4, 2, 16)), g.input("v", (4, 32))
    pos, slots = g.input("pos", (4,), "i64"), g.input("slots", (4,), "i64")
    k_pool, v_pool = g.input("k_pool", (16, 32)), g.input("v_pool", (16, 32))
    total = g.add(x, r)
    normed = g.rms_norm(total, g.param("w", (64,)), 1e-5)
    q_rot, k_rot = g.rope(q, pos), g.rope(k, pos)
    k_out = g.kv_scatter(k_pool, g.reshape(k_rot, (4, 32)), slots)
    v_out = g.kv_scatter(v_pool, v, slots)
    g.output(g.add(total, normed), g.mul(g.silu(gate), up), g.mul(x, normed), q_rot, k_out, v_out, g.rope(q, pos))
    inputs = {"x": f32(4, 64), "r": f32(4, 64), "gate": f32(4, 32), "up": f32(4, 32), "q": f32(4, 4, 16),
              "k": f32(4, 2, 16), "v": f32(4, 32), "pos": np.array([3, 0, 9, 4]), "slots": np.array([5, 0, 15, 6]),
              "k_pool": f32(16, 32), "v_pool": f32(16, 32)}
    w = f32(64) + 1
    runs = {}
    kernels_here = cpu_kernels.library() is not None
    for fuse in (False, True, None):
        monkeypatch.setattr(TorchExecutable, "fuse_pairs", fuse)
        ex = compile_("torch", g)
        ex.set_param("w", w)
        kernels = [step.kernel for step in ex._steps]  # type: ignore[attr-defined]
        fused = [kernels.count(f) for f in (add_rms_norm, silu_mul, rope_pair, kv_scatter_pair)]
        on = fuse or (fuse is None and kernels_here)
        assert fused == ([1, 1, 1, 1] if on else [0, 0, 0, 0])  # the third rope has no partner
        calls.clear()
        runs[fuse] = ex.run(inputs)
        assert calls == (["add_rms_norm", "rope_half_pair"] if on and kernels_here else [])
    for fuse in (True, None):
        for fused_out, plain in zip(runs[fuse], runs[False], strict=True):
            assert np.array_equal(fused_out, plain)


def test_a_llama_stage_fuses_every_layer_s_pairs(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The model builder declares a layer's nodes in an order that lets each pair fuse, and parse keeps it: a paged
    Llama stage gets one rope pair and one KV scatter pair a layer (parse once moved the v scatter to right after
    its product, before the k rope, and the scatter pair never formed: two index_copy kernels a layer on CUDA)."""
    from graphmesh import plan as dag
    from graphmesh_executor.backends.torch_attention import kv_scatter_pair
    from graphmesh_executor.backends.torch_backend import TorchExecutable
    from graphmesh_executor.backends.torch_ops import rope_pair
    from graphmesh_executor.stage import StageRuntime
    from graphmesh_executor.stage_types import StageSpec, StepRow
    from tests.model_fixtures import make_tiny_llama

    monkeypatch.setattr(TorchExecutable, "fuse_pairs", True)
    path = make_tiny_llama(tmp_path)
    rt = StageRuntime("torch", "cpu", pusher=lambda *a: a[-1](None), kv_cache_bytes=8 << 20)
    rt.install(1, 0, 1, StageSpec(str(path), 0, 2, True, True), dag.pipeline([(0, 2)], ["0"], 64))
    rt.execute_step(1, 1, [StepRow("a", 1, 0, 0, [1, 2, 3])], False, 30.0)
    rt.execute_step(1, 2, [StepRow("a", 2, 1, 3, [4])], False, 30.0)
    assert rt._executables  # type: ignore[attr-defined]
    for exe in rt._executables.values():  # type: ignore[attr-defined]
        kernels = [step.kernel for step in exe._steps]  # type: ignore[attr-defined]
        assert (kernels.count(rope_pair), kernels.count(kv_scatter_pair)) == (2, 2)  # 2 layers


def test_parse_keeps_a_valid_declaration_order() -> None:
    g = GraphBuilder("order")
    x = g.input("x", (2, 4))
    a = g.exp(x)
    b = g.exp(a)
    c = g.exp(x)  # ready as early as a: Kahn's algorithm in first-ready order would run it second
    g.output(g.add(b, c))
    assert [n.name for n in parse(g.build()).nodes] == [a.name, b.name, c.name, "add_4"]


def test_the_cuda_kernels_stand_down_without_triton_or_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton builds its launchers with the host's C compiler at first use: without triton, without a compiler or
    with GRAPHMESH_CUDA_KERNELS=0 the CUDA path runs torch's ops instead of failing at its first launch."""
    from graphmesh_executor.backends import cuda_kernels

    enabled = cuda_kernels._enabled.__wrapped__
    monkeypatch.delenv("GRAPHMESH_CUDA_KERNELS", raising=False)
    monkeypatch.setattr(cuda_kernels, "triton", object())
    monkeypatch.setenv("CC", "cc")
    assert enabled()
    monkeypatch.setenv("GRAPHMESH_CUDA_KERNELS", "0")
    assert not enabled()
    monkeypatch.delenv("GRAPHMESH_CUDA_KERNELS")
    monkeypatch.delenv("CC")
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert not enabled()
    monkeypatch.setenv("CC", "cc")
    monkeypatch.setattr(cuda_kernels, "triton", None)
    assert not enabled()
