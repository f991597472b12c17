"""Speculative decoding by prompt lookup or a draft model: the modes, the prompt-lookup proposer and each
session's adaptive k.

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
not pay. Rows with logprobs do not speculate (they are sampled on the host one position a row). A guided row
proposes what its grammar allows one after another (guided.Guide.proposals, the matcher rolled back after), and
each position of its pass is sampled under its own mask, the grammar's after the proposals before it: the token
plain guided decoding would sample there.

A draft model (`--speculative draft:MODEL[:K]`, draft.py) proposes its own greedy tokens: deterministic too, so the
same verification stays exact, and the same adaptive k, backoff and metrics apply.

Whether a step of decodes verifies proposals at all is the mesh's measured costs' call (PassCosts): a decode run
gives every row several tokens a round trip, a verified chunk one more than it accepts, so a step verifies only
where its sessions' tokens per pass beat the run's tokens per second on this mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from prometheus_client import Counter

from graphmesh.errors import InvalidArgument
from graphmesh.v1 import coordinator_pb2

# A match of the last token alone is weak evidence: in open text the token after an earlier "the" or "," is rarely
# the next one, and each such pass costs a verified chunk; a match of two carries the copied spans of summaries,
# edits and code (bench/RESULTS.md, speculative decoding).
MAX_NGRAM, MIN_NGRAM = 3, 2
# k at most 8 by default: a copied span pays more at up to 8 proposals a pass than at 4, and k falls back at once
# where fewer are accepted (bench/RESULTS.md, speculative decoding)
DEFAULT_K, MAX_K = 8, 16
# Acceptance per proposed token (an exponential average) under which k drops to 0 for a while: a verified chunk
# costs more than a decode row (more rows per pass), so a session whose proposals keep failing decodes plainly.
MIN_ACCEPTANCE = 0.25
EMA = 0.3  # weight of the newest pass in the acceptance average
BACKOFF_TOKENS, MAX_BACKOFF_TOKENS = 8, 256  # plain tokens before speculating again, doubled on each fall to 0
# What a verified pass's cost keeps each time a step of decodes runs instead (PassCosts): a cost not measured
# lately (a lighter load since, a larger k) is tried again after a few declines, ~14 where passes cost twice
# what pays.
AGING = 0.95

PROPOSED_TOKENS = Counter("graphmesh_speculative_proposed_tokens", "Tokens proposed for verification (prompt lookup "
                          "or a draft model)")
ACCEPTED_TOKENS = Counter("graphmesh_speculative_accepted_tokens", "Proposed tokens the target model accepted")
VERIFY_PASSES = Counter("graphmesh_speculative_passes", "Verified chunks (passes through every stage with proposals)")
PASS_TOKENS = Counter("graphmesh_speculative_pass_tokens", "Tokens verified chunks produced (accepted proposals and "
                      "the token after them): divided by graphmesh_speculative_passes, the tokens per pass")


@dataclass(frozen=True)
class Mode:
    """Speculative decoding as a request or the coordinator asks for it: a method and the largest k."""

    method: str = "off"  # "prompt-lookup", "draft" or "off"
    max_k: int = DEFAULT_K
    model: str = ""  # the draft model (method "draft"; as --speculative named it)

    @property
    def on(self) -> bool:
        return self.method != "off" and self.max_k > 0

    def __str__(self) -> str:
        if not self.on:
            return "off"
        return f"draft:{self.model} k={self.max_k}" if self.method == DRAFT else f"{self.method} k={self.max_k}"


OFF = Mode()
DRAFT = "draft"
NO_DRAFT = "this coordinator has no draft model: start it with --speculative draft:MODEL"


def parse_mode(text: str) -> Mode:
    """--speculative: "prompt-lookup", "prompt-lookup:K", "draft:MODEL", "draft:MODEL:K" or "off"."""
    method, _, k = text.strip().partition(":")
    if method == "off" and not k:
        return OFF
    if method == DRAFT:
        # MODEL may hold colons itself (a path): only a last part of digits is K
        model, _, last = k.rpartition(":")
        model, k = (model, last) if model and last.isdigit() else (k, "")
        if not model:
            raise InvalidArgument(f"speculative draft needs a model: draft:MODEL[:K], got {text!r}",
                                  "BAD_SPECULATIVE", {"parameter": "speculative"})
        return Mode(DRAFT, _max_k(k or str(DEFAULT_K)), model)
    if method != "prompt-lookup":
        raise InvalidArgument(f"speculative takes prompt-lookup[:K], draft:MODEL[:K] or off, got {text!r}",
                              "BAD_SPECULATIVE", {"parameter": "speculative"})
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
              coordinator_pb2.SPECULATIVE_METHOD_PROMPT_LOOKUP: "prompt-lookup",
              coordinator_pb2.SPECULATIVE_METHOD_DRAFT: DRAFT}.get(message.method)
    if method is None:
        raise InvalidArgument(f"unknown speculative method {message.method}", "BAD_SPECULATIVE",
                              {"parameter": "speculative"})
    return _mode(method, _max_k(message.max_proposed) if message.max_proposed else default.max_k, default,
                 "speculative.method")


def _mode(method: str, k: int, default: Mode, field: str) -> Mode:
    """A request's mode; a draft only where the coordinator loaded one (its default is then the draft)."""
    if method != DRAFT:
        return Mode(method, k)
    if default.method != DRAFT:
        raise InvalidArgument(f"{field} asks for draft: {NO_DRAFT}", "NO_DRAFT_MODEL", {"parameter": field})
    return Mode(DRAFT, k, default.model)


def to_proto(mode: Mode) -> coordinator_pb2.SpeculativeDecoding:
    """from_proto's inverse (a draft is the coordinator's own, so its model is not named)."""
    method = {"off": coordinator_pb2.SPECULATIVE_METHOD_OFF, "prompt-lookup": coordinator_pb2.SPECULATIVE_METHOD_PROMPT_LOOKUP,
              DRAFT: coordinator_pb2.SPECULATIVE_METHOD_DRAFT}[mode.method]
    return coordinator_pb2.SpeculativeDecoding(method=method, max_proposed=mode.max_k)


def from_status(text: str) -> Mode:
    """StatusResponse.speculative (a Mode as str() writes it: "off", "prompt-lookup k=4", "draft:MODEL k=4")."""
    head, _, k = text.rpartition(" k=")
    if not head or not k.isdigit():
        return OFF
    return Mode(DRAFT, int(k), head.removeprefix(DRAFT + ":")) if head.startswith(DRAFT + ":") else Mode(head, int(k))


def from_json(value: object, default: Mode) -> Mode:
    """The OpenAI API's extension field (and KServe's parameter): "prompt-lookup", "draft", "off", or
    {"method": ..., "max_proposed": k}. A draft is the coordinator's own (--speculative draft:MODEL)."""
    if value is None:
        return default
    if isinstance(value, str):
        name, _, count = value.partition(":")
        if name == DRAFT and (not count or count.isdigit()):  # "draft" or "draft:K": the coordinator's draft
            return _mode(DRAFT, _max_k(count) if count else default.max_k, default, "speculative")
        if value == "prompt-lookup":
            return Mode("prompt-lookup", default.max_k)
        mode = parse_mode(value)
        return _other_draft(mode, default) if mode.method == DRAFT else mode
    if isinstance(value, dict) and set(value) <= {"method", "max_proposed"}:
        method = value.get("method", default.method if default.on else "prompt-lookup")
        if method not in ("prompt-lookup", DRAFT, "off"):
            raise InvalidArgument(f"speculative.method must be prompt-lookup, draft or off, got {method!r}",
                                  "BAD_SPECULATIVE", {"parameter": "speculative.method"})
        k = value.get("max_proposed")
        return _mode(str(method), _max_k(k) if isinstance(k, int) and not isinstance(k, bool) else
                     default.max_k if k is None else _max_k(str(k)), default, "speculative.method")
    raise InvalidArgument("speculative must be \"prompt-lookup\", \"draft\", \"off\" or {\"method\", "
                          "\"max_proposed\"}", "BAD_SPECULATIVE", {"parameter": "speculative"})


def _other_draft(mode: Mode, default: Mode) -> Mode:
    """A request naming a draft model: only the coordinator's own can draft (it is installed at start)."""
    if mode.model == default.model:
        return Mode(DRAFT, mode.max_k, default.model)
    if default.method != DRAFT:
        raise InvalidArgument(f"speculative asks for draft: {NO_DRAFT}", "NO_DRAFT_MODEL",
                              {"parameter": "speculative"})
    raise InvalidArgument(f"speculative names the draft model {mode.model!r}; this coordinator drafts with "
                          f"{default.model!r} only (a request says \"draft\" or \"draft:K\" for it)",
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


def _average(old: float, new: float) -> float:
    """An exponential average of weight EMA; `old` 0 is none yet."""
    return new if old == 0.0 else (1 - EMA) * old + EMA * new


@dataclass
class Speculation:
    """One session's speculative state: its largest k, the k of its next pass, and its acceptance."""

    max_k: int
    k: int = 0
    acceptance: float = 1.0  # per proposed token, an exponential average
    backoff: int = 0  # plain tokens left before it speculates again
    next_backoff: int = BACKOFF_TOKENS
    probation: bool = False  # back from a backoff: one pass that accepts nothing sends it back, for longer
    passes: int = 0
    draft: bool = False  # proposals come from the coordinator's draft model (draft.py), else prompt lookup
    tokens_per_pass: float = 0.0  # what its verified passes gave (an exponential average); 0: none yet

    def __post_init__(self) -> None:
        self.k = self.max_k

    def want(self, room: int) -> int:
        """How many tokens the session's next pass may propose (at most `room`: what it may still grow by); 0 to
        decode plainly."""
        return 0 if self.backoff > 0 or self.k <= 0 else max(0, min(self.k, room))

    def proposals(self, tokens: list[int], room: int) -> list[int]:
        """The prompt-lookup proposals of the session's next pass; [] to decode plainly."""
        return propose(tokens, self.want(room))

    def plain(self, tokens: int) -> None:
        """The session decoded `tokens` without proposals."""
        if self.backoff > 0:
            self.backoff = max(0, self.backoff - tokens)
            if self.backoff == 0:
                self.k, self.probation = 1, True  # try again, small: it grows back with acceptance

    def verified(self, proposed: int, accepted: int) -> None:
        """A pass proposed `proposed` tokens and the target accepted the first `accepted` of them."""
        PROPOSED_TOKENS.inc(proposed)
        ACCEPTED_TOKENS.inc(accepted)
        VERIFY_PASSES.inc()
        PASS_TOKENS.inc(accepted + 1)
        self.passes += 1
        self.acceptance = (1 - EMA) * self.acceptance + EMA * accepted / proposed
        self.tokens_per_pass = _average(self.tokens_per_pass, accepted + 1)
        if accepted == proposed:
            self.k, self.probation = min(self.max_k, self.k + 1), False
        elif (self.probation and accepted == 0) or (self.acceptance < MIN_ACCEPTANCE and self.passes >= 3):
            # Does not pay: plain decoding for a while. Each probe after a backoff is a verified chunk in place of
            # a decode run, so open text (whose one-token matches rarely hold) pays one failed pass per backoff.
            self.k, self.backoff = 0, self.next_backoff
            self.next_backoff = min(MAX_BACKOFF_TOKENS, self.next_backoff * 2)
            self.acceptance, self.passes, self.probation = 0.5, 0, False
        else:
            self.k, self.probation = max(1, min(self.max_k, accepted + 1)), False


@dataclass
class PassCosts:
    """What this mesh's passes cost lately (exponential averages of seconds; 0: not measured yet): a verified
    chunk's step, a decode run's step per token, the draft model's pass, and the scheduler's turn from a step's
    reply to its next step's send. One per scheduler, which observes every step and asks verify_pays of each step of
    decodes with proposals. A race between two observers loses an update of an average, nothing else."""

    verify_s: float = 0.0
    run_token_s: float = 0.0
    draft_s: float = 0.0
    turn_s: float = 0.0
    verify_seen: int = 0  # verified steps observed; the first is not a cost (a first use of its shapes)
    # What any session's verified pass gave lately: a new session's expectation until its own passes say
    tokens_per_pass: float = 0.0

    def verified(self, seconds: float) -> None:
        self.verify_seen += 1
        if self.verify_seen > 1:
            self.verify_s = _average(self.verify_s, seconds)

    def passed(self, tokens: int) -> None:
        self.tokens_per_pass = _average(self.tokens_per_pass, tokens)

    def ran(self, seconds: float, steps: int) -> None:
        self.run_token_s = _average(self.run_token_s, seconds / steps)

    def drafted(self, seconds: float) -> None:
        self.draft_s = _average(self.draft_s, seconds)

    def turned(self, seconds: float) -> None:
        self.turn_s = _average(self.turn_s, seconds)

    def seconds(self) -> dict[str, float]:
        return {"verify": self.verify_s, "run_token": self.run_token_s, "draft": self.draft_s, "turn": self.turn_s}

    def expected(self, spec: Speculation) -> float:
        """The tokens a verified pass of this session should give: its own passes', else this mesh's lately."""
        return spec.tokens_per_pass or self.tokens_per_pass

    def pays(self, yields: Sequence[float], rows: int, run: int, draft: bool) -> bool:
        """Whether a step of `rows` decodes, the speculating ones expecting `yields` tokens from a verified pass
        (the others one), gives more tokens a second verified than as a decode run of `run` tokens a row. True
        until both are measured, and while a session has nothing to expect of a pass yet."""
        if run <= 1 or not self.verify_s or not self.run_token_s or not all(yields):
            return True
        verify = (sum(yields) + rows - len(yields)) / (self.verify_s + self.turn_s + (self.draft_s if draft else 0.0))
        return verify >= rows * run / (self.run_token_s * run + self.turn_s)

    def verify_pays(self, yields: Sequence[float], rows: int, run: int, draft: bool) -> bool:
        """pays(), where a decline ages the verified pass's cost (AGING): measured long ago, under another load or
        k, it counts for less until a pass measures it again."""
        if self.pays(yields, rows, run, draft):
            return True
        self.verify_s *= AGING
        return False
