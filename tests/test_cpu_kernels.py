"""cpu_kernels: the torch backend's x86-64 kernels (x @ w.T from panels, paged decode attention) against float64.

Besides the numbers, it must be batch-invariant: a row's outputs are bit-identical whatever other rows share
the product and however its columns are split over threads, which is what keeps a session's tokens the same
in a step of one and a step of sixteen.

Every test runs once per build this host can run (the `build` fixture pins GRAPHMESH_CPU_ISA): AVX2 everywhere,
AVX-512 too on hosts that have it, so an AVX-512 host checks both paths and the two builds' bits are compared.
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from graphmesh.graph import GraphBuilder, parse
from graphmesh_executor.backends import compile_graph, cpu_kernels
from graphmesh_server.serving import cpu_flags
from tests.test_paged_ops import paged_ref

RUNNABLE = (platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma", "f16c"} <= cpu_flags()
            and shutil.which("cc") is not None)
pytestmark = pytest.mark.skipif(not RUNNABLE, reason="needs an x86-64 CPU with AVX2 + FMA + F16C and a C compiler")
BUILDS = [b for b in ("avx2", "avx512") if cpu_kernels._ISA_CPU[b] <= cpu_flags()]
PROMPT_ROWS = 35  # more rows than a decode step's packed product keeps between slices (cpu_kernels.c's PANEL_ROWS)
SHAPES = [(1, 576, 576), (2, 7, 5), (3, 13, 13), (5, 576, 1536), (16, 1536, 576), (32, 100, 49), (7, 8, 6),
          (8, 32, 9), (11, 9, 7), (17, 64, 10), (30, 576, 1536), (5, 24, 48), (100, 576, 200)]
# quads of rows and their 3-, 2- and 1-row tails (5 rows: 3 + 2), partial and whole panels of 24, a prompt chunk


@pytest.fixture(autouse=True, params=BUILDS or ["avx2"])
def build(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernel build each test runs on (see the module's docstring)."""
    cpu_kernels.select(request.param)
    yield str(request.param)
    cpu_kernels.select(None)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def test_the_kernel_builds_on_a_host_that_can_run_it(build: str) -> None:
    assert cpu_kernels.library() is not None  # a compile or load failure here would silently fall back to MKL
    assert cpu_kernels.panel() == {"avx2": 24, "avx512": 48}[build]  # the build it claims to be


def test_a_build_in_the_cache_loads_without_a_compiler(build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor image compiles every build and then drops its compiler: the cached build must still load."""
    assert cpu_kernels.library() is not None  # compiled into the cache
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    cpu_kernels._library.cache_clear()
    try:
        assert cpu_kernels.library() is not None
    finally:
        cpu_kernels._library.cache_clear()


def _pair(outs: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    assert outs is not None
    return outs


@pytest.mark.skipif(len(BUILDS) < 2, reason="one kernel build runs on this host (no AVX-512): nothing to compare")
def test_the_avx2_and_avx512_builds_give_the_same_bits() -> None:
    """A session's tokens do not depend on which host kind served it: every kernel's outputs are bit-identical
    between the two builds (each product output is one FMA chain over k in order; attention and the norms keep
    8-lane sums in both)."""
    x, w = _rand(PROMPT_ROWS, 576, seed=1), _rand(200, 576, seed=2)
    blocks = torch.from_numpy(_gguf_blocks("q4_1", 200, 576, seed=3))
    xk = _rand(PROMPT_ROWS, 512, seed=8)
    k_blocks = {scheme: torch.from_numpy(_k_blocks(scheme, 200, 512, seed=9)) for scheme in K_QUANTS}
    q, k_pool, v_pool, table, pos = _decode_case(6, seed=4)
    norm_w, cos, sin = _rand(576, seed=5), _rand(PROMPT_ROWS, 1, 64, seed=6), _rand(PROMPT_ROWS, 1, 64, seed=7)
    results = []
    for b in BUILDS:
        cpu_kernels.select(b)
        w2, blocks2 = w.clone(), blocks.clone()  # fresh tensors: panels of each build's own width
        k_blocks2 = {scheme: t.clone() for scheme, t in k_blocks.items()}
        results.append([cpu_kernels.matmul_xwt(x, w2), cpu_kernels.matmul_xwt(x[:3], w2),
                        cpu_kernels.matmul_xwt_packed(x, blocks2, "q4_1", 200),
                        cpu_kernels.matmul_xwt_packed(x[:5], blocks2, "q4_1", 200),
                        *(cpu_kernels.matmul_xwt_packed(rows, t, scheme, 200)
                          for scheme, t in k_blocks2.items() for rows in (xk, xk[:5])),
                        cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, pos, 16, 0.125),
                        cpu_kernels.rms_norm(x, norm_w, 1e-5), cpu_kernels.rope_half(x[:, :128].reshape(-1, 2, 64), cos, sin),
                        *_pair(cpu_kernels.add_rms_norm(x, x.flip(0).contiguous(), norm_w, 1e-5)),
                        *_pair(cpu_kernels.rope_half_pair(x[:, :128].reshape(-1, 2, 64),
                                                          x[:, 256:448].reshape(-1, 3, 64), cos, sin))])
    for a, b in zip(*results):
        assert a is not None and b is not None and torch.equal(a, b)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matches_the_float64_product(m: int, k: int, n: int) -> None:
    x, w = _rand(m, k, seed=m), _rand(n, k, seed=n + 1)
    out = cpu_kernels.matmul_xwt(x, w)
    ref = x.double() @ w.double().T
    # f32 sums of k products: error grows like sqrt(k) times the products' size
    np.testing.assert_allclose(out.double().numpy(), ref.numpy(), rtol=1e-5, atol=1e-6 * k ** 0.5 * 4)


@pytest.mark.parametrize("m,k,n", [(16, 576, 1536), (9, 13, 13), (32, 1536, 576), (17, 576, 1536), (14, 40, 7),
                                   (70, 64, 50)])
def test_a_row_gets_the_same_bits_in_any_batch_and_any_split(m: int, k: int, n: int) -> None:
    x, w = _rand(m, k, seed=3), _rand(n, k, seed=4)
    whole = cpu_kernels.matmul_xwt(x, w)
    for i in range(m):
        assert torch.equal(cpu_kernels.matmul_xwt(x[i:i + 1], w)[0], whole[i])
    flipped = cpu_kernels.matmul_xwt(x.flip(0), w).flip(0)  # every row in another place of its tiles
    assert torch.equal(flipped, whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(cpu_kernels.matmul_xwt(x, w), whole)
    finally:
        torch.set_num_threads(threads)


def test_usable_only_for_what_it_computes() -> None:
    x, w = _rand(4, 8, seed=1), _rand(6, 8, seed=2)
    assert cpu_kernels.usable(x, w)
    assert cpu_kernels.usable(_rand(PROMPT_ROWS, 8, seed=1), w)  # prompt chunks too
    assert not cpu_kernels.usable(x, w.T.contiguous().T)  # column-major weight
    assert not cpu_kernels.usable(x.double(), w.double())
    assert not cpu_kernels.usable(x, _rand(6, 9, seed=2))


def test_the_torch_backend_runs_its_weights_through_the_kernel() -> None:
    g = GraphBuilder("proj")
    g.output(g.matmul(g.input("x", (4, 576)), g.param("w", (1536, 576)), transpose_b=True))
    exe = compile_graph(parse(g.build()), "torch", "cpu")
    w, x = _rand(1536, 576, seed=5), _rand(4, 576, seed=6)
    exe.set_param("w", w.numpy())
    assert cpu_kernels.has_fpanels(exe._params["w"])  # type: ignore[attr-defined]  # made when set, not by a request
    out = exe.run({"x": x.numpy()})[0]
    assert np.array_equal(out, cpu_kernels.matmul_xwt(x, w).numpy())  # the kernel's exact bits, not MKL's


def test_a_prompt_row_gets_the_bits_of_a_decode_row() -> None:
    """Prompt chunks go through the same panels as decode rows: a token's activations do not depend on whether it
    came in a prompt of 40 or alone."""
    g = GraphBuilder("proj")
    g.output(g.matmul(g.input("x", (40, 576)), g.param("w", (1536, 576)), transpose_b=True))
    prompt = compile_graph(parse(g.build()), "torch", "cpu")
    g = GraphBuilder("proj")
    g.output(g.matmul(g.input("x", (1, 576)), g.param("w", (1536, 576)), transpose_b=True))
    decode = compile_graph(parse(g.build()), "torch", "cpu")
    w, x = _rand(1536, 576, seed=7), _rand(40, 576, seed=8)
    for exe in (prompt, decode):
        exe.set_param("w", w.numpy())
    whole = prompt.run({"x": x.numpy()})[0]
    for i in (0, 17, 39):
        assert np.array_equal(decode.run({"x": x[i:i + 1].numpy()})[0][0], whole[i])


def _decode_case(t: int, seed: int, hq: int = 9, hkv: int = 3, d: int = 64) -> tuple[torch.Tensor, ...]:
    """t sequences of ragged lengths over a pool of 16-token blocks; sequences 0 and 1 share their first block."""
    rng = np.random.default_rng(seed)
    block, blocks = 16, 5
    table = rng.permutation(40)[: t * blocks].reshape(t, blocks).astype(np.int64)
    table[1, 0] = table[0, 0]
    pos = rng.integers(0, blocks * block, t).astype(np.int64)
    pos[0] = 0  # a sequence of one key
    pools = [torch.from_numpy(rng.standard_normal((40 * block, hkv, d), dtype=np.float32)) for _ in range(2)]
    q = torch.from_numpy(rng.standard_normal((t, hq, d), dtype=np.float32))
    return q, pools[0], pools[1], torch.from_numpy(table), torch.from_numpy(pos)


# (query heads, kv heads, head dim): SmolLM2's 3 query heads a kv head, TinyLlama's 8 (3 + 3 + 2 at once), heads
# of their own, 2 a kv head, and a head dim that leaves a tail past its 8-lane vectors.
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 4, 64), (4, 4, 32), (4, 2, 72)])
def test_paged_decode_attention_matches_the_float64_reference(hq: int, hkv: int, d: int) -> None:
    q, k_pool, v_pool, table, pos = _decode_case(6, seed=7, hq=hq, hkv=hkv, d=d)
    assert cpu_kernels.attention_usable(q, k_pool, v_pool)
    out = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, pos, 16, 0.125)
    ref = paged_ref([a.numpy() for a in (q, k_pool, v_pool, table, torch.arange(6), pos)], 16, 0.125)
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_with_scores_far_apart() -> None:
    """Scores hundreds apart: the softmax's exp underflows to 0 for all but the top keys, as expf does."""
    q, k_pool, v_pool, table, pos = _decode_case(6, seed=9)
    q = q * 40
    out = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, pos, 16, 0.125)
    ref = paged_ref([a.numpy() for a in (q, k_pool, v_pool, table, torch.arange(6), pos)], 16, 0.125)
    assert np.isfinite(out.numpy()).all()
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_of_a_row_is_the_same_alone() -> None:
    q, k_pool, v_pool, table, pos = _decode_case(6, seed=8)
    whole = cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, pos, 16, 0.125)
    for i in range(6):
        alone = cpu_kernels.paged_decode_attention(q[i:i + 1], k_pool, v_pool, table[i:i + 1], pos[i:i + 1], 16, 0.125)
        assert torch.equal(alone[0], whole[i])


def _gguf_blocks(scheme: str, n: int, k: int, seed: int) -> np.ndarray:
    """Well-formed GGUF blocks [n, k/32 * block bytes]: finite f16 scales (and mins), any quant bits."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = rng.uniform(0.001, 0.05, (n, nb, 1)).astype(np.float16).view(np.uint8)
    if scheme == "q8_0":
        return np.concatenate([d, rng.integers(0, 256, (n, nb, 32)).astype(np.uint8)], -1).reshape(n, -1)
    qs = rng.integers(0, 256, (n, nb, 16)).astype(np.uint8)
    if scheme == "q4_0":
        return np.concatenate([d, qs], -1).reshape(n, -1)
    m = rng.uniform(-0.1, 0.1, (n, nb, 1)).astype(np.float16).view(np.uint8)
    return np.concatenate([d, m, qs], -1).reshape(n, -1)


@pytest.mark.parametrize("scheme", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 576), (2, 64, 7), (2, 576, 100), (5, 576, 1536), (8, 1536, 577), (13, 32, 13),
                                   (32, 96, 100)])
def test_packed_weights_are_ggufs_values_and_each_row_sums_alone(scheme: str, m: int, k: int, n: int) -> None:
    """x @ w.T over GGUF blocks (read in panels) multiplies by exactly the f32 weights gguf dequantizes them to,
    is within float32 rounding of float64, and gives every row the same bits alone, in any batch and over any
    thread split: a session's numbers never depend on the other sessions of its step."""
    import gguf

    packed = _gguf_blocks(scheme, n, k, seed=n)
    dense = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[scheme.upper()]).astype(np.float32)
    blocks = torch.from_numpy(packed)
    unit = torch.eye(k)[: min(k, PROMPT_ROWS)]  # row i picks column i of w: one product, exact
    assert np.array_equal(cpu_kernels.matmul_xwt_packed(unit, blocks, scheme, n).numpy(), dense[:, : len(unit)].T)
    x = _rand(m, k, seed=m)
    assert cpu_kernels.packed_usable(x, blocks, scheme)
    out = cpu_kernels.matmul_xwt_packed(x, blocks, scheme, n)
    np.testing.assert_allclose(out.numpy(), x.double().numpy() @ dense.astype(np.float64).T, rtol=1e-4,
                               atol=1e-5 * np.abs(dense).max() * k ** 0.5)
    for i in range(m):
        assert torch.equal(cpu_kernels.matmul_xwt_packed(x[i:i + 1], blocks, scheme, n)[0], out[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(cpu_kernels.matmul_xwt_packed(x, blocks, scheme, n), out)
    finally:
        torch.set_num_threads(threads)


def test_the_torch_backend_multiplies_packed_weights_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode's rows and a prompt chunk's read the blocks through the kernel, in panels made when the param is
    set: never a dequantized copy and torch's product, whose bits would depend on the row count."""
    from graphmesh.ops import packed_shape
    from graphmesh_executor.backends.torch_ops import CONVERTED, dequantize

    n, k = 96, 128
    packed = _gguf_blocks("q4_1", n, k, seed=9)
    for rows in (4, PROMPT_ROWS):
        g = GraphBuilder(f"q_{rows}")
        g.output(g.dequant_matmul(g.input("x", (rows, k)), g.param("w", packed_shape("q4_1", n, k), "u8"), "q4_1", n, k))
        exe = compile_graph(parse(g.build()), "torch", "cpu")
        exe.set_param_typed("w", packed)
        assert any(key.startswith(cpu_kernels._PANELS) for key in exe._params["w"].__dict__)  # type: ignore[attr-defined]
        x = _rand(rows, k, seed=rows)
        with monkeypatch.context() as m:
            m.setattr(torch.nn.functional, "linear", None)  # the path under test: torch's product must not serve it
            out = exe.run({"x": x.numpy()})[0]
        ref = x.double().numpy() @ dequantize(torch.from_numpy(packed), "q4_1", n, k).double().numpy().T
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        assert CONVERTED not in exe._params["w"].__dict__  # type: ignore[attr-defined]  # no dense copy
        assert np.array_equal(out, cpu_kernels.matmul_xwt_packed(x, torch.from_numpy(packed), "q4_1", n).numpy())


@pytest.mark.parametrize("scheme", ["q4_0", "q4_1", "q8_0"])
def test_a_packed_product_has_the_bits_of_the_f32_product_over_ggufs_dequantization(scheme: str) -> None:
    """--weights packed and --weights f32 of the same GGUF give a row the same bits: the packed kernel multiplies
    by exactly gguf's dequantized values in the f32 kernel's order, for decode rows and prompt chunks alike."""
    import gguf

    n, k = 100, 576
    packed = _gguf_blocks(scheme, n, k, seed=11)
    dense = torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[scheme.upper()])
                             .astype(np.float32)).contiguous()
    for rows in (1, 2, 3, 4, 5, 6, 8, 10, 11, 16, PROMPT_ROWS, 70):  # fused rows, fused groups, slices, a prompt
        x = _rand(rows, k, seed=rows)
        assert torch.equal(cpu_kernels.matmul_xwt_packed(x, torch.from_numpy(packed), scheme, n),
                           cpu_kernels.matmul_xwt(x, dense))


@pytest.mark.serial  # the helper thread runs on the cores a worker of make test does not have
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: no helper thread to share a product with")
@pytest.mark.parametrize("scheme", ["f32", "q4_0", "q4_1", "q8_0", "q4_k"])
def test_a_lone_rows_product_shared_with_the_helper_thread_has_the_one_thread_bits(scheme: str) -> None:
    """Products of one or two rows (a lone stream's decode) split their columns with cpu_kernels.c's helper thread,
    also in an executor held to one thread: each output is still the one-thread FMA chain, whichever thread took
    its chunk, and the helper really takes chunks."""
    lib = cpu_kernels.library()
    assert lib is not None and cpu_kernels._helper(lib)

    def products(n: int, k: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """(one thread, shared with the helper): x [m, k] @ W.T for a random W [n, k] in the scheme."""
        if scheme == "f32":
            weight = cpu_kernels.fpanels(_rand(n, k, seed=3))
            code = -1
        else:
            blocks = (_k_blocks if scheme in K_QUANTS else _gguf_blocks)(scheme, n, k, seed=5)
            weight, code = cpu_kernels.panels(torch.from_numpy(blocks), scheme, n, k), cpu_kernels.PACKED_SCHEMES[scheme]

        def run(x: torch.Tensor, shared: bool) -> torch.Tensor:
            m, out = x.shape[0], torch.empty(x.shape[0], n)
            if code < 0 and shared:
                lib.gemm_fpanels_shared(m, k, x.data_ptr(), k, weight.data_ptr(), out.data_ptr(), n, n)
            elif code < 0:
                lib.gemm_fpanels(m, k, x.data_ptr(), k, weight.data_ptr(), out.data_ptr(), n, 0, n)
            elif shared:
                lib.gemm_qpanels_shared(m, k, x.data_ptr(), k, weight.data_ptr(), code, out.data_ptr(), n, n)
            else:
                lib.gemm_qpanels(m, k, x.data_ptr(), k, weight.data_ptr(), code, out.data_ptr(), n, 0, n)
            return out
        return (lambda x: run(x, False)), (lambda x: run(x, True))

    n, k = 50 * cpu_kernels.panel() + 7, 512  # many chunks and a short last one
    alone, shared = products(n, k)
    for m in (1, 2):
        for trial in range(20):
            x = _rand(m, k, seed=10 * m + trial)
            assert torch.equal(shared(x), alone(x)), (m, trial)
    # The helper really takes chunks: of a product long enough for it to wake from its futex (one as short as
    # those above may be done before it is, on a busy host), within a bounded number of tries.
    helped = lib.helper_chunks()
    _, shared = products(400 * cpu_kernels.panel(), 4096)
    x = _rand(1, 4096, seed=1)
    for _ in range(100):
        shared(x)
        if lib.helper_chunks() > helped:
            break
    assert lib.helper_chunks() > helped


@pytest.mark.serial
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: no helper thread to share a product with")
@pytest.mark.parametrize("packed", [False, True])
def test_a_light_steps_products_of_any_rows_share_with_the_helper_and_keep_their_bits(packed: bool) -> None:
    """A step of few sessions (a verified chunk, a lone prompt; RunContext.light) lets products of any row count
    borrow the helper thread where torch's threads would not split them: the same bits as without it."""
    lib = cpu_kernels.library()
    assert lib is not None
    n, k = 20 * cpu_kernels.panel() + 5, 256
    weight = torch.from_numpy(_gguf_blocks("q4_1", n, k, seed=9)) if packed else _rand(n, k, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        helped = lib.helper_chunks()
        for m in (3, 9, PROMPT_ROWS) * 5:
            x = _rand(m, k, seed=m)
            if packed:
                light, plain = (cpu_kernels.matmul_xwt_packed(x, weight, "q4_1", n, light) for light in (True, False))
            else:
                light, plain = (cpu_kernels.matmul_xwt(x, weight, light) for light in (True, False))
            assert torch.equal(light, plain), m
        assert lib.helper_chunks() > helped  # it took part (a 35-row product outlasts its wake-up many times over)
    finally:
        torch.set_num_threads(threads)


K_QUANTS = ["q4_k", "q6_k"]


def _k_blocks(scheme: str, n: int, k: int, seed: int) -> np.ndarray:
    """Well-formed K-quant super-blocks [n, k/256 * block bytes]: finite f16 d (and dmin) of either sign, any
    scale, min and quant bits."""
    rng = np.random.default_rng(seed)
    nb = k // 256
    if scheme == "q4_k":  # d, dmin, then 12 bytes of 6-bit scales and mins and 128 of nibbles
        d = rng.uniform(-0.01, 0.02, (n, nb, 2)).astype(np.float16).view(np.uint8)
        return np.concatenate([d, rng.integers(0, 256, (n, nb, 140)).astype(np.uint8)], -1).reshape(n, -1)
    d = rng.uniform(-0.002, 0.002, (n, nb, 1)).astype(np.float16).view(np.uint8)  # after ql, qh and int8 scales
    return np.concatenate([rng.integers(0, 256, (n, nb, 208)).astype(np.uint8), d], -1).reshape(n, -1)


def _ggufs(packed: np.ndarray, scheme: str) -> torch.Tensor:
    """The f32 weight gguf's own dequantization (llama.cpp's reference code in gguf-py) makes of the blocks."""
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[scheme.upper()])
                            .astype(np.float32)).contiguous()


@pytest.mark.parametrize("scheme", K_QUANTS)
def test_k_quant_products_have_the_bits_of_the_f32_product_over_ggufs_dequantization(scheme: str) -> None:
    """Q4_K and Q6_K kept packed: for 1 to 64 rows (decode tiles, their 3-, 2- and 1-row tails, prompt chunks
    past PANEL_ROWS) the product is bit for bit the f32 kernel's over gguf's dequantized weight, a row gets the
    same bits alone, in another place of its tiles and over another thread split. 800 rows of w leave a partial
    last panel in both builds; k of 3 super-blocks makes the decode's slices (KC columns) cross their bounds."""
    n, k = 800, 768
    packed = _k_blocks(scheme, n, k, seed=21)
    blocks, dense = torch.from_numpy(packed), _ggufs(packed, scheme)
    unit = torch.eye(k)[:256]  # row i picks column i of w: a whole super-block's values, exact
    assert np.array_equal(cpu_kernels.matmul_xwt_packed(unit, blocks, scheme, n).numpy(), dense[:, :256].numpy().T)
    assert np.array_equal(cpu_kernels.matmul_xwt_packed(unit[:7], blocks, scheme, n).numpy(), dense[:, :7].numpy().T)
    x = _rand(64, k, seed=22)
    assert cpu_kernels.packed_usable(x, blocks, scheme)
    whole = cpu_kernels.matmul_xwt_packed(x, blocks, scheme, n)
    for m in range(1, 65):
        got = cpu_kernels.matmul_xwt_packed(x[:m], blocks, scheme, n)
        assert torch.equal(got, cpu_kernels.matmul_xwt(x[:m], dense)), m
        assert torch.equal(got, whole[:m]), m
    for i in range(64):
        assert torch.equal(cpu_kernels.matmul_xwt_packed(x[i:i + 1], blocks, scheme, n)[0], whole[i])
    assert torch.equal(cpu_kernels.matmul_xwt_packed(x.flip(0), blocks, scheme, n).flip(0), whole)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(cpu_kernels.matmul_xwt_packed(x[:5], blocks, scheme, n), whole[:5])
    finally:
        torch.set_num_threads(threads)


def test_k_quants_need_whole_super_blocks() -> None:
    """A K-quant row is whole super-blocks of 256 values: other widths are not the kernel's (the op refuses
    them), and the 32-value schemes still take any multiple of 32."""
    blocks = torch.from_numpy(_k_blocks("q4_k", 8, 512, seed=1))
    assert cpu_kernels.packs("q4_k", 512) and cpu_kernels.packs("q6_k", 256) and cpu_kernels.packs("q4_0", 96)
    assert not cpu_kernels.packs("q4_k", 288) and not cpu_kernels.packs("q6_k", 96) and not cpu_kernels.packs("q5_k", 256)
    assert cpu_kernels.packed_usable(_rand(2, 512, seed=1), blocks, "q4_k")
    assert not cpu_kernels.packed_usable(_rand(2, 288, seed=1), blocks, "q4_k")


def test_the_torch_backend_multiplies_k_quants_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_K_M layer's products in the torch backend: q and k (Q4_K) joined into one call, v (Q6_K) alone,
    panels made when the params are set, no dense copy, no torch product; every output has the bits of the f32
    graph over gguf's dequantized weights, for a decode's rows and a prompt chunk's."""
    from graphmesh.ops import packed_shape
    from graphmesh_executor.backends.torch_ops import CONVERTED, joined_matmul

    k, members = 512, (("q4_k", 96), ("q4_k", 48), ("q6_k", 48))
    weights = {f"w{i}": _k_blocks(scheme, n, k, seed=30 + i) for i, (scheme, n) in enumerate(members)}
    for rows in (4, PROMPT_ROWS):
        graphs = []
        for packed in (True, False):
            g = GraphBuilder(f"qkv_{rows}")
            x = g.input("x", (rows, k))
            outs = []
            for i, (scheme, n) in enumerate(members):
                if packed:
                    outs.append(g.dequant_matmul(x, g.param(f"w{i}", packed_shape(scheme, n, k), "u8"), scheme, n, k))
                else:
                    outs.append(g.matmul(x, g.param(f"w{i}", (n, k)), transpose_b=True))
            g.output(*outs)
            exe = compile_graph(parse(g.build()), "torch", "cpu")
            for i, (scheme, _) in enumerate(members):
                exe.set_param_typed(f"w{i}", weights[f"w{i}"] if packed else _ggufs(weights[f"w{i}"], scheme).numpy())
            exe.finalize_params()
            graphs.append(exe)
        quantized, dense = graphs
        assert sum(step.kernel is joined_matmul for step in quantized._steps) == 1  # type: ignore[attr-defined]
        assert any(key.startswith(cpu_kernels._PANELS) for key in quantized._params["w2"].__dict__)  # type: ignore[attr-defined]
        xs = {"x": _rand(rows, k, seed=rows).numpy()}
        with monkeypatch.context() as m:
            m.setattr(torch, "matmul", None)  # the path under test: every product through the kernels
            m.setattr(torch.nn.functional, "linear", None)
            got = quantized.run(xs)
        for a, b in zip(got, dense.run(xs)):
            assert np.array_equal(a, b)
        for i in range(len(members)):
            assert CONVERTED not in quantized._params[f"w{i}"].__dict__  # type: ignore[attr-defined]


@pytest.mark.parametrize("packed", [False, True])
def test_products_of_the_same_rows_run_as_one_with_each_members_bits(packed: bool) -> None:
    """q, k, v over the same rows are one call over the joined weight (a third of the calls a layer): a decode's
    rows get exactly the bits of each product alone, a prompt's rows run each product as before, and a weight
    set on its own after the join is still read."""
    from graphmesh.ops import packed_shape
    from graphmesh_executor.backends.torch_ops import joined_matmul

    k, widths = 128, (96, 48, 48)
    g = GraphBuilder("qkv")
    outs = []
    for rows in (4, PROMPT_ROWS):
        x = g.input(f"x{rows}", (rows, k))
        for i, n in enumerate(widths):
            w = g.param(f"w{rows}_{i}", packed_shape("q4_1", n, k) if packed else (n, k), "u8" if packed else "f32")
            outs.append(g.dequant_matmul(x, w, "q4_1", n, k) if packed else g.matmul(x, w, transpose_b=True))
    g.output(*outs)
    exe = compile_graph(parse(g.build()), "torch", "cpu")
    weights = {}
    for rows in (4, PROMPT_ROWS):
        for i, n in enumerate(widths):
            weights[f"w{rows}_{i}"] = _gguf_blocks("q4_1", n, k, seed=n + i) if packed else _rand(n, k, seed=n + i).numpy()
            exe.set_param_typed(f"w{rows}_{i}", weights[f"w{rows}_{i}"])
    exe.finalize_params()
    assert sum(step.kernel is joined_matmul for step in exe._steps) == 2  # type: ignore[attr-defined]
    xs = {f"x{rows}": _rand(rows, k, seed=rows).numpy() for rows in (4, PROMPT_ROWS)}

    def alone(x: np.ndarray, name: str, n: int) -> np.ndarray:
        g1 = GraphBuilder("one")
        w = g1.param("w", packed_shape("q4_1", n, k) if packed else (n, k), "u8" if packed else "f32")
        xv = g1.input("x", x.shape)
        g1.output(g1.dequant_matmul(xv, w, "q4_1", n, k) if packed else g1.matmul(xv, w, transpose_b=True))
        one = compile_graph(parse(g1.build()), "torch", "cpu")
        one.set_param_typed("w", weights[name])
        return one.run({"x": x})[0]

    expected = [alone(xs[f"x{rows}"], f"w{rows}_{i}", n) for rows in (4, PROMPT_ROWS)
                for i, n in enumerate(widths)]
    for got, want in zip(exe.run(xs), expected):
        assert np.array_equal(got, want)
    exe.set_param_typed("w4_1", weights["w4_2"])  # on its own: the join no longer holds it
    if not packed:  # read alone through its own panels, made when it was set: the kernel's bits, not MKL's
        assert cpu_kernels.has_fpanels(exe._params["w4_1"])  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "matmul", None)  # the path under test: every product through the kernels, none through torch
        m.setattr(torch.nn.functional, "linear", None)
        after = exe.run(xs)
    assert np.array_equal(after[1], expected[2]) and np.array_equal(after[0], expected[0])


@pytest.mark.parametrize("shape", [(8, 9, 64), (1, 3, 64), (5, 4, 20), (3, 2, 128)])
def test_rope_half_gives_the_bits_of_torchs_three_kernels(shape: tuple[int, int, int]) -> None:
    rows, _, d = shape
    x, angles = _rand(*shape, seed=d), _rand(rows, 1, d // 2, seed=rows)
    cos, sin = torch.cat([angles.cos(), angles.cos()], -1), torch.cat([-angles.sin(), angles.sin()], -1)
    fused = cpu_kernels.rope_half(x, cos, sin)
    assert fused is not None and torch.equal(fused, x * cos + x.roll(d // 2, -1) * sin)
    assert cpu_kernels.rope_half(x.transpose(0, 1), cos, sin) is None  # heads apart: torch's kernels serve it
    wide = _rand(rows, shape[1] * d + 40, seed=d + 1)  # rows apart, as q in a joined q, k, v product
    sliced = wide[:, 8:8 + shape[1] * d].reshape(shape)
    fused = cpu_kernels.rope_half(sliced, cos, sin)
    assert fused is not None and torch.equal(fused, sliced * cos + sliced.roll(d // 2, -1) * sin)


@pytest.mark.parametrize("rows", [1, 5])
def test_a_pair_in_one_call_gives_the_bits_of_each_apart(rows: int) -> None:
    """The host's fused pairs (TorchExecutable._fusions): a layer's k and q roped in one call, and an add with the
    norm of its sum, each output the bits of its kernel alone."""
    joined = _rand(rows, 9 * 64 + 2 * 3 * 64, seed=rows)  # a joined q, k, v product: q and k are rows apart
    q, k = joined[:, :576].reshape(rows, 9, 64), joined[:, 576:768].reshape(rows, 3, 64)
    angles = _rand(rows, 1, 32, seed=2)
    cos, sin = torch.cat([angles.cos(), angles.cos()], -1), torch.cat([-angles.sin(), angles.sin()], -1)
    pair = cpu_kernels.rope_half_pair(k, q, cos, sin)
    k_alone, q_alone = cpu_kernels.rope_half(k, cos, sin), cpu_kernels.rope_half(q, cos, sin)
    assert pair is not None and k_alone is not None and q_alone is not None
    assert torch.equal(pair[0], k_alone) and torch.equal(pair[1], q_alone)
    assert cpu_kernels.rope_half_pair(k, q[:, :, :32].contiguous(), cos, sin) is None  # heads of two sizes
    x, y, w = _rand(rows, 576, seed=3), _rand(rows, 576, seed=4), _rand(576, seed=5)
    both = cpu_kernels.add_rms_norm(x, y, w, 1e-5)
    normed = cpu_kernels.rms_norm(x + y, w, 1e-5)
    assert both is not None and normed is not None
    assert torch.equal(both[0], x + y) and torch.equal(both[1], normed)
    if rows > 1:
        assert cpu_kernels.add_rms_norm(x, y[:1], w, 1e-5) is None  # a broadcast add: torch serves it


@pytest.mark.parametrize("shape", [(8, 576), (1, 576), (3, 20), (2, 3, 64)])
def test_rms_norm_matches_float64_and_each_row_is_its_own(shape: tuple[int, ...]) -> None:
    x, w = _rand(*shape, seed=len(shape)) * 3, _rand(shape[-1], seed=7)
    out = cpu_kernels.rms_norm(x, w, 1e-5)
    assert out is not None
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    np.testing.assert_allclose(out.double().numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    rows = x.reshape(-1, shape[-1])
    for i in range(len(rows)):
        alone = cpu_kernels.rms_norm(rows[i:i + 1], w, 1e-5)
        assert alone is not None and torch.equal(alone[0], out.reshape(-1, shape[-1])[i])
    assert cpu_kernels.rms_norm(x.double(), w.double(), 1e-5) is None  # f64: torch serves it


@pytest.mark.parametrize("n", [49152, 1, 7, 8, 9, 100003])
def test_argmax_rows_picks_numpys_first_maximum(n: int) -> None:
    x = _rand(6, n, seed=n)
    x[1] = x[1].round()  # many ties: the first maximum wins
    x[2] = float("-inf")
    x[3, n // 2] = x[3, -1] = x[3].max() + 1  # the same top twice, once in the tail a vector does not cover
    x[4, -1] = float("nan")  # a NaN is the maximum, as torch and numpy have it
    x[5, n // 3] = float("nan")
    x[5, -1] = float("nan")
    out = cpu_kernels.argmax_rows(x)
    assert out is not None
    np.testing.assert_array_equal(out.numpy(), np.argmax(x.numpy(), axis=-1))
    assert torch.equal(out, torch.argmax(x, dim=-1))
    assert cpu_kernels.argmax_rows(x.double()) is None  # f64: torch serves it


# -- a whole model: a Q4_K_M GGUF (Q4_K and Q6_K kept packed) against the f32 load of the same file -------------

@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama 3 (hidden 256, 2 layers) written as llama.cpp's Q4_K_M: Q4_K and Q6_K weights, F32 norms."""
    from tests import gguf_fixtures

    root = tmp_path_factory.mktemp("q4_k_m")
    return gguf_fixtures.write_gguf(gguf_fixtures.make_wide_llama3(root / "hf"), root / "llama3-q4_k_m.gguf", "llama",
                                    gguf_fixtures.q4_k_m_packed)


def test_a_q4_k_m_model_served_packed_has_the_f32_loads_bits(q4_k_m_gguf: Path) -> None:
    """The stages of --weights packed multiply by the Q4_K/Q6_K blocks themselves (dequant_matmul of those
    schemes), and their prompt logits and greedy tokens are bit for bit those of the stages that read the same
    file dequantized to f32."""
    from graphmesh import models
    from graphmesh.checkpoints import open_checkpoint
    from tests.test_models import BUCKET, CACHE, NEW_TOKENS, SPLITS, generate, make_stages

    ckpt = open_checkpoint(q4_k_m_gguf)
    config = ckpt.config
    assert config is not None
    schemes = ckpt.packed_schemes()
    assert schemes["model.layers.0.self_attn.q_proj.weight"] == "q4_k" and schemes["lm_head.weight"] == "q6_k"
    assert schemes["model.layers.1.mlp.down_proj.weight"] == "q6_k"
    graph = models.build_stage(config, range(0, 2), 1, 1, True, True, quantized=True, packed_schemes=schemes)
    assert {n.attrs["scheme"].s for n in graph.nodes if n.op == "dequant_matmul"} == {"q4_k", "q6_k"}
    prompt = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
    runs = [generate(make_stages(ckpt, config, SPLITS[2], BUCKET, CACHE, quantized=quantized, backend="torch"),
                     config, prompt, NEW_TOKENS, BUCKET) for quantized in (True, False)]
    (packed_logits, packed_tokens), (f32_logits, f32_tokens) = runs
    assert np.array_equal(packed_logits, f32_logits)
    assert packed_tokens == f32_tokens


@pytest.fixture(scope="module")
def f32_mesh(q4_k_m_gguf: Path) -> tuple[list[int], int]:
    """Greedy tokens and weight bytes of a torch mesh reading the Q4_K_M file as f32 (--weights f32)."""
    return _mesh_run(q4_k_m_gguf, "f32", {})


def _mesh_run(path: Path, weights: str, env: dict[str, str]) -> tuple[list[int], int]:
    """24 greedy tokens of a 2-executor torch mesh, and the bytes of the weights its executors hold."""
    from graphmesh.coordinator_client import CoordinatorClient
    from graphmesh.launcher import LocalMesh

    with LocalMesh(2, "torch", str(path), startup_timeout_s=120, weights=weights, env=env,
                   extra_executor_args=("--kv-cache-bytes", "4Mi")) as mesh:
        with CoordinatorClient(mesh.coordinator_address) as client:
            tokens = [t for chunk in client.generate(prompt_token_ids=[5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1],
                                                     max_tokens=24, ignore_eos=True) for t in chunk.token_ids]
            return tokens, sum(stage.param_bytes for stage in client.status().stages)


def test_a_q4_k_m_gguf_over_two_executors_packed_gives_the_f32_loads_tokens(build: str, q4_k_m_gguf: Path,
                                                                          f32_mesh: tuple[list[int], int]) -> None:
    """The real mesh (coordinator, 2 torch executor processes on this build, paged engine) serving the Q4_K_M
    file with --weights packed holds its layers and head as blocks (the embedding, gathered, stays f32: under
    half the f32 load's bytes) and gives the same greedy tokens as the mesh that reads it as f32."""
    tokens, held = _mesh_run(q4_k_m_gguf, "packed", {"GRAPHMESH_CPU_ISA": build})
    f32_tokens, f32_held = f32_mesh
    assert len(tokens) == 24 and tokens == f32_tokens
    assert 0 < held < f32_held / 2
