"""Issue 38's remaining families: Gemma 2 (attention and final logit soft-capping, alternating sliding-window and
global layers, GeGLU, scaled embeddings, sandwich norms of (1 + w), query_pre_attn_scalar), Gemma 3 text (q/k
norms, the local layers' own rope base) and sliding-window attention in Mistral and Qwen2. Tiny random checkpoints
made by transformers here, with a window of 6 tokens under prompts of 11 and 20 new tokens, so every query past
the sixth position loses keys to it; greedy tokens identical to transformers' f32 (eager attention: the reference
for soft-capping) through the stage graphs split 1, 2 and 3 ways on numpy and torch, and through the real mesh."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from graphmesh import models
from graphmesh.checkpoints import open_checkpoint
from graphmesh.errors import InvalidArgument
from graphmesh.models import ModelConfig
from tests import model_fixtures
from tests.conftest import backend_targets
from tests.test_models import (
    BUCKET,
    CACHE,
    LOGIT_TOL,
    NEW_TOKENS,
    SPLITS,
    Reference,
    generate,
    make_stages,
    reference,
)

WINDOW = 6
SHAPE: dict[str, Any] = {"vocab_size": model_fixtures.VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                         "max_position_embeddings": 256, "initializer_range": model_fixtures.INIT,
                         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
TYPES = ["sliding_attention", "full_attention"]


def make_gemma2(path: Path) -> Path:
    """Gemma 2: layer 0 sliding, layer 1 global; caps small enough to bend these random scores and logits;
    query_pre_attn_scalar 24, not head_dim 16, so the scale is the config's."""
    torch.manual_seed(11)
    config = Gemma2Config(**SHAPE, head_dim=16, sliding_window=WINDOW, layer_types=TYPES, query_pre_attn_scalar=24,
                          attn_logit_softcapping=2.0, final_logit_softcapping=4.0, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return model_fixtures._save(Gemma2ForCausalLM(config), path)


def make_gemma3(path: Path) -> Path:
    """Gemma 3 text: q/k norms, the global layer's rope linear-scaled at theta 1e6, the local one's theta 1e4."""
    torch.manual_seed(12)
    config = Gemma3TextConfig(**SHAPE, head_dim=16, sliding_window=WINDOW, layer_types=TYPES,
                              query_pre_attn_scalar=16, rms_norm_eps=1e-6, rope_parameters={
                                  "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    return model_fixtures._save(Gemma3ForCausalLM(config), path)


def make_mistral(path: Path) -> Path:
    """Mistral with its window on every layer."""
    torch.manual_seed(13)
    config = MistralConfig(**SHAPE, sliding_window=WINDOW, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return model_fixtures._save(MistralForCausalLM(config), path)


def make_qwen2(path: Path) -> Path:
    """Qwen2 with use_sliding_window: layers from max_window_layers (1) on are windowed, layer 0 is not."""
    torch.manual_seed(14)
    config = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                         rms_norm_eps=1e-6, tie_word_embeddings=True)
    return model_fixtures._save(Qwen2ForCausalLM(config), path)


MODELS = {"gemma2": make_gemma2, "gemma3": make_gemma3, "mistral-window": make_mistral, "qwen2-window": make_qwen2}


@pytest.fixture(scope="module", params=list(MODELS))
def ref(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return reference(request.param, MODELS[request.param], tmp_path_factory.mktemp(request.param), 9)


@pytest.mark.parametrize("backend", backend_targets())  # numpy, torch, mlx where installed, torch:cuda on a GPU
def test_greedy_matches_transformers(ref: Reference, backend: str) -> None:
    """Prompt logits within LOGIT_TOL and 20 greedy tokens identical, split 1, 2 and 3 ways; and the window
    matters: the same graphs without it miss transformers' logits at the prompt's last position."""
    ckpt = open_checkpoint(ref.path)
    config = ckpt.config
    assert config is not None and any(config.windows)
    name, _, device = backend.partition(":")
    for ways in sorted(SPLITS):
        stages = make_stages(ckpt, config, SPLITS[ways], BUCKET, CACHE, backend=name, device=device or "cpu")
        logits, tokens = generate(stages, config, ref.prompt, NEW_TOKENS, BUCKET)
        assert np.abs(logits[0] - ref.logits).max() < LOGIT_TOL, f"{ways} ways"
        assert tokens == ref.tokens, f"{ways} ways"
    if backend == "numpy":
        plain = dataclasses.replace(config, windows=())
        other, _ = generate(make_stages(ckpt, plain, SPLITS[1], BUCKET, CACHE), plain, ref.prompt, 1, BUCKET)
        assert np.abs(other[0] - ref.logits).max() > 100 * LOGIT_TOL


def test_configs() -> None:
    """What each config turns into, and the params a stage declares are what the planner counts."""
    g2 = ModelConfig.from_hf_config(Gemma2Config(**SHAPE, head_dim=16, sliding_window=WINDOW,
                                                 query_pre_attn_scalar=24).to_dict())
    assert (g2.gemma, g2.windows, g2.attn_softcap, g2.final_softcap, g2.hidden_act) == (
        True, (WINDOW, 0), 50.0, 30.0, "gelu_tanh")
    assert g2.attn_scale == pytest.approx(24 ** -0.5) and g2.local_rope is None and g2.tie_word_embeddings
    g3 = ModelConfig.from_hf_config(Gemma3TextConfig(**{**SHAPE, "num_hidden_layers": 7}, head_dim=16).to_dict())
    assert g3.windows == (4096,) * 5 + (0, 4096) and g3.qk_norm and g3.attn_softcap == 0.0  # pattern 6
    assert g3.local_rope is not None and (g3.rope_theta, g3.local_rope.theta) == (1e6, 1e4)
    # transformers 4's config.json: rope_theta / rope_scaling for global layers, rope_local_base_freq for local ones
    v4 = {**g3_v4_base(), "rope_theta": 5e5, "rope_local_base_freq": 2e4,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    old = ModelConfig.from_hf_config(v4)
    assert old.local_rope is not None and (old.rope_theta, old.local_rope.theta) == (5e5, 2e4)
    np.testing.assert_allclose(old.rope_inv_freq, 5e5 ** (-np.arange(0, 16, 2) / 16) / 8.0)
    qwen = ModelConfig.from_hf_config(Qwen2Config(**{**SHAPE, "num_hidden_layers": 4}, use_sliding_window=True,
                                                  sliding_window=32, max_window_layers=2).to_dict())
    assert qwen.windows == (0, 0, 32, 32)
    assert ModelConfig.from_hf_config(Qwen2Config(**SHAPE, sliding_window=32).to_dict()).windows == ()  # no flag
    assert ModelConfig.from_hf_config(MistralConfig(**SHAPE, sliding_window=32).to_dict()).windows == (32, 32)
    moe = {"num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    assert ModelConfig.from_hf_config({**SHAPE, **moe, "model_type": "mixtral", "sliding_window": 32}).windows == (
        32, 32)
    assert ModelConfig.from_hf_config({**SHAPE, **moe, "model_type": "qwen3_moe", "use_sliding_window": True,
                                       "sliding_window": 32}).windows == (32, 32)
    for c in (g2, g3):
        for layers in (range(0, 1), range(1, 2)):
            params = models.stage_params(c, layers, layers.start == 0, layers.stop == c.n_layers)
            assert c.param_bytes(layers) == sum(4 * int(np.prod(t.shape)) for t in params.values())
    assert {"model.layers.1.pre_feedforward_layernorm.weight", "model.layers.1.post_feedforward_layernorm.weight",
            "model.layers.1.self_attn.q_norm.weight"} <= set(models.stage_params(g3, range(1, 2), False, True))


def g3_v4_base() -> dict[str, Any]:
    cfg = {**SHAPE, "model_type": "gemma3_text", "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh",
           "sliding_window": 512, "query_pre_attn_scalar": 16}
    return cfg


@pytest.mark.parametrize("cfg,words", [
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, ["hidden_activation", "'gelu'"]),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, ["use_bidirectional_attention", "True"]),
    ({"model_type": "gemma2", "sliding_window": 8, "layer_types": ["chunked_attention", "full_attention"]},
     ["layer_types", "chunked_attention"]),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "default"},
                                                       "chunked_attention": {"rope_type": "default"}}},
     ["rope_parameters", "chunked_attention"]),
    ({"model_type": "llama", "sliding_window": 8}, ["sliding_window", "8", "llama"]),
    ({"model_type": "mistral", "sliding_window": 0}, ["sliding_window", "0"]),
    ({"model_type": "gemma3"}, ["model_type", "'gemma3'"]),
])
def test_unsupported_remainders_are_refused_by_field_and_value(cfg: dict[str, Any], words: list[str]) -> None:
    base = {**SHAPE, "head_dim": 16}
    with pytest.raises(InvalidArgument) as e:
        ModelConfig.from_hf_config({**base, **cfg})
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("backend", ["numpy", "torch", *(["torch:cuda"] if torch.cuda.is_available() else [])])
def test_mesh_over_one_and_three_executors_matches_transformers(name: str, backend: str, tmp_path: Path) -> None:
    """The real mesh (coordinator and executor processes, the paged engine: prompt chunks and decode runs over the
    paged KV) on 1 executor (a decode run chained on one rank) and on 3 (first, middle and last ranks, the tokens
    fed back), greedy output token-identical to transformers f32 past the window. Splits 2 ways are
    test_greedy_matches_transformers's, in-process."""
    from graphmesh.coordinator_client import CoordinatorClient
    from graphmesh.launcher import LocalMesh

    path = MODELS[name](tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    prompt = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1, 77, 301, 8, 64, 19, 23]  # 17 tokens: 3 windows
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    want = out[0, len(prompt):].tolist()
    for n in (1, 3):
        # --max-step-tokens 8: the prompt arrives in chunks, each attending to the window over the pool. On CUDA the
        # stages default to bf16: f32 is asked for, the dtype of the reference.
        kind, _, device = backend.partition(":")
        with LocalMesh(n, kind, str(path), startup_timeout_s=120,
                       extra_executor_args=("--kv-cache-bytes", "4Mi", *(("--device", "cuda:0") if device else ())),
                       extra_coordinator_args=("--max-step-tokens", "8", "--dtype", "f32")) as mesh:
            with CoordinatorClient(mesh.coordinator_address) as client:
                got = [t for chunk in client.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True)
                       for t in chunk.token_ids]
        assert got == want, f"{name} over {n} executors on {backend}"
