"""The Triton kernels of the torch backend's CUDA decode path (backends/cuda_kernels.py) against float64 references
written here (rope, paged decode attention over ragged positions, shared and shuffled blocks, key counts either side
of the kernel's 64-key tile, the fused add + RMS norm and silu * up) or against the unfused kernel (the rope pair,
the KV-write pair). Skipped without a GPU (CI has none); run on the lent H200. tests/test_executable.py checks on the
host that the executable wires the fused pairs of nodes into its plan.

Pool rows that no query may see hold large finite garbage, as in test_paged_ops.py: a kernel that lets one through
changes the result."""

import math

import pytest
import torch

cuda_kernels = pytest.importorskip("graphmesh_executor.backends.cuda_kernels")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if cuda_kernels.triton is None:
    pytest.fail("torch sees a GPU but triton is not installed: the CUDA path would run without its kernels")
DEVICE = "cuda"
THETA = {"theta": 10000.0, "inv_freq": (), "scale": 1.0}  # an unscaled rope node's attributes

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
TOL = {"f32": 1e-5, "bf16": 2e-2, "f16": 4e-3}  # atol = rtol, against float64 on inputs already in the dtype
BLOCK = 16
gen = torch.Generator().manual_seed(20261203)


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=gen, dtype=torch.float64)


def close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
    torch.testing.assert_close(got.cpu().double(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("heads", [9, 4, 1])
def test_rope_half_matches_the_reference(heads: int, dtype: str) -> None:
    from graphmesh_executor.backends.torch_ops import half_table

    rows, d = 7, 64
    pos = torch.tensor([0, 1, 5, 17, 200, 4095, 9], dtype=torch.int64)
    # x a view with a row stride wider than its heads, as a slice of the joined q, k, v product is
    wide = rand(rows, heads * d + 96).to(TORCH_DTYPES[dtype]).to(DEVICE)
    x = wide[:, 32 : 32 + heads * d].view(rows, heads, d)
    cos, sin = half_table(pos.to(DEVICE), THETA, d, torch.float32)
    got = cuda_kernels.rope_half(x, cos, sin)
    assert got.dtype == x.dtype and got.shape == x.shape
    c64, s64 = (t.cpu().double() for t in half_table(pos, THETA, d, torch.float64))
    x64 = x.cpu().double()
    close(got, x64 * c64 + x64.roll(d // 2, -1) * s64, dtype)


def paged_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                    pos: torch.Tensor, scale: float) -> torch.Tensor:
    q, k_pool, v_pool = (x.cpu().double() for x in (q, k_pool, v_pool))
    t, hq, d = q.shape
    group = hq // k_pool.shape[1]
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    for i in range(t):
        rows = [int(table[i, j // BLOCK]) * BLOCK + j % BLOCK for j in range(int(pos[i]) + 1)]
        k, v = k_pool[rows], v_pool[rows]
        for h in range(hq):
            w = torch.softmax(k[:, h // group] @ q[i, h] * scale, 0)
            out[i, h] = w @ v[:, h // group]
    return out


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("heads", [(32, 4), (9, 3), (4, 4)], ids=["gqa8", "smollm2", "mha"])
def test_paged_decode_attention_matches_the_reference(heads: tuple[int, int], dtype: str) -> None:
    hq, hkv = heads
    d, n_blocks, width = 64, 64, 24
    # positions 0, one short of a tile, a tile, past it, two long ones, and a row sharing another's first blocks
    pos = torch.tensor([0, 63, 64, 65, 150, 300, 40], dtype=torch.int64)
    ids = torch.randperm(n_blocks - 1, generator=gen).to(torch.int32)  # 44 of them are owned, shuffled
    table = torch.full((len(pos), width), n_blocks - 1, dtype=torch.int32)  # padding: the last block, garbage
    used = 0
    for i, p in enumerate(pos.tolist()[:-1]):
        need = p // BLOCK + 1
        table[i, :need] = ids[used : used + need]
        used += need
    table[-1, :3] = table[4, :3]  # a common prompt prefix: the same pool blocks
    k_pool = rand(n_blocks * BLOCK, hkv, d, scale=30.0)
    v_pool = rand(n_blocks * BLOCK, hkv, d, scale=30.0)
    for i, p in enumerate(pos.tolist()):  # every visible row sane, the rest garbage
        rows = [int(table[i, j // BLOCK]) * BLOCK + j % BLOCK for j in range(p + 1)]
        k_pool[rows] = rand(len(rows), hkv, d)
        v_pool[rows] = rand(len(rows), hkv, d)
    dt = TORCH_DTYPES[dtype]
    q, k_pool, v_pool = (x.to(dt).to(DEVICE) for x in (rand(len(pos), hq, d), k_pool, v_pool))
    scale = 1.0 / math.sqrt(d)
    got = cuda_kernels.paged_decode_attention(q, k_pool, v_pool, table.to(DEVICE), pos.to(DEVICE), BLOCK, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    close(got, paged_reference(q, k_pool, v_pool, table, pos, scale), dtype)


def test_paged_decode_attention_of_no_rows() -> None:
    q = torch.zeros(0, 8, 64, device=DEVICE)
    pool = torch.zeros(4 * BLOCK, 2, 64, device=DEVICE)
    table = torch.zeros(0, 4, dtype=torch.int32, device=DEVICE)
    got = cuda_kernels.paged_decode_attention(q, pool, pool, table, torch.zeros(0, dtype=torch.int64, device=DEVICE),
                                              BLOCK, 0.125)
    assert got.shape == (0, 8, 64)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("hidden", [2048, 576])
def test_add_rms_norm_matches_the_reference(hidden: int, dtype: str) -> None:
    dt, eps = TORCH_DTYPES[dtype], 1e-5
    a, b = (rand(5, hidden).to(dt).to(DEVICE) for _ in range(2))
    w = (1 + rand(hidden, scale=0.1)).to(dt).to(DEVICE)
    total, normed = cuda_kernels.add_rms_norm(a, b, w, eps)
    want = (a.double() + b.double()).to(dt).cpu().double()  # the sum as the add rounds it, then the norm of that
    close(total, want, dtype)
    close(normed, want / (want.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w.cpu().double(), dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("hidden", [2048, 576, 16])
def test_rms_norm_alone_has_the_bits_of_the_fused_add(hidden: int, dtype: str) -> None:
    """A stage that begins at a norm runs it alone where a stage holding the layer before runs add_rms_norm: the
    same bits, at any row count (a recovery re-plans sessions over other stages and must keep their tokens)."""
    dt, eps = TORCH_DTYPES[dtype], 1e-6
    a, b = (rand(256, hidden).to(dt).to(DEVICE) for _ in range(2))
    w = (1 + rand(hidden, scale=0.1)).to(dt).to(DEVICE)
    total, normed = cuda_kernels.add_rms_norm(a, b, w, eps)
    assert torch.equal(cuda_kernels.rms_norm(total, w, eps), normed)
    for rows in (1, 7):
        assert torch.equal(cuda_kernels.rms_norm(total[:rows].clone(), w, eps), normed[:rows])
    want = total.cpu().double()
    close(normed, want / (want.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w.cpu().double(), dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_silu_mul_over_the_halves_of_a_joined_product(dtype: str) -> None:
    dt, n = TORCH_DTYPES[dtype], 5632
    joined = rand(3, 2 * n, scale=3.0).to(dt).to(DEVICE)  # gate and up: column halves, row stride 2n
    gate, up = joined[:, :n], joined[:, n:]
    got = cuda_kernels.silu_mul(gate, up)
    g = gate.cpu().double()
    close(got, torch.nn.functional.silu(g).to(dt).double() * up.cpu().double(), dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_rope_half_pair_is_each_rope_alone(dtype: str) -> None:
    from graphmesh_executor.backends.torch_ops import half_table

    rows, d, dt = 6, 64, TORCH_DTYPES[dtype]
    joined = rand(rows, (32 + 2 * 4) * d).to(dt).to(DEVICE)  # q, k, v of one product: views with its row stride
    q, k = joined[:, : 32 * d].view(rows, 32, d), joined[:, 32 * d : 36 * d].view(rows, 4, d)
    cos, sin = half_table(torch.tensor([0, 3, 7, 8, 100, 2047], device=DEVICE), THETA, d, torch.float32)
    q_rot, k_rot = cuda_kernels.rope_half_pair(q, k, cos, sin)
    assert torch.equal(q_rot, cuda_kernels.rope_half(q, cos, sin))
    assert torch.equal(k_rot, cuda_kernels.rope_half(k, cos, sin))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_scatter_pair_writes_both_pools_at_the_slots_only(dtype: str) -> None:
    dt, width = TORCH_DTYPES[dtype], 256
    k_pool, v_pool = (rand(40, width).to(dt).to(DEVICE) for _ in range(2))
    before = k_pool.clone(), v_pool.clone()
    k_rows = rand(5, width).to(dt).to(DEVICE)
    v_rows = rand(5, 3 * width).to(dt).to(DEVICE)[:, width : 2 * width]  # a column slice, as v of a joined product
    slots = torch.tensor([7, 0, 39, 8, 21], device=DEVICE)
    cuda_kernels.scatter_pair(k_pool, v_pool, k_rows, v_rows, slots)
    for pool, old, rows in ((k_pool, before[0], k_rows), (v_pool, before[1], v_rows)):
        assert torch.equal(pool[slots], rows)
        rest = torch.ones(40, dtype=torch.bool, device=DEVICE)
        rest[slots] = False
        assert torch.equal(pool[rest], old[rest])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_products_match_the_reference_and_f32_rows_keep_their_bits_in_any_batch(dtype: str) -> None:
    """x @ W.T and the grouped product against float64; in f32 each row's bits are the same at 1 to 256 rows
    (cuBLAS's are not: the reason the kernel exists)."""
    t = TORCH_DTYPES[dtype]
    x, w = rand(256, 576), rand(1536, 576, scale=0.05)
    experts, ew = 8, rand(8, 576, 384, scale=0.05)
    ids = torch.randint(0, experts, (256,), generator=gen)
    ids[ids == 2] = 3
    xd, wd, ewd, idd = x.to(DEVICE, t), w.to(DEVICE, t), ew.to(DEVICE, t), ids.to(DEVICE)
    tol = {"f32": 1e-4, "bf16": 3e-2}[dtype]
    want = x.to(t).double() @ w.to(t).double().T
    torch.testing.assert_close(cuda_kernels.matmul_xwt(xd, wd).cpu().double(), want, rtol=tol, atol=tol)
    grouped_want = torch.stack([x[r].to(t).double() @ ew[ids[r]].to(t).double() for r in range(256)])
    grouped = cuda_kernels.grouped_matmul(xd, ewd, idd)
    torch.testing.assert_close(grouped.cpu().double(), grouped_want, rtol=tol, atol=tol)
    if dtype == "f32":
        whole = cuda_kernels.matmul_xwt(xd, wd)
        for lo, hi in ((0, 1), (5, 6), (0, 16), (3, 40), (100, 228)):
            assert torch.equal(cuda_kernels.matmul_xwt(xd[lo:hi].contiguous(), wd), whole[lo:hi]), (lo, hi)
            assert torch.equal(cuda_kernels.grouped_matmul(xd[lo:hi].contiguous(), ewd, idd[lo:hi]),
                               grouped[lo:hi]), (lo, hi)
