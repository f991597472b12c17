"""Partition planning: contiguous layer ranges, balanced by what bounds each stage's decode step.

A stage's decode step is its layers' products (the weight bytes they read, at the speed its kernels read them)
plus the work that reads no weights: a decoder layer also runs attention, norms and rope, while the head is one
product. That work is charged to each layer as a fraction of its products' time at 8 rows (a micro-batch of 16
streams over two stages), measured per weight format; the embedding costs one row per token and is left out:
balancing on plain parameter bytes would give the first stage far too few layers. A sparse-MoE layer (Mixtral,
Qwen3-MoE) counts the experts a token reads (top_k of n_experts), not all it holds.

- f32: LAYER_EXTRA["f32"] = 0.40 (SmolLM2's first 19 layers, 8 rows, one core: 28.6 ms of products, 11.3 ms of
  the rest). SmolLM2 splits 18+12. While the f32 product read its weights at half the memory's speed, the step was
  bound by bytes alone (19+11 and 18+12 served 134 and 135 tok/s, 17+13 only 111); since it prefetches into L2 it
  reads them ~1.5x faster, and 18+12 and 17+13 served 118 and 120 tok/s where 19+11 served 112 (medians of 4
  interleaved runs, 16 streams). Since it reads them as panels (a first stage's step at 8 rows ~40 -> ~27 ms, the
  head ~2.4x faster) 18+12 and 19+11 served 172 and 170 tok/s (medians of 6 interleaved runs): the split stays.
- packed GGUF weights (--weights packed, packed-bf16): 0.65, since the products read a fifth of the bytes. SmolLM2
  splits 17+13, which served 147 tok/s where 19+11 served 132 and 18+12 139 (the same 9 runs each).

The stages become the decoder groups of the plan's DAG (graphmesh.plan); a model with an encoder gets it as an
optional root group on the last rank, feeding the first stage: a prefill keeps the first rank the busiest one (it
embeds and runs the most layers), while the last waits for its activations, so an encoder wave there costs the
pipeline least.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from graphmesh import plan as dag
from graphmesh.errors import InvalidArgument
from graphmesh.models.config import ModelConfig


@dataclass(frozen=True)
class StagePlan:
    rank: int
    address: str
    layer_start: int
    layer_end: int

    @property
    def first(self) -> bool:
        return self.rank == 0


# A layer's work that reads no weights, in units of its products' time at 8 rows, by weight format (SmolLM2 on the
# 2-core VM: f32 0.40; packed 0.61-0.72).
LAYER_EXTRA = {"f32": 0.40, "packed": 0.65}


def layer_bytes(config: ModelConfig) -> int:
    """f32 bytes a decoder layer's products read per token, averaged over the layers: a sparse-MoE layer reads
    its router and top_k of its experts (the stage still holds all of them: ModelConfig.param_bytes)."""
    return round(sum(4 * config.layer_params(i, active=True) for i in range(config.n_layers)) / config.n_layers)


def head_bytes(config: ModelConfig) -> int:
    return config.vocab_size * config.hidden_size * 4


def stage_costs(config: ModelConfig, weights: str = "f32") -> tuple[float, float]:
    """(a decoder layer, the head) in the units the split balances, for the mesh's weight format."""
    extra = LAYER_EXTRA["packed" if weights.startswith("packed") else "f32"]
    return layer_bytes(config) * (1.0 + extra), float(head_bytes(config))


def plan(config: ModelConfig, addresses: Sequence[str], split: Sequence[int] | None = None,
         capacities: Sequence[float] | None = None, weights: str = "f32") -> list[StagePlan]:
    """Assigns contiguous layer ranges to executors in order, balanced for `weights` (the mesh's format); `split`
    overrides with layer counts."""
    n = len(addresses)
    if n == 0:
        raise InvalidArgument("no executors to plan over", "NO_EXECUTORS")
    if n > config.n_layers:
        raise InvalidArgument(f"{n} executors for {config.n_layers} layers: at most one stage per layer",
                              "TOO_MANY_EXECUTORS")
    if split:
        if len(split) != n or sum(split) != config.n_layers or min(split) < 1:
            raise InvalidArgument(f"split {list(split)} must give each of {n} executors >= 1 layer and sum to "
                                  f"{config.n_layers}", "BAD_SPLIT")
        counts = list(split)
    else:
        counts = _balance(config, n, capacities or [1.0] * n, weights)
    stages, start = [], 0
    for rank, (address, count) in enumerate(zip(addresses, counts)):
        stages.append(StagePlan(rank, address, start, start + count))
        start += count
    return stages


def partition(config: ModelConfig, stages: Sequence[StagePlan]) -> dag.Plan:
    """The DAG plan of `stages`: their decoder groups, and the model's encoder (if any) on the last rank."""
    return dag.pipeline([(s.layer_start, s.layer_end) for s in stages], [s.address for s in stages],
                        config.hidden_size, encoder_rank=len(stages) - 1 if config.encoder is not None else None)


def _balance(config: ModelConfig, n: int, capacities: Sequence[float], weights: str) -> list[int]:
    per_layer, head = stage_costs(config, weights)
    total = config.n_layers * per_layer + head
    share = [c / sum(capacities) * total for c in capacities]
    counts, assigned = [], 0
    for rank in range(n):
        remaining_ranks = n - rank - 1
        budget = share[rank] - (head if rank == n - 1 else 0)
        count = max(1, round(budget / per_layer))
        count = min(count, config.n_layers - assigned - remaining_ranks)
        if rank == n - 1:
            count = config.n_layers - assigned
        counts.append(count)
        assigned += count
    return counts
