"""ModelConfig: the shape of a decoder LLM, read from a Hugging Face config.json or GGUF metadata; and
EncoderConfig, the shape of its optional encoder group (graphmesh.models.encoder builds that graph)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphmesh.errors import InvalidArgument
from graphmesh.models.rope import Rope, rope_from_hf

ARCHS = ("llama", "gpt2")
MOE_FAMILY = ("mixtral", "qwen3_moe")  # sparse-MoE model_types, also built by graphmesh.models.llama
GEMMA_FAMILY = ("gemma2", "gemma3_text")  # sandwich norms, (1 + w) RMS norms, scaled embeddings, GeGLU
LLAMA_FAMILY = ("llama", "qwen2", "mistral", "qwen3", "phi3", *MOE_FAMILY, *GEMMA_FAMILY)  # graphmesh.models.llama
# Where each model_type's sliding window applies in transformers: on every layer, or on the layers layer_types
# calls "sliding_attention" (computed as transformers does when config.json has no layer_types).
_WINDOW_EVERY_LAYER = ("mistral", "mixtral", "phi3", "qwen3_moe")
_WINDOW_NEEDS_FLAG = ("qwen2", "qwen3", "qwen3_moe")  # the window applies only with use_sliding_window
# Config fields of MoE variants graphmesh does not build (shared experts, grouped routing, sparse attention...):
# refused at start by field and value rather than served wrong.
MOE_REFUSED = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts", "moe_layer_freq",
               "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "scoring_func",
               "topk_method", "moe_shared_expert_intermediate_size")
ENCODER_KEY = "graphmesh_encoder"  # the config.json key of the encoder group


@dataclass(frozen=True)
class EncoderConfig:
    """A two-layer MLP projector (LLaVA style): features [rows, input_dim] -> rows of the model's input
    embedding [rows, output_dim], which replace the embeddings of the prompt's `token_id` placeholders in order."""

    input_dim: int
    intermediate_size: int
    output_dim: int  # the model's hidden size
    token_id: int


def encoder_config(cfg: dict[str, Any]) -> EncoderConfig | None:
    """The encoder of a Hugging Face config.json dict (its "graphmesh_encoder" object, output_dim from
    hidden_size); None when it has none."""
    if ENCODER_KEY not in cfg:
        return None
    enc = cfg[ENCODER_KEY]
    if not isinstance(enc, dict):
        raise InvalidArgument(f"{ENCODER_KEY} must be an object, got {enc!r}", "BAD_CONFIG")
    values = {**enc, "output_dim": cfg.get("hidden_size")}
    for key in ("input_dim", "intermediate_size", "output_dim", "token_id"):
        v = values.get(key)
        # bool is an int to Python; a token id may be 0, a size may not
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "token_id" else 1):
            raise InvalidArgument(f"{ENCODER_KEY}: {key} must be a {'non-negative' if key == 'token_id' else 'positive'}"
                                  f" integer, got {v!r}", "BAD_CONFIG")
    return EncoderConfig(values["input_dim"], values["intermediate_size"], values["output_dim"], values["token_id"])


@dataclass(frozen=True)
class MoeConfig:
    """The sparse-MoE MLP of some layers (graphmesh.models.moe builds it): a router picks `top_k` of `n_experts`
    SwiGLU experts per token (softmax, then top-k, then, with norm_topk_prob, renormalised to sum 1)."""

    n_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    layers: tuple[int, ...]  # the sparse layers (global indices); the others keep the dense MLP
    naming: str  # checkpoint names: "mixtral" (block_sparse_moe.experts.E.w1/w2/w3) | "qwen3_moe" (mlp.experts.E.*)


def moe_config(cfg: dict[str, Any], model_type: str) -> MoeConfig | None:
    """The MoE block of a mixtral / qwen3_moe config.json dict; None for a dense model_type."""
    if model_type not in MOE_FAMILY:
        return None
    # transformers 5 writes num_local_experts for both (num_experts is its alias); Qwen's own files say num_experts
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not isinstance(n_experts, int) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise InvalidArgument(f"{model_type}: num_experts_per_tok {top_k!r} must be in [1, num_experts "
                              f"{n_experts!r}]", "BAD_CONFIG")
    n_layers = cfg["num_hidden_layers"]
    if model_type == "mixtral":
        return MoeConfig(n_experts, top_k, cfg["intermediate_size"], True, tuple(range(n_layers)), "mixtral")
    step = cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    if not isinstance(step, int) or step < 1:
        raise InvalidArgument(f"decoder_sparse_step {step!r} must be a positive integer", "BAD_CONFIG")
    layers = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)  # as Qwen3MoeDecoderLayer
    return MoeConfig(n_experts, top_k, cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False)), layers,
                     "qwen3_moe")


def _positive(cfg: dict[str, Any], key: str, default: float | None) -> float | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise InvalidArgument(f"{key} {value!r} must be a positive number", "BAD_CONFIG")
    return float(value)


def _windows(cfg: dict[str, Any], model_type: str) -> tuple[int, ...]:
    """Each layer's sliding window, as transformers' model_type applies config.sliding_window (see the table above);
    () where no layer has one."""
    window = cfg.get("sliding_window")
    if window is None or (model_type in _WINDOW_NEEDS_FLAG and not cfg.get("use_sliding_window")):
        return ()
    if model_type not in _WINDOW_EVERY_LAYER + _WINDOW_NEEDS_FLAG + GEMMA_FAMILY:
        raise InvalidArgument(f"sliding_window {window!r} is not supported for model_type {model_type}: "
                              "transformers' model does not apply it", "UNSUPPORTED_MODEL")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidArgument(f"sliding_window {window!r} must be a positive integer", "BAD_CONFIG")
    n = cfg["num_hidden_layers"]
    if model_type in _WINDOW_EVERY_LAYER:
        return (window,) * n
    types = cfg.get("layer_types")
    if types is None:  # transformers' defaults: Qwen's first max_window_layers are global; Gemma alternates
        if model_type == "gemma2":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        elif model_type == "gemma3_text":
            pattern = cfg.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise InvalidArgument(f"layer_types {types!r} is not supported: graphmesh knows one of 'sliding_attention' "
                              f"or 'full_attention' for each of the {n} layers", "UNSUPPORTED_MODEL")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _ropes(cfg: dict[str, Any], model_type: str, head_dim: int) -> tuple[Rope, Rope | None]:
    """The rope, and Gemma 3's sliding layers' own (None elsewhere): transformers 5 writes one rope_parameters
    object per layer type; transformers 4's config.json had rope_theta and rope_scaling for the global layers and
    rope_local_base_freq for the local ones."""
    if model_type != "gemma3_text":
        return rope_from_hf(cfg, model_type, head_dim, partial_rotary=model_type == "phi3"), None
    raw = cfg.get("rope_parameters")
    base = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    if isinstance(raw, dict) and raw and all(isinstance(v, dict) for v in raw.values()):
        unknown = sorted(set(raw) - {"full_attention", "sliding_attention"})
        if unknown:
            raise InvalidArgument(f"rope_parameters {unknown} is not supported: gemma3_text has full_attention and "
                                  "sliding_attention layers", "UNSUPPORTED_MODEL")
        full = raw.get("full_attention", {"rope_type": "default", "rope_theta": 1e6})
        local = raw.get("sliding_attention", {"rope_type": "default", "rope_theta": 1e4})
    else:
        full = {**(cfg.get("rope_scaling") or raw or {"rope_type": "default"}), "rope_theta": cfg.get("rope_theta", 1e6)}
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    return (rope_from_hf({**base, "rope_parameters": full}, model_type, head_dim),
            rope_from_hf({**base, "rope_parameters": local}, model_type, head_dim))


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" (also Qwen2, Mistral-style) | "gpt2"
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float = 10000.0
    rope_style: str = "half"  # HF Llama layout: rotate the two halves of each head
    rotary_dim: int = 0  # 0: rotate whole heads; else the first rotary_dim dims (Phi-3 partial_rotary_factor)
    rope_inv_freq: tuple[float, ...] = ()  # a scaled rope's frequencies (graphmesh.models.rope); empty: theta's
    rope_scale: float = 1.0  # YaRN/longrope attention factor on cos and sin
    qkv_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: per-head RMS norms of q and k (self_attn.q_norm/k_norm) before rope
    fused_proj: bool = False  # Phi-3: self_attn.qkv_proj and mlp.gate_up_proj, each one matmul
    tie_word_embeddings: bool = False
    max_position: int = 2048  # context length in tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # gpt2: "gelu_tanh" | "gelu"
    encoder: EncoderConfig | None = None  # llama family only: an encoder group feeding the first stage
    moe: MoeConfig | None = None  # llama family only: sparse-MoE MLPs in moe.layers
    windows: tuple[int, ...] = ()  # each layer's sliding window in tokens (0: none); empty: no window anywhere
    attn_scale: float = 0.0  # scores' scale; 0: 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # Gemma 2's attention logit soft-capping; 0: none
    final_softcap: float = 0.0  # Gemma 2's final logit soft-capping; 0: none
    gemma: bool = False  # RMS norms scale by (1 + w), embeddings by sqrt(hidden), norms before and after each block
    local_rope: Rope | None = None  # Gemma 3: the sliding layers' own rope (rope_local_base_freq); None: the one rope

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def kv_window(self, layer_start: int, layer_end: int) -> int:
        """The sliding window of a stage of layers [layer_start, layer_end) for its KV: the widest of its layers'
        windows where every one has a window, else 0 (a layer without one, a global layer, sees every row, so the
        stage keeps them all)."""
        windows = [self.window(layer) for layer in range(layer_start, layer_end)]
        return max(windows) if windows and min(windows) > 0 else 0

    def __post_init__(self) -> None:
        if self.windows and (len(self.windows) != self.n_layers or min(self.windows) < 0):
            raise InvalidArgument(f"windows {self.windows} are not one non-negative window for each of the "
                                  f"{self.n_layers} layers", "BAD_CONFIG")
        if self.moe is not None and self.arch != "llama":
            raise InvalidArgument(f"MoE blocks exist for the llama family only, not {self.arch}", "UNSUPPORTED_MODEL")
        if self.arch not in ARCHS:
            raise InvalidArgument(f"unknown architecture {self.arch!r}; expected one of {ARCHS}", "UNSUPPORTED_MODEL")
        if self.n_heads <= 0 or self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise InvalidArgument(f"{self.n_heads} query heads are not a multiple of {self.n_kv_heads} kv heads",
                                  "BAD_CONFIG")
        if self.encoder is not None:
            if self.arch != "llama":
                raise InvalidArgument(f"encoders exist for the llama family only, not {self.arch}", "UNSUPPORTED_MODEL")
            if self.encoder.output_dim != self.hidden_size:
                raise InvalidArgument(f"encoder output_dim {self.encoder.output_dim} is not the hidden size "
                                      f"{self.hidden_size}", "BAD_CONFIG")
            if not 0 <= self.encoder.token_id < self.vocab_size:
                raise InvalidArgument(f"encoder token_id {self.encoder.token_id} is outside the vocabulary of "
                                      f"{self.vocab_size}", "BAD_CONFIG")

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From the config.json of LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, Qwen3ForCausalLM,
        Phi3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM or GPT2LMHeadModel."""
        model_type = cfg.get("model_type", "")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if model_type == "gpt2":
            if ENCODER_KEY in cfg:
                raise InvalidArgument("encoders exist for the llama family only, not gpt2", "UNSUPPORTED_MODEL")
            if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
                raise InvalidArgument("GPT-2 variants with per-layer attention scaling are not supported",
                                      "UNSUPPORTED_MODEL")
            act = cfg.get("activation_function", "gelu_new")
            acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
            if act not in acts:
                raise InvalidArgument(f"GPT-2 activation {act!r} is not supported", "UNSUPPORTED_MODEL")
            hidden, heads = cfg["n_embd"], cfg["n_head"]
            return cls(arch="gpt2", vocab_size=cfg["vocab_size"], hidden_size=hidden, n_layers=cfg["n_layer"],
                       n_heads=heads, n_kv_heads=heads, head_dim=hidden // heads,
                       intermediate_size=cfg.get("n_inner") or 4 * hidden, norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                       tie_word_embeddings=cfg.get("tie_word_embeddings", True), max_position=cfg["n_positions"],
                       bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, hidden_act=acts[act])
        for key in MOE_REFUSED:
            if cfg.get(key):
                raise InvalidArgument(f"{key} {cfg[key]!r} (model_type {model_type!r}) is not supported: graphmesh's "
                                      f"MoE is {' and '.join(MOE_FAMILY)}'s routed experts only", "UNSUPPORTED_MODEL")
        if model_type not in LLAMA_FAMILY:
            raise InvalidArgument(f"model_type {model_type!r} is not supported; expected one of "
                                  f"{', '.join(LLAMA_FAMILY)} or gpt2", "UNSUPPORTED_MODEL")
        for key in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v bias is implied by its model_type, not a field
            if cfg.get(key):
                raise InvalidArgument(f"{key} {cfg[key]!r} is not supported for model_type {model_type}",
                                      "UNSUPPORTED_MODEL")
        gemma = model_type in GEMMA_FAMILY
        if gemma and cfg.get("use_bidirectional_attention"):
            raise InvalidArgument(f"use_bidirectional_attention {cfg['use_bidirectional_attention']!r} is not "
                                  "supported: graphmesh serves causal decoders", "UNSUPPORTED_MODEL")
        act_key = "hidden_activation" if gemma and cfg.get("hidden_activation") else "hidden_act"
        act = cfg.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise InvalidArgument(f"{act_key} {act!r} is not supported for model_type {model_type}",
                                  "UNSUPPORTED_MODEL")
        heads = cfg["num_attention_heads"]
        # Phi-3's attention takes head_dim from hidden_size / heads only
        head_dim = (None if model_type == "phi3" else cfg.get("head_dim")) or cfg["hidden_size"] // heads
        rope, local_rope = _ropes(cfg, model_type, head_dim)
        extra: dict[str, Any] = {}
        if gemma:
            extra = {"gemma": True, "hidden_act": "gelu_tanh", "local_rope": local_rope,
                     "attn_scale": (_positive(cfg, "query_pre_attn_scalar", 256) or 256.0) ** -0.5,
                     "attn_softcap": float(_positive(cfg, "attn_logit_softcapping", None) or 0.0),
                     "final_softcap": float(_positive(cfg, "final_logit_softcapping", None) or 0.0)}
        return cls(arch="llama", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   n_layers=cfg["num_hidden_layers"], n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=head_dim, intermediate_size=cfg["intermediate_size"],
                   norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope.theta, rotary_dim=rope.rotary_dim,
                   rope_inv_freq=rope.inv_freq, rope_scale=rope.scale, qkv_bias=model_type == "qwen2",
                   qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"), fused_proj=model_type == "phi3",
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), max_position=min(
                       rope.max_position, local_rope.max_position if local_rope else rope.max_position),
                   bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, encoder=encoder_config(cfg),
                   moe=moe_config(cfg, model_type), windows=_windows(cfg, model_type), **extra)

    def layer_params(self, layer: int = 0, active: bool = False) -> int:
        """Parameter count of decoder block `layer`; with `active`, of what one token reads there (a sparse
        layer's router and its top_k experts of n_experts)."""
        h, i = self.hidden_size, self.intermediate_size
        if self.arch == "gpt2":
            return 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        qk_norm += 2 * h if self.gemma else 0  # the norms after attention and around the MLP
        if self.moe is not None and layer in self.moe.layers:
            experts = self.moe.top_k if active else self.moe.n_experts
            mlp = self.moe.n_experts * h + experts * 3 * h * self.moe.intermediate_size
        else:
            mlp = 3 * h * i
        return 2 * h + h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + mlp + bias + qk_norm

    def param_bytes(self, layers: range) -> int:
        """f32 bytes of the params of a stage over `layers`: the embedding comes with layer 0 and the head
        (final norm + lm_head, counted even when tied: the stage loads it as its own param) with the last layer."""
        h, v = self.hidden_size, self.vocab_size
        count = sum(self.layer_params(layer) for layer in layers)
        if layers.start == 0:
            count += v * h + (self.max_position * h if self.arch == "gpt2" else 0)
        if layers.stop == self.n_layers:
            count += (2 * h if self.arch == "gpt2" else h) + v * h
        return 4 * count
