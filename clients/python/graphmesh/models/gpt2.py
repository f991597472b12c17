"""GPT-2 stage graphs: learned positions, pre-LayerNorm blocks, Conv1D weights stored [in, out].

Same stage I/O contract as the Llama builder (see graphmesh.models.llama).
"""

from __future__ import annotations

from graphmesh.errors import InvalidArgument
from graphmesh.graph import GraphBuilder, Value
from graphmesh.models.config import ModelConfig
from graphmesh.models.llama import PagedLayout, StageIO, cached_attention, stage_inputs, stage_outputs
from graphmesh.v1 import graph_pb2


def _conv1d(g: GraphBuilder, x: Value, prefix: str, k: int, n: int) -> Value:
    """HF Conv1D: x [S, k] @ W [k, n] + b; the weight is already [in, out], so a plain matmul."""
    return g.add(g.matmul(x, g.param(prefix + ".weight", (k, n))), g.param(prefix + ".bias", (n,)))


def _norm(g: GraphBuilder, c: ModelConfig, x: Value, prefix: str) -> Value:
    h = c.hidden_size
    return g.layer_norm(x, g.param(prefix + ".weight", (h,)), g.param(prefix + ".bias", (h,)), c.norm_eps)


def _block(g: GraphBuilder, c: ModelConfig, io: StageIO, i: int, layer: int, x: Value) -> tuple[Value, Value, Value]:
    p = f"transformer.h.{layer}."
    s, h = x.shape[0], c.hidden_size
    qkv = _conv1d(g, _norm(g, c, x, p + "ln_1"), p + "attn.c_attn", h, 3 * h)
    q = g.reshape(g.slice(qkv, 1, 0, h), (s, c.n_heads, c.head_dim))
    attn, k_cache, v_cache = cached_attention(g, c, io, i, q, g.slice(qkv, 1, h, 2 * h), g.slice(qkv, 1, 2 * h, 3 * h))
    x = g.add(x, _conv1d(g, attn, p + "attn.c_proj", h, h))
    m = _conv1d(g, _norm(g, c, x, p + "ln_2"), p + "mlp.c_fc", h, c.intermediate_size)
    m = g.gelu(m, "tanh" if c.hidden_act == "gelu_tanh" else "none")
    return g.add(x, _conv1d(g, m, p + "mlp.c_proj", c.intermediate_size, h)), k_cache, v_cache


def build_stage(config: ModelConfig, layers: range, seq_len: int, cache_len: int, first: bool, last: bool,
                sample: bool = False, name: str | None = None, dtype: str = "f32",
                paged: PagedLayout | None = None) -> graph_pb2.Graph:
    c = config
    if dtype != "f32":
        raise InvalidArgument(f"gpt2 stages run in f32 only, not {dtype}", "UNSUPPORTED_DTYPE")
    shape = f"_s{seq_len}_b{paged.seqs}x{paged.blocks}_p{paged.pool_blocks}" if paged else f"_s{seq_len}_c{cache_len}"
    g = GraphBuilder(name or f"gpt2_{layers.start}-{layers.stop}{shape}")
    io = stage_inputs(g, c, len(layers), seq_len, cache_len, first, last, sample, paged=paged)
    x = io.x
    if first:
        wte = g.param("transformer.wte.weight", (c.vocab_size, c.hidden_size))
        wpe = g.param("transformer.wpe.weight", (c.max_position, c.hidden_size))
        x = g.add(g.gather(wte, io.x), g.gather(wpe, io.positions))
    caches: list[Value] = []
    for i, layer in enumerate(layers):
        x, k_cache, v_cache = _block(g, c, io, i, layer, x)
        caches += [k_cache, v_cache]
    if io.last_index is None:
        return stage_outputs(g, io, x, caches)
    x = _norm(g, c, g.gather(x, io.last_index), "transformer.ln_f")
    logits = g.matmul(x, g.param("lm_head.weight", (c.vocab_size, c.hidden_size)), transpose_b=True)
    return stage_outputs(g, io, logits, caches)
