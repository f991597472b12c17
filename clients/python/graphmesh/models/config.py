"""ModelConfig: the shape of a decoder LLM, read from a Hugging Face config.json or GGUF metadata; and
EncoderConfig, the shape of its optional encoder group (graphmesh.models.encoder builds that graph)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphmesh.errors import InvalidArgument
from graphmesh.models.rope import rope_from_hf

ARCHS = ("llama", "gpt2")
MOE_FAMILY = ("mixtral", "qwen3_moe")  # sparse-MoE model_types, also built by graphmesh.models.llama
LLAMA_FAMILY = ("llama", "qwen2", "mistral", "qwen3", "phi3", *MOE_FAMILY)  # built by graphmesh.models.llama
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

    def __post_init__(self) -> None:
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
        if cfg.get("use_sliding_window"):
            raise InvalidArgument(f"use_sliding_window {cfg['use_sliding_window']!r} is not supported: graphmesh has "
                                  "no sliding-window attention", "UNSUPPORTED_MODEL")
        if cfg.get("hidden_act", "silu") != "silu":
            raise InvalidArgument(f"hidden_act {cfg.get('hidden_act')!r} is not supported", "UNSUPPORTED_MODEL")
        heads = cfg["num_attention_heads"]
        # Phi-3's attention takes head_dim from hidden_size / heads only
        head_dim = (None if model_type == "phi3" else cfg.get("head_dim")) or cfg["hidden_size"] // heads
        rope = rope_from_hf(cfg, model_type, head_dim, partial_rotary=model_type == "phi3")
        window = cfg.get("sliding_window")
        # Mistral and Mixtral always apply their window; Phi-3 does where set, which is no window within a shorter
        # context
        always = model_type in ("mistral", "mixtral")
        if window is not None and (always or (model_type == "phi3" and window < rope.max_position)):
            raise InvalidArgument(f"sliding_window {window!r} is not supported: graphmesh has no sliding-window "
                                  f"attention (context {rope.max_position})", "UNSUPPORTED_MODEL")
        return cls(arch="llama", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   n_layers=cfg["num_hidden_layers"], n_heads=heads, n_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=head_dim, intermediate_size=cfg["intermediate_size"],
                   norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope.theta, rotary_dim=rope.rotary_dim,
                   rope_inv_freq=rope.inv_freq, rope_scale=rope.scale, qkv_bias=model_type == "qwen2",
                   qk_norm=model_type in ("qwen3", "qwen3_moe"), fused_proj=model_type == "phi3",
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), max_position=rope.max_position,
                   bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, encoder=encoder_config(cfg),
                   moe=moe_config(cfg, model_type))

    def layer_params(self, layer: int = 0, active: bool = False) -> int:
        """Parameter count of decoder block `layer`; with `active`, of what one token reads there (a sparse
        layer's router and its top_k experts of n_experts)."""
        h, i = self.hidden_size, self.intermediate_size
        if self.arch == "gpt2":
            return 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
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
