"""Sparse-MoE MLP blocks (Mixtral, Qwen3-MoE) as stage-graph nodes, and the stacked expert params they read.

A sparse layer's MLP, for S token rows, top-k of E experts of intermediate size F:
  router:  probs = softmax(m @ gate.T) [S, E] (f32 whatever the stage dtype, as transformers routes in float);
           top = top_k(probs) [S, K]; weights = probs at top, renormalised to sum 1 when norm_topk_prob
  experts: each token row is repeated K times ([S*K, H], one row per expert slot) and each slot's row goes
           through its expert's SwiGLU with grouped_matmul (gate, up, then down: the executor's residency
           accounting takes a layer's grouped_matmuls three at a time, in that order);
  combine: out[s] = sum_k weights[s, k] * expert_out[s*K + k]
Every reshape keeps the token axis first with -1 (never a constant of S rows), so an executor can still cut a
padded prefill to its active rows.

The experts' weights are params of [E, in, out]: each expert's HF weight [out, in] transposed, stacked over E
(grouped_matmul's layout), named `<experts prefix>.<proj>.stacked`. No checkpoint holds that tensor:
read_param assembles it from what transformers writes, per-expert tensors (`...experts.E.w1.weight`,
`...experts.E.gate_proj.weight`) or the fused 3-D form (`...experts.gate_up_proj` [E, 2F, H],
`...experts.down_proj` [E, H, F]).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Protocol

import numpy as np

from graphmesh.errors import NotFound
from graphmesh.graph import GraphBuilder, Value
from graphmesh.models.config import ModelConfig, MoeConfig

STACKED_SUFFIX = ".stacked"
# (gate, up, down) projection names per checkpoint naming
_PROJS = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.stacked$")


def mlp_prefix(moe: MoeConfig, layer: int) -> str:
    return f"model.layers.{layer}." + ("block_sparse_moe" if moe.naming == "mixtral" else "mlp")


def stacked_name(moe: MoeConfig, layer: int, which: int) -> str:
    """The param of projection `which` (0 gate, 1 up, 2 down) of layer's experts."""
    return f"{mlp_prefix(moe, layer)}.experts.{_PROJS[moe.naming][which]}{STACKED_SUFFIX}"


def moe_mlp(g: GraphBuilder, c: ModelConfig, m: Value, layer: int, dtype: str) -> Value:
    """The sparse MLP of `layer` on normed rows m [S, H] -> [S, H] (see the module docstring)."""
    moe = c.moe
    assert moe is not None
    h, f, e, k = c.hidden_size, moe.intermediate_size, moe.n_experts, moe.top_k
    logits = g.matmul(m, g.param(mlp_prefix(moe, layer) + ".gate.weight", (e, h), dtype), transpose_b=True)
    probs = g.softmax(g.cast(logits, "f32") if dtype != "f32" else logits)
    top = g.top_k(probs, k)  # [S, K] expert ids, most likely first
    weights = g.take_along_axis(probs, top)
    if moe.norm_topk_prob:
        weights = g.div(weights, g.sum(weights, axes=(-1,), keepdims=True))
    weights = g.cast(weights, dtype) if dtype != "f32" else weights
    ids = g.reshape(top, (-1,))  # [S*K]: slot s*K + j is token s's j-th expert
    # each token row K times, by a gather along a unit axis: exact, and no constant spans the token axis
    rows = g.reshape(g.gather(g.reshape(m, (-1, 1, h)), g.constant(np.zeros(k, np.int64)), axis=1), (-1, h))
    gate = g.grouped_matmul(rows, g.param(stacked_name(moe, layer, 0), (e, h, f), dtype), ids)
    up = g.grouped_matmul(rows, g.param(stacked_name(moe, layer, 1), (e, h, f), dtype), ids)
    down = g.grouped_matmul(g.mul(g.silu(gate), up), g.param(stacked_name(moe, layer, 2), (e, f, h), dtype), ids)
    weighted = g.mul(down, g.reshape(weights, (-1, 1)))
    return g.sum(g.reshape(weighted, (-1, k, h)), axes=(1,))


class _Tensors(Protocol):
    """What read_param needs of a graphmesh.checkpoints.Checkpoint."""

    def names(self) -> list[str]: ...

    def tensor(self, name: str, dtype: str = "f32") -> np.ndarray: ...


def _sources(name: str, available: Collection[str]) -> tuple[list[str], str] | None:
    """(checkpoint tensors, form) a stacked param is assembled from: "experts" (one [out, in] per expert) or
    "fused" (transformers' 3-D gate_up_proj / down_proj); None when `name` is not a stacked param or has none."""
    match = _STACKED.match(name)
    if match is None:
        return None
    prefix, proj = match["prefix"], match["proj"]
    experts: list[str] = []
    while f"{prefix}.{len(experts)}.{proj}.weight" in available:
        experts.append(f"{prefix}.{len(experts)}.{proj}.weight")
    if experts:
        return experts, "experts"
    fused = f"{prefix}.{'down_proj' if proj in ('w2', 'down_proj') else 'gate_up_proj'}"
    return ([fused], "fused") if fused in available else None


def has_param(name: str, available: Collection[str]) -> bool:
    """Whether a checkpoint holding `available` tensors can give param `name` (read_param)."""
    return name in available or _sources(name, available) is not None


def read_param(ckpt: _Tensors, name: str, dtype: str = "f32", available: Collection[str] | None = None,
               ) -> np.ndarray:
    """Param `name` of a stage graph from `ckpt`: the tensor of that name, or a stacked expert param assembled
    from the checkpoint's experts (module docstring). `available`: ckpt.names(), when the caller has it."""
    have = set(ckpt.names()) if available is None else available
    if name in have:
        return ckpt.tensor(name, dtype)
    found = _sources(name, have)
    if found is None:
        raise NotFound(f"checkpoint has no tensor {name!r}", "UNKNOWN_TENSOR")
    sources, form = found
    if form == "experts":  # [out, in] each -> [E, in, out]
        return np.ascontiguousarray(np.stack([ckpt.tensor(s, dtype).T for s in sources]))
    fused = ckpt.tensor(sources[0], dtype)  # gate_up_proj [E, 2F, H] (gate rows first) | down_proj [E, H, F]
    proj = name.removesuffix(STACKED_SUFFIX).rsplit(".", 1)[1]
    if proj in ("w1", "gate_proj"):
        fused = fused[:, : fused.shape[1] // 2]
    elif proj in ("w3", "up_proj"):
        fused = fused[:, fused.shape[1] // 2:]
    return np.ascontiguousarray(fused.transpose(0, 2, 1))
