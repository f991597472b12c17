"""Int8 activations into packed q4_0 / q4_1 / q8_0 products (--weights packed-q8; graphmesh.ops.ACTIVATIONS):
the CPU kernels (cpu_kernels.c's quantize_rows_q8 and gemm_q8panels) against numpy's float64 reference, and the
guarantees a session's tokens rest on: a row's bits are the same alone or in any batch, over any thread split, in
the AVX2 and the AVX-512 builds, with and without VNNI.

Every kernel test runs once per build this host can run (test_cpu_kernels' `build` fixture)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from graphmesh.graph import Graph, GraphBuilder, parse
from graphmesh.ops import OpError, packed_shape
from graphmesh_executor.backends import compile_graph, cpu_kernels
from graphmesh_executor.backends.numpy_backend import _q8_matmul as numpy_q8_matmul
from graphmesh_executor.backends.numpy_backend import quantize_q8
from graphmesh_executor.backends.torch_ops import _q8_matmul
from graphmesh_server.serving import cpu_flags
from tests.test_cpu_kernels import BUILDS, RUNNABLE, _gguf_blocks, _rand

pytestmark = pytest.mark.skipif(not RUNNABLE, reason="needs an x86-64 CPU with AVX2 + FMA + F16C and a C compiler")
SCHEMES = ["q4_0", "q4_1", "q8_0"]
SHAPES = [(1, 576, 576), (2, 64, 7), (5, 576, 1536), (17, 1536, 577), (35, 96, 100)]


@pytest.fixture(autouse=True, params=BUILDS or ["avx2"])
def build(request: pytest.FixtureRequest) -> Iterator[str]:
    cpu_kernels.select(request.param)
    yield str(request.param)
    cpu_kernels.select(None)


def _reference(x: torch.Tensor, blocks: np.ndarray, scheme: str, n: int) -> np.ndarray:
    """The numpy backend's kernel of the op, kept in float64 (given float64 rows, it quantizes them as f32)."""
    return numpy_q8_matmul(x.double().numpy(), blocks, scheme, n, x.shape[1])


def _graph(m: int, k: int, n: int, scheme: str, dtype: str = "f32", activations: str = "q8") -> Graph:
    g = GraphBuilder("q8")
    x = g.input("x", (m, k), dtype)
    w = g.param("w", packed_shape(scheme, n, k), "u8")
    g.output(g.dequant_matmul(x, w, scheme, n, k, activations))
    return parse(g.build())


def test_rows_are_quantized_as_numpys_reference_does() -> None:
    """quantize_rows_q8's codes and scales are numpy's f32 steps, bit for bit (an all-zero block gets d = 0)."""
    x = _rand(7, 576, seed=3)
    x[2, 32:64] = 0.0
    codes, scales, sums = cpu_kernels.quantize_rows(x)
    ref_codes, ref_d = quantize_q8(x.numpy())
    assert np.array_equal(codes.numpy().reshape(7, -1, 32), ref_codes.astype(np.int8))
    assert np.array_equal(scales.numpy(), ref_d)
    assert np.array_equal(sums.numpy(), ref_codes.sum(-1).astype(np.int32))
    assert scales[2, 1] == 0 and not codes[2, 32:64].any()


@pytest.mark.serial  # the helper thread runs on the cores a worker of make test does not have
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matches_the_float64_reference_and_each_row_sums_alone(scheme: str, m: int, k: int, n: int) -> None:
    """Within f32 rounding of the float64 reference, and every row has its bits alone, in any batch, over two
    threads and with the helper thread: a session's numbers never depend on the other sessions of its step."""
    packed = _gguf_blocks(scheme, n, k, seed=n)
    blocks = torch.from_numpy(packed)
    x = _rand(m, k, seed=m)
    out = cpu_kernels.matmul_xwt_packed(x, blocks, scheme, n, activations="q8")
    ref = _reference(x, packed, scheme, n)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    for i in range(m):
        alone = cpu_kernels.matmul_xwt_packed(x[i:i + 1], blocks, scheme, n, activations="q8")[0]
        assert torch.equal(alone, out[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(cpu_kernels.matmul_xwt_packed(x, blocks, scheme, n, activations="q8"), out)
    finally:
        torch.set_num_threads(threads)
    if len(os.sched_getaffinity(0)) > 1:  # light: the helper thread takes chunks of the columns
        assert torch.equal(cpu_kernels.matmul_xwt_packed(x, blocks, scheme, n, light=True, activations="q8"), out)


def test_differs_from_the_f32_product_and_its_panels_are_its_own() -> None:
    """The q8 product is another arithmetic (its rows are rounded to int8), kept in a panel form of its own beside
    the f32 product's: the two never read each other's layout."""
    packed = torch.from_numpy(_gguf_blocks("q4_1", 100, 576, seed=1))
    x = _rand(3, 576, seed=2)
    f32 = cpu_kernels.matmul_xwt_packed(x, packed, "q4_1", 100)
    q8 = cpu_kernels.matmul_xwt_packed(x, packed, "q4_1", 100, activations="q8")
    assert not torch.equal(f32, q8)
    np.testing.assert_allclose(q8.numpy(), f32.numpy(), rtol=0.05, atol=0.05 * float(f32.abs().max()))
    assert torch.equal(cpu_kernels.matmul_xwt_packed(x, packed, "q4_1", 100), f32)
    assert len([key for key in packed.__dict__ if key.startswith("_graphmesh_")]) == 2


def test_the_avx2_and_avx512_builds_and_vnni_give_the_same_bits() -> None:
    """The integer dots are exact and the blocks are summed in one order in every build: AVX2 (vpmaddubsw), AVX-512
    without VNNI (the same, 16 lanes) and with it (vpdpbusd) give every output the same bits."""
    x = _rand(9, 576, seed=1)
    results = []
    for b in BUILDS:
        cpu_kernels.select(b)
        lib = cpu_kernels.library()
        assert lib is not None
        vnni = [0, 1] if b == "avx512" and "avx512_vnni" in cpu_flags() else [0]
        for on in vnni:
            lib.q8_use_vnni(on)
            try:
                assert lib.q8_vnni() == on
                results.append([cpu_kernels.matmul_xwt_packed(rows, torch.from_numpy(_gguf_blocks(s, 200, 576, seed=3)),
                                                              s, 200, activations="q8")
                                for s in SCHEMES for rows in (x, x[:1])])
            finally:
                lib.q8_use_vnni(-1)
    if len(results) < 2:
        pytest.skip("this host runs one of the three paths only")
    for other in results[1:]:
        for first, then in zip(results[0], other):
            assert torch.equal(first, then)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_torch_fallback_is_within_rounding_of_the_kernel(scheme: str) -> None:
    """Where the kernels cannot run (no compiler, not x86-64, a GPU), torch computes the same arithmetic in float64."""
    packed = _gguf_blocks(scheme, 77, 576, seed=4)
    x = _rand(6, 576, seed=5)
    kernel = cpu_kernels.matmul_xwt_packed(x, torch.from_numpy(packed), scheme, 77, activations="q8")
    np.testing.assert_allclose(_q8_matmul(x, torch.from_numpy(packed), scheme, 77, 576).numpy(), kernel.numpy(),
                               rtol=1e-5, atol=1e-6 * float(kernel.abs().max()))


def test_the_torch_backend_runs_a_q8_graph_through_the_kernel() -> None:
    """A graph's dequant_matmul with activations="q8" reads the q8 panels on the host: the kernel's bits."""
    packed = _gguf_blocks("q4_1", 100, 576, seed=6)
    exe = compile_graph(_graph(4, 576, 100, "q4_1"), "torch", "cpu")
    exe.set_param_typed("w", packed)
    assert any(key.startswith(cpu_kernels._Q8_PANELS) for key in exe._params["w"].__dict__)  # type: ignore[attr-defined]
    x = _rand(4, 576, seed=7)
    got = exe.run({"x": x.numpy()})[0]
    assert np.array_equal(np.asarray(got),
                          cpu_kernels.matmul_xwt_packed(x, torch.from_numpy(packed), "q4_1", 100, activations="q8").numpy())


def test_a_graph_asking_for_unknown_activations_or_q8_of_bf16_rows_is_refused() -> None:
    with pytest.raises(OpError, match="activations must be one of"):
        _graph(2, 64, 8, "q4_1", activations="int4")
    with pytest.raises(OpError, match="takes f32 rows"):
        _graph(2, 64, 8, "q4_1", "bf16")

