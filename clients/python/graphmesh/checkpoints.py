"""Checkpoint readers: a GGUF file, a .safetensors file, or a Hugging Face directory, all seen the same way.

Every tensor is presented under its Hugging Face name and in HF layout (Linear weights [out, in], llama.cpp's
Q/K row permutation undone, GPT-2 Conv1D weights [in, out]) and read from a memory map, so opening a
checkpoint costs nothing and a stage reads only its own layers. GGUF Q4_0/Q4_1/Q8_0 weights and the K-quants
Q4_K and Q6_K can also be handed out packed, as the raw blocks the dequant_matmul op consumes; the other block types
read (Q5_0/Q5_1, Q2_K, Q3_K, Q5_K, BF16) are always dequantized, so a Q4_K_M file (Q4_K and Q6_K) served packed
keeps nearly all of its weights packed. Gemma files' RMS norm weights are handed back as HF's w, not llama.cpp's
1 + w. No torch or transformers here: the executor imports this module.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from graphmesh import dtypes
from graphmesh.errors import InvalidArgument, NotFound
from graphmesh.models.config import ModelConfig
from graphmesh.models.rope import Rope, rope_from_gguf, rope_from_hf
from graphmesh.ops import packed_shape

PACKED_SCHEMES = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0",
                  GGMLQuantizationType.Q4_K: "q4_k", GGMLQuantizationType.Q6_K: "q6_k"}
_SCHEME_TYPES = {scheme: t for t, scheme in PACKED_SCHEMES.items()}
_PLAIN_GGML = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64)
# Block types read by dequantizing to f32 with gguf.quants (llama.cpp's own reference code); the PACKED_SCHEMES
# ones can also stay packed. Others (IQ*, TQ*, Q8_K ...) are refused when the file is opened, not mid-load.
_DEQUANTIZED_GGML = (*PACKED_SCHEMES, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.BF16,
                     GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
                     GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)

_ST_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": dtypes.to_numpy("bf16"),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_)}

# GGUF tensor names -> HF names, per family; "{i}" is the block index.
_GGUF_LLAMA = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight", "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"blk.{{i}}.attn_{a}.{kind}": f"model.layers.{{i}}.self_attn.{a}_proj.{kind}"
       for a in "qkv" for kind in ("weight", "bias")},
    **{f"blk.{{i}}.attn_{a}_norm.weight": f"model.layers.{{i}}.self_attn.{a}_norm.weight" for a in "qk"},  # Qwen3
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    **{f"blk.{{i}}.ffn_{m}.weight": f"model.layers.{{i}}.mlp.{m}_proj.weight" for m in ("gate", "up", "down")},
}
# Phi-3's converter keeps HF's fused projections: attn_qkv is qkv_proj, ffn_up is gate_up_proj (gate rows first)
_GGUF_PHI3 = {**_GGUF_LLAMA, "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
              "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight"}
_GGUF_GPT2 = {
    "token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
    "output.weight": "lm_head.weight",
    **{f"output_norm.{k}": f"transformer.ln_f.{k}" for k in ("weight", "bias")},
    **{f"blk.{{i}}.{src}.{k}": f"transformer.h.{{i}}.{dst}.{k}" for k in ("weight", "bias") for src, dst in (
        ("attn_norm", "ln_1"), ("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"), ("ffn_norm", "ln_2"),
        ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj"))},
}
# Gemma 2/3's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP, and two norms follow the blocks
_GGUF_GEMMA = {**_GGUF_LLAMA, "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
               "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
               "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight"}
# llama.cpp's converter transposes GPT-2's Conv1D weights to [out, in]; we hand them back as [in, out].
_GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# GGUF architectures whose converter permutes Q/K rows for llama.cpp's interleaved rope.
_PERMUTED_ARCHS = ("llama", "mistral")
_LLAMA_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm")
_GEMMA_ARCHS = ("gemma2", "gemma3")
# What llama.cpp's loader fixes per Gemma architecture rather than reading from the file (llama-model.cpp): every
# n-th layer global, the others sliding; the 27B models (known by their layer count) scale scores by
# 1/sqrt(hidden / heads), the others by 1/sqrt(head_dim); Gemma 3's sliding layers rotate at base 10000, unscaled.
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_LOCAL_BASE = 10000.0


@dataclass(frozen=True)
class _Tensor:
    data: np.ndarray  # memory-mapped, file layout: plain numbers, or GGUF blocks u8 [rows, row_bytes]
    shape: tuple[int, ...]  # HF layout
    ggml_type: GGMLQuantizationType | None = None  # None: `data` holds plain numbers
    heads: int = 0  # > 0: undo llama.cpp's Q/K row permutation over this many heads
    transpose: bool = False
    shift: float = 0.0  # added after dequantizing: -1 turns a llama.cpp Gemma norm (1 + w) back into HF's w


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute(): within each head, rows (j, pair) go back to (pair, j). Works on
    any row payload, so packed block rows un-permute the same way as float rows."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


class Checkpoint:
    """One opened checkpoint. Tensors are read lazily from memory maps; safe to share between threads."""

    def __init__(self, path: Path, fmt: str, tensors: dict[str, _Tensor], config: ModelConfig | None,
                 metadata: dict[str, Any], files: list[Path]) -> None:
        self.path = path
        self.format = fmt  # "gguf" | "safetensors" | "hf"
        self.config = config
        self.metadata = metadata
        self._files = files
        self._tensors = tensors
        self._identity: str | None = None
        embed = next((n for n in ("model.embed_tokens.weight", "transformer.wte.weight") if n in tensors), None)
        if "lm_head.weight" not in tensors and embed and (config is None or config.tie_word_embeddings):
            tensors["lm_head.weight"] = tensors[embed]

    def names(self) -> list[str]:
        return list(self._tensors)

    def _get(self, name: str) -> _Tensor:
        if name not in self._tensors:
            raise NotFound(f"checkpoint {self.path} has no tensor {name!r}", "UNKNOWN_TENSOR")
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._get(name).shape

    def tensor(self, name: str, dtype: str = "f32") -> np.ndarray:
        """The tensor in HF layout as `dtype`, dequantized if stored quantized; a read-only memory map when
        nothing needs converting."""
        t = self._get(name)
        out = t.data if t.ggml_type is None else _dequantize(t.data, t.ggml_type)
        if t.heads:
            out = _unpermute(out, t.heads)
        if t.transpose:
            out = out.T
        if t.shift:  # exact in f32 wherever 1 + w >= 0.5, as a norm's is
            out = out.astype(np.float32) + np.float32(t.shift)
        return np.ascontiguousarray(out.astype(dtypes.to_numpy(dtype), copy=False)).reshape(t.shape)

    def packed(self, name: str) -> tuple[str, np.ndarray] | None:
        """(scheme, u8 blocks [n, k/B * block_bytes]) for a Q4_0/Q4_1/Q8_0 (B = 32) or Q4_K/Q6_K (B = 256)
        matrix in HF row order; None when the tensor is not stored in one of those schemes (or its layout cannot
        be kept packed)."""
        t = self._get(name)
        if t.ggml_type not in PACKED_SCHEMES or t.transpose or len(t.shape) != 2:
            return None
        scheme = PACKED_SCHEMES[t.ggml_type]
        blocks = _unpermute(t.data, t.heads) if t.heads else t.data
        return scheme, blocks.reshape(packed_shape(scheme, *t.shape))

    def packed_schemes(self) -> dict[str, str]:
        """name -> scheme for every tensor packed() can hand out (the `packed_schemes` of a quantized stage)."""
        return {name: PACKED_SCHEMES[t.ggml_type] for name, t in self._tensors.items()
                if t.ggml_type in PACKED_SCHEMES and not t.transpose and len(t.shape) == 2}

    def identity(self) -> str:
        """sha256 over each file's name, size, header and evenly spaced samples: stable across processes and
        cheap on multi-GB files, and it changes when the weights do (any re-quantization changes the header
        and the sampled blocks)."""
        if self._identity is None:
            h = hashlib.sha256()
            for f in self._files:
                size = f.stat().st_size
                h.update(f"{f.name}:{size}".encode())
                with open(f, "rb") as fh:
                    for offset in sorted({0, *(size * j // 16 for j in range(1, 16)), max(size - 65536, 0)}):
                        fh.seek(offset)
                        h.update(fh.read(65536))
            self._identity = h.hexdigest()
        return self._identity


def dequantize_packed(blocks: np.ndarray, scheme: str, n: int, k: int) -> np.ndarray:
    """f32 [n, k] of a packed weight's GGUF blocks (u8 [n, k/B * block_bytes]), by gguf's own dequantization:
    the values Checkpoint.tensor reads, which the backends multiply by wherever they keep no packed kernel."""
    return _dequantize(np.ascontiguousarray(blocks).reshape(n, -1), _SCHEME_TYPES[scheme]).reshape(n, k)


_Q8_0_SLICE = 1 << 15  # blocks dequantized at a time: 1 MiB of codes, 4 MiB of f32 out


def _dequantize(data: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """f32 of GGUF blocks (u8 [..., row bytes]): gguf.quants.dequantize, the Q8_0 of an embedding (SmolLM2's 28M
    values, on every executor that starts) in large slices, where gguf's works 16 rows at a time (several times
    slower). The values are the same: one f32 product of the int8 and its block's scale."""
    if ggml_type != GGMLQuantizationType.Q8_0:
        return gguf.quants.dequantize(data, ggml_type)
    block, type_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    blocks = data.reshape(-1, type_bytes)
    out = np.empty((blocks.shape[0], block), np.float32)
    for start in range(0, blocks.shape[0], _Q8_0_SLICE):
        part = blocks[start:start + _Q8_0_SLICE]
        scales = np.ascontiguousarray(part[:, :2]).view(np.float16).astype(np.float32)
        np.multiply(part[:, 2:].view(np.int8), scales, out=out[start:start + len(part)])
    return out.reshape(*data.shape[:-1], data.shape[-1] // type_bytes * block)


def _bad(path: Path, why: str) -> InvalidArgument:
    return InvalidArgument(f"{path} is not a readable checkpoint: {why}", "BAD_CHECKPOINT")


# -- GGUF ------------------------------------------------------------------------------------------------

# Value types of GGUF metadata (the format's gguf_type): numbers by their struct codes, 7 bool, 8 string, 9 array
_GGUF_NUMBERS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 10: "Q", 11: "q", 12: "d"}
_GGUF_BOOL, _GGUF_STRING, _GGUF_ARRAY = 7, 8, 9
# Tensor types stored as plain numbers (viewed as numpy arrays, as gguf-py does); every other type is blocks
_GGUF_PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                      GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                      GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                      GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class _GgufTensor:
    name: str
    dims: tuple[int, ...]  # ggml order: fastest dimension first
    ggml_type: GGMLQuantizationType
    data: np.ndarray  # memory-mapped: numbers in numpy order, or u8 blocks [..., row_bytes]


_U64 = struct.Struct("<Q")


def _read_gguf(path: Path) -> tuple[dict[str, Any], list[_GgufTensor]]:
    """(metadata, tensors) of a GGUF file (v2, v3): the header walked with struct over the memory map, tensors
    viewed in it. gguf's own GGUFReader builds a numpy view per string of the vocabulary (~100k of them in a
    tokenizer): seconds per open, on every executor's first install and every coordinator start."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = mm.data  # a memoryview of the mapping: struct and frombuffer read it without a copy
    pos, end = 0, len(buf)

    def take(fmt: str) -> Any:
        nonlocal pos
        values = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:  # a vocabulary's ~100k of them: one read of the length, no bytes copy
        nonlocal pos
        (n,) = _U64.unpack_from(buf, pos)
        pos += 8
        if pos + n > end:
            raise ValueError(f"a string of {n} bytes at offset {pos} runs past the end of the file")
        pos += n
        return str(buf[pos - n:pos], "utf-8", "replace")

    def value(kind: int) -> Any:
        nonlocal pos
        if kind in _GGUF_NUMBERS:
            return take("<" + _GGUF_NUMBERS[kind])
        if kind == _GGUF_BOOL:
            return bool(take("<B"))
        if kind == _GGUF_STRING:
            return string()
        if kind == _GGUF_ARRAY:
            item, n = take("<IQ")
            if item in _GGUF_NUMBERS:  # one slice of the file, not one read per element
                dtype = np.dtype("<" + _GGUF_NUMBERS[item])
                out = np.frombuffer(buf, dtype, n, pos).tolist()
                pos += n * dtype.itemsize
                return out
            if item == _GGUF_STRING:
                return [string() for _ in range(n)]
            return [value(item) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {kind} at offset {pos}")

    magic, version = take("<4sI")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a GGUF v2/v3 file (magic {magic!r}, version {version})")
    n_tensors, n_kv = take("<QQ")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        metadata[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        n_dims = take("<I")
        dims = tuple(int(d) for d in struct.unpack_from(f"<{n_dims}Q", buf, pos))
        pos += 8 * n_dims
        infos.append((name, dims, GGMLQuantizationType(take("<I")), take("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, dims, ggml_type, offset in infos:
        numpy_shape = tuple(reversed(dims))
        block, type_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        n_bytes = math.prod(dims) * type_bytes // block
        if start + offset + n_bytes > len(mm):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        raw = mm[start + offset:start + offset + n_bytes]
        if ggml_type in _GGUF_PLAIN_DTYPES:
            data = raw.view(_GGUF_PLAIN_DTYPES[ggml_type]).reshape(numpy_shape)
        else:
            data = raw.reshape(*numpy_shape[:-1], numpy_shape[-1] // block * type_bytes)
        tensors.append(_GgufTensor(name, dims, ggml_type, data))
    return metadata, tensors


_Key = Callable[..., Any]  # an architecture's metadata value: key(name, default)
_Refuse = Callable[[str, str], InvalidArgument]


def config_from_gguf(metadata: dict[str, Any], tensors: list[_GgufTensor]) -> ModelConfig:
    """ModelConfig from GGUF metadata (llama.cpp key names)."""
    arch = metadata.get("general.architecture")
    shapes = {t.name: list(t.dims) for t in tensors}  # ggml order: fastest dimension first
    if arch not in (*_LLAMA_ARCHS, *_GEMMA_ARCHS, "gpt2"):
        raise InvalidArgument(f"GGUF general.architecture {arch!r} is not supported; graphmesh reads "
                              f"{', '.join((*_LLAMA_ARCHS, *_GEMMA_ARCHS, 'gpt2'))}", "UNSUPPORTED_MODEL")

    def key(k: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{k}", default)

    def refuse(k: str, why: str) -> InvalidArgument:
        return InvalidArgument(f"GGUF {arch}.{k} {key(k)!r} is not supported: {why}", "UNSUPPORTED_MODEL")

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    if "token_embd.weight" not in shapes:
        raise InvalidArgument("GGUF file has no token_embd.weight", "BAD_CHECKPOINT")
    head_dim = int(key("attention.key_length") or hidden // heads)
    # What the llama graph does not have: experts (Mixtral-style llama files), v heads of another width, partial rope
    if int(key("expert_count") or 0) > 0:
        raise refuse("expert_count", "graphmesh reads dense GGUF models only")
    if int(key("attention.value_length") or head_dim) != head_dim:
        raise refuse("attention.value_length", f"values must be as wide as keys ({head_dim})")
    rotary = int(key("rope.dimension_count") or head_dim)
    if arch != "gpt2" and rotary != head_dim and (arch != "phi3" or rotary % 2 or not 2 <= rotary < head_dim):
        raise refuse("rope.dimension_count", f"graphmesh rotates whole {head_dim}-dim heads of {arch}"
                     + (" or an even part of them" if arch == "phi3" else ""))

    def plain(name: str) -> np.ndarray | None:
        t = next((t for t in tensors if t.name == name), None)
        if t is not None and t.ggml_type not in _GGUF_PLAIN_DTYPES:
            raise InvalidArgument(f"GGUF {name} is {t.ggml_type.name}; graphmesh reads it as plain floats",
                                  "UNSUPPORTED_MODEL")
        return None if t is None else np.asarray(t.data).reshape(-1)

    max_position = int(key("context_length", 2048))
    n_layers = int(key("block_count"))
    rope = None if arch == "gpt2" else _gguf_rope(key, refuse, head_dim, 0 if rotary == head_dim else rotary,
                                                   max_position, plain)
    local_rope = None
    if arch == "gemma3":
        local_rope = rope_from_gguf(float(key("rope.freq_base_swa", _GEMMA3_LOCAL_BASE)), head_dim, max_position,
                                    None, None, None)
    if rope is not None:
        max_position = min(rope.max_position, local_rope.max_position if local_rope else rope.max_position)
    gemma: dict[str, Any] = {}
    if arch in _GEMMA_ARCHS:
        scalar = hidden / heads if n_layers == _GEMMA_27B_LAYERS[arch] else head_dim
        gemma = {"gemma": True, "local_rope": local_rope, "attn_scale": float(scalar) ** -0.5,
                 "attn_softcap": float(key("attn_logit_softcapping") or 0.0),
                 "final_softcap": float(key("final_logit_softcapping") or 0.0)}
    eos = [metadata.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")]
    return ModelConfig(
        arch="gpt2" if arch == "gpt2" else "llama", vocab_size=shapes["token_embd.weight"][1], hidden_size=hidden,
        n_layers=n_layers, n_heads=heads, n_kv_heads=int(key("attention.head_count_kv") or heads),
        head_dim=head_dim, intermediate_size=int(key("feed_forward_length")),
        norm_eps=float(key("attention.layer_norm_epsilon") if arch == "gpt2" else key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)), rope_inv_freq=() if rope is None else rope.inv_freq,
        rotary_dim=0 if rope is None else rope.rotary_dim, rope_scale=1.0 if rope is None else rope.scale,
        qkv_bias="blk.0.attn_q.bias" in shapes, qk_norm="blk.0.attn_q_norm.weight" in shapes,
        fused_proj=arch == "phi3",
        tie_word_embeddings="output.weight" not in shapes,
        max_position=max_position,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        hidden_act="silu" if arch in _LLAMA_ARCHS else "gelu_tanh",
        windows=() if arch == "gpt2" else _gguf_windows(arch, key, refuse, n_layers), **gemma)


def _gguf_rope(key: _Key, refuse: _Refuse, head_dim: int, rotary_dim: int, max_position: int,
               plain: Callable[[str], np.ndarray | None]) -> Rope:
    """The rope of llama.cpp's metadata. rope.scaling.type yarn (with .factor, .original_context_length and the
    optional yarn_attn_factor / yarn_beta_fast / yarn_beta_slow convert_hf_to_gguf copies from rope_parameters'
    attention_factor / beta_fast / beta_slow) is transformers' YaRN on those parameters. llama3's scaled
    frequencies arrive as the rope_freqs tensor (each default frequency's divisor: llama.cpp writes no low/high
    freq factor keys); Phi-3's longrope as rope_factors_short/long, of which graphmesh serves the short range."""
    theta = float(key("rope.freq_base", 10000.0))
    scaling, factor = key("rope.scaling.type"), key("rope.scaling.factor")
    original = key("rope.scaling.original_context_length")
    if scaling == "yarn":
        if factor is None or original is None:
            raise refuse("rope.scaling.type", "yarn needs rope.scaling.factor and rope.scaling.original_context_length")
        if float(key("rope.scaling.yarn_ext_factor", 1.0)) != 1.0:
            raise refuse("rope.scaling.yarn_ext_factor", "transformers' YaRN mixes with an extrapolation factor of 1")
        if float(key("rope.scaling.yarn_log_multiplier", 0.0)) != 0.0:
            raise refuse("rope.scaling.yarn_log_multiplier", "graphmesh's llama family has no mscale_all_dim")
        if rotary_dim:
            raise refuse("rope.dimension_count", "YaRN rotates whole heads here")
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor),
                  "original_max_position_embeddings": int(original)}
        for gguf_key, hf_key in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                                 ("yarn_beta_slow", "beta_slow")):
            if key(f"rope.scaling.{gguf_key}") is not None:
                params[hf_key] = float(key(f"rope.scaling.{gguf_key}"))
        return rope_from_hf({"rope_parameters": params, "max_position_embeddings": max_position}, "llama", head_dim)
    attn_factor = key("rope.scaling.attn_factor")
    return rope_from_gguf(
        theta, head_dim, max_position, scaling, None if factor is None else float(factor), plain("rope_freqs.weight"),
        rotary_dim=rotary_dim, short_factors=plain("rope_factors_short.weight"),
        attn_factor=None if attn_factor is None else float(attn_factor),
        original_context=None if original is None else int(original))


def _gguf_windows(arch: str, key: _Key, refuse: _Refuse, n_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (ModelConfig.windows) from attention.sliding_window (0 or absent: none) and
    attention.sliding_window_pattern: llama.cpp's per-layer booleans (true: sliding), or an integer n (layer i slides
    unless i % n == n - 1; 0: every layer), as llama.cpp's set_swa_pattern. Without a pattern Gemma's is llama.cpp's
    fixed one, and every other architecture's window applies to every layer, as transformers' Mistral and Phi-3 do
    (llama.cpp itself ignores the window of llama and qwen2 files); Qwen2's use_sliding_window with
    max_window_layers is a boolean pattern."""
    window = key("attention.sliding_window")
    if window is None or window == 0:  # Phi-3 writes 0 for none
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise refuse("attention.sliding_window", "expected a window in tokens")
    pattern = key("attention.sliding_window_pattern", _GEMMA_SWA_PATTERN.get(arch, 0))
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(p, bool) for p in pattern):
            raise refuse("attention.sliding_window_pattern", f"expected one boolean for each of the {n_layers} layers")
        sliding = pattern
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    else:
        raise refuse("attention.sliding_window_pattern", "expected a layer period or one boolean per layer")
    return tuple(window if s else 0 for s in sliding)


def _hf_name(gguf_name: str, table: dict[str, str]) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        pattern = ".".join(["blk", "{i}", *parts[2:]])
        return table[pattern].format(i=parts[1]) if pattern in table else None
    return table.get(gguf_name)


def _open_gguf(path: Path) -> Checkpoint:
    try:
        metadata, gguf_tensors = _read_gguf(path)
    except (ValueError, OSError, struct.error, IndexError, KeyError) as e:
        raise _bad(path, str(e)) from e
    config = config_from_gguf(metadata, gguf_tensors)
    arch = metadata.get("general.architecture")
    for t in gguf_tensors:
        if t.ggml_type not in _GGUF_PLAIN_DTYPES and t.ggml_type not in _DEQUANTIZED_GGML:
            readable = [q.name for q in (*_PLAIN_GGML, *_DEQUANTIZED_GGML)]
            raise InvalidArgument(f"GGUF tensor {t.name!r} type {t.ggml_type.name} is not supported; graphmesh reads "
                                  f"{', '.join(readable)}", "UNSUPPORTED_MODEL")
    table = _GGUF_GPT2 if config.arch == "gpt2" else _GGUF_PHI3 if arch == "phi3" else \
        _GGUF_GEMMA if arch in _GEMMA_ARCHS else _GGUF_LLAMA
    tensors: dict[str, _Tensor] = {}
    for t in gguf_tensors:
        name = _hf_name(t.name, table) or t.name
        shape = tuple(reversed(t.dims))
        qtype = None if t.ggml_type in _PLAIN_GGML else t.ggml_type
        data = t.data
        heads = 0
        if arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.n_heads if name.endswith("q_proj.weight") else config.n_kv_heads
        transpose = config.arch == "gpt2" and name.endswith(_GPT2_TRANSPOSED)
        shift = -1.0 if arch in _GEMMA_ARCHS and name.endswith("norm.weight") else 0.0
        tensors[name] = _Tensor(data, shape[::-1] if transpose else shape, qtype, heads, transpose, shift)
    return Checkpoint(path, "gguf", tensors, config, metadata, [path])


# -- safetensors -----------------------------------------------------------------------------------------

def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(name -> read-only memory-mapped array, __metadata__) without copying any tensor data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 2 <= n <= min(size - 8, 1 << 28):
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        arrays = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (8 + n + int(o) for o in info["data_offsets"])
            if end > size or end - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {name!r} {info['dtype']}{list(shape)} has bad data offsets")
            arrays[name] = mm[start:end].view(dtype).reshape(shape)
    except (ValueError, OSError, struct.error, KeyError, TypeError) as e:
        raise _bad(path, str(e)) from e
    return arrays, dict(header.get("__metadata__") or {})


def _plain(arrays: dict[str, np.ndarray], config: ModelConfig | None) -> dict[str, _Tensor]:
    tensors = {}
    for name, a in arrays.items():
        if config is not None and config.arch == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # causal-mask buffers of old GPT-2 checkpoints, not weights
            name = "transformer." + name
        tensors[name] = _Tensor(a, tuple(a.shape))
    return tensors


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise _bad(path, str(e)) from e


def _open_hf_dir(path: Path) -> Checkpoint:
    cfg = _read_json(path / "config.json")
    generation = path / "generation_config.json"
    if generation.exists():
        eos = _read_json(generation).get("eos_token_id")
        if eos is not None:
            cfg = {**cfg, "eos_token_id": list(dict.fromkeys([*_as_list(cfg.get("eos_token_id")), *_as_list(eos)]))}
    config = ModelConfig.from_hf_config(cfg)
    index = path / "model.safetensors.index.json"
    files = sorted({path / f for f in _read_json(index)["weight_map"].values()}) if index.exists() else sorted(
        path.glob("*.safetensors"))
    if not files:
        raise NotFound(f"{path} has a config.json but no .safetensors files", "CHECKPOINT_NOT_FOUND")
    arrays: dict[str, np.ndarray] = {}
    metadata: dict[str, Any] = {}
    for f in files:
        a, meta = _read_safetensors(f)
        arrays.update(a)
        metadata.update(meta)
    return Checkpoint(path, "hf", _plain(arrays, config), config, metadata, [path / "config.json", *files])


def _as_list(v: Any) -> list[int]:
    return [] if v is None else [int(x) for x in v] if isinstance(v, list) else [int(v)]


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Opens a .gguf file, a .safetensors file or a Hugging Face directory (config.json + *.safetensors,
    sharded or not). Missing paths raise NotFound; unreadable ones InvalidArgument."""
    p = Path(path).resolve()
    if not p.exists():
        raise NotFound(f"checkpoint {path} does not exist", "CHECKPOINT_NOT_FOUND")
    files = sorted(p.iterdir()) if p.is_dir() else [p]
    return _open(p, tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()))


# GGUFReader spends seconds decoding the vocabulary arrays, and an executor opens the same file for every
# stage it compiles: keep recent opens, keyed by (name, size, mtime) of the files so a rewritten one is reread.
@lru_cache(maxsize=8)
def _open(p: Path, files: tuple[tuple[str, int, int], ...]) -> Checkpoint:
    if p.is_dir():
        if not (p / "config.json").exists():
            raise NotFound(f"{p} is a directory without a config.json", "CHECKPOINT_NOT_FOUND")
        return _open_hf_dir(p)
    if p.suffix == ".gguf":
        return _open_gguf(p)
    if p.suffix == ".safetensors":
        arrays, metadata = _read_safetensors(p)
        return Checkpoint(p, "safetensors", _plain(arrays, None), None, metadata, [p])
    raise InvalidArgument(f"{p}: unknown checkpoint format; expected .gguf, .safetensors or a directory",
                          "UNKNOWN_CHECKPOINT_FORMAT")
