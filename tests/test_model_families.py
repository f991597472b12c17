"""Issue 38's families and rope variants against transformers: the host-made rope frequencies against
transformers' own ROPE_INIT_FUNCTIONS; tiny random checkpoints (Llama with llama3 rope, Qwen2 with YaRN, Qwen3,
Phi-3 with longrope and partial rotary) greedy-decoded through the stage graphs on numpy and torch, token for token
as transformers f32 decodes them; and what is still refused, by field and value."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config, PretrainedConfig, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from graphmesh import models
from graphmesh.checkpoints import _GgufTensor, config_from_gguf, open_checkpoint
from graphmesh.errors import InvalidArgument
from graphmesh.models import ModelConfig
from graphmesh.models.rope import rope_from_hf
from tests import model_fixtures
from tests.test_models import BUCKET, CACHE, LOGIT_TOL, NEW_TOKENS, SPLITS, generate, hf_reference, make_stages

SMALL: dict[str, Any] = {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 32, "max_position_embeddings": 16384}
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
PHI_SHORT = [1.0 + 0.15 * i for i in range(6)]  # 6 frequencies: 12 of head_dim 16 at partial_rotary_factor 0.75


def _v4(**kwargs: Any) -> dict[str, Any]:
    """Config keys of transformers 4's config.json files, which transformers 5 still reads (untyped kwargs)."""
    return kwargs


def _rope_cases() -> list[tuple[str, PretrainedConfig, bool]]:
    """(id, transformers config, partial rotary) for each variant, in both config.json generations: v5's
    rope_parameters and v4's rope_scaling beside a top-level rope_theta (as Llama 3.1's and Qwen2.5's files are)."""
    return [
        ("llama3", LlamaConfig(**SMALL, rope_parameters={**LLAMA31, "rope_theta": 500000.0}), False),
        ("llama3-v4", LlamaConfig(**SMALL, **_v4(rope_scaling=dict(LLAMA31), rope_theta=500000.0)), False),
        ("linear", LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                         "rope_theta": 10000.0}), False),
        ("dynamic", LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                          "rope_theta": 10000.0}), False),
        ("yarn", Qwen2Config(**SMALL, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                       "original_max_position_embeddings": 1024}), False),
        ("yarn-v4", Qwen2Config(**SMALL, **_v4(rope_scaling={"type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 1024}, rope_theta=1e6)),
         False),
        ("yarn-mscale", LlamaConfig(**SMALL, rope_parameters={
            "rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0, "original_max_position_embeddings": 512,
            "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False}), False),
        ("longrope", Phi3Config(**SMALL, original_max_position_embeddings=1024, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": PHI_SHORT, "long_factor": [4 * f for f in PHI_SHORT]}), True),
        ("longrope-v4", Phi3Config(**SMALL, original_max_position_embeddings=1024, **_v4(
            partial_rotary_factor=0.75, rope_theta=10000.0, rope_scaling={
                "type": "longrope", "short_factor": PHI_SHORT, "long_factor": [4 * f for f in PHI_SHORT]})),
         True),
    ]


@pytest.mark.parametrize("name,hf,partial", _rope_cases(), ids=[c[0] for c in _rope_cases()])
def test_rope_frequencies_match_transformers(name: str, hf: PretrainedConfig, partial: bool) -> None:
    """transformers computes in float32; graphmesh's float64 frequencies agree to f32 rounding."""
    cfg = hf.to_dict()
    head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    rope = rope_from_hf(cfg, cfg["model_type"], head_dim, partial_rotary=partial)
    rope_type = hf.rope_parameters["rope_type"]
    want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")  # at start-up length: no dynamic growth
    dim = rope.rotary_dim or head_dim
    got = np.array(rope.inv_freq) if rope.inv_freq else rope.theta ** (-np.arange(0, dim, 2) / dim)
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.double().numpy(), rtol=2e-6)
    assert rope.scale == pytest.approx(want_scale, rel=1e-12)
    # the context graphmesh serves: exact there (see graphmesh.models.rope)
    original = hf.rope_parameters.get("original_max_position_embeddings")
    assert rope.max_position == (original if rope_type == "longrope" else SMALL["max_position_embeddings"])
    if rope_type == "longrope":  # and past it transformers switches to long_factor: graphmesh does not serve that
        long, _ = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len=original + 1)
        assert not np.allclose(got, long.double().numpy())


def test_dynamic_ntk_is_the_default_rope_within_the_served_context() -> None:
    """transformers' dynamic rope at its longest in-context sequence is the default rope, which graphmesh uses."""
    hf = LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    rope = rope_from_hf(hf.to_dict(), "llama", 16)
    at_max, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=rope.max_position)
    past, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, "cpu", seq_len=rope.max_position + 1)
    assert rope.inv_freq == () and rope.scale == 1.0
    np.testing.assert_allclose(at_max.double().numpy(), 10000.0 ** (-np.arange(0, 16, 2) / 16), rtol=2e-6)
    assert not np.allclose(past.numpy(), at_max.numpy())  # beyond: another rope, which graphmesh refuses to reach


@dataclasses.dataclass
class FamilyRef:
    name: str
    path: Path
    prompt: list[int]
    logits: np.ndarray
    tokens: list[int]


@pytest.fixture(scope="module", params=list(model_fixtures.FAMILY_MODELS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FamilyRef:
    name = request.param
    path = model_fixtures.FAMILY_MODELS[name](tmp_path_factory.mktemp(name))
    _, prompt, logits, tokens = hf_reference(path, 8)
    return FamilyRef(name, path, prompt, logits, tokens)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_family_greedy_matches_transformers(family: FamilyRef, backend: str) -> None:
    """Prompt logits within 1e-4 and 20 greedy tokens identical, split two ways; and the variant matters: the
    same checkpoint with an unscaled rope (or without the q/k norms) misses the logits."""
    ckpt = open_checkpoint(family.path)
    config = ckpt.config
    assert config is not None
    logits, tokens = generate(make_stages(ckpt, config, SPLITS[2], BUCKET, CACHE, backend=backend), config,
                              family.prompt, NEW_TOKENS, BUCKET)
    assert np.abs(logits[0] - family.logits).max() < LOGIT_TOL
    assert tokens == family.tokens
    if backend == "numpy" and config.rope_inv_freq:
        plain = dataclasses.replace(config, rope_inv_freq=(), rope_scale=1.0)
        other, _ = generate(make_stages(ckpt, plain, SPLITS[2], BUCKET, CACHE), plain, family.prompt, 1, BUCKET)
        assert np.abs(other[0] - family.logits).max() > 100 * LOGIT_TOL


def test_family_configs() -> None:
    """What each family's config turns into."""
    qwen3 = ModelConfig.from_hf_config(Qwen3Config(**SMALL, head_dim=32).to_dict())
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.q_dim, qwen3.qkv_bias) == (True, 32, 128, False)
    phi3 = ModelConfig.from_hf_config(Phi3Config(**SMALL, **_v4(partial_rotary_factor=0.75)).to_dict())
    assert (phi3.fused_proj, phi3.rotary_dim, phi3.rope_inv_freq) == (True, 12, ())  # 0.75 of 16
    for c in (qwen3, phi3):
        for layers in (range(0, 1), range(1, 1)):
            params = models.stage_params(c, layers, layers.start == 0, True)
            assert c.param_bytes(layers) == sum(4 * int(np.prod(t.shape)) for t in params.values())
    names = set(models.stage_params(phi3, range(0, 1), True, True))
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= set(
        models.stage_params(qwen3, range(0, 1), True, True))


BASE: dict[str, Any] = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "intermediate_size": 24, "max_position_embeddings": 128}


@pytest.mark.parametrize("cfg,words", [
    ({"model_type": "llama", "rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 2]}},
     ["rope_type", "'mrope'"]),
    ({"model_type": "llama", "partial_rotary_factor": 0.5}, ["partial_rotary_factor", "0.5"]),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "linear"}}, ["rope_parameters.factor", "None"]),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]},
      "original_max_position_embeddings": 64}, ["short_factor", "[1.0]"]),
    ({"model_type": "llama", "sliding_window": 64}, ["sliding_window", "64"]),  # transformers' Llama has none
    ({"model_type": "qwen3", "attention_bias": True}, ["attention_bias", "True"]),
    ({"model_type": "gemma"}, ["model_type", "'gemma'"]),  # Gemma 1; Gemma 2 and 3: tests/test_gemma.py
    ({"model_type": "llama", "rope_parameters": {"full_attention": {"rope_type": "default"},
                                                 "sliding_attention": {"rope_type": "default"}}},
     ["rope_parameters", "per-layer"]),
])
def test_unsupported_remainders_are_refused_by_field_and_value(cfg: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(InvalidArgument) as e:
        ModelConfig.from_hf_config({**BASE, **cfg})
    assert e.value.reason == "UNSUPPORTED_MODEL"
    assert all(w in str(e.value) for w in words), str(e.value)


def test_phi3_window_past_the_context_is_no_window() -> None:
    c = ModelConfig.from_hf_config({**BASE, "model_type": "phi3", "sliding_window": 128})
    assert c.fused_proj and c.max_position == 128


def _gguf_meta(**extra: Any) -> dict[str, Any]:
    return {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.block_count": 1, "llama.feed_forward_length": 32, "llama.context_length": 4096,
            "llama.rope.freq_base": 500000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5, **extra}


def _gguf_tensors(*extra: _GgufTensor) -> list[_GgufTensor]:
    import gguf
    embed = _GgufTensor("token_embd.weight", (64, 100), gguf.GGMLQuantizationType.F32, np.zeros((100, 64), np.float32))
    return [embed, *extra]


def test_gguf_llama3_rope_freqs_and_linear_scaling() -> None:
    """llama.cpp's converter writes Llama 3.1's scaling as rope_freqs (a divisor per frequency); the frequencies
    it gives are transformers' llama3 ones. llama.rope.scaling.type linear divides them all."""
    import gguf
    hf = LlamaConfig(**SMALL, rope_parameters={**LLAMA31, "rope_theta": 500000.0})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    base = 500000.0 ** (-np.arange(0, 16, 2) / 16)
    # convert_hf_to_gguf's LlamaModel.generate_extra_tensors: factor for low frequencies, 1 for high, smoothed between
    factors = []
    for freq in base:
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    freqs = _GgufTensor("rope_freqs.weight", (8,), gguf.GGMLQuantizationType.F32, np.array(factors, np.float32))
    c = config_from_gguf(_gguf_meta(), _gguf_tensors(freqs))
    np.testing.assert_allclose(c.rope_inv_freq, want.double().numpy(), rtol=2e-6)
    linear = config_from_gguf(_gguf_meta(**{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}),
                              _gguf_tensors())
    np.testing.assert_allclose(linear.rope_inv_freq, base / 4.0, rtol=1e-12)
    assert config_from_gguf(_gguf_meta(), _gguf_tensors()).rope_inv_freq == ()
    with pytest.raises(InvalidArgument, match=r"rope\.scaling\.type 'yarn'"):
        config_from_gguf(_gguf_meta(**{"llama.rope.scaling.type": "yarn"}), _gguf_tensors())


@pytest.mark.parametrize("name", ["llama3-rope", "qwen3"])
def test_family_over_one_and_two_executors_matches_transformers(name: str, tmp_path: Path) -> None:
    """The real mesh (coordinator and executor processes, the paged engine) on 1 and 2 executors, greedy output
    token-identical to transformers f32."""
    from graphmesh.coordinator_client import CoordinatorClient
    from graphmesh.launcher import LocalMesh

    path = model_fixtures.FAMILY_MODELS[name](tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    want = out[0, len(prompt):].tolist()
    for n in (1, 2):
        # a small KV pool: the numpy backend copies the pool every step
        with LocalMesh(n, "numpy", str(path), startup_timeout_s=120,
                       extra_executor_args=("--kv-cache-bytes", "4Mi")) as mesh:
            with CoordinatorClient(mesh.coordinator_address) as client:
                got = [t for chunk in client.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True)
                       for t in chunk.token_ids]
        assert got == want, f"{name} over {n} executors"


def _chat_dir(path: Path, template: str, eos_token: str, generation_eos: Any) -> Path:
    """A tiny Llama beside a byte-level tokenizer with Llama 3's, Gemma's and Phi-3's end-of-turn tokens."""
    import json

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    model_fixtures.write_tiny_tokenizer(model_fixtures.make_tiny_llama(path))
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in ("<|eot_id|>", "<end_of_turn>", "<|end|>")])  # ids 258, 259, 260
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": eos_token}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


@pytest.mark.parametrize("template,eos_token,generation_eos,want", [
    # ChatML (Qwen2.5): config.json's eos 2, the tokenizer's <|im_end|> 257, generation_config's extra 7
    (model_fixtures.CHATML, "<|im_end|>", [2, 7], (2, 7, 257)),
    # Llama 3 instruct: eos_token <|end_of_text|>-like (here 2), the template's <|eot_id|> stops too
    ("{% for m in messages %}{{ m['content'] + '<|eot_id|>' }}{% endfor %}", "<|im_start|>", None, (2, 256, 258)),
    # Gemma: <end_of_turn> from the template; Phi-3: <|end|>; a marker absent from the template is not a stop
    ("{% for m in messages %}{{ m['content'] + '<end_of_turn>\n' }}{% endfor %}", "<|im_start|>", 2, (2, 256, 259)),
    ("{% for m in messages %}{{ m['content'] + '<|end|>\n' }}{% endfor %}", "<|im_start|>", 2, (2, 256, 260)),
])
def test_end_of_turn_tokens_stop_generation(tmp_path: Path, template: str, eos_token: str, generation_eos: Any,
                                            want: tuple[int, ...]) -> None:
    from graphmesh.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(open_checkpoint(_chat_dir(tmp_path / "m", template, eos_token, generation_eos)))
    assert tok.eos_token_ids == want
