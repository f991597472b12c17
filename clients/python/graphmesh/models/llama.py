"""Llama-family stage graphs (Llama, SmolLM, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norms, Phi-3 with fused
projections and partial rotary; Mixtral and Qwen3-MoE with sparse-MoE MLPs, graphmesh.models.moe), and the stage
I/O contract every architecture shares.

A stage runs the local layers `layers` (global indices) of the model on S rows. The same builder makes the
prefill graph (S = bucket) and the decode graph (S = 1). Contract, in order:
  inputs:  input_ids i64[S] (first stage) | hidden_in f32[S, H]; positions i64[S];
           past_k_{i}, past_v_{i} f32[cache_len, kv_dim] for each local layer i;
           last stage: last_index i64[1]; with sample: temperature f32[1], top_k i64[1], top_p f32[1], seed i64[1].
  outputs: hidden_out f32[S, H] | logits f32[1, V] | token i64[1]; then for each local layer i the updated
           K cache (output 1+2i) and V cache (output 2+2i), which the executor feeds back into past_k_i/past_v_i.
New K/V rows go to cache rows positions[0] .. positions[0]+S-1; attention masks cache rows by position,
so rows of a padded prefill past the prompt never reach a real query.

With encoded=True (a first stage of a config with an encoder; see graphmesh.models.encoder) two inputs follow
all the others, in both forms: encoded f32[S, H] and encoded_mask f32[S]. Row r's input embedding is then
exactly encoded[r] where encoded_mask[r] is 1.0 and exactly the embedding of input_ids[r] where it is 0.0
(the mask must be 0.0 or 1.0, and encoded rows under a 0.0 finite, e.g. zeros: 0 * inf is NaN). A bf16/f16
stage rounds encoded rows to its dtype as a later stage rounds hidden_in.

The paged form (a PagedLayout given; what the executor's engine runs) is one step over many sessions: S token
rows of B sequences, the rows of each sequence contiguous. The caches are pools shared by every session of the
stage, in blocks of `block_size` rows:
  inputs:  input_ids i64[S] | hidden_in f32[S, H]; positions i64[S]; slots i64[S] (the pool row each token's K/V
           goes to); block_table i64[B, M] (each sequence's pool blocks in order); token_seq i64[S] (each token's
           sequence); past_k_{i}, past_v_{i} f32[pool rows, kv_dim];
           last stage: last_index i64[B] (each sequence's last token row); with sample: temperature f32[B],
           top_k i64[B], top_p f32[B], seed i64[B] (one per sequence: each draws what it would alone).
  outputs: hidden_out f32[S, H] | logits f32[B, V] | token i64[B]; then the updated pools as above.

Two opt-in precisions (the defaults are the exact f32 graph above): dtype="bf16"/"f16" keeps params, KV
caches and compute in that dtype while the boundary, logits and token stay as in the contract (a GPU
stage); packed_activations="bf16" feeds bf16 activations to the dequant_matmuls of a quantized stage's
layers (not its head), the form torch's packed int4 CPU kernel multiplies without dequantizing the weight;
packed_activations="q8" has every dequant_matmul, the head's too, quantize its f32 rows to int8 (graphmesh.ops'
ACTIVATIONS: llama.cpp's arithmetic for its 4- and 8-bit blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from graphmesh.errors import InvalidArgument
from graphmesh.graph import GraphBuilder, Value
from graphmesh.models.config import ModelConfig
from graphmesh.models.moe import moe_mlp
from graphmesh.ops import packed_shape
from graphmesh.v1 import graph_pb2


@dataclass(frozen=True)
class PagedLayout:
    """The shape of a batched step: `seqs` sequences each reading at most `blocks` blocks of `block_size` rows
    from pools of `pool_blocks` blocks; `decode` promises one token per sequence (kernels then read no host value)."""

    seqs: int
    blocks: int
    block_size: int
    pool_blocks: int
    decode: bool = False

    @property
    def pool_rows(self) -> int:
        return self.pool_blocks * self.block_size


@dataclass
class PagedIO:
    layout: PagedLayout
    slots: Value  # [S] i64
    block_table: Value  # [B, M] i64
    token_seq: Value  # [S] i64


@dataclass
class StageIO:
    x: Value  # [S] i64 token ids on the first stage, else [S, H] f32 hidden state
    positions: Value  # [S] i64
    start: Value  # [1] i64: the cache row of the first new K/V row (contiguous form)
    past: list[tuple[Value, Value]]  # per local layer: [cache_len, kv_dim] K and V (paged: the pools)
    last_index: Value | None  # [1] i64 ([B] paged), last stage only
    sampling: tuple[Value, Value, Value, Value] | None  # temperature, top_k, top_p, seed
    paged: PagedIO | None = None


def stage_inputs(g: GraphBuilder, c: ModelConfig, n_local: int, seq_len: int, cache_len: int, first: bool, last: bool,
                 sample: bool, kv_dtype: str = "f32", paged: PagedLayout | None = None) -> StageIO:
    x = g.input("input_ids", (seq_len,), "i64") if first else g.input("hidden_in", (seq_len, c.hidden_size))
    positions = g.input("positions", (seq_len,), "i64")
    rows = paged.pool_rows if paged else cache_len
    past = [(g.input(f"past_k_{i}", (rows, c.kv_dim), kv_dtype), g.input(f"past_v_{i}", (rows, c.kv_dim), kv_dtype))
            for i in range(n_local)]
    outs = paged.seqs if paged else 1
    last_index = g.input("last_index", (outs,), "i64") if last else None
    sampling = (g.input("temperature", (outs,)), g.input("top_k", (outs,), "i64"), g.input("top_p", (outs,)),
                g.input("seed", (outs,), "i64")) if last and sample else None
    paged_io = PagedIO(paged, g.input("slots", (seq_len,), "i64"), g.input("block_table", (paged.seqs, paged.blocks),
                                                                             "i64"),
                       g.input("token_seq", (seq_len,), "i64")) if paged else None
    return StageIO(x, positions, g.slice(positions, 0, 0, 1), past, last_index, sampling, paged_io)


def stage_outputs(g: GraphBuilder, io: StageIO, result: Value, caches: list[Value]) -> graph_pb2.Graph:
    """result: hidden [S, H] or logits [1, V]; the sampled token replaces logits when the stage samples."""
    if io.sampling is not None:
        result = g.sample(result, *io.sampling)
    g.output(result, *caches)
    return g.build()


def cached_attention(g: GraphBuilder, c: ModelConfig, io: StageIO, i: int, q: Value, k: Value, v: Value,
                     window: int = 0) -> tuple[Value, Value, Value]:
    """q [S, Hq, D] and k, v [S, kv_dim] (k already rotated) -> (attention output [S, Hq*D], K cache, V cache).
    window: the layer's sliding window (0: none); the scale and soft-cap are the model's."""
    scale, softcap = c.attn_scale, c.attn_softcap
    if io.paged is not None:
        p = io.paged
        k_pool, v_pool = g.kv_scatter(io.past[i][0], k, p.slots), g.kv_scatter(io.past[i][1], v, p.slots)
        heads = (p.layout.pool_rows, c.n_kv_heads, c.head_dim)
        out = g.paged_attention(q, g.reshape(k_pool, heads), g.reshape(v_pool, heads), p.block_table, p.token_seq,
                                io.positions, p.layout.block_size, p.layout.decode, scale, window, softcap)
        return g.reshape(out, (q.shape[0], c.q_dim)), k_pool, v_pool
    cache_len = io.past[i][0].shape[0]
    k_cache = g.kv_write(io.past[i][0], k, io.start)
    v_cache = g.kv_write(io.past[i][1], v, io.start)
    heads = (cache_len, c.n_kv_heads, c.head_dim)
    out = g.attention(q, g.reshape(k_cache, heads), g.reshape(v_cache, heads), io.positions, causal=True, scale=scale,
                      window=window, softcap=softcap)
    return g.reshape(out, (q.shape[0], c.q_dim)), k_cache, v_cache


@dataclass
class _Precision:
    dtype: str = "f32"  # params, KV caches and compute
    packed_activations: str = "f32"  # the dtype dequant_matmuls take, or "q8": f32 rows they quantize to int8
    casts: dict[str, Value] = field(default_factory=dict)  # one cast per activation that several Linears read

    def packed_input(self, g: GraphBuilder, x: Value) -> Value:
        if self.packed_activations in (x.dtype, "q8"):
            return x
        if x.name not in self.casts:
            self.casts[x.name] = g.cast(x, self.packed_activations)
        return self.casts[x.name]


def _linear(g: GraphBuilder, x: Value, name: str, n: int, k: int, schemes: dict[str, str], bias: bool = False,
            precision: _Precision | None = None) -> Value:
    """x [S, k] @ W.T with W stored [n, k] as in HF (or packed GGUF blocks when `name` has a scheme)."""
    p = precision or _Precision()
    if name in schemes:
        scheme = schemes[name]
        y = g.dequant_matmul(p.packed_input(g, x), g.param(name, packed_shape(scheme, n, k), "u8"), scheme, n, k,
                             "q8" if p.packed_activations == "q8" else "f32")
        y = g.cast(y, x.dtype) if y.dtype != x.dtype else y
    else:
        y = g.matmul(x, g.param(name, (n, k), p.dtype), transpose_b=True)
    return g.add(y, g.param(name.removesuffix("weight") + "bias", (n,), p.dtype)) if bias else y


def _rope(g: GraphBuilder, c: ModelConfig, x: Value, positions: Value, layer: int) -> Value:
    local = c.local_rope if c.local_rope is not None and c.window(layer) else None  # Gemma 3's sliding layers
    if local is not None:
        return g.rope(x, positions, local.theta, c.rope_style, local.rotary_dim, local.inv_freq, local.scale)
    return g.rope(x, positions, c.rope_theta, c.rope_style, c.rotary_dim, c.rope_inv_freq, c.rope_scale)


def _norm(g: GraphBuilder, c: ModelConfig, x: Value, name: str, dim: int, dtype: str) -> Value:
    """RMS norm by param `name`; Gemma's scales by (1 + w), its weights being stored as offsets from 1."""
    w = g.param(name, (dim,), dtype)
    return g.rms_norm(x, g.add(w, 1.0) if c.gemma else w, c.norm_eps)


def _block(g: GraphBuilder, c: ModelConfig, io: StageIO, i: int, layer: int, x: Value, schemes: dict[str, str],
           precision: _Precision) -> tuple[Value, Value, Value]:
    p = f"model.layers.{layer}."
    s, h, dt = x.shape[0], c.hidden_size, precision.dtype
    a = _norm(g, c, x, p + "input_layernorm.weight", h, dt)
    if c.fused_proj:  # Phi-3 stores q/k/v as one weight: one matmul, then its column ranges
        qkv = _linear(g, a, p + "self_attn.qkv_proj.weight", c.q_dim + 2 * c.kv_dim, h, schemes, precision=precision)
        q, k = g.slice(qkv, 1, 0, c.q_dim), g.slice(qkv, 1, c.q_dim, c.q_dim + c.kv_dim)
        v = g.slice(qkv, 1, c.q_dim + c.kv_dim, c.q_dim + 2 * c.kv_dim)
    else:
        q = _linear(g, a, p + "self_attn.q_proj.weight", c.q_dim, h, schemes, c.qkv_bias, precision)
        k = _linear(g, a, p + "self_attn.k_proj.weight", c.kv_dim, h, schemes, c.qkv_bias, precision)
        v = _linear(g, a, p + "self_attn.v_proj.weight", c.kv_dim, h, schemes, c.qkv_bias, precision)
    q, k = g.reshape(q, (s, c.n_heads, c.head_dim)), g.reshape(k, (s, c.n_kv_heads, c.head_dim))
    if c.qk_norm:  # Qwen3, Gemma 3: each head of q and k RMS-normed over head_dim before rope
        q = _norm(g, c, q, p + "self_attn.q_norm.weight", c.head_dim, dt)
        k = _norm(g, c, k, p + "self_attn.k_norm.weight", c.head_dim, dt)
    q, k = _rope(g, c, q, io.positions, layer), _rope(g, c, k, io.positions, layer)
    attn, k_cache, v_cache = cached_attention(g, c, io, i, q, g.reshape(k, (s, c.kv_dim)), v, c.window(layer))
    o = _linear(g, attn, p + "self_attn.o_proj.weight", h, c.q_dim, schemes, precision=precision)
    if c.gemma:  # Gemma normalizes each block's output before the residual add, and the MLP's input by its own norm
        o = _norm(g, c, o, p + "post_attention_layernorm.weight", h, dt)
    x = g.add(x, o)
    m = _norm(g, c, x, p + ("pre_feedforward_layernorm.weight" if c.gemma else "post_attention_layernorm.weight"), h, dt)
    if c.moe is not None and layer in c.moe.layers:  # Mixtral / Qwen3-MoE sparse layer: router, top-k, experts
        return g.add(x, moe_mlp(g, c, m, layer, dt)), k_cache, v_cache
    if c.fused_proj:  # Phi-3's gate_up_proj: gate rows first, then up
        n = c.intermediate_size
        gate_up = _linear(g, m, p + "mlp.gate_up_proj.weight", 2 * n, h, schemes, precision=precision)
        gate, up = g.slice(gate_up, 1, 0, n), g.slice(gate_up, 1, n, 2 * n)
    else:
        gate = _linear(g, m, p + "mlp.gate_proj.weight", c.intermediate_size, h, schemes, precision=precision)
        up = _linear(g, m, p + "mlp.up_proj.weight", c.intermediate_size, h, schemes, precision=precision)
    act = g.gelu(gate, "tanh") if c.hidden_act == "gelu_tanh" else g.silu(gate)  # Gemma's GeGLU | SwiGLU
    out = _linear(g, g.mul(act, up), p + "mlp.down_proj.weight", h, c.intermediate_size, schemes, precision=precision)
    if c.gemma:
        out = _norm(g, c, out, p + "post_feedforward_layernorm.weight", h, dt)
    return g.add(x, out), k_cache, v_cache


def check_encoded(config: ModelConfig, first: bool) -> None:
    """Raises unless a stage may take encoded rows: the first stage of a model with an encoder."""
    if config.encoder is None:
        raise InvalidArgument("encoded=True needs a model with an encoder (graphmesh_encoder in its config)",
                              "UNSUPPORTED_MODEL")
    if not first:
        raise InvalidArgument("encoded=True is for the first stage only: encoded rows replace input embeddings",
                              "BAD_SHAPE")


def _encoded_rows(g: GraphBuilder, x: Value, encoded: Value, mask: Value) -> Value:
    """x [S, H] with the rows where mask is 1 replaced by encoded's: x*(1-m) + e*m, exact for m in {0, 1} and
    finite values (x*1 + 0 and 0 + e*1 round nothing). Elementwise along the row axis rather than a gather at
    constant row indices, so an executor can still cut the graph to a prompt's active rows."""
    # bf16/f16 stages: the embedding table is already in the stage dtype (the params are), so casting the
    # encoded rows first is the same rounding as selecting in f32 and casting after, as hidden_in is rounded.
    e = g.cast(encoded, x.dtype) if encoded.dtype != x.dtype else encoded
    m = g.reshape(g.cast(mask, x.dtype) if mask.dtype != x.dtype else mask, (x.shape[0], 1))
    return g.add(g.mul(x, g.sub(1.0, m)), g.mul(e, m))


def build_stage(config: ModelConfig, layers: range, seq_len: int, cache_len: int, first: bool, last: bool,
                sample: bool = False, name: str | None = None, quantized: bool = False,
                packed_schemes: dict[str, str] | None = None, dtype: str = "f32",
                packed_activations: str = "f32", paged: PagedLayout | None = None,
                encoded: bool = False) -> graph_pb2.Graph:
    """The stage graph over global layers `layers`. With quantized=True every Linear weight named in
    packed_schemes (from Checkpoint.packed_schemes()) is a u8 param of GGUF blocks used through dequant_matmul.
    dtype, packed_activations, paged and encoded: see the module docstring."""
    c = config
    if encoded:
        check_encoded(c, first)
    schemes = dict(packed_schemes or {}) if quantized else {}
    precision = _Precision(dtype, packed_activations if schemes else dtype)
    suffix = ("_q" if schemes else "") + ("" if dtype == "f32" else f"_{dtype}") + \
        ("_a" + packed_activations if schemes and packed_activations != "f32" else "") + ("_enc" if encoded else "")
    shape = f"_s{seq_len}_b{paged.seqs}x{paged.blocks}_p{paged.pool_blocks}" if paged else f"_s{seq_len}_c{cache_len}"
    g = GraphBuilder(name or f"llama_{layers.start}-{layers.stop}{shape}{suffix}")
    io = stage_inputs(g, c, len(layers), seq_len, cache_len, first, last, sample, dtype, paged)
    if first:
        x = g.gather(g.param("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), dtype), io.x)
        if c.gemma:  # the scale rounded to the embedding's dtype first, as transformers' Gemma rounds it
            x = g.mul(x, math.sqrt(c.hidden_size))
        if encoded:
            x = _encoded_rows(g, x, g.input("encoded", (seq_len, c.hidden_size)), g.input("encoded_mask", (seq_len,)))
    else:
        x = g.cast(io.x, dtype) if dtype != "f32" else io.x
    caches: list[Value] = []
    for i, layer in enumerate(layers):
        x, k_cache, v_cache = _block(g, c, io, i, layer, x, schemes, precision)
        caches += [k_cache, v_cache]
    if io.last_index is None:
        return stage_outputs(g, io, g.cast(x, "f32") if dtype != "f32" else x, caches)
    x = _norm(g, c, g.gather(x, io.last_index), "model.norm.weight", c.hidden_size, dtype)
    # The head keeps the stage dtype: bf16 logits near 16 are 0.125 apart, and greedy picks would flip. Int8 rows
    # (as llama.cpp's head takes them) keep f32 logits.
    head = _Precision(dtype, "q8" if precision.packed_activations == "q8" else dtype)
    logits = _linear(g, x, "lm_head.weight", c.vocab_size, c.hidden_size, schemes, precision=head)
    logits = g.cast(logits, "f32") if dtype != "f32" else logits
    if c.final_softcap:  # Gemma 2: cap * tanh(logits / cap)
        logits = g.mul(g.tanh(g.div(logits, c.final_softcap)), c.final_softcap)
    return stage_outputs(g, io, logits, caches)
