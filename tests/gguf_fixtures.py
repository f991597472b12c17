"""Tiny GGUF files written from tiny transformers checkpoints the way llama.cpp's convert_hf_to_gguf.py writes
them (per-architecture metadata keys, tensor names, Q/K rows permuted for the llama architecture only, Llama 3's
rope scaling as a rope_freqs tensor), quantized with gguf-py for Q4_0/Q4_1/Q5_0/Q8_0 and with the K-quant
quantizers below, which gguf-py (0.19) does not have: it only dequantizes Q2_K-Q6_K.

The K-quant quantizers are simple (min/max scales, no llama.cpp error search): the tests compare graphmesh
against transformers holding the *dequantized* weights, so they need valid blocks, not the best ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from graphmesh import checkpoints
from graphmesh.checkpoints import open_checkpoint
from graphmesh.tokenizer import _byte_alphabet
from tests import model_fixtures

QK_K = 256
F16 = np.float16


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(F16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def _scale_min_k4(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K's common part for blocks x [n, 256]: (d, dmin as f16 [n, 1], 6-bit scales and mins [n, 8],
    quants [n, 8, 32] in 0..levels) with x ~ d*sc*q - dmin*m per 32-value sub-block."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    step = (sub.max(axis=-1) - lo) / levels  # each sub-block's step and offset before the 6-bit rounding
    d = _f16(step.max(axis=-1, keepdims=True) / 63)
    dmin = _f16(-lo.min(axis=-1, keepdims=True) / 63)
    sc = np.clip(np.rint(_safe_div(step, d.astype(np.float32))), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-lo, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    scale = (d.astype(np.float32) * sc)[..., None]
    offset = (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.rint(_safe_div(sub + offset, scale)), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 scale bytes gguf.quants.Q4_K.get_scale_min unpacks: 6 bits each, the top 2 of sub-blocks 4-7
    in the high bits of bytes 0-7."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=-1).astype(np.uint8)


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] 4-bit values -> [n, 128] bytes: sub-blocks 2k and 2k+1 share bytes 32k..32k+31 (low, high)."""
    pairs = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _scale_min_k4(x, 15)
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_scales_k4(sc, mn), _low_nibbles(q)], axis=-1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _scale_min_k4(x, 31)
    high = ((q >> 4) & 1).astype(np.uint8)  # bit j of qh[b]: sub-block j's value b
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), _pack_scales_k4(sc, mn), qh, _low_nibbles(q)],
                          axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=-1) / 31  # signed 6 bits: -32..31 around 32
    d = _f16(step.max(axis=-1, keepdims=True) / 127)
    scales = np.clip(np.rint(_safe_div(step, d.astype(np.float32))), 0, 127).astype(np.int8)
    scale = (d.astype(np.float32) * scales)[..., None]
    q = (np.clip(np.rint(_safe_div(sub, scale)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    # value i of a half h: ql byte h*64 + i%64 (nibble i//64), qh byte h*32 + i%32 (bits 2*(i//32))
    lo = q & 0x0F
    ql = (lo[:, :, :64] | (lo[:, :, 64:] << 4)).reshape(-1, 128)
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    qh = (hi << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, scales.view(np.uint8), d.view(np.uint8)], axis=-1)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """[n, 256] 2-bit values -> [n, 64] bytes (Q2_K/Q3_K's qs): value h*128 + s*32 + j in bits 2s of byte h*32 + j."""
    four = (q & 3).reshape(-1, 2, 4, 32)
    return (four << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def _q2_k(x: np.ndarray) -> np.ndarray:
    """x ~ d*sc*q - dmin*m per 16-value sub-block, sc and m 4 bits (one byte: sc | m << 4), q 0..3."""
    sub = x.reshape(-1, 16, 16)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    step = (sub.max(axis=-1) - lo) / 3
    d = _f16(step.max(axis=-1, keepdims=True) / 15)
    dmin = _f16(-lo.min(axis=-1, keepdims=True) / 15)
    sc = np.clip(np.rint(_safe_div(step, d.astype(np.float32))), 0, 15).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-lo, dmin.astype(np.float32))), 0, 15).astype(np.uint8)
    offset = (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.rint(_safe_div(sub + offset, (d.astype(np.float32) * sc)[..., None])), 0, 3).astype(np.uint8)
    return np.concatenate([sc | (mn << 4), _crumbs(q.reshape(-1, QK_K)), d.view(np.uint8), dmin.view(np.uint8)],
                          axis=-1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    """x ~ d*sc*q per 16-value sub-block, sc signed 6 bits (stored + 32), q -4..3: its low 2 bits in qs, and a
    hmask bit set where q >= 0 (value b*32 + j in bit b of byte j). Each sub-block's largest magnitude maps to -4."""
    sub = x.reshape(-1, 16, 16)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    step = -peak / 4
    d = _f16(np.abs(step).max(axis=-1, keepdims=True) / 31)
    sc = np.clip(np.rint(_safe_div(step, d.astype(np.float32))), -32, 31).astype(np.int8)
    q = np.clip(np.rint(_safe_div(sub, (d.astype(np.float32) * sc)[..., None])), -4, 3).astype(np.int8).reshape(-1, QK_K)
    stored = (sc.astype(np.int16) + 32).astype(np.uint8)  # scale k: low 4 bits in byte k % 8 (nibble k // 8), high 2
    low = stored & 0x0F                                   # bits in byte 8 + k % 4 at bit 2 * (k // 4)
    lscales = low[:, :8] | (low[:, 8:] << 4)
    hscales = ((stored >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(
        axis=1, dtype=np.uint8)
    high = (q >= 0).astype(np.uint8).reshape(-1, 8, 32)
    hmask = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([hmask, _crumbs(q.view(np.uint8)), lscales, hscales, d.view(np.uint8)], axis=-1)


_K_QUANTIZERS: dict[Q, Callable[[np.ndarray], np.ndarray]] = {Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k,
                                                              Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def quantize(array: np.ndarray, qtype: Q) -> np.ndarray:
    """u8 blocks [rows, row_bytes] of a 2-D f32 array, as gguf.quants.quantize lays them out."""
    if qtype not in _K_QUANTIZERS:
        return gguf.quants.quantize(array, qtype)
    rows, cols = array.shape
    if cols % QK_K:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} values, not {cols}")
    blocks = _K_QUANTIZERS[qtype](np.asarray(array, np.float32).reshape(-1, QK_K))
    return blocks.reshape(rows, -1)


# -- the files --------------------------------------------------------------------------------------------

TypePicker = Callable[[str, tuple[int, ...]], Q]  # (GGUF tensor name, numpy shape) -> its type


def f32_only(name: str, shape: tuple[int, ...]) -> Q:
    return Q.F32


def _not_k_quantized(name: str, shape: tuple[int, ...]) -> Q | None:
    """What every K-quant mix below keeps out of K-quants: norms and rope_freqs (vectors) F32, Q8_0 (llama.cpp's
    fallback) where rows are not a multiple of 256 values; None for the rest."""
    if len(shape) < 2 or name.endswith("norm.weight"):
        return Q.F32
    return Q.Q8_0 if shape[-1] % QK_K else None


def q4_k_m(name: str, shape: tuple[int, ...]) -> Q:
    """A Q4_K_M-style mix: Q6_K for the head, attn_v and ffn_down (llama.cpp's Q4_K_M gives those more bits),
    Q5_K for attn_k (so all three K-quants occur), Q4_K for the rest; Q4_0 for layer 1's ffn_gate (a block type
    graphmesh keeps packed, as mixed files carry); Q8_0 (llama.cpp's fallback for Q6_K) where rows are not a
    multiple of 256 values; norms and rope_freqs F32."""
    if (kept := _not_k_quantized(name, shape)) is not None:
        return kept
    if name == "blk.1.ffn_gate.weight":
        return Q.Q4_0
    if name == "output.weight" or name.endswith(("attn_v.weight", "ffn_down.weight")):
        return Q.Q6_K
    return Q.Q5_K if name.endswith("attn_k.weight") else Q.Q4_K


def q2_k_q3_k(name: str, shape: tuple[int, ...]) -> Q:
    """A Q2_K/Q3_K-style mix (llama.cpp's Q2_K and Q3_K_M files): Q3_K for attention, Q2_K for the MLP, Q6_K for
    the head and embedding, Q8_0 where rows are not a multiple of 256 values; norms and rope_freqs F32."""
    if (kept := _not_k_quantized(name, shape)) is not None:
        return kept
    if name in ("output.weight", "token_embd.weight"):
        return Q.Q6_K
    return Q.Q3_K if ".attn_" in name else Q.Q2_K


def q4_k_m_packed(name: str, shape: tuple[int, ...]) -> Q:
    """llama.cpp's Q4_K_M proper, whose blocks graphmesh keeps packed: Q6_K for the head, attn_v and ffn_down,
    Q4_K for the rest, Q8_0 where rows are not a multiple of 256 values; norms and rope_freqs F32."""
    if (kept := _not_k_quantized(name, shape)) is not None:
        return kept
    return Q.Q6_K if name == "output.weight" or name.endswith(("attn_v.weight", "ffn_down.weight")) else Q.Q4_K


def _llama3_rope_freqs(rope: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.generate_extra_tensors: each default frequency's divisor."""
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def q8_0_2d(name: str, shape: tuple[int, ...]) -> Q:
    """Q8_0 for every matrix (rows of any multiple of 32 values), F32 for the rest."""
    return Q.Q8_0 if len(shape) == 2 else Q.F32


def write_gguf(hf_dir: Path, path: Path, arch: str, types: TypePicker = f32_only) -> Path:
    """The HF checkpoint at hf_dir (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 or Gemma 3 text) as llama.cpp's
    converter writes it for `arch`. A sliding window is written as attention.sliding_window (llama.cpp's converter
    writes it for Phi-3 and Gemma only), with a per-layer boolean attention.sliding_window_pattern where only some
    layers slide outside Gemma (Qwen2's max_window_layers)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    ckpt = open_checkpoint(hf_dir)
    c = ckpt.config
    assert c is not None and c.arch == "llama"
    gemma = arch in ("gemma2", "gemma3")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    if arch != "phi3":  # Phi3MiniModel writes its own keys, without key_length
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch != "gemma2":  # Gemma2Model writes no rope keys: llama.cpp's default base 10000
        w.add_rope_freq_base(c.rope_theta)
    if not gemma:
        w.add_rope_dimension_count(c.rotary_dim or c.head_dim)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_bos_token_id(c.bos_token_id or 0)
    w.add_eos_token_id(c.eos_token_ids[0])
    # A byte-level BPE vocabulary without merges (the coordinator needs a tokenizer): the 256 byte tokens, then fillers
    alphabet = [char for _, char in sorted(_byte_alphabet().items())]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(alphabet + [f"tok{i}" for i in range(len(alphabet), c.vocab_size)])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' (TextModel.set_gguf_parameters)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        for beta, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast), ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(beta) is not None:
                add(rope[beta])
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3" and cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if c.windows and arch != "phi3":
        w.add_sliding_window(max(c.windows))
        if not gemma and not all(c.windows):
            w.add_sliding_window_pattern([bool(x) for x in c.windows])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(rope, c.rope_theta, c.head_dim))
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        original = cfg.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    table = {hf: g for g, hf in (checkpoints._GGUF_PHI3 if arch == "phi3" else checkpoints._GGUF_GEMMA if gemma
                                 else checkpoints._GGUF_LLAMA).items()}
    for name in ckpt.names():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        gname = table[name.replace(f".{layer}.", ".{i}.", 1) if layer else name].format(i=layer)
        array = ckpt.tensor(name)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # only LlamaModel permutes
            array = model_fixtures._llamacpp_permute(array, c.n_heads if "q_proj" in name else c.n_kv_heads)
        if gemma and name.endswith("norm.weight"):  # Gemma2Model/Gemma3Model: llama.cpp's norm multiplies by w
            array = array + np.float32(1.0)
        qtype = types(gname, array.shape)
        if qtype == Q.F32:
            w.add_tensor(gname, array)
        else:
            w.add_tensor(gname, quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- tiny models wide enough for K-quants (rows of 256 values) --------------------------------------------

def make_wide_llama3(path: Path, seed: int = 11) -> Path:
    """Llama 3.1-style (llama3 rope over 64 original positions), hidden 256, 4 heads of 64, 2 kv heads, untied."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=model_fixtures.VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=512, max_position_embeddings=256, rms_norm_eps=1e-5,
                         initializer_range=0.05, tie_word_embeddings=False,
                         rope_parameters={**model_fixtures.LLAMA3_ROPE, "rope_theta": 500000.0},
                         bos_token_id=1, eos_token_id=2)
    return _save(LlamaForCausalLM(config), path)


def make_wide_qwen3(path: Path, seed: int = 12) -> Path:
    """Qwen3 dense, hidden 256, 4 heads of 32 (q_dim 128: o_proj's rows take the Q8_0 fallback), tied head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=model_fixtures.VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=512, max_position_embeddings=256,
                         rms_norm_eps=1e-6, initializer_range=0.05, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=1, eos_token_id=2)
    return _save(Qwen3ForCausalLM(config), path)


def _save(model: PreTrainedModel, path: Path) -> Path:
    return model_fixtures._save(model, path)


# -- sliding windows and Gemma as llama.cpp's files carry them ----------------------------------------------------

WINDOW = 6  # under prompts of 11 and 20 new tokens: every query past the sixth position loses keys to it
_SMALL: dict[str, Any] = {"vocab_size": model_fixtures.VOCAB, "hidden_size": 64, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 256,
                          "initializer_range": model_fixtures.INIT, "bos_token_id": 1, "eos_token_id": 2,
                          "pad_token_id": 0}


def make_window_mistral(path: Path, seed: int = 21) -> Path:
    """Mistral with its window on every layer (written under llama.cpp's llama architecture)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(**_SMALL, num_hidden_layers=2, sliding_window=WINDOW, rms_norm_eps=1e-5,
                           tie_word_embeddings=False)
    return _save(MistralForCausalLM(config), path)


def make_window_qwen2(path: Path, seed: int = 22) -> Path:
    """Qwen2 with use_sliding_window from layer 1 on (max_window_layers 1): layer 0 global, layers 1-2 sliding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**_SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1, rms_norm_eps=1e-6, tie_word_embeddings=True)
    return _save(Qwen2ForCausalLM(config), path)


def make_gguf_gemma2(path: Path, seed: int = 23) -> Path:
    """Gemma 2 as llama.cpp serves it: layer 0 sliding, layer 1 global (its fixed pattern 2), scores scaled by
    1/sqrt(head_dim) (query_pre_attn_scalar = head_dim: the GGUF file carries no scalar), caps small enough to
    bend these random scores and logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    config = Gemma2Config(**_SMALL, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW,
                          layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                          attn_logit_softcapping=2.0, final_logit_softcapping=4.0, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _save(Gemma2ForCausalLM(config), path)


def make_gguf_gemma3(path: Path, seed: int = 24) -> Path:
    """Gemma 3 text as llama.cpp serves it: 6 layers in its fixed pattern (0-4 sliding, 5 global), q/k norms, the
    global rope linear-scaled at theta 1e6, the local one at theta 1e4, a final soft-cap."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(**_SMALL, num_hidden_layers=6, head_dim=16, sliding_window=WINDOW,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=16,
                              final_logit_softcapping=4.0, rms_norm_eps=1e-6, rope_parameters={
                                  "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    return _save(Gemma3ForCausalLM(config), path)
