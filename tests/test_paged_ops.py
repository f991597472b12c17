"""The batched stage's ops on every available backend: paged_attention and kv_scatter against float64 references
written here (never the numpy backend's kernels), and sample with per-row settings against sampling each row alone.

Pool rows that no query may see (unwritten tails of blocks, blocks no sequence owns, the block table's padding)
hold large finite garbage: a kernel that lets one of them through changes the result, one that masks it does not.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from graphmesh import dtypes
from graphmesh.errors import OutOfRange
from graphmesh.graph import GraphBuilder, parse
from graphmesh_executor.backends import compile_graph
from graphmesh_executor.executable import Executable, RngOptions
from tests.conftest import backend_targets

BACKENDS = backend_targets()
Exe = Executable[Any]
# (rtol, atol) against the float64 reference; inputs are rounded to their dtype before the reference sees them
TOL: dict[str, tuple[float, float]] = {"f32": (1e-4, 1e-4), "bf16": (2e-2, 2e-2)}
BLOCK, D = 4, 16
PA_INPUTS = ("q", "k_pool", "v_pool", "block_table", "token_seq", "q_positions")

rng = np.random.default_rng(20261201)


def compile_(target: str, g: GraphBuilder) -> Exe:
    name, _, device = target.partition(":")
    return compile_graph(parse(g.build()), name, device or "cpu")


def f64(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64)


def rand(shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


# -- paged_attention -------------------------------------------------------------------------------------------
def paged_ref(ins: list[np.ndarray], block: int, scale: float = 0.0) -> np.ndarray:
    """Per query: gather its sequence's rows for positions 0..q_positions[t], then softmax attention per head."""
    q, k_pool, v_pool, table, token_seq, pos = ins
    t, hq, d = q.shape
    group = hq // k_pool.shape[1]
    scale = scale or 1.0 / math.sqrt(d)
    out = np.zeros((t, hq, d))
    for i in range(t):
        s = int(token_seq[i])
        rows = [int(table[s, j // block]) * block + j % block for j in range(int(pos[i]) + 1)]
        k, v = f64(k_pool[rows]), f64(v_pool[rows])  # [keys, Hkv, D]
        for h in range(hq):
            w = k[:, h // group] @ f64(q[i, h]) * scale
            w = np.exp(w - w.max())
            out[i, h] = (w / w.sum()) @ v[:, h // group]
    return out


def paged_inputs(table: np.ndarray, chunks: list[tuple[int, int, int]], n_blocks: int, dtype: str, hq: int = 8,
                 hkv: int = 2, shuffle: bool = False, d: int = D, block: int = BLOCK) -> list[np.ndarray]:
    """Inputs for chunks of (sequence, first position, tokens); each sequence's rows 0..its last position are live."""
    token_seq = np.concatenate([np.full(n, s) for s, _, n in chunks]).astype(np.int64)
    pos = np.concatenate([np.arange(start, start + n) for _, start, n in chunks]).astype(np.int64)
    if shuffle:  # token order is free: a kernel must not assume a sequence's tokens are adjacent
        perm = rng.permutation(len(pos))
        token_seq, pos = token_seq[perm], pos[perm]
    k_pool, v_pool = rand((n_blocks * block, hkv, d), 30.0), rand((n_blocks * block, hkv, d), 30.0)
    for s in np.unique(token_seq):
        j = np.arange(int(pos[token_seq == s].max()) + 1)
        rows = table[s, j // block].astype(np.int64) * block + j % block
        k_pool[rows], v_pool[rows] = rand((len(j), hkv, d)), rand((len(j), hkv, d))
    floats = [x.astype(dtypes.to_numpy(dtype)) for x in (rand((len(pos), hq, d)), k_pool, v_pool)]
    return [*floats, table, token_seq, pos]


def run_paged(backend: str, ins: list[np.ndarray], decode: bool = False, scale: float = 0.0,
              block: int = BLOCK) -> np.ndarray:
    g = GraphBuilder("paged")
    q, k, v, table, token_seq, pos = (g.input(n, a.shape, dtypes.from_numpy(a.dtype)) for n, a in zip(PA_INPUTS, ins))
    g.output(g.paged_attention(q, k, v, table, token_seq, pos, block_size=block, decode=decode, scale=scale))
    (out,) = compile_(backend, g).run(dict(zip(PA_INPUTS, ins)), typed=True)
    assert out.dtype == ins[0].dtype and out.shape == ins[0].shape, (out.dtype, out.shape)
    return out


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    rtol, atol = TOL[dtypes.from_numpy(got.dtype)]
    np.testing.assert_allclose(f64(got), want, rtol=rtol, atol=atol)


def ragged_table(table_dtype: str = "i64") -> np.ndarray:
    """Three sequences of 12 block slots in a pool of 32 blocks: 4, 11 and 1 live blocks, padding = block 31."""
    table = np.full((3, 12), 31)
    ids = rng.permutation(31)
    table[0, :4], table[1, :11], table[2, :1] = ids[:4], ids[4:15], ids[15:16]
    return table.astype(dtypes.to_numpy(table_dtype))


# a 5-token prefill chunk from position 11, a 1-token decode at position 40, a 3-token chunk from 0
RAGGED = [(0, 11, 5), (1, 40, 1), (2, 0, 3)]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_ragged_batch(backend: str, heads: tuple[int, int], dtype: str) -> None:
    ins = paged_inputs(ragged_table(), RAGGED, 32, dtype, *heads)
    assert_close(run_paged(backend, ins), paged_ref(ins, BLOCK))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_shuffled_tokens_i32_table_and_scale(backend: str, dtype: str) -> None:
    ins = paged_inputs(ragged_table("i32"), RAGGED, 32, dtype, shuffle=True)
    ins[4], ins[5] = ins[4].astype(np.int32), ins[5].astype(np.int32)
    assert_close(run_paged(backend, ins, scale=0.3), paged_ref(ins, BLOCK, 0.3))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_shared_prefix_blocks(backend: str, dtype: str) -> None:
    # Both rows of the table start with blocks 5 and 9 (positions 0..7), then diverge. A query at position 6 of each
    # sequence, with the same q, sees the same keys and must give the same output.
    table = np.full((2, 6), 15)
    table[0, :3], table[1, :3] = [5, 9, 2], [5, 9, 7]
    ins = paged_inputs(table, [(0, 6, 1), (0, 8, 3), (1, 6, 1), (1, 9, 1)], 16, dtype)
    ins[0][4] = ins[0][0]
    got = run_paged(backend, ins)
    assert_close(got, paged_ref(ins, BLOCK))
    np.testing.assert_allclose(f64(got[4]), f64(got[0]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_decode(backend: str, dtype: str) -> None:
    # One query per sequence at ragged positions; the decode form must agree with the general one.
    table = rng.permutation(24)[:24].reshape(4, 6)
    ins = paged_inputs(table, [(0, 0, 1), (1, 7, 1), (2, 21, 1), (3, 3, 1)], 25, dtype)
    got = run_paged(backend, ins, decode=True)
    assert_close(got, paged_ref(ins, BLOCK))
    assert_close(run_paged(backend, ins), f64(got))


@pytest.mark.parametrize("shuffle", [False, True], ids=["adjacent", "shuffled"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "torch:cuda"] or
                         [pytest.param("torch:cuda", marks=pytest.mark.skip(reason="no CUDA device"))])
def test_cuda_mixed_step_rows_and_long_runs(backend: str, dtype: str, shuffle: bool) -> None:
    # A step of decodes, short prompt chunks and one chunk longer than the row kernel takes: the short runs' rows
    # go through the row kernel in one launch, the long run through its own flash call (FlashInfer's prefill in bf16
    # where it is installed), each against the reference.
    from graphmesh_executor.backends import torch_attention
    long = torch_attention.ROW_KERNEL_RUN + 20
    width = -(-max(long, 130) // BLOCK)  # every sequence's keys fit its table row
    table = rng.permutation(4 * width).reshape(4, width)
    chunks = [(0, 11, 5), (1, 40, 1), (2, 0, long), (3, 100, 30)]
    ins = paged_inputs(table, chunks, 4 * width, dtype, shuffle=shuffle)
    assert_close(run_paged(backend, ins), paged_ref(ins, BLOCK))


@pytest.mark.parametrize("shuffle", [False, True], ids=["adjacent", "shuffled"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "torch:cuda"] or
                         [pytest.param("torch:cuda", marks=pytest.mark.skip(reason="no CUDA device"))])
def test_cuda_long_runs_through_flashinfer(backend: str, shuffle: bool) -> None:
    # Where flashinfer-python is installed, a bf16 step's long runs (one from position 0, one after a prefix) take
    # its paged prefill in one launch, the rest the row kernel: each row against the reference.
    pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")
    from graphmesh_executor.backends import flashinfer_prefill, torch_attention
    long, block = torch_attention.ROW_KERNEL_RUN + 20, 16
    width = -(-(100 + long) // block)
    table = rng.permutation(4 * width).reshape(4, width)
    chunks = [(0, 11, 5), (1, 40, 1), (2, 0, long), (3, 100, long)]
    ins = paged_inputs(table, chunks, 4 * width, "bf16", hq=8, hkv=2, shuffle=shuffle, d=64, block=block)
    before = flashinfer_prefill.calls
    assert_close(run_paged(backend, ins, block=block), paged_ref(ins, block))
    assert flashinfer_prefill.calls - before == (0 if shuffle else 2)  # shuffled rows make no long run


# One index made bad: (input, where, value). Inputs 3, 4, 5 are block_table, token_seq, q_positions.
OOR: dict[str, tuple[int, tuple[int, ...], int]] = {
    "block id past the pool": (3, (0, 0), 8),
    "negative block id": (3, (1, 2), -1),  # block slot 2 holds position 9
    "position past the table": (5, (1,), 16),
    "negative position": (5, (0,), -1),
    "sequence past the table": (4, (1,), 2),
}


def oor_inputs(change: str) -> list[np.ndarray]:
    """A valid decode-shaped batch (2 sequences, 4 block slots, a pool of 8 blocks), then one index made bad."""
    ins = paged_inputs(np.array([[0, 1, 2, 3], [4, 5, 6, 7]]), [(0, 3, 1), (1, 9, 1)], 8, "f32")
    i, at, value = OOR[change]
    ins[i][at] = value
    return ins


@pytest.mark.parametrize("change", list(OOR))
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_index_out_of_range(backend: str, change: str) -> None:
    with pytest.raises(OutOfRange) as e:
        run_paged(backend, oor_inputs(change))
    assert e.value.reason == "INDEX_OUT_OF_RANGE"


@pytest.mark.parametrize("change", [c for c in OOR if c != "sequence past the table"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_decode_checks_blocks_and_positions_too(backend: str, change: str) -> None:
    # decode promises token_seq[t] == t, nothing about the table or positions: those are still checked.
    with pytest.raises(OutOfRange):
        run_paged(backend, oor_inputs(change), decode=True)


# -- kv_scatter ------------------------------------------------------------------------------------------------
def scatter_graph(pool: np.ndarray, rows: np.ndarray, slots: np.ndarray, other_reader: bool = False) -> GraphBuilder:
    """Outputs: the scattered pool, then (other_reader) a sum of the old pool read after the scatter."""
    g = GraphBuilder("scatter")
    p = g.input("pool", pool.shape, dtypes.from_numpy(pool.dtype))
    out = g.kv_scatter(p, g.input("rows", rows.shape, dtypes.from_numpy(rows.dtype)),
                       g.input("slots", slots.shape, dtypes.from_numpy(slots.dtype)))
    g.output(out, *([g.sum(g.mul(p, 1.0))] if other_reader else []))
    return g


@pytest.mark.parametrize("slot_dtype", ["i64", "i32"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_scatter_rows_land_at_their_slots(backend: str, dtype: str, slot_dtype: str) -> None:
    np_dtype = dtypes.to_numpy(dtype)
    pool, rows = rand((10, 2, 4)).astype(np_dtype), rand((3, 2, 4)).astype(np_dtype)
    slots = np.array([7, 0, 4]).astype(dtypes.to_numpy(slot_dtype))
    (got,) = compile_(backend, scatter_graph(pool, rows, slots)).run({"pool": pool, "rows": rows, "slots": slots},
                                                                      typed=True)
    assert got.dtype == pool.dtype and got.shape == pool.shape
    np.testing.assert_array_equal(f64(got[[7, 0, 4]]), f64(rows))
    untouched = [i for i in range(10) if i not in (7, 0, 4)]
    np.testing.assert_array_equal(f64(got[untouched]), f64(pool[untouched]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_scatter_leaves_its_pool_input_unchanged(backend: str) -> None:
    pool, rows, slots = rand((6, 3)), np.ones((2, 3), np.float32), np.array([5, 1])
    ex = compile_(backend, scatter_graph(pool, rows, slots, other_reader=True))
    ex.bind_handle("pool", pool)
    written, total = ex.run({"rows": rows, "slots": slots}, typed=True)
    np.testing.assert_array_equal(ex.read_handle("pool"), pool)
    np.testing.assert_allclose(total, f64(pool).sum(), rtol=1e-5)
    np.testing.assert_array_equal(written[[5, 1]], rows)


@pytest.mark.parametrize("other_reader", [False, True], ids=["sole-reader", "other-reader"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fed_kv_scatter_advances_the_pool(backend: str, other_reader: bool) -> None:
    # The pool handle fed back from the scatter: the decode loop. Backends may update it in place when the scatter
    # is its only reader; with another reader, that reader must still see the old rows.
    pool = rand((8, 2, 3))
    want = pool.copy()
    ex = compile_(backend, scatter_graph(pool, rand((2, 2, 3)), np.array([0, 0]), other_reader))
    ex.bind_handle("pool", pool)
    ex.set_handle_feed("pool", 0)
    for step in range(4):
        rows, slots = rand((2, 2, 3)), np.array([step, 7 - step])
        outs = ex.run({"rows": rows, "slots": slots}, typed=True)
        if other_reader:
            np.testing.assert_allclose(outs[1], f64(want).sum(), rtol=1e-5)
        want[slots] = rows
        np.testing.assert_array_equal(outs[0], want)
        np.testing.assert_array_equal(ex.read_handle("pool"), want)


@pytest.mark.parametrize("slot", [10, -1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_scatter_bad_slot(backend: str, slot: int) -> None:
    pool, rows, slots = rand((10, 3)), rand((2, 3)), np.array([3, slot])
    with pytest.raises(OutOfRange) as e:
        compile_(backend, scatter_graph(pool, rows, slots)).run({"pool": pool, "rows": rows, "slots": slots})
    assert e.value.reason == "INDEX_OUT_OF_RANGE"


# -- sample with per-row settings ------------------------------------------------------------------------------
def run_sample(backend: str, logits: np.ndarray, settings: list[np.ndarray], rng_seed: int = 5) -> np.ndarray:
    g = GraphBuilder("sample")
    names = ("temperature", "top_k", "top_p", "seed")
    values = [g.input(n, a.shape, dtypes.from_numpy(a.dtype)) for n, a in zip(names, settings)]
    g.output(g.sample(g.input("logits", logits.shape), *values))
    ex = compile_(backend, g)
    ex.set_rng(RngOptions(seed=rng_seed))
    (tokens,) = ex.run({"logits": logits, **dict(zip(names, settings))}, typed=True)
    assert tokens.dtype == np.int64 and tokens.shape == (logits.shape[0],)
    return tokens


TEMPERATURE = np.array([0.0, 0.7, 1.0, 1.3], np.float32)
TOP_K = np.array([0, 5, 0, 3])
TOP_P = np.array([1.0, 0.9, 0.6, 1.0], np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_per_row_settings_draw_what_each_row_draws_alone(backend: str) -> None:
    drawn = []
    for draw in range(6):
        logits = rand((4, 30), 2.0)
        seeds = np.array([3, 17, 42, 99]) + 1000 * draw
        tokens = run_sample(backend, logits, [TEMPERATURE, TOP_K, TOP_P, seeds])
        for b in range(4):
            alone = run_sample(backend, logits[b : b + 1], [np.array(TEMPERATURE[b]), np.array(TOP_K[b]),
                                                            np.array(TOP_P[b]), np.array(seeds[b])])
            assert tokens[b] == alone[0], (draw, b, tokens, alone)
        assert tokens[0] == np.argmax(logits[0])  # temperature 0 is greedy
        drawn.append(tokens[1:])
    assert len({tuple(t) for t in drawn}) > 1  # the draws are not all the same tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_per_row_settings_with_one_seed_match_scalar_settings(backend: str) -> None:
    # With one seed, row b draws with row index b whether the other settings come per row or once.
    logits = rand((4, 30), 2.0)
    seed = np.array(77)
    per_row = run_sample(backend, logits, [np.full(4, 0.9, np.float32), np.full(4, 6), np.full(4, 0.8, np.float32), seed])
    scalar = run_sample(backend, logits, [np.array(0.9, np.float32), np.array([6]), np.array(0.8, np.float32), seed])
    np.testing.assert_array_equal(per_row, scalar)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_greedy_rows_are_argmax(backend: str) -> None:
    logits = rand((4, 30), 2.0)
    tokens = run_sample(backend, logits, [np.zeros(4, np.float32), TOP_K, TOP_P, np.arange(4)])
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=1))


def test_a_steps_runs_fit_the_row_kernel_when_each_is_short_and_padding_rows_stand_alone() -> None:
    """torch_attention.rows_fit, the host check that lets a CUDA prompt step run static: a run is adjacent rows of
    one sequence at consecutive positions, so a bucket's padding (sequence 0, position 0) never lengthens a run."""
    from graphmesh_executor.backends.torch_attention import ROW_KERNEL_RUN, rows_fit

    def step(lengths: list[int], padding: int) -> tuple[np.ndarray, np.ndarray]:
        seqs = np.concatenate([np.full(n, s) for s, n in enumerate(lengths)] + [np.zeros(padding, np.int64)])
        pos = np.concatenate([np.arange(n) + 7 * s for s, n in enumerate(lengths)] + [np.zeros(padding, np.int64)])
        return seqs.astype(np.int64), pos.astype(np.int64)

    assert rows_fit(*step([3, ROW_KERNEL_RUN, 1], 0))
    assert not rows_fit(*step([3, ROW_KERNEL_RUN + 1, 1], 0))
    assert rows_fit(*step([ROW_KERNEL_RUN], ROW_KERNEL_RUN))  # sequence 0's run, then padding rows of sequence 0
    assert rows_fit(*step([5, 9], 3 * ROW_KERNEL_RUN))
    assert rows_fit(np.zeros(0, np.int64), np.zeros(0, np.int64))
