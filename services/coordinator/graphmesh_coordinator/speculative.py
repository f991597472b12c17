"""Speculative decoding by prompt lookup: the proposer and each session's adaptive k.

A speculating session's row is its last token and k proposed tokens, verified in one pass through every stage as
a (k+1)-row chunk (stage.proto StepRow.prediction_target): the last stage samples every position with that
position's own seed and keeps the proposals up to the first its sample disagrees with. The proposer is
deterministic (q is one-hot), so speculative sampling's rule (accept t with probability min(1, p(t) / q(t)) =
p(t), else draw from the residual p without t, renormalised) is exactly "draw the position's token as plain
decoding would, accept t when it is that token": the tokens are those of plain decoding, greedy or seeded, alone,
batched or replayed after a fault.

Prompt lookup proposes the tokens that followed the latest earlier occurrence of the session's last n tokens
(n from MAX_NGRAM down to MIN_NGRAM) in its prompt and output: no weights, and it pays where the output repeats
its input (summaries, edits, code). k adapts per session: it grows while whole proposals are accepted and
shrinks with the acceptance rate, down to 0 (plain decoding, and decode runs) for a while when speculation does
not pay. Guided rows (a grammar) and rows with logprobs do not speculate: a proposal would need the grammar
advanced over tokens not yet delivered, and logprobs are sampled on the host one position a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from prometheus_client import Counter

from graphmesh.errors import InvalidArgument
from graphmesh.v1 import coordinator_pb2

MAX_NGRAM, MIN_NGRAM = 3, 1
DEFAULT_K, MAX_K = 4, 16
# Acceptance per proposed token (an exponential average) under which k drops to 0 for a while: a verified chunk
# costs more than a decode row (more rows per pass), so a session whose proposals keep failing decodes plainly.
MIN_ACCEPTANCE = 0.25
EMA = 0.3  # weight of the newest pass in the acceptance average
BACKOFF_TOKENS, MAX_BACKOFF_TOKENS = 8, 256  # plain tokens before speculating again, doubled on each fall to 0

PROPOSED_TOKENS = Counter("graphmesh_speculative_proposed_tokens", "Tokens proposed for verification (prompt lookup)")
ACCEPTED_TOKENS = Counter("graphmesh_speculative_accepted_tokens", "Proposed tokens the target model accepted")
VERIFY_PASSES = Counter("graphmesh_speculative_passes", "Verified chunks (passes through every stage with proposals)")
PASS_TOKENS = Counter("graphmesh_speculative_pass_tokens", "Tokens verified chunks produced (accepted proposals and "
                      "the token after them): divided by graphmesh_speculative_passes, the tokens per pass")


@dataclass(frozen=True)
class Mode:
    """Speculative decoding as a request or the coordinator asks for it: a method and the largest k."""

    method: str = "off"  # "prompt-lookup" or "off"
    max_k: int = DEFAULT_K

    @property
    def on(self) -> bool:
        return self.method != "off" and self.max_k > 0

    def __str__(self) -> str:
        return f"{self.method} k={self.max_k}" if self.on else "off"


OFF = Mode()


def parse_mode(text: str) -> Mode:
    """--speculative: "prompt-lookup", "prompt-lookup:K" or "off"."""
    method, _, k = text.strip().partition(":")
    if method == "off" and not k:
        return OFF
    if method == "draft":
        raise InvalidArgument("speculative decoding by a draft model (draft:MODEL) is not supported yet; use "
                              "prompt-lookup or off",
                              "BAD_SPECULATIVE", {"parameter": "speculative"})
    if method != "prompt-lookup":
        raise InvalidArgument(f"speculative takes prompt-lookup[:K] or off, got {text!r}", "BAD_SPECULATIVE",
                              {"parameter": "speculative"})
    return Mode(method, _max_k(k or str(DEFAULT_K)))


def _max_k(value: str | int) -> int:
    try:
        k = int(value)
    except ValueError:
        k = -1
    if not 1 <= k <= MAX_K:
        raise InvalidArgument(f"speculative max_proposed must be in [1, {MAX_K}], got {value!r}", "BAD_SPECULATIVE",
                              {"parameter": "speculative"})
    return k


def from_proto(message: coordinator_pb2.SpeculativeDecoding, default: Mode) -> Mode:
    """GenerateRequest.speculative over the coordinator's default."""
    method = {coordinator_pb2.SPECULATIVE_METHOD_UNSPECIFIED: default.method,
              coordinator_pb2.SPECULATIVE_METHOD_OFF: "off",
              coordinator_pb2.SPECULATIVE_METHOD_PROMPT_LOOKUP: "prompt-lookup"}.get(message.method)
    if method is None:
        raise InvalidArgument(f"unknown speculative method {message.method}", "BAD_SPECULATIVE",
                              {"parameter": "speculative"})
    return Mode(method, _max_k(message.max_proposed) if message.max_proposed else default.max_k)


def from_json(value: object, default: Mode) -> Mode:
    """The OpenAI API's extension field: "prompt-lookup", "off", or {"method": ..., "max_proposed": k}."""
    if value is None:
        return default
    if isinstance(value, str):
        return parse_mode(value) if value != "prompt-lookup" else Mode("prompt-lookup", default.max_k)
    if isinstance(value, dict) and set(value) <= {"method", "max_proposed"}:
        method = value.get("method", default.method if default.on else "prompt-lookup")
        if method not in ("prompt-lookup", "off"):
            raise InvalidArgument(f"speculative.method must be prompt-lookup or off, got {method!r}", "BAD_SPECULATIVE",
                                  {"parameter": "speculative"})
        k = value.get("max_proposed")
        return Mode(str(method), _max_k(k) if isinstance(k, int) and not isinstance(k, bool) else
                    default.max_k if k is None else _max_k(str(k)))
    raise InvalidArgument("speculative must be \"prompt-lookup\", \"off\" or {\"method\", \"max_proposed\"}",
                          "BAD_SPECULATIVE", {"parameter": "speculative"})


def propose(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` (of max_ngram
    down to min_ngram tokens) found earlier in them; [] when none occurs."""
    n_tokens = len(tokens)
    if k <= 0 or n_tokens < min_ngram + 1:
        return []
    arr = np.asarray(tokens, np.int64)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = arr[n_tokens - n:]
        # windows starting at 0 .. n_tokens - n - 1: every occurrence that ends before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(arr[:n_tokens - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in arr[start:start + k]]
    return []


@dataclass
class Speculation:
    """One session's speculative state: its largest k, the k of its next pass, and its acceptance."""

    max_k: int
    k: int = 0
    acceptance: float = 1.0  # per proposed token, an exponential average
    backoff: int = 0  # plain tokens left before it speculates again
    next_backoff: int = BACKOFF_TOKENS
    passes: int = 0

    def __post_init__(self) -> None:
        self.k = self.max_k

    def proposals(self, tokens: list[int], room: int) -> list[int]:
        """The proposals of the session's next pass (at most `room`: what it may still grow by); [] to decode
        plainly."""
        if self.backoff > 0 or self.k <= 0:
            return []
        return propose(tokens, min(self.k, room))

    def plain(self, tokens: int) -> None:
        """The session decoded `tokens` without proposals."""
        if self.backoff > 0:
            self.backoff = max(0, self.backoff - tokens)
            if self.backoff == 0:
                self.k = 1  # try again, small: it grows back with acceptance

    def verified(self, proposed: int, accepted: int) -> None:
        """A pass proposed `proposed` tokens and the target accepted the first `accepted` of them."""
        PROPOSED_TOKENS.inc(proposed)
        ACCEPTED_TOKENS.inc(accepted)
        VERIFY_PASSES.inc()
        PASS_TOKENS.inc(accepted + 1)
        self.passes += 1
        self.acceptance = (1 - EMA) * self.acceptance + EMA * accepted / proposed
        if accepted == proposed:
            self.k = min(self.max_k, self.k + 1)
        elif self.acceptance < MIN_ACCEPTANCE and self.passes >= 3:
            self.k, self.backoff = 0, self.next_backoff  # does not pay: plain decoding for a while
            self.next_backoff = min(MAX_BACKOFF_TOKENS, self.next_backoff * 2)
            self.acceptance, self.passes = 0.5, 0
        else:
            self.k = max(1, min(self.max_k, accepted + 1))
