"""Partition planning, without processes."""

from __future__ import annotations

import itertools

import pytest

from graphmesh.errors import InvalidArgument
from graphmesh.models.config import ModelConfig
from graphmesh_coordinator.planner import LAYER_EXTRA, head_bytes, layer_bytes, plan, stage_costs

SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      head_dim=64, intermediate_size=1536, norm_eps=1e-5, tie_word_embeddings=True, max_position=8192)


def test_split_covers_every_layer_once_in_order() -> None:
    for n in (1, 2, 3, 5):
        stages = plan(SMOLLM2, [f"e{i}" for i in range(n)])
        assert [s.rank for s in stages] == list(range(n))
        assert stages[0].layer_start == 0 and stages[-1].layer_end == 30
        assert all(a.layer_end == b.layer_start for a, b in itertools.pairwise(stages))
        assert all(s.layer_end > s.layer_start for s in stages)


def test_balance_charges_the_lm_head_to_the_last_stage() -> None:
    first, last = plan(SMOLLM2, ["a", "b"])
    layer, head = stage_costs(SMOLLM2)
    cost = [(s.layer_end - s.layer_start) * layer for s in (first, last)]
    cost[1] += head
    assert first.layer_end - first.layer_start > last.layer_end - last.layer_start
    assert abs(cost[0] - cost[1]) <= layer  # within one layer of even


@pytest.mark.parametrize(("weights", "split"), [("f32", (18, 12)), ("packed", (17, 13)), ("packed-bf16", (17, 13))])
def test_a_layer_is_charged_its_work_beyond_its_weights(weights: str, split: tuple[int, int]) -> None:
    """A layer costs its products and the attention, norms and rope beside them, the head its product alone, so
    the last stage takes more layers than by bytes alone (19+11 for SmolLM2), more so with packed weights, whose
    products read a fifth of the bytes (the faster split of each in bench runs); the costs stay within one layer
    of even."""
    layer, head = stage_costs(SMOLLM2, weights)
    extra = LAYER_EXTRA["packed" if weights.startswith("packed") else "f32"]
    assert layer == layer_bytes(SMOLLM2) * (1 + extra) and head == head_bytes(SMOLLM2)
    first, last = plan(SMOLLM2, ["a", "b"], weights=weights)
    assert (first.layer_end - first.layer_start, last.layer_end - last.layer_start) == split
    cost = [(s.layer_end - s.layer_start) * layer for s in (first, last)]
    cost[1] += head
    assert abs(cost[0] - cost[1]) <= layer


def test_explicit_split_and_bad_splits() -> None:
    stages = plan(SMOLLM2, ["a", "b", "c"], split=[10, 10, 10])
    assert [(s.layer_start, s.layer_end) for s in stages] == [(0, 10), (10, 20), (20, 30)]
    for bad in ([10, 10], [10, 10, 11], [0, 15, 15]):
        with pytest.raises(InvalidArgument):
            plan(SMOLLM2, ["a", "b", "c"], split=bad)
    with pytest.raises(InvalidArgument):
        plan(SMOLLM2, [])
