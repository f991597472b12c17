"""Sampling with log-probabilities on the last stage, from the logits it already holds: the client gets each token's
log-probability and the top alternatives, never a vocabulary-sized row over the wire.

The token is drawn by executable.sample_row with the draw the in-graph sample op would use for the same row
(uniform(rng, seed, 0): each row of a step draws with its own seed and row index 0), so asking for logprobs never
changes a session's tokens, alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphmesh_executor.executable import RngOptions, sample_row, uniform


@dataclass(frozen=True)
class RowSampling:
    """One row's sampling settings, with the seed of its position already derived (stage.seed_for)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: bool
    top_logprobs: int
    allowed_tokens: bytes = b""  # guided decoding: a little-endian uint32 bitmask of the tokens it may sample


@dataclass(frozen=True)
class RowLogprobs:
    logprob: float  # of the sampled token
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """[vocab] -> [vocab] float64: computed in float64 so a near-certain token's logprob does not round to 0 or a
    rare one's to -inf."""
    x = logits.astype(np.float64)
    shifted = x - x.max()
    return np.asarray(shifted - np.log(np.exp(shifted).sum()))


def top_tokens(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens, most likely first; a tie goes to the lower id, as argmax picks it."""
    if k <= 0:
        return []
    k = min(k, logprobs.shape[0])
    candidates = np.argpartition(-logprobs, k - 1)[:k]
    order = sorted(candidates.tolist(), key=lambda t: (-logprobs[t], t))
    return [(int(t), float(logprobs[t])) for t in order]


def allowed(mask: bytes, vocab: int) -> np.ndarray:
    """bool [vocab]: the tokens a guided row may sample (bit i % 32 of little-endian uint32 word i // 32)."""
    bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little").astype(bool)
    out = np.zeros(vocab, bool)
    out[: min(vocab, bits.size)] = bits[:vocab]
    return out


def masked(logits: np.ndarray, mask: bytes) -> np.ndarray:
    """The row's logits with every token the mask forbids at -inf: sample_row never picks one (a grammar allows at
    least one token where it is not finished; a mask of none leaves the row as it was rather than pick at random)."""
    keep = allowed(mask, logits.shape[-1])
    if not keep.any():
        return logits
    return np.where(keep, logits, -np.inf).astype(logits.dtype, copy=False)


def sample_with_logprobs(rng: RngOptions, logits: np.ndarray,
                         rows: list[RowSampling]) -> tuple[list[int], list[RowLogprobs | None]]:
    """logits: [rows, vocab] (a step's last positions) -> each row's token and, where it asked, its logprobs."""
    tokens: list[int] = []
    out: list[RowLogprobs | None] = []
    for row_logits, s in zip(logits, rows):
        if s.allowed_tokens:
            row_logits = masked(row_logits, s.allowed_tokens)
        token = sample_row(row_logits, s.temperature, s.top_k, s.top_p, uniform(rng, s.seed, 0))
        tokens.append(token)
        if not s.logprobs:
            out.append(None)
            continue
        lp = log_softmax(row_logits)
        out.append(RowLogprobs(float(lp[token]), top_tokens(lp, s.top_logprobs)))
    return tokens, out
