"""Issue 38's MoE families against transformers: tiny random Mixtral and Qwen3-MoE checkpoints (written here by
transformers' save_pretrained, no download) greedy-decoded through the stage graphs (graphmesh.models.moe: router,
top-k, grouped expert products) split over two stages on numpy and torch, token for token as transformers f32
decodes them; one of them through a real mesh of two torch executors; what the planner counts for a sparse layer;
and the MoE variants still refused, by field and value."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from graphmesh import models
from graphmesh.checkpoints import open_checkpoint
from graphmesh.errors import InvalidArgument
from graphmesh.models import ModelConfig
from graphmesh.models.moe import read_param
from graphmesh_coordinator.planner import layer_bytes, plan
from tests import model_fixtures
from tests.test_models import BUCKET, CACHE, LOGIT_TOL, NEW_TOKENS, Reference, generate, make_stages, reference

ATTN: dict[str, Any] = {"vocab_size": model_fixtures.VOCAB, "hidden_size": 64, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "max_position_embeddings": 256,
                        "initializer_range": model_fixtures.INIT, "tie_word_embeddings": False,
                        "bos_token_id": 1, "eos_token_id": 2}


def _kw(**kwargs: Any) -> dict[str, Any]:
    """Keys transformers' typed config signatures omit but still take (Qwen3MoeConfig's head_dim)."""
    return kwargs


def make_tiny_mixtral(path: Path, seed: int = 11) -> Path:
    """Mixtral: every layer sparse, 4 experts of 96, top-2 renormalised; 2 layers."""
    torch.manual_seed(seed)
    config = MixtralConfig(**ATTN, num_hidden_layers=2, intermediate_size=96, num_local_experts=4,
                           num_experts_per_tok=2, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return model_fixtures._save(MixtralForCausalLM(config), path)


def make_tiny_qwen3_moe(path: Path, seed: int = 12) -> Path:
    """Qwen3-MoE: q/k norms, head_dim 32, 8 experts of 48, top-2 renormalised (norm_topk_prob, as Qwen3-30B-A3B);
    3 layers, the middle one dense (mlp_only_layers) with intermediate 128."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**ATTN, num_hidden_layers=3, **_kw(head_dim=32), intermediate_size=128, moe_intermediate_size=48,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return model_fixtures._save(Qwen3MoeForCausalLM(config), path)


def make_tiny_qwen3_moe_step(path: Path, seed: int = 13) -> Path:
    """Qwen3-MoE, the other knobs: decoder_sparse_step 2 (layers 1 and 3 sparse) and raw top-k probabilities
    (norm_topk_prob False); 4 layers."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**ATTN, num_hidden_layers=4, **_kw(head_dim=16), intermediate_size=96, moe_intermediate_size=32,
                            num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2,
                            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return model_fixtures._save(Qwen3MoeForCausalLM(config), path)


MOE_MODELS: dict[str, Callable[[Path], Path]] = {
    "mixtral": make_tiny_mixtral, "qwen3_moe": make_tiny_qwen3_moe, "qwen3_moe-step2": make_tiny_qwen3_moe_step}


@pytest.fixture(scope="module", params=list(MOE_MODELS))
def moe_ref(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return reference(request.param, MOE_MODELS[request.param], tmp_path_factory.mktemp(request.param), 9)


def _two_stages(n_layers: int) -> list[range]:
    return [range(0, n_layers // 2), range(n_layers // 2, n_layers)]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_moe_greedy_matches_transformers(moe_ref: Reference, backend: str) -> None:
    """Prompt logits within 1e-4 and 20 greedy tokens identical over two stages (a padded prefill bucket, then
    decode); and the routing matters: the same checkpoint with top-1 routing misses the logits."""
    ckpt = open_checkpoint(moe_ref.path)
    config = ckpt.config
    assert config is not None and config.moe is not None
    split = _two_stages(config.n_layers)
    logits, tokens = generate(make_stages(ckpt, config, split, BUCKET, CACHE, backend=backend), config,
                              moe_ref.prompt, NEW_TOKENS, BUCKET)
    assert np.abs(logits[0] - moe_ref.logits).max() < LOGIT_TOL
    assert tokens == moe_ref.tokens
    if backend == "numpy":
        top1 = dataclasses.replace(config, moe=dataclasses.replace(config.moe, top_k=1))
        other, _ = generate(make_stages(ckpt, top1, split, BUCKET, CACHE), top1, moe_ref.prompt, 1, BUCKET)
        assert np.abs(other[0] - moe_ref.logits).max() > 100 * LOGIT_TOL


def test_moe_configs_and_params(tmp_path: Path) -> None:
    """Which layers are sparse, the params a stage declares (stacked experts [E, in, out]) and what they are read
    from: transformers' per-expert tensors, transposed and stacked."""
    mixtral = open_checkpoint(make_tiny_mixtral(tmp_path / "mixtral"))
    qwen = open_checkpoint(make_tiny_qwen3_moe_step(tmp_path / "qwen"))
    assert mixtral.config is not None and qwen.config is not None
    mc, qc = mixtral.config, qwen.config
    assert mc.moe is not None and qc.moe is not None
    assert (mc.moe.n_experts, mc.moe.top_k, mc.moe.layers, mc.moe.norm_topk_prob) == (4, 2, (0, 1), True)
    assert (qc.moe.n_experts, qc.moe.intermediate_size, qc.moe.layers, qc.moe.norm_topk_prob) == (6, 32, (1, 3), False)
    assert qc.qk_norm and not mc.qk_norm
    params = models.stage_params(mc, range(1, 2), False, True)
    assert params["model.layers.1.block_sparse_moe.experts.w2.stacked"].shape == (4, 96, 64)
    assert params["model.layers.1.block_sparse_moe.gate.weight"].shape == (4, 64)
    w1 = read_param(mixtral, "model.layers.1.block_sparse_moe.experts.w1.stacked")
    assert w1.shape == (4, 64, 96)
    np.testing.assert_array_equal(w1[3], mixtral.tensor("model.layers.1.block_sparse_moe.experts.3.w1.weight").T)
    qnames = set(models.stage_params(qc, range(0, 4), True, True))
    assert "model.layers.0.mlp.gate_proj.weight" in qnames and "model.layers.1.mlp.gate.weight" in qnames
    assert "model.layers.3.mlp.experts.up_proj.stacked" in qnames and "model.layers.2.mlp.gate.weight" not in qnames
    for c in (mc, qc):
        for layers in (range(0, 1), range(1, c.n_layers), range(1, 1)):
            declared = models.stage_params(c, layers, layers.start == 0, layers.stop == c.n_layers)
            assert c.param_bytes(layers) == sum(4 * int(np.prod(t.shape)) for t in declared.values())


def test_fused_expert_tensors_are_read(tmp_path: Path) -> None:
    """A checkpoint in transformers 5's in-memory layout (experts fused: gate_up_proj [E, 2F, H], down_proj
    [E, H, F]) gives the same stacked params as the per-expert one save_pretrained writes."""
    from safetensors.numpy import save_file

    per_expert = open_checkpoint(make_tiny_mixtral(tmp_path / "m"))
    prefix = "model.layers.0.block_sparse_moe.experts"
    proj = {name: [per_expert.tensor(f"{prefix}.{i}.{name}.weight") for i in range(4)] for name in ("w1", "w3", "w2")}
    gate_up = np.stack([np.concatenate([g, u]) for g, u in zip(proj["w1"], proj["w3"])])
    fused = tmp_path / "fused.safetensors"
    save_file({f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": np.stack(proj["w2"])}, str(fused))
    ckpt = open_checkpoint(fused)
    for name in ("w1", "w3", "w2"):
        np.testing.assert_array_equal(read_param(ckpt, f"{prefix}.{name}.stacked"),
                                      read_param(per_expert, f"{prefix}.{name}.stacked"))


def test_planner_counts_active_experts() -> None:
    """A sparse layer costs its top_k experts' bytes per token in the split, and all of them in memory; a plan
    over a MoE model balances without error."""
    cfg = {**ATTN, "model_type": "mixtral", "num_hidden_layers": 8, "intermediate_size": 96,
           "num_local_experts": 8, "num_experts_per_tok": 2}
    c = ModelConfig.from_hf_config(cfg)
    dense = dataclasses.replace(c, moe=None)
    h, f = c.hidden_size, 96
    assert c.layer_params(0) - dense.layer_params(0) == 8 * h + 7 * 3 * h * f  # router + 7 more experts
    assert c.layer_params(0, active=True) - dense.layer_params(0) == 8 * h + 3 * h * f  # router + 1 more expert
    assert layer_bytes(c) == 4 * c.layer_params(0, active=True)
    stages = plan(c, ["a", "b", "c"])
    assert [s.layer_end - s.layer_start for s in stages] and stages[-1].layer_end == 8


BASE: dict[str, Any] = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "intermediate_size": 24, "max_position_embeddings": 128,
                        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}


@pytest.mark.parametrize("cfg,words", [
    ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 32}, ["shared_expert_intermediate_size", "32"]),
    ({"model_type": "deepseek_v3", "n_shared_experts": 1}, ["n_shared_experts", "1"]),
    ({"model_type": "deepseek_v2", "first_k_dense_replace": 1}, ["first_k_dense_replace", "1"]),
    ({"model_type": "qwen3_moe", "num_experts_per_tok": 5}, ["num_experts_per_tok", "5"]),
    # windows are served (tests/test_gemma.py); a malformed one is not
    ({"model_type": "mixtral", "sliding_window": -4}, ["sliding_window", "-4"]),
    ({"model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 2.5}, ["sliding_window", "2.5"]),
    ({"model_type": "olmoe"}, ["model_type", "'olmoe'"]),
])
def test_unsupported_moe_variants_are_refused_by_field_and_value(cfg: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(InvalidArgument) as e:
        ModelConfig.from_hf_config({**BASE, **cfg})
    assert e.value.reason in ("UNSUPPORTED_MODEL", "BAD_CONFIG")
    assert all(w in str(e.value) for w in words), str(e.value)


def test_qwen3_moe_over_two_torch_executors_matches_transformers(tmp_path: Path) -> None:
    """The real mesh (coordinator and two torch executor processes, the paged engine): greedy output
    token-identical to transformers f32."""
    from graphmesh.coordinator_client import CoordinatorClient
    from graphmesh.launcher import LocalMesh

    path = make_tiny_qwen3_moe(tmp_path / "qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    want = out[0, len(prompt):].tolist()
    with LocalMesh(2, "torch", str(path), startup_timeout_s=120,
                   extra_executor_args=("--kv-cache-bytes", "4Mi")) as mesh:
        with CoordinatorClient(mesh.coordinator_address) as client:
            got = [t for chunk in client.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True)
                   for t in chunk.token_ids]
    assert got == want
