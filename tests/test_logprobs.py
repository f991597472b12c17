"""The last stage's host sampling with logprobs draws exactly what the in-graph sample op draws, alone or batched, so
asking for logprobs never changes a token; and its logprobs are the model's distribution."""

from __future__ import annotations

import numpy as np
import pytest

from graphmesh_executor.executable import RngOptions, sample_rows
from graphmesh_executor.logprobs import RowSampling, log_softmax, sample_with_logprobs, top_tokens

SETTINGS = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 40, 0.9), (1.3, 5, 1.0), (0.9, 0, 0.5)]  # (temperature, top_k, top_p)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_host_sampling_draws_what_the_sample_op_draws(batch: int) -> None:
    rng = np.random.default_rng(batch)
    rngs = RngOptions()
    for trial in range(20):
        logits = rng.normal(0.0, 3.0, (batch, 257)).astype(np.float32)
        picks = [SETTINGS[(trial + b) % len(SETTINGS)] for b in range(batch)]
        seeds = [int(s) for s in rng.integers(0, 2**62, batch)]
        # the stage feeds the op one setting per row, padded to a bucket of rows
        pad = 8 - batch if batch > 1 else 0
        padded = np.concatenate([logits, np.zeros((pad, 257), np.float32)])
        in_graph = sample_rows(rngs, padded, np.array([p[0] for p in picks] + [0.0] * pad, np.float32),
                               np.array([p[1] for p in picks] + [0] * pad, np.int64),
                               np.array([p[2] for p in picks] + [1.0] * pad, np.float32),
                               np.array(seeds + [0] * pad, np.int64))[:batch]
        rows = [RowSampling(float(np.float32(t)), k, float(np.float32(p)), s, b % 2 == 0, 3)
                for b, ((t, k, p), s) in enumerate(zip(picks, seeds))]
        tokens, logprobs = sample_with_logprobs(rngs, logits, rows)
        assert tokens == in_graph.tolist()
        assert [lp is not None for lp in logprobs] == [b % 2 == 0 for b in range(batch)]  # only rows that asked


def test_logprobs_are_the_distribution_and_ties_go_to_the_lower_id() -> None:
    logits = np.array([1.0, 3.0, 3.0, -2.0, 0.5], np.float32)
    lp = log_softmax(logits)
    assert np.exp(lp).sum() == pytest.approx(1.0)
    assert lp[1] == pytest.approx(3.0 - np.log(np.exp(logits.astype(np.float64)).sum()))
    assert [t for t, _ in top_tokens(lp, 3)] == [1, 2, 0]
    assert top_tokens(lp, 0) == [] and len(top_tokens(lp, 99)) == 5
    tokens, out = sample_with_logprobs(RngOptions(), logits[None], [RowSampling(0.0, 0, 1.0, 7, True, 2)])
    assert tokens == [1] and out[0] is not None  # greedy: argmax's first maximum
    assert out[0].logprob == pytest.approx(lp[1])
    assert [t for t, _ in out[0].top] == [1, 2] and [v for _, v in out[0].top] == pytest.approx([lp[1], lp[2]])
    # float64: a token of probability 1 - 1e-13 keeps a logprob below 0, one of 1e-13 a finite one
    sharp = log_softmax(np.array([0.0, 30.0], np.float32))
    assert sharp[1] < 0 and sharp[0] == pytest.approx(-30.0)
