"""The torch backend's grouped expert product and MoE stages on a CUDA device: grouped_matmul (rows sorted by
expert, one product per expert present) against a float64 reference, experts absent or uneven; and a
tiny Mixtral and Qwen3-MoE split over two f32 stages on the GPU, greedy tokens identical to transformers. Skipped
without a GPU (CI has none); run on the lent H200."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from graphmesh.checkpoints import open_checkpoint
from graphmesh.graph import GraphBuilder, parse
from graphmesh_executor.backends import compile_graph
from tests import test_models
from tests.test_moe_models import MOE_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {"f32": 1e-4, "bf16": 3e-2}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("m,k,n,e", [(37, 64, 96, 8), (1, 128, 64, 4), (200, 32, 48, 16)])
def test_grouped_matmul_on_cuda(dtype: str, m: int, k: int, n: int, e: int) -> None:
    g = GraphBuilder("gmm")
    x, w, ids = g.input("x", (m, k), dtype), g.input("w", (e, k, n), dtype), g.input("ids", (m,), "i64")
    g.output(g.grouped_matmul(x, w, ids))
    exe = compile_graph(parse(g.build()), "torch", "cuda")
    rng = np.random.default_rng(m + e)
    xs, ws = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((e, k, n)).astype(np.float32)
    chosen = rng.integers(0, e // 2 + 1, m)  # half the experts idle, the rest uneven
    (out,) = exe.run({"x": xs, "w": ws, "ids": chosen})
    if dtype == "bf16":  # the reference on the inputs as the kernel sees them
        xs = torch.from_numpy(xs).bfloat16().float().numpy()
        ws = torch.from_numpy(ws).bfloat16().float().numpy()
    want = np.einsum("mk,mkn->mn", xs.astype(np.float64), ws.astype(np.float64)[chosen])
    scale = np.abs(want).max()
    assert np.abs(out - want).max() <= TOL[dtype] * scale


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_stages_on_cuda_match_transformers(name: str, tmp_path: Path) -> None:
    path = MOE_MODELS[name](tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    prompt = np.random.default_rng(9).integers(3, 1000, test_models.PROMPT_LEN).tolist()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=test_models.NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    ckpt = open_checkpoint(path)
    config = ckpt.config
    assert config is not None
    split = [range(0, config.n_layers // 2), range(config.n_layers // 2, config.n_layers)]
    stages = test_models.make_stages(ckpt, config, split, test_models.BUCKET, test_models.CACHE, backend="torch",
                                     device="cuda")
    _, tokens = test_models.generate(stages, config, prompt, test_models.NEW_TOKENS, test_models.BUCKET)
    assert tokens == out[0, test_models.PROMPT_LEN:].tolist()


def test_a_moe_block_is_captured_and_tallies_its_experts_on_cuda() -> None:
    """The MoE block runs static and, from its second run, as a captured CUDA graph (no host read of expert ids):
    each replay routes as the eager run and gives its output (within f32 rounding: the plan fuses silu * up),
    and its experts are tallied as the eager run's."""
    from tests.test_moe import E, F, H, T, moe_block_graph

    graph = parse(moe_block_graph().build())
    exe, eager = compile_graph(graph, "torch", "cuda"), compile_graph(graph, "torch", "cuda")
    rng = np.random.default_rng(6)
    for name, shape in (("router", (E, H)), ("w_gate", (E, H, F)), ("w_up", (E, H, F)), ("w_down", (E, F, H))):
        value = rng.standard_normal(shape).astype(np.float32)
        exe.set_param(name, value)
        eager.set_param(name, value)
    eager.enable_moe_topk_capture(E)  # the interpreter: eager kernels, ids read back
    x = rng.standard_normal((T, H)).astype(np.float32)
    (want, want_top), outs = eager.run({"x": x}), [exe.run({"x": x}) for _ in range(3)]
    assert exe._captures  # type: ignore[attr-defined]
    for out, top in outs:
        assert np.array_equal(top, want_top)
        # the Triton grouped product sums in another order than the eager experts' cuBLAS products: the rounding
        # scales with the outputs' magnitude (up to ~150 here), not with each output (cancellation leaves some < 1)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))
    got, expected = exe.take_moe_residency_stats(), eager.take_moe_residency_stats()
    assert got.resident_tokens == 3 * expected.resident_tokens
    assert got.resident_expert_calls == 3 * expected.resident_expert_calls
