"""Checks of cuda_kernels' products run by Triton's interpreter on the host (tests/test_cuda_products.py runs
each in a process of its own: the interpreter is chosen when the kernels are defined, TRITON_INTERPRET=1 first).
The interpreter follows the kernel's program (its tiles, masks and k loop) in numpy; the same program's bits on a
GPU are checked by tests/test_cuda_kernels.py there. bf16 is left to the GPU: the interpreter has no bf16."""

import os
import sys
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import torch

from graphmesh_executor.backends import cuda_kernels


def _dot(a: np.ndarray, b: np.ndarray, dtype: Any = None, **kwargs: Any) -> np.ndarray:
    """np.matmul as the interpreter's tl.dot calls it, each output element summed over k by the same loop wherever
    its row sits in the tile: the host BLAS's sgemm does not promise that (OpenBLAS 0.3.31 gives a row other bits
    at another place in a 16-row tile on an AVX-512 host), and a GPU's dot does. What these checks test is the
    kernel's own program: its tiles, masks and k loop."""
    assert not kwargs, kwargs
    return np.einsum("...ik,...kj->...ij", a, b, dtype=dtype, optimize=False)


np.matmul = _dot  # type: ignore[assignment]  # this process only runs these checks


def products() -> None:
    """x @ W.T against float64 for f32 and f16, a strided W, and a row count of 0."""
    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 3e-2)):
        x, w = torch.randn(37, 80).to(dtype), torch.randn(70, 80).to(dtype)
        for weight in (w, w.T.contiguous().T):  # [N, K] row-major, and the same values column-major
            got = cuda_kernels.matmul_xwt(x, weight).double()
            want = x.double() @ w.double().T
            assert (got - want).abs().max() < tol * want.abs().max(), (dtype, (got - want).abs().max())
    assert cuda_kernels.matmul_xwt(torch.randn(0, 80), torch.randn(70, 80)).shape == (0, 70)


def rows_alone() -> None:
    """A row's f32 product has the same bits whatever rows share its launch: 1 to 40 rows, any offset."""
    torch.manual_seed(1)
    x, w = torch.randn(40, 96), torch.randn(130, 96)
    whole = cuda_kernels.matmul_xwt(x, w)
    for lo, hi in ((0, 1), (7, 8), (3, 19), (16, 33), (0, 17)):
        assert torch.equal(cuda_kernels.matmul_xwt(x[lo:hi].contiguous(), w), whole[lo:hi]), (lo, hi)


def grouped() -> None:
    """out[r] = x[r] @ w[ids[r]] against float64 for f32 and f16: experts absent, one expert taking every row, a
    single row; and each row's f32 bits the same in any company."""
    torch.manual_seed(2)
    experts = 6
    x, w = torch.randn(37, 80), torch.randn(experts, 80, 50)
    ids = torch.randint(0, experts, (37,))
    ids[ids == 3] = 4  # expert 3 idle
    for routing in (ids, torch.full((37,), 5)):
        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 3e-2)):
            got = cuda_kernels.grouped_matmul(x.to(dtype), w.to(dtype), routing).double()
            want = torch.stack([x[r].to(dtype).double() @ w[routing[r]].to(dtype).double() for r in range(37)])
            assert (got - want).abs().max() < tol * want.abs().max(), (dtype, (got - want).abs().max())
    whole = cuda_kernels.grouped_matmul(x, w, ids)
    for lo, hi in ((0, 1), (5, 6), (2, 21), (0, 17)):
        assert torch.equal(cuda_kernels.grouped_matmul(x[lo:hi].contiguous(), w, ids[lo:hi]), whole[lo:hi]), (lo, hi)


def tiles() -> None:
    """The grouped schedule covers every row exactly once, each tile within one expert's run, for random routings."""
    gen = torch.Generator().manual_seed(3)
    for rows, experts, tile in ((1, 4, 16), (37, 6, 16), (100, 128, 16), (64, 2, 16), (33, 8, 4)):
        ids = torch.randint(0, experts, (rows,), generator=gen)
        src, expert, first, end = cuda_kernels.expert_tiles(ids, experts, tile)
        assert sorted(src.tolist()) == list(range(rows))
        covered = []
        for e, f, n in zip(expert.tolist(), first.tolist(), end.tolist()):
            if e < 0:
                continue
            run = src[f:min(f + tile, n)]
            assert (ids[run] == e).all() and len(run) > 0
            covered += run.tolist()
        assert sorted(covered) == list(range(rows)), (rows, experts)


if __name__ == "__main__":
    {"products": products, "rows_alone": rows_alone, "grouped": grouped, "tiles": tiles}[sys.argv[1]]()
