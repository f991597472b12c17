"""The attention ops' window and softcap attributes (sliding-window attention: Mistral, Qwen2, Gemma's local layers;
Gemma 2's attention logit soft-capping) on every available backend, against float64 references written here: the
contiguous attention op (prefill and decode rows) and paged_attention (ragged prompt chunks, decodes, the decode
form), where every row sees keys its window hides. The C decode kernel and the CUDA row kernel are checked directly
too, as test_cpu_kernels.py and test_cuda_kernels.py check them without these attributes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from graphmesh import dtypes
from graphmesh.graph import GraphBuilder
from graphmesh.ops import OpError, TensorType, infer, resolve_attrs
from tests.test_paged_ops import (
    BACKENDS,
    BLOCK,
    PA_INPUTS,
    RAGGED,
    assert_close,
    compile_,
    f64,
    paged_inputs,
    ragged_table,
    rand,
)

# (window, softcap): a window shorter than every chunk's keys, one longer than some, and the cap alone and with one
CASES = [(3, 0.0), (9, 0.0), (0, 1.5), (5, 2.0)]
IDS = [f"w{w}-cap{c}" for w, c in CASES]


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: int, scale: float, window: int, softcap: float,
              ) -> np.ndarray:
    """One query [Hq, D] at position `pos` over keys/values [keys, Hkv, D] at positions 0.. : float64."""
    hq, d = q.shape
    group = hq // k.shape[1]
    lo = max(0, pos + 1 - window) if window else 0
    out = np.zeros((hq, d))
    for h in range(hq):
        w = f64(k[lo:pos + 1, h // group]) @ f64(q[h]) * scale
        if softcap:
            w = softcap * np.tanh(w / softcap)
        w = np.exp(w - w.max())
        out[h] = (w / w.sum()) @ f64(v[lo:pos + 1, h // group])
    return out


def paged_reference(ins: list[np.ndarray], scale: float, window: int, softcap: float) -> np.ndarray:
    q, k_pool, v_pool, table, token_seq, pos = ins
    out = np.zeros(q.shape)
    for i in range(q.shape[0]):
        s, p = int(token_seq[i]), int(pos[i])
        rows = [int(table[s, j // BLOCK]) * BLOCK + j % BLOCK for j in range(p + 1)]
        out[i] = reference(q[i], k_pool[rows], v_pool[rows], p, scale, window, softcap)
    return out


def run_paged(backend: str, ins: list[np.ndarray], window: int, softcap: float, decode: bool = False,
              scale: float = 0.0) -> np.ndarray:
    g = GraphBuilder("paged")
    q, k, v, table, token_seq, pos = (g.input(n, a.shape, dtypes.from_numpy(a.dtype)) for n, a in zip(PA_INPUTS, ins))
    g.output(g.paged_attention(q, k, v, table, token_seq, pos, block_size=BLOCK, decode=decode, scale=scale,
                               window=window, softcap=softcap))
    (out,) = compile_(backend, g).run(dict(zip(PA_INPUTS, ins)), typed=True)
    assert out.dtype == ins[0].dtype and out.shape == ins[0].shape
    return out


@pytest.mark.parametrize("window,softcap", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_window_and_softcap_ragged_batch(backend: str, dtype: str, window: int, softcap: float,
                                                         ) -> None:
    """Prompt chunks from positions 11 and 0 and a decode at 40 in one step; shuffled rows too."""
    for shuffle in (False, True):
        ins = paged_inputs(ragged_table(), RAGGED, 32, dtype, shuffle=shuffle)
        want = paged_reference(ins, 0.3, window, softcap)
        assert_close(run_paged(backend, ins, window, softcap, scale=0.3), want)
        if window:  # and the window changes the result: the test would see a kernel that ignores it
            assert np.abs(paged_reference(ins, 0.3, 0, softcap) - want).max() > 1e-2


@pytest.mark.parametrize("window,softcap", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_window_and_softcap_decode(backend: str, dtype: str, window: int, softcap: float) -> None:
    """One query per sequence (the decode form: the C kernel on x86 torch, the Triton kernel on CUDA) at positions
    inside, at and past the window, and past a tile of 64 keys; the general form agrees."""
    table = rng_table(5, 24, 120)
    ins = paged_inputs(table, [(0, 0, 1), (1, 4, 1), (2, 9, 1), (3, 21, 1), (4, 70, 1)], 120, dtype)
    got = run_paged(backend, ins, window, softcap, decode=True)
    assert_close(got, paged_reference(ins, 1 / math.sqrt(16), window, softcap))
    assert_close(run_paged(backend, ins, window, softcap), f64(got))


def rng_table(seqs: int, width: int, n_blocks: int) -> np.ndarray:
    return np.random.default_rng(3).permutation(n_blocks)[:seqs * width].reshape(seqs, width).astype(np.int64)


def run_attention(backend: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, window: int,
                  softcap: float, scale: float) -> np.ndarray:
    g = GraphBuilder("attn")
    ins = {"q": q, "k": k, "v": v, "pos": pos}
    vals = {n: g.input(n, a.shape, dtypes.from_numpy(a.dtype)) for n, a in ins.items()}
    g.output(g.attention(vals["q"], vals["k"], vals["v"], vals["pos"], scale=scale, window=window, softcap=softcap))
    (out,) = compile_(backend, g).run(ins, typed=True)
    return out


@pytest.mark.parametrize("window,softcap", CASES, ids=IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_window_and_softcap(backend: str, window: int, softcap: float) -> None:
    """The contiguous form: a prefill from 0 (the causal kernel's case), a chunk from position 7, and one decode
    row, over a cache of 32 rows whose rows past every query hold garbage."""
    cache = rand((32, 2, 16), 30.0)
    cache_v = rand((32, 2, 16), 30.0)
    cache[:24], cache_v[:24] = rand((24, 2, 16)), rand((24, 2, 16))
    for pos in (np.arange(12), np.arange(7, 19), np.array([23])):
        q = rand((len(pos), 8, 16))
        got = run_attention(backend, q, cache, cache_v, pos.astype(np.int64), window, softcap, 0.2)
        want = np.stack([reference(q[i], cache, cache_v, int(p), 0.2, window, softcap) for i, p in enumerate(pos)])
        assert_close(got, want)


def test_attributes_are_checked() -> None:
    q = TensorType("f32", (4, 8, 16))
    kv = TensorType("f32", (32, 2, 16))
    pos = TensorType("i64", (4,))

    def attrs(**kw: Any) -> dict[str, Any]:
        return resolve_attrs("attention", kw)

    assert infer("attention", [q, kv, kv, pos], attrs(window=8, softcap=30.0)) == q
    for bad, words in (({"window": -1}, "window -1"), ({"softcap": -2.0}, "softcap -2.0"),
                       ({"softcap": math.inf}, "softcap inf")):
        with pytest.raises(OpError, match=words):
            infer("attention", [q, kv, kv, pos], attrs(**bad))
    with pytest.raises(OpError, match="needs causal"):
        infer("attention", [q, kv, kv], attrs(causal=False, window=4))
    with pytest.raises(OpError, match="window"):
        resolve_attrs("attention", {"window": 2.5})
    # a plain node keeps the attributes it had: the builder writes window and softcap only where set
    g = GraphBuilder("plain")
    x = g.input("q", (4, 8, 16))
    k = g.input("k", (32, 2, 16))
    node = g.attention(x, k, k, g.input("pos", (4,), "i64"))
    g.output(node)
    assert {"window", "softcap"}.isdisjoint(next(n for n in g.build().nodes if n.op == "attention").attrs)


@pytest.mark.parametrize("window,softcap", CASES, ids=IDS)
def test_cpu_decode_kernel_every_build(window: int, softcap: float) -> None:
    """The C decode kernel of each build this host runs (AVX2; AVX-512 where the CPU has it) against the float64
    reference, and the same bits from every build (the soft-cap is scalar tanhf in both)."""
    from tests.test_cpu_kernels import BUILDS, RUNNABLE

    if not RUNNABLE:
        pytest.skip("needs an x86-64 CPU with AVX2 + FMA + F16C and a C compiler")
    import torch

    from graphmesh_executor.backends import cpu_kernels

    table = rng_table(4, 20, 80)
    ins = paged_inputs(table, [(0, 2, 1), (1, 8, 1), (2, 40, 1), (3, 77, 1)], 80, "f32", hq=9, hkv=3)
    want = paged_reference(ins, 0.25, window, softcap)
    q, k_pool, v_pool = (torch.from_numpy(x) for x in ins[:3])
    outs = []
    try:
        for build in BUILDS:
            cpu_kernels.select(build)
            outs.append(cpu_kernels.paged_decode_attention(q, k_pool, v_pool, torch.from_numpy(table),
                                                           torch.from_numpy(ins[5]), BLOCK, 0.25, window,
                                                           softcap).numpy())
    finally:
        cpu_kernels.select(None)
    assert outs, "no kernel build runs on this host"
    for out in outs:
        assert_close(out, want)
        np.testing.assert_array_equal(out, outs[0])
