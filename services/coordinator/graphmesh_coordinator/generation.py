"""Sessions: a request becomes a scheduler Sequence; its tokens are detokenized and streamed as the steps
that carry its rows come back.

Each of a session's rows is numbered by its commit epoch; epoch e's commit is folded into the session's next
row. Sampling is seeded per session and token position, so any replay of an epoch, alone or in any batch,
gives the same token.
"""

from __future__ import annotations

import collections.abc
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from prometheus_client import Counter, Histogram

from graphmesh.errors import Cancelled, InvalidArgument, ResourceExhausted, Unavailable
from graphmesh.models.config import EncoderConfig
from graphmesh.tokenizer import Tokenizer
from graphmesh.v1 import stage_pb2
from graphmesh_coordinator.guided import Grammars, Guide, GuidedSpec
from graphmesh_coordinator.pipeline import Mesh
from graphmesh_coordinator.scheduler import Encoded, Output, Scheduler, SessionInfo
from graphmesh_coordinator.scheduler import Sequence as SchedulerSequence
from graphmesh_coordinator.speculative import DRAFT, OFF, Mode, Speculation
from graphmesh_coordinator.validation import check_finite_sampling
from graphmesh_server import telemetry
from graphmesh_server.aio_serving import Wait

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TTFT_SECONDS = Histogram("graphmesh_ttft_seconds", "Time from a generation request to its first token",
                         buckets=_LATENCY_BUCKETS)
INTER_TOKEN_SECONDS = Histogram("graphmesh_inter_token_seconds", "Time between consecutive tokens of a stream",
                                buckets=_LATENCY_BUCKETS)
TOKENS_GENERATED = Counter("graphmesh_tokens_generated", "Tokens generated and streamed to clients")
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows
INT32_MAX = (1 << 31) - 1  # top_k and max_tokens travel to the executors as 32-bit fields
UINT64_MAX = (1 << 64) - 1


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
    logprobs: bool = False  # each token's log-probability, computed on the last stage
    top_logprobs: int = 0  # and the most likely alternatives at its position (with logprobs)
    # Tokens a broken stream of this same request already delivered: they continue the history at their own
    # positions (so seeded sampling gives the rest exactly) and count against max_tokens; only new ones stream.
    resume_ids: tuple[int, ...] = ()
    # f32 [n, input_dim]: the features of the prompt's n encoder placeholder tokens, in order (a model with an
    # encoder): the plan's encoder group runs on them in the prompt's steps
    encoder_input: np.ndarray | None = field(default=None, compare=False)
    # Guided decoding (guided.py): what the completion must be (a JSON schema, any JSON object, a regex, a grammar, a
    # tool call); None: free text
    guided: GuidedSpec | None = None
    # Speculative decoding for this request (speculative.py); None: the coordinator's default. Never changes tokens.
    speculative: Mode | None = None
    # Events without text: the caller detokenizes (GenerateRequest.skip_text); stop strings still need the text
    skip_text: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's natural-log probability under the model (before temperature, top-k and top-p), and the
    `top` most likely tokens at its position as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Event:
    token_ids: list[int]
    text: str
    finish_reason: str = ""  # "", "length", "eos", "stop"
    ttft_ms: float = 0.0
    prefill_computed_tokens: int = 0
    session_id: str = ""  # on the first event of a session
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when the request asked


@dataclass
class Detokenizer:
    """Emits text only once it is final: a token that ends inside a UTF-8 sequence waits for the next.

    Incremental: each push decodes only the tokens of the last emitted piece and those after it, and emits what
    they add to that piece's own text. Decoding the whole completion per token cost 183 us a token over 2,000
    tokens (SmolLM2's tokenizer on this VM), quadratic in the length. The piece before keeps what depends on
    context (a SentencePiece word's leading space) and always starts on a character, since a piece is emitted
    only when it ends on one."""

    tokenizer: Tokenizer | None
    ids: list[int] = field(default_factory=list)
    emitted: str = ""
    _piece: int = 0  # where the last emitted piece's tokens start in `ids`
    _read: int = 0  # where the tokens not yet emitted start

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        before = self.tokenizer.decode(self.ids[self._piece:self._read])
        text = self.tokenizer.decode(self.ids[self._piece:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        new = text[len(before):]
        self._piece, self._read = self._read, len(self.ids)
        self.emitted += new
        return new

    def push_many(self, token_ids: list[int]) -> str:
        """push() of each token in turn, with two decodes for all of them (a decode run's tokens come together):
        the same text, since the pieces of consecutive pushes concatenate to the text their tokens add. Where the
        tokens end inside a character, or add no text, each is pushed alone, so that the text that was final at
        each token is emitted exactly as push() would."""
        if len(token_ids) == 1 or self.tokenizer is None:
            return "".join([self.push(t) for t in token_ids])
        before = self.tokenizer.decode(self.ids[self._piece:self._read])
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids[self._piece:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            del self.ids[-len(token_ids):]
            return "".join([self.push(t) for t in token_ids])
        new = text[len(before):]
        self._piece, self._read = self._read, len(self.ids)
        self.emitted += new
        return new


def validate(request: GenerationRequest, context_tokens: int, vocab_size: int,
             encoder: EncoderConfig | None = None) -> None:
    """Everything that would make a request's rows fail, refused before it joins a step with other sessions."""
    if not request.prompt_ids:
        raise InvalidArgument("the prompt is empty", "EMPTY_PROMPT")
    if not 0 < request.max_tokens <= INT32_MAX:
        raise InvalidArgument(f"max_tokens must be in [1, {INT32_MAX}], got {request.max_tokens}", "BAD_MAX_TOKENS",
                              {"parameter": "max_tokens"})
    if len(request.prompt_ids) >= context_tokens:
        raise InvalidArgument(f"the prompt has {len(request.prompt_ids)} tokens; the context holds {context_tokens}",
                              "PROMPT_TOO_LONG")
    bad = next((t for t in request.prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"prompt token id {bad} is outside the vocabulary of {vocab_size}", "BAD_TOKEN_ID")
    bad = next((t for t in request.resume_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"resume token id {bad} is outside the vocabulary of {vocab_size}", "BAD_TOKEN_ID",
                              {"parameter": "resume_token_ids"})
    budget = min(request.max_tokens, context_tokens - len(request.prompt_ids))
    if len(request.resume_ids) >= budget:
        raise InvalidArgument(f"resume_token_ids holds {len(request.resume_ids)} tokens: the completion of "
                              f"{budget} tokens has nothing left to generate", "RESUME_COMPLETE",
                              {"parameter": "resume_token_ids"})
    if request.guided is not None and request.ignore_eos:
        raise InvalidArgument("ignore_eos cannot be combined with guided decoding: a finished grammar allows only the "
                              "end of sequence", "BAD_GUIDED_DECODING", {"parameter": "ignore_eos"})
    check_finite_sampling(temperature=request.temperature, top_p=request.top_p)
    if not 0 <= request.seed <= UINT64_MAX:
        raise InvalidArgument(f"seed must be in [0, {UINT64_MAX}], got {request.seed}", "BAD_SEED",
                              {"parameter": "seed"})
    if request.temperature < 0 or not 0 <= request.top_k <= INT32_MAX or not 0.0 <= request.top_p <= 1.0:
        raise InvalidArgument(f"bad sampling: temperature {request.temperature} (>= 0), top_k {request.top_k} "
                              f"(in [0, {INT32_MAX}]), top_p {request.top_p} (in [0, 1])", "BAD_SAMPLING")
    if request.top_logprobs and not request.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs", "BAD_LOGPROBS", {"parameter": "top_logprobs"})
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}",
                              "BAD_LOGPROBS", {"parameter": "top_logprobs"})
    _validate_encoder_input(request, encoder)


def _validate_encoder_input(request: GenerationRequest, encoder: EncoderConfig | None) -> None:
    features = request.encoder_input
    if features is None:
        return
    if encoder is None:
        raise InvalidArgument("encoder_input was given; the model has no encoder", "NO_ENCODER",
                              {"parameter": "encoder_input"})
    placeholders = sum(1 for t in request.prompt_ids if t == encoder.token_id)
    if features.dtype != np.float32 or features.ndim != 2 or features.shape[1] != encoder.input_dim:
        raise InvalidArgument(f"encoder_input is {features.dtype}{list(features.shape)}; the encoder takes "
                              f"f32[n, {encoder.input_dim}]", "BAD_ENCODER_INPUT", {"parameter": "encoder_input"})
    if features.shape[0] != placeholders or not placeholders:
        raise InvalidArgument(f"encoder_input has {features.shape[0]} rows; the prompt holds {placeholders} "
                              f"placeholder tokens ({encoder.token_id}): one row each", "BAD_ENCODER_INPUT",
                              {"parameter": "encoder_input"})
    if not np.isfinite(features).all():
        raise InvalidArgument("encoder_input holds NaN or infinite values", "BAD_ENCODER_INPUT",
                              {"parameter": "encoder_input"})


def _not_ready(waited_s: float) -> Unavailable:
    return Unavailable(f"the mesh has not been ready for {waited_s:.0f} s (starting or recovering)", "MESH_NOT_READY")


def _logprob(token: int, row: stage_pb2.StepRowResult) -> TokenLogprob:
    return TokenLogprob(token, row.logprob, tuple((t.token_id, t.logprob) for t in row.top_logprobs))


CLIENT_POLL_S = 0.2  # how often a session waiting for its next token checks that its client is still there
# The same, for a session that waits without a thread (generate_waiting): its server cancels the call when the client
# leaves, which closes the session at once, so this only backs that up. Each look costs the coordinator a pass of the
# session's code: at 0.2 s, 256 streams of a CPU mesh (a step of ~0.2 s) looked about once per token.
WAITING_POLL_S = 1.0
READY_POLL_S = 0.25  # how often a request waiting (without a thread) for a recovering mesh looks again
# Generation requests that may wait for their first token (for the mesh, for KV cache, in prefill) at once; more get
# RESOURCE_EXHAUSTED. A waiting request costs its prompt and its call's buffers (kilobytes), no thread: the bound
# caps memory and how long the queue can take, not concurrency. vLLM queues without bound; this is the same order.
DEFAULT_MAX_WAITING = 4096


def _gone(seq: SchedulerSequence) -> Cancelled:
    return Cancelled(f"the client of session {seq.session.session_id} went away", "CLIENT_GONE")


def _next_events(seq: SchedulerSequence, alive: Callable[[], bool] | None) -> list[Output | BaseException]:
    """The session's next output, waited for, and every one already behind it (up to an error, which ends them).
    A decode run delivers its tokens at once; a message each cost the coordinator's and the client's gRPC ~0.15 ms
    of GIL apiece, which at 32 GPU streams (~5,000 tokens/s) took most of the coordinator's time from scheduling."""
    while True:
        try:
            events = [seq.events.get(timeout=None if alive is None else CLIENT_POLL_S)]
            break
        except queue.Empty:
            if alive is not None and not alive():
                raise _gone(seq) from None
    return _behind(seq, events)


def _tokens(outs: list[Output | BaseException]) -> Iterator[tuple[Output | BaseException, int]]:
    """Each output's tokens in turn with their output; an error (which ends them) with -1."""
    for out in outs:
        if isinstance(out, BaseException):
            yield out, -1
            return
        for token in out.tokens:
            yield out, token


def _behind(seq: SchedulerSequence, events: list[Output | BaseException]) -> list[Output | BaseException]:
    """`events` and every output already queued behind them (up to an error, which ends them)."""
    while not events or not isinstance(events[-1], BaseException):
        try:
            events.append(seq.events.get_nowait())
        except queue.Empty:
            break
    return events


class Generator:
    def __init__(self, mesh: Mesh, tokenizer: Tokenizer | None, eos_token_ids: Sequence[int], context_tokens: int,
                 scheduler: Scheduler | None = None, max_waiting: int = DEFAULT_MAX_WAITING) -> None:
        if max_waiting < 1:
            raise InvalidArgument(f"--max-waiting-requests must be >= 1, got {max_waiting}", "BAD_LIMIT")
        self.mesh, self.tokenizer = mesh, tokenizer
        self.scheduler = scheduler or Scheduler(mesh)
        self.eos = frozenset(eos_token_ids)
        self.context_tokens = context_tokens
        self.max_waiting = max_waiting
        self.waiting = 0  # requests without their first output yet (for the mesh, for KV cache, in prefill)
        self.queue_full = 0  # requests refused because `max_waiting` already waited (a metric)
        self.sessions: dict[str, SessionInfo] = {}
        self._lock = threading.Lock()
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.speculative = OFF  # the default of requests that do not choose (--speculative)

    @property
    def session_tokens(self) -> int:
        """The most tokens one session may hold: the context, or the smallest stage's KV pool when that holds less
        (a windowed mesh holds only the window of a session at once, Scheduler._most_held, so its context bounds it).
        A request without max_tokens generates up to this: a default must never be refused for not fitting."""
        mesh = self.mesh
        if mesh.kv_pool_blocks and not mesh.kv_window_tokens:
            return min(self.context_tokens, mesh.kv_pool_blocks * mesh.kv_block_tokens)
        return self.context_tokens

    def guide(self, spec: GuidedSpec) -> Guide:
        """A fresh matcher for `spec` (compiled once per spec; INVALID_ARGUMENT when it does not compile)."""
        if self.tokenizer is None:
            raise InvalidArgument("guided decoding needs the model's tokenizer; this model has none",
                                  "BAD_GUIDED_DECODING", {"parameter": "guided"})
        with self._grammars_lock:  # the tokenizer's vocabulary is read once, by the first guided request
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.mesh.config.vocab_size)
        return self._grammars.guide(spec)

    def generate(self, request: GenerationRequest, session_id: str = "", alive: Callable[[], bool] | None = None,
                 ready_wait_s: float = 0.0) -> collections.abc.Generator[Event, None, None]:
        """The session's events, blocking while none is ready. `alive` (the call's is_active): a client that leaves
        while no token comes (a long prefill, a wait for admission) ends its session within CLIENT_POLL_S, its
        chunks unscheduled on every stage, instead of when the next token would have come. ready_wait_s: how long
        to wait out a mesh that is not ready (starting, recovering) before UNAVAILABLE; 0: do not wait."""
        return cast(collections.abc.Generator[Event, None, None],
                    self._generate(request, session_id, alive, ready_wait_s, waits=False))

    def generate_waiting(self, request: GenerationRequest, session_id: str = "", alive: Callable[[], bool] | None = None,
                         ready_wait_s: float = 0.0) -> collections.abc.Generator[Event | Wait, None, None]:
        """generate(), yielding a Wait (aio_serving) where it would block: for a server that gives the thread back
        meanwhile (AioServer's streams, aiterate), so that thousands of queued requests hold no thread each."""
        return self._generate(request, session_id, alive, ready_wait_s, waits=True)

    def _admit(self) -> None:
        with self._lock:
            if self.waiting >= self.max_waiting:
                self.queue_full += 1
                raise ResourceExhausted(f"the waiting queue is full: {self.max_waiting} generation requests already "
                                        "wait for the mesh or for KV cache (--max-waiting-requests); retry later",
                                        "QUEUE_FULL", {"limit": str(self.max_waiting)})
            self.waiting += 1

    def _started(self) -> None:
        with self._lock:
            self.waiting -= 1

    def _wait_ready(self, ready_wait_s: float, alive: Callable[[], bool] | None,
                    waits: bool) -> Iterator[Wait]:
        """Waits out a mesh that is not ready (a recovery delays a request rather than refusing it)."""
        if self.mesh.ready:
            return
        if not waits:
            if not self.mesh.wait_ready(ready_wait_s):
                raise _not_ready(ready_wait_s)
            return
        deadline = time.monotonic() + ready_wait_s
        while not self.mesh.ready:
            if time.monotonic() >= deadline:
                raise _not_ready(ready_wait_s)
            if alive is not None and not alive():
                raise Cancelled("the client went away while the mesh was not ready", "CLIENT_GONE")
            yield Wait(READY_POLL_S)  # polled: nothing signals readiness to a waiter without a thread

    def _generate(self, request: GenerationRequest, session_id: str, alive: Callable[[], bool] | None,
                  ready_wait_s: float, waits: bool) -> collections.abc.Generator[Event | Wait, None, None]:
        validate(request, self.context_tokens, self.mesh.config.vocab_size, self.mesh.config.encoder)
        guide = self.guide(request.guided) if request.guided is not None else None
        self._admit()
        counted = True  # in `waiting` until its first output, or its end
        session: collections.abc.Generator[Event | Wait, None, None] | None = None
        try:
            if ready_wait_s > 0:
                yield from self._wait_ready(ready_wait_s, alive, waits)
            session = self._session(request, session_id, alive, waits, guide)
            for item in session:
                if counted and isinstance(item, Event):
                    counted = False
                    self._started()
                yield item
        finally:
            if session is not None:
                session.close()  # now, not when collected: its end releases the session's KV
            if counted:
                self._started()

    def _session(self, request: GenerationRequest, session_id: str, alive: Callable[[], bool] | None,
                 waits: bool, guide: Guide | None = None) -> collections.abc.Generator[Event | Wait, None, None]:
        session = SessionInfo(session_id or uuid.uuid4().hex)
        resumed = list(request.resume_ids)
        total = min(request.max_tokens, self.context_tokens - len(request.prompt_ids))
        budget = total - len(resumed)  # validate() left at least one
        sampling = stage_pb2.SamplingParams(temperature=request.temperature, top_k=request.top_k,
                                            top_p=request.top_p, seed=request.seed, logprobs=request.logprobs,
                                            top_logprobs=request.top_logprobs if request.logprobs else 0)
        # A resumed session is a new one whose prompt is the original prompt and the tokens already delivered: every
        # position, hence every seeded draw, is the one the broken stream would have made.
        seq = SchedulerSequence(session, list(request.prompt_ids) + resumed, sampling, stage_pb2.OUTPUT_KIND_TOKEN,
                                budget, frozenset() if request.ignore_eos else self.eos,
                                len(request.prompt_ids) + total)
        if request.encoder_input is not None:
            assert self.mesh.config.encoder is not None  # validate() refused it otherwise
            token = self.mesh.config.encoder.token_id
            seq.encoded = Encoded([i for i, t in enumerate(request.prompt_ids) if t == token], request.encoder_input)
        if guide is not None:
            for token in resumed:  # the grammar's state after the tokens already delivered
                guide.accept(token)
            seq.guide = guide
        mode = request.speculative or self.speculative
        if mode.on and not request.logprobs:  # logprobs are sampled on the host one position a row
            seq.speculation = Speculation(mode.max_k, draft=mode.method == DRAFT)
        detok = Detokenizer(self.tokenizer)
        for token in resumed:  # the text already delivered: stop strings and UTF-8 boundaries span the break
            detok.push(token)
        t0 = last = time.perf_counter()
        with self._lock:
            self.sessions[session.session_id] = session
        try:
            with telemetry.span("generate", session=session.session_id, prompt_tokens=len(request.prompt_ids),
                                max_tokens=request.max_tokens) as span:
                self.scheduler.submit(seq)
                step = 0
                while step < budget:
                    if waits:
                        wait = Wait(WAITING_POLL_S)
                        seq.waker = wait.wake  # before looking: an output put after the look wakes it
                        outs = _behind(seq, [])
                        if not outs:
                            if alive is not None and not alive():
                                raise _gone(seq)
                            yield wait
                            continue
                    else:
                        outs = _next_events(seq, alive)
                    now = time.perf_counter()
                    first, tokens, text, logprobs, finish = step == 0, [], "", [], ""
                    error: BaseException | None = None
                    texts: list[int] = []  # tokens whose text is detokenized together after the loop (no stop strings)
                    for out, token in _tokens(outs):  # the outputs that came together stream as one event
                        if isinstance(out, BaseException):
                            error = out
                            break
                        tokens.append(token)
                        if request.logprobs and out.row is not None:
                            logprobs.append(_logprob(token, out.row))
                        step += 1
                        if token in self.eos and not request.ignore_eos:
                            finish = "eos"
                            break
                        if request.stop:  # a stop string ends the event at the token that completes it
                            text += detok.push(token)
                            hit = next((s for s in request.stop if s in detok.emitted), None)
                            if hit is not None:
                                overshoot = len(detok.emitted) - detok.emitted.index(hit)
                                text, finish = text[: max(0, len(text) - overshoot)], "stop"
                                break
                        else:
                            texts.append(token)
                        if step == budget:
                            finish = "length"
                            break
                    if texts and not request.skip_text:
                        text = detok.push_many(texts)
                    if tokens:  # the first came `now - last` after the token before; the others with it
                        (TTFT_SECONDS if first else INTER_TOKEN_SECONDS).observe(now - last)
                        telemetry.observe_many(INTER_TOKEN_SECONDS, 0.0, len(tokens) - 1)
                        last = now
                        TOKENS_GENERATED.inc(len(tokens))
                        span.set_attribute("completion_tokens", step)
                        yield Event(tokens, text, finish, (now - t0) * 1000.0 if first else 0.0,
                                    outs[0].computed_tokens if first and isinstance(outs[0], Output) else 0,
                                    session.session_id if first else "", logprobs)
                    if finish:
                        if waits:  # the last event leaves before the session's end, which takes the scheduler's lock
                            yield Wait.now()
                        return
                    if error is not None:
                        raise error
        finally:
            self.scheduler.finish(seq)  # also when the client went away: its rows stop, its KV is released
            with self._lock:
                self.sessions.pop(session.session_id, None)

    def logits(self, token_ids: list[int]) -> np.ndarray:
        validate(GenerationRequest(token_ids, 1), self.context_tokens, self.mesh.config.vocab_size)
        seq = SchedulerSequence(SessionInfo(uuid.uuid4().hex), list(token_ids), stage_pb2.SamplingParams(),
                                stage_pb2.OUTPUT_KIND_LOGITS, 1, max_tokens_total=len(token_ids))
        try:
            self.scheduler.submit(seq)
            out = seq.events.get()
        finally:
            self.scheduler.finish(seq)
        if isinstance(out, BaseException):
            raise out
        assert out.logits is not None
        return out.logits
