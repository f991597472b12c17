"""Partition planning: contiguous layer ranges, balanced by the bytes each stage reads per token.

Decode is memory-bound, so a stage's cost is the weight bytes it reads per token: every layer's
weights, plus the LM head on the last stage. The embedding costs one row per token and is left out:
balancing on plain parameter bytes would give the first stage far too few layers.

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


def layer_bytes(config: ModelConfig) -> int:
    return 4 * config.layer_params()


def head_bytes(config: ModelConfig) -> int:
    return config.vocab_size * config.hidden_size * 4


def plan(config: ModelConfig, addresses: Sequence[str], split: Sequence[int] | None = None,
         capacities: Sequence[float] | None = None) -> list[StagePlan]:
    """Assigns contiguous layer ranges to executors in order; `split` overrides with layer counts."""
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
        counts = _balance(config, n, capacities or [1.0] * n)
    stages, start = [], 0
    for rank, (address, count) in enumerate(zip(addresses, counts)):
        stages.append(StagePlan(rank, address, start, start + count))
        start += count
    return stages


def partition(config: ModelConfig, stages: Sequence[StagePlan]) -> dag.Plan:
    """The DAG plan of `stages`: their decoder groups, and the model's encoder (if any) on the last rank."""
    return dag.pipeline([(s.layer_start, s.layer_end) for s in stages], [s.address for s in stages],
                        config.hidden_size, encoder_rank=len(stages) - 1 if config.encoder is not None else None)


def _balance(config: ModelConfig, n: int, capacities: Sequence[float]) -> list[int]:
    per_layer, head = layer_bytes(config), head_bytes(config)
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
