"""Sessions: a prefill invocation, then one decode invocation per token, streamed as they come.

Each invocation is numbered by the session's commit epoch; epoch e's commit is folded into epoch
e+1's ExecuteGroup. Sampling is seeded per session and token position, so any replay of an epoch
gives the same token.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import Counter, Histogram

from graphmesh import telemetry, tensors
from graphmesh.errors import InvalidArgument, Unavailable
from graphmesh.tokenizer import Tokenizer
from graphmesh.v1 import stage_pb2
from graphmesh_coordinator.pipeline import InvocationFailed, Mesh

MAX_RECOVERIES = 3
MAX_ARCH_RETRIES = 1

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TTFT_SECONDS = Histogram("graphmesh_ttft_seconds", "Time from a generation request to its first token",
                         buckets=_LATENCY_BUCKETS)
INTER_TOKEN_SECONDS = Histogram("graphmesh_inter_token_seconds", "Time between consecutive tokens of a stream",
                                buckets=_LATENCY_BUCKETS)
TOKENS_GENERATED = Counter("graphmesh_tokens_generated", "Tokens generated and streamed to clients")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class Event:
    token_ids: list[int]
    text: str
    finish_reason: str = ""  # "", "length", "eos", "stop"
    ttft_ms: float = 0.0
    prefill_computed_tokens: int = 0


@dataclass
class SessionInfo:
    session_id: str
    history: list[int] = field(default_factory=list)  # tokens whose KV is committed, in order
    epoch: int = 0  # the newest epoch issued (epochs are consumed even when they fail)
    delivered_epoch: int = 0  # the newest epoch whose output reached the client: committed, folded into the next
    incarnation: int = 0  # the incarnation holding this session's KV; 0 until the first invocation

    @property
    def tokens(self) -> int:
        return len(self.history)


@dataclass
class Detokenizer:
    """Emits text only once it is final: a token that ends inside a UTF-8 sequence waits for the next."""

    tokenizer: Tokenizer | None
    ids: list[int] = field(default_factory=list)
    emitted: str = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new


def validate(request: GenerationRequest, context_tokens: int) -> None:
    if not request.prompt_ids:
        raise InvalidArgument("the prompt is empty", "EMPTY_PROMPT")
    if request.max_tokens <= 0:
        raise InvalidArgument(f"max_tokens must be >= 1, got {request.max_tokens}", "BAD_MAX_TOKENS")
    if len(request.prompt_ids) >= context_tokens:
        raise InvalidArgument(f"the prompt has {len(request.prompt_ids)} tokens; the context holds {context_tokens}",
                              "PROMPT_TOO_LONG")
    if request.temperature < 0 or request.top_k < 0 or not 0.0 <= request.top_p <= 1.0:
        raise InvalidArgument(f"bad sampling: temperature {request.temperature} (>= 0), top_k {request.top_k} (>= 0), "
                              f"top_p {request.top_p} (in [0, 1])", "BAD_SAMPLING")


class Generator:
    def __init__(self, mesh: Mesh, tokenizer: Tokenizer | None, eos_token_ids: Sequence[int], context_tokens: int) -> None:
        self.mesh, self.tokenizer = mesh, tokenizer
        self.eos = set(eos_token_ids)
        self.context_tokens = context_tokens
        self.sessions: dict[str, SessionInfo] = {}
        self._lock = threading.Lock()

    def generate(self, request: GenerationRequest, session_id: str = "") -> Iterator[Event]:
        validate(request, self.context_tokens)
        session = SessionInfo(session_id or uuid.uuid4().hex)
        with self._lock:
            self.sessions[session.session_id] = session
        sampling = stage_pb2.SamplingParams(temperature=request.temperature, top_k=request.top_k,
                                            top_p=request.top_p, seed=request.seed)
        detok = Detokenizer(self.tokenizer)
        t0 = time.perf_counter()
        completion = ""
        budget = min(request.max_tokens, self.context_tokens - len(request.prompt_ids))
        last = t0
        try:
            with telemetry.span("generate", session=session.session_id, prompt_tokens=len(request.prompt_ids),
                                max_tokens=request.max_tokens) as span:
                pending = list(request.prompt_ids)
                for step in range(budget):
                    reply = self.invoke(session, pending, sampling, stage_pb2.OUTPUT_KIND_TOKEN)
                    token = int(reply.token)
                    pending = [token]
                    now = time.perf_counter()
                    (TTFT_SECONDS if step == 0 else INTER_TOKEN_SECONDS).observe(now - last)
                    last = now
                    TOKENS_GENERATED.inc()
                    span.set_attribute("completion_tokens", step + 1)
                    ttft_ms = (now - t0) * 1000.0 if step == 0 else 0.0
                    computed = int(reply.computed_tokens) if step == 0 else 0
                    if token in self.eos and not request.ignore_eos:
                        yield Event([token], "", "eos", ttft_ms, computed)
                        return
                    text = detok.push(token)
                    completion += text
                    hit = next((s for s in request.stop if s in completion), None)
                    if hit is not None:
                        overshoot = len(completion) - completion.index(hit)
                        yield Event([token], text[: max(0, len(text) - overshoot)], "stop", ttft_ms, computed)
                        return
                    yield Event([token], text, "length" if step == budget - 1 else "", ttft_ms, computed)
        finally:
            with self._lock:
                self.sessions.pop(session.session_id, None)
            self.mesh.release(session.session_id)

    def invoke(self, session: SessionInfo, pending: list[int], sampling: stage_pb2.SamplingParams,
               output: stage_pb2.OutputKind.ValueType) -> stage_pb2.ExecuteGroupResponse:
        """One invocation, surviving the loss of executors: after a COMM failure the roster is rebuilt and the
        session's committed tokens are recomputed together with the pending ones, so the replay samples the
        same token at the same position with the same seed."""
        arch_retries = MAX_ARCH_RETRIES
        for _ in range(MAX_RECOVERIES + MAX_ARCH_RETRIES + 1):
            incarnation = self.mesh.incarnation
            restore = session.incarnation != incarnation  # a new session, or one whose KV was lost
            tokens = session.history + pending if restore else pending
            start = self.mesh.seed_prefix(session.session_id, tokens) if restore else len(session.history)
            tokens = tokens[start:] if restore else tokens
            commit = 0 if restore else session.delivered_epoch
            session.epoch += 1
            try:
                reply = self.mesh.invoke(session.session_id, session.epoch, commit, start, tokens, sampling, output)
            except InvocationFailed as failure:
                if failure.error_class == "ARCH":
                    if arch_retries == 0:
                        raise
                    arch_retries -= 1  # every rank rolled back and stays ACTIVE: the invocation is retryable
                    continue
                self.mesh.recover(incarnation)
                continue
            session.history += pending
            session.delivered_epoch, session.incarnation = session.epoch, incarnation
            return reply
        raise Unavailable(f"session {session.session_id} lost the mesh {MAX_RECOVERIES + 1} times in a row",
                          "TOO_MANY_RECOVERIES")

    def logits(self, token_ids: list[int]) -> np.ndarray:
        validate(GenerationRequest(token_ids, 1), self.context_tokens)
        session = SessionInfo(uuid.uuid4().hex)
        try:
            reply = self.invoke(session, token_ids, stage_pb2.SamplingParams(), stage_pb2.OUTPUT_KIND_LOGITS)
        finally:
            self.mesh.release(session.session_id)
        return tensors.from_proto(reply.logits)
