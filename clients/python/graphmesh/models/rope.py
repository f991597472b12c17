"""Rotary embedding variants: the inverse frequencies and cos/sin factor of a checkpoint's rope, made on the host
from its config and given to the rope op as attributes (inv_freq, scale), so every backend rotates with the same
numbers. The formulas are transformers' (modeling_rope_utils.ROPE_INIT_FUNCTIONS), in float64.

What graphmesh serves of each, against transformers:
  default, linear, llama3, YaRN: static frequencies, exact at every position.
  dynamic (NTK): transformers recomputes the frequencies once a sequence passes max_position_embeddings; up to
      there they are the default ones. graphmesh serves exactly that range: context = max_position_embeddings.
  longrope (Phi-3): transformers uses short_factor while a sequence is within original_max_position_embeddings and
      long_factor past it (Phi-3's generate then recomputes the whole cache). graphmesh serves the short range:
      context = original_max_position_embeddings, short_factor, the attention factor of the full extension.
  partial rotary (partial_rotary_factor): the first rotary_dim dims of each head rotate, the rest pass through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from graphmesh.errors import InvalidArgument

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class Rope:
    theta: float
    rotary_dim: int  # 0: the whole head
    inv_freq: tuple[float, ...]  # empty: theta ** (-2i / rotary_dim), the backends' own (the unscaled bits)
    scale: float  # multiplies cos and sin (YaRN's and longrope's attention factor)
    max_position: int  # the context over which graphmesh's rope is exactly transformers'


def _refuse(field: str, value: Any, why: str) -> InvalidArgument:
    return InvalidArgument(f"{field} {value!r} is not supported: {why}", "UNSUPPORTED_MODEL")


def hf_rope_parameters(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The rope parameters of a config.json dict as transformers standardizes them: rope_parameters (v5) or
    rope_scaling (v4), with rope_theta, partial_rotary_factor and original_max_position_embeddings folded in."""
    raw = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(raw, dict):
        raise _refuse("rope_parameters", raw, "expected an object")
    if raw and all(isinstance(v, dict) for v in raw.values()):
        raise _refuse("rope_parameters", sorted(raw), "per-layer-type rope (sliding/full attention layers)")
    params = dict(raw)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if model_type == "phi3" and params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"  # Phi3Config's names from before transformers called it longrope
    # top-level rope_theta wins, as in ModelConfig before; transformers treats them as the same field
    params["rope_theta"] = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if cfg.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if cfg.get("original_max_position_embeddings") is not None:  # Phi-3 keeps it at the top, and it wins there
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return params


def _number(params: dict[str, Any], key: str, rope_type: str, default: float | None = None) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _refuse(f"rope_parameters.{key}", value, f"rope_type {rope_type} needs a finite number")
    return float(value)


def rope_from_hf(cfg: dict[str, Any], model_type: str, head_dim: int, partial_rotary: bool = False) -> Rope:
    """The rope of a llama-family config.json dict. partial_rotary: the architecture rotates only the first
    partial_rotary_factor of each head (Phi-3); elsewhere transformers rotates whole heads, so a factor is refused."""
    params = hf_rope_parameters(cfg, model_type)
    rope_type, theta = params["rope_type"], params["rope_theta"]
    max_position = int(cfg.get("max_position_embeddings", 2048))
    if rope_type not in ROPE_TYPES:
        raise _refuse("rope_parameters.rope_type", rope_type, f"graphmesh's rope knows {', '.join(ROPE_TYPES)}")
    factor_p = _number(params, "partial_rotary_factor", rope_type, 1.0)
    if factor_p != 1.0 and not partial_rotary:
        raise _refuse("partial_rotary_factor", factor_p, f"transformers' {model_type} rotates whole heads")
    dim = int(head_dim * factor_p)
    if dim < 2 or dim % 2 or dim > head_dim:
        raise _refuse("partial_rotary_factor", factor_p, f"it gives {dim} rotary dims of a {head_dim}-dim head")
    rotary_dim = 0 if dim == head_dim else dim
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv = 1.0 / theta ** exponents  # the default frequencies, which the variants below rescale
    scale = 1.0
    if rope_type in ("default", "dynamic"):
        return Rope(theta, rotary_dim, (), 1.0, max_position)  # dynamic: see the module docstring
    if rope_type == "linear":
        inv = inv / _number(params, "factor", rope_type)
    elif rope_type == "llama3":
        factor = _number(params, "factor", rope_type)
        low, high = _number(params, "low_freq_factor", rope_type), _number(params, "high_freq_factor", rope_type)
        old = _number(params, "original_max_position_embeddings", rope_type)
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif rope_type == "yarn":
        original = _number(params, "original_max_position_embeddings", rope_type)
        factor = max_position / original if params.get("factor") is None else _number(params, "factor", rope_type)
        scale = _yarn_attention_factor(params, factor, rope_type)
        beta_fast = float(params.get("beta_fast") or 32)
        beta_slow = float(params.get("beta_slow") or 1)

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
        extrapolation = 1.0 - ramp
        inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
        # YaRN is static: exact at every position, so serve the extended context
        max_position = max(max_position, int(factor * original))
    else:  # longrope
        original = _number(params, "original_max_position_embeddings", rope_type)
        short = params.get("short_factor")
        if not isinstance(short, list) or len(short) != dim // 2 or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) for f in short):
            raise _refuse("rope_parameters.short_factor", short, f"longrope needs {dim // 2} numbers")
        factor = max_position / original if params.get("factor") is None else _number(params, "factor", rope_type)
        if params.get("attention_factor") is not None:
            scale = _number(params, "attention_factor", rope_type)
        else:
            scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        inv = 1.0 / (np.array(short, np.float64) * theta ** exponents)
        max_position = min(max_position, int(original))  # the short-factor range: see the module docstring
    return Rope(theta, rotary_dim, tuple(float(f) for f in inv), float(scale), max_position)


def _yarn_attention_factor(params: dict[str, Any], factor: float, rope_type: str) -> float:
    if params.get("attention_factor") is not None:
        return _number(params, "attention_factor", rope_type)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    return mscale(factor, float(m)) / mscale(factor, float(m_all)) if m and m_all else mscale(factor)


def rope_from_gguf(theta: float, head_dim: int, max_position: int, scaling: str | None, factor: float | None,
                   freq_factors: np.ndarray | None, rotary_dim: int = 0, short_factors: np.ndarray | None = None,
                   attn_factor: float | None = None, original_context: int | None = None) -> Rope:
    """The rope of GGUF metadata: llama.rope.scaling.type none or linear (with .factor), and llama3's
    rope_freqs tensor (llama.cpp divides each default frequency by its entry). Phi-3 (longrope): rotary_dim from
    rope.dimension_count, the rope_factors_short tensor, rope.scaling.attn_factor and .original_context_length,
    served as from config.json: the short-factor range only (see the module docstring)."""
    dim = rotary_dim or head_dim
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if scaling not in (None, "none", "linear"):
        raise _refuse("GGUF rope.scaling.type", scaling, "graphmesh reads none and linear (and llama3's rope_freqs)")
    changed, scale = False, 1.0
    if scaling == "linear" and factor not in (None, 0.0, 1.0):
        inv, changed = inv / float(factor), True  # type: ignore[arg-type]
    for name, factors in (("rope_freqs", freq_factors), ("rope_factors_short", short_factors)):
        if factors is not None:
            if factors.shape != (dim // 2,):
                raise _refuse(f"GGUF {name} shape", factors.shape, f"expected ({dim // 2},)")
            inv, changed = inv / factors.astype(np.float64), True
    if short_factors is not None:
        scale = 1.0 if attn_factor is None else float(attn_factor)
        max_position = min(max_position, original_context or max_position)
    return Rope(theta, 0 if dim == head_dim else dim, tuple(float(f) for f in inv) if changed else (), scale,
                max_position)
