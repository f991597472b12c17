"""cuda_kernels' products (the batch-invariant f32 x @ W.T and MoE's grouped product) on every host: Triton's
interpreter runs the kernels' programs on the CPU, each check in a process of its own (tests/triton_interpreted.py).
On a GPU, tests/test_cuda_kernels.py checks the same kernels compiled."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # installed with the product's requirements (xgrammar needs it)


@pytest.mark.parametrize("check", ["products", "rows_alone", "grouped", "tiles"])
def test_product_kernels_under_the_interpreter(check: str) -> None:
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, str(here / "triton_interpreted.py"), check], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
