"""Partition planning: contiguous layer ranges, balanced by what bounds each stage's decode step.

With dense weights a decode step is memory-bound, so a stage's cost is the weight bytes it reads per token: every
layer's weights, plus the LM head on the last stage. The embedding costs one row per token and is left out:
balancing on plain parameter bytes would give the first stage far too few layers. The stages of one machine share
its memory bus, which is what two f32 stages of SmolLM2 saturate at 16 streams on the 2-core VM: 19+11 (by bytes)
and 18+12 served 134 and 135 tok/s (medians of 9 interleaved runs), 17+13 only 111.

Packed GGUF weights (--weights packed, packed-bf16) are a fifth of those bytes, and the arithmetic bounds the step
instead: a decoder layer also runs attention, norms and rope, which read no weights and take about
PACKED_LAYER_EXTRA of its products' time at 8 rows, while the head is one product. Charged that way SmolLM2 splits
17+13, which served 147 tok/s where 19+11 served 132 and 18+12 139 (the same 9 runs each).

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


PACKED_LAYER_EXTRA = 0.65  # a layer's work that reads no weights, in units of its products' (SmolLM2, 8 rows: 0.61-0.72)


def layer_bytes(config: ModelConfig) -> int:
    return 4 * config.layer_params()


def head_bytes(config: ModelConfig) -> int:
    return config.vocab_size * config.hidden_size * 4


def stage_costs(config: ModelConfig, weights: str = "f32") -> tuple[float, float]:
    """(a decoder layer, the head) in the units the split balances, for the mesh's weight format."""
    extra = PACKED_LAYER_EXTRA if weights.startswith("packed") else 0.0
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
