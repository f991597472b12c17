"""Tiny seeded random-weight checkpoints written by transformers (offline), and the bundled SmolLM2 loaded
by transformers as the reference for the real-model tests."""

from __future__ import annotations

import fcntl
import functools
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from graphmesh import checkpoints
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.models.config import ModelConfig

VOCAB = 1000
# A wider init than HF's 0.02 spreads the logits, so greedy decoding of a random model does not hinge on
# near-ties that float32 rounding could flip.
INIT = 0.1
# The tiny decoder every Llama-like family here shares: hidden 64, 4 heads of 16, 2 kv heads; each maker adds what
# its family changes (layers, context, norm eps, a tied head, rope).
SHAPE: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "intermediate_size": 128, "initializer_range": INIT, "bos_token_id": 1, "eos_token_id": 2}


def _save(model: PreTrainedModel, path: Path, **kwargs: Any) -> Path:
    with torch.no_grad():  # HF starts norms at 1 and biases at 0; perturb them so the tests see if they are used
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, INIT)
            elif "norm" in name or ".ln_" in name:
                p.normal_(1.0, INIT)
    model.generation_config.eos_token_id = None  # random weights: decode a fixed number of tokens
    model.save_pretrained(path, **kwargs)
    return path


def make_tiny_llama(path: Path, seed: int = 0, max_position: int = 256, layers: int = 2) -> Path:
    """Llama, untied head, 2 layers (or `layers`), hidden 64, 4 heads of 16, 2 kv heads."""
    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPE, num_hidden_layers=layers, max_position_embeddings=max_position, rms_norm_eps=1e-5,
                         tie_word_embeddings=False)
    return _save(LlamaForCausalLM(config), path)


def tiny_llama_config(path: Path) -> ModelConfig:
    """Writes the tiny Llama at `path` (make_tiny_llama) and returns its config as graphmesh reads it."""
    config = open_checkpoint(make_tiny_llama(path)).config
    assert config is not None
    return config


def make_tiny_mistral(path: Path, seed: int = 8, max_position: int = 256) -> Path:
    """Mistral (the Llama shape under model_type mistral, no sliding window), untied head."""
    torch.manual_seed(seed)
    config = MistralConfig(**SHAPE, num_hidden_layers=2, max_position_embeddings=max_position, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, sliding_window=None)
    return _save(MistralForCausalLM(config), path)


def make_tiny_qwen2(path: Path, seed: int = 1) -> Path:
    """Qwen2 (Llama with q/k/v bias), tied head, rope theta 1e6, saved in small shards with an index."""
    torch.manual_seed(seed)
    config = Qwen2Config(**SHAPE, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return _save(Qwen2ForCausalLM(config), path, max_shard_size="200KB")


# -- issue 38's families and rope variants: small original contexts, so the scaling moves the first positions --

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.7, 3.1, 5.3], "long_factor": [1.0, 4.0, 9.0, 16.0]}


def make_tiny_llama3_rope(path: Path, seed: int = 4, layers: int = 2) -> Path:
    """Llama 3.1-style rope scaling (rope_type llama3) on the tiny Llama shape."""
    torch.manual_seed(seed)
    config = LlamaConfig(**SHAPE, num_hidden_layers=layers, max_position_embeddings=256, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, rope_parameters=dict(LLAMA3_ROPE))
    return _save(LlamaForCausalLM(config), path)


def make_tiny_qwen2_yarn(path: Path, seed: int = 5) -> Path:
    """Qwen2.5 long-context style: YaRN (factor 4 over 64 original positions, attention factor 1.139)."""
    torch.manual_seed(seed)
    config = Qwen2Config(**SHAPE, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, rope_parameters=dict(YARN_ROPE))
    return _save(Qwen2ForCausalLM(config), path)


def make_tiny_qwen3(path: Path, seed: int = 6, layers: int = 2) -> Path:
    """Qwen3 dense: per-head q/k norms, explicit head_dim (32: q_dim 128 != hidden 64), no bias, tied head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**SHAPE, num_hidden_layers=layers, head_dim=32, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return _save(Qwen3ForCausalLM(config), path)


def make_tiny_phi3(path: Path, seed: int = 7) -> Path:
    """Phi-3.5/Phi-4-mini style: fused qkv_proj and gate_up_proj, longrope over 64 original positions (of 256),
    half of each head rotary."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    config = Phi3Config(**SHAPE, num_hidden_layers=2, max_position_embeddings=256, original_max_position_embeddings=64,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=dict(LONGROPE), pad_token_id=0)
    return _save(Phi3ForCausalLM(config), path)


FAMILY_MODELS = {"llama3-rope": make_tiny_llama3_rope, "qwen2-yarn": make_tiny_qwen2_yarn, "qwen3": make_tiny_qwen3,
                 "phi3-longrope": make_tiny_phi3}


def make_tiny_gpt2(path: Path, seed: int = 2) -> Path:
    """GPT-2, 2 layers, hidden 64, 4 heads, tied head."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, initializer_range=INIT,
                        bos_token_id=0, eos_token_id=0)
    return _save(GPT2LMHeadModel(config), path)


def _llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute() of Q/K rows (HF half-rotation -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_TYPES = {"self_attn": gguf.GGMLQuantizationType.Q4_0, "mlp": gguf.GGMLQuantizationType.Q8_0,
              "lm_head": gguf.GGMLQuantizationType.Q4_1}


def write_llama_gguf(hf_dir: Path, path: Path) -> Path:
    """An HF Llama checkpoint as llama.cpp's converter writes it: Q/K rows permuted, attention weights Q4_0,
    MLP Q8_0, an untied head Q4_1, embedding F16, norms F32."""
    ckpt = open_checkpoint(hf_dir)
    c = ckpt.config
    assert c is not None and c.arch == "llama" and not c.qkv_bias
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_bos_token_id(c.bos_token_id or 0)
    w.add_eos_token_id(c.eos_token_ids[0])
    table = {hf: g for g, hf in checkpoints._GGUF_LLAMA.items()}
    for name in ckpt.names():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        key = name.replace(f".{layer}.", ".{i}.", 1) if layer else name
        gname = table[key].format(i=layer)
        array = ckpt.tensor(name)
        if name.endswith("q_proj.weight"):
            array = _llamacpp_permute(array, c.n_heads)
        elif name.endswith("k_proj.weight"):
            array = _llamacpp_permute(array, c.n_kv_heads)
        qtype = next((t for part, t in GGUF_TYPES.items() if part in name), None)
        if qtype is not None:
            w.add_tensor(gname, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, array.astype(np.float16) if "embed" in name else array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TINY_MODELS = {"llama": make_tiny_llama, "qwen2": make_tiny_qwen2, "gpt2": make_tiny_gpt2}


def smollm2_path() -> Path:
    return resolve_model("smollm2-135m")


@functools.cache
def smollm2_hf() -> Any:
    """transformers' SmolLM2 from the bundled GGUF, f32, in eval mode. transformers dequantizes a GGUF in Python
    (15-30 s), so this loads the benchmarks' dequantized copy (bench.peers.ensure_hf_model, under build/peers),
    made by the first test process that needs it while the others wait for it."""
    from bench.peers import HF_MODEL, ensure_hf_model

    HF_MODEL.parent.mkdir(parents=True, exist_ok=True)
    with open(HF_MODEL.parent / "smollm2-hf.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process converts; the others wait for its copy
        path = ensure_hf_model(smollm2_path())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@functools.cache
def smollm2_hf_tokenizer() -> Any:
    path = smollm2_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tiny_tokenizer(path: Path) -> Path:
    """A byte-level tokenizer that fits a tiny model's vocabulary (256 byte tokens, no merges, then
    <|im_start|> 256 and <|im_end|> 257 as special tokens) and a ChatML chat template, in `path` beside a
    checkpoint: the coordinator then serves text prompts on a random-weight model."""
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    from graphmesh.tokenizer import _byte_alphabet

    vocab = {char: i for i, char in sorted((b, c) for b, c in _byte_alphabet().items())}
    tok = HFTokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return path


# -- an encoder group (graphmesh.models.encoder) beside a tiny Llama -------------------------------------

ENCODER_FILE = "encoder.safetensors"


def add_tiny_encoder(path: Path, seed: int = 3, input_dim: int = 24, intermediate_size: int = 48,
                     token_id: int = 999) -> Path:
    """Adds a random encoder (encoder.fc1/fc2 weights and biases, f32) to the HF checkpoint at `path` (from
    make_tiny_llama): its own encoder.safetensors, and "graphmesh_encoder" in config.json. A sharded
    checkpoint's index gets the encoder's tensors too, since the readers only open the files an index names."""
    from safetensors.numpy import save_file

    cfg = json.loads((path / "config.json").read_text())
    rng = np.random.default_rng(seed)
    shapes = {"encoder.fc1.weight": (intermediate_size, input_dim), "encoder.fc1.bias": (intermediate_size,),
              "encoder.fc2.weight": (cfg["hidden_size"], intermediate_size), "encoder.fc2.bias": (cfg["hidden_size"],)}
    save_file({name: rng.normal(0.0, INIT, shape).astype(np.float32) for name, shape in shapes.items()},
              str(path / ENCODER_FILE))
    cfg["graphmesh_encoder"] = {"input_dim": input_dim, "intermediate_size": intermediate_size, "token_id": token_id}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] |= dict.fromkeys(shapes, ENCODER_FILE)
        index.write_text(json.dumps(data, indent=2))
    return path


def encoder_reference(path: Path, features: np.ndarray) -> np.ndarray:
    """The encoder of `path` in torch float32: fc2(gelu(fc1(features))), exact (erf) GELU."""
    from safetensors.torch import load_file

    w = load_file(str(path / ENCODER_FILE))
    x = torch.from_numpy(np.asarray(features, np.float32))
    with torch.no_grad():
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w["encoder.fc1.weight"], w["encoder.fc1.bias"]))
        return torch.nn.functional.linear(h, w["encoder.fc2.weight"], w["encoder.fc2.bias"]).numpy()


def hf_greedy_with_encoder(path: Path, prompt_ids: list[int], features: np.ndarray, max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for `prompt_ids` whose placeholder tokens' embeddings are replaced, in order,
    by encoder_reference(features) rows: the reference for a first stage built with encoded=True. from_pretrained
    reads model.safetensors only (or the index's files, where the encoder's tensors are unexpected keys: a
    warning), so the encoder's tensors never reach the model."""
    token_id = json.loads((path / "config.json").read_text())["graphmesh_encoder"]["token_id"]
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")  # in eval mode
    assert not model.training
    ids = torch.tensor([prompt_ids])
    rows = (ids[0] == token_id).nonzero().flatten()
    if len(rows) != len(features):
        raise ValueError(f"{len(rows)} placeholder tokens for {len(features)} feature rows")
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        embeds[0, rows] = torch.from_numpy(encoder_reference(path, features))
        # Given inputs_embeds and no input_ids, generate returns the new tokens only.
        out = model.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens: list[int] = out[0].tolist()
    assert len(tokens) == max_new_tokens, tokens
    return tokens
