"""Iteration-level scheduling of many sessions through the pipeline: schedule -> execute -> update.

Each step is one invocation of the protocol over rows of many sessions: decode tokens first, then prompt
chunks (new sessions, restored ones) under a token budget, first come first served. Up to P steps are in
flight for P stages, and no session is ever in two at once, so with enough sessions every stage works on a
different micro-batch at the same time. A step is sized to a P-th of the live sessions for that reason. A step
of decodes alone, when no prompt waits to join, is a decode run: its rows take several tokens each on the ranks
(the last stage feeding each sampled token back to the first) before the step comes back here.

KV blocks are counted here exactly as every rank lends them (ceil(tokens / block) per session, less the leading
blocks a sliding window has passed where every rank drops them): a session is admitted only when its next rows fit
every rank's pool, and when a running session cannot grow, the newest other session is preempted (released
everywhere, recomputed later from its tokens). A request that could never fit alone is refused at once.

Failures keep their per-session guarantees: an ARCH failure rolled every row back on every rank and each of
the step's sessions is retried alone (so an invalid row can only fail its own session); a COMM failure fences
the incarnation, the roster is rebuilt, and every session is restored (KV store, else recompute) and
replayed with the same seeds, so its tokens are exactly those of a fault-free run. An INDETERMINATE failure
(a rank that never learned how a session's previous epoch ended, now told from the decision log) rolled the
step back everywhere: its rows are scheduled again as they were, with new epochs.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from graphmesh import kvkeys, tensors
from graphmesh.errors import GraphmeshError, ResourceExhausted, Unavailable
from graphmesh.kvkeys import blocks_for
from graphmesh.protocol import Action
from graphmesh.v1 import stage_pb2
from graphmesh_coordinator import speculative
from graphmesh_coordinator.pipeline import InvocationFailed, Mesh
from graphmesh_server import telemetry
from graphmesh_server.aio_serving import deferred_wakes

if TYPE_CHECKING:
    from graphmesh_coordinator.draft import Drafter
    from graphmesh_coordinator.guided import Guide
    from graphmesh_coordinator.speculative import Speculation

log = logging.getLogger("graphmesh.coordinator.scheduler")

MAX_RECOVERIES = 3  # in a row, for one session
# The longest decode run when none is set: on GPUs a step's compute is ~1 ms and its round trips several, so longer
# runs pay; on CPUs compute dominates and a run's tokens reach the client in one burst, so shorter ones.
DECODE_STEPS_CUDA, DECODE_STEPS_CPU = 8, 4
# On GPUs a run grows by DECODE_STEPS_CUDA tokens for every RUN_ROWS_CUDA rows, up to LONGEST_RUN_CUDA: what the
# coordinator does per run grows with its rows (each stream's tokens streamed to its client, in one message a run),
# what the GPU does per token hardly, so the host's share of a token stays what it is at RUN_ROWS_CUDA rows.
RUN_ROWS_CUDA, LONGEST_RUN_CUDA = 64, 32
# The token budget of a step when none is set; a decode row spends one token of it. On a GPU a step costs about the
# same up to thousands of rows, and 256 decodes left no room for the prompts waiting behind them (256 streams waited
# seconds for their first tokens), so the budget is vLLM's chunked-prefill budget. On CPUs a token costs the same
# in a chunk of 128 as in one of 256, and smaller chunks let the stages work on different ones at once: 16 prompts
# of 40 tokens over SmolLM2's 2 executors reach their first tokens ~30% sooner (TTFT p50 ~950 against ~1340 ms).
STEP_TOKENS_CUDA, STEP_TOKENS_CPU = 2048, 128
# Sessions in one step at most when none is set. On a GPU a decode row costs next to nothing up to hundreds of rows
# (the executor captures a CUDA graph per batch bucket up to 256): a cap of 64 left 192 of 256 streams waiting for
# the first 64 to finish. On CPUs a row costs its share of the products, and 64 keeps a step's latency in bounds.
STEP_SEQS_CUDA, STEP_SEQS_CPU = 256, 64
# The fewest rows of a micro-batch where stages share a GPU (Scheduler._micro_batches): on one GPU, two micro-batches
# of 16 rows were slower than one of 32, two of 128 faster than one of 256 (bench/RESULTS.md, executors sharing a GPU).
SHARED_GPU_ROWS = 64
MAX_ARCH_RETRIES = 1  # of a session's row alone, after the rollback
STEP_KINDS = ("prompt", "decode_run", "decode", "verify")  # a step with a prompt chunk is "prompt", mixed or not

# Decodes in a step at most for its rows to carry proposals (speculative.py). A verified chunk of k + 1 rows costs
# about a decode row on a GPU and on a CPU a share of the products per row: past this many decodes the step is busy
# already and speculation would only slow it, so it steps aside.
SPEC_SEQS_CUDA, SPEC_SEQS_CPU = 16, 2

@dataclass
class SessionInfo:
    session_id: str
    history: list[int] = field(default_factory=list)  # tokens whose KV is committed, in order
    epoch: int = 0  # the newest epoch issued (epochs are consumed even when they fail)
    delivered_epoch: int = 0  # the newest epoch whose output reached the client: committed, folded into the next
    incarnation: int = 0  # the incarnation holding this session's KV; 0 until its first step, or after preemption

    @property
    def tokens(self) -> int:
        return len(self.history)


@dataclass(slots=True)  # one per row of a step that gave a session tokens, made on the scheduler's critical path
class Output:
    tokens: list[int]  # in order: a decode run's, or the one a step sampled (at least one)
    logits: np.ndarray | None
    computed_tokens: int  # the tokens this session's rows computed to produce its first output (0 after)
    row: stage_pb2.StepRowResult | None = None  # the last stage's result (logprobs, when the sampling asked)


@dataclass(frozen=True, eq=False)
class Encoded:
    """A session's encoder input: the positions of its prompt's placeholder tokens and their features f32
    [len(positions), input_dim]. Every row over those positions (the prompt's, or a restore's recompute) carries
    its slice, so the encoder runs again wherever the rows are computed again. Its KV rows depend on the features,
    not only on the tokens, so it neither shares nor seeds a prefix by tokens."""

    positions: list[int]
    features: np.ndarray

    def slice(self, start: int, end: int) -> tuple[list[int], np.ndarray]:
        """The offsets (from `start`) and features of the placeholders among positions [start, end)."""
        picked = [i for i, p in enumerate(self.positions) if start <= p < end]
        return [self.positions[i] - start for i in picked], self.features[picked]


@dataclass(eq=False)
class Sequence:
    """One session as the scheduler sees it; its outputs (or the error that ended it) go to `events`."""

    session: SessionInfo
    pending: list[int]  # tokens to feed next: the prompt (or what is left of it), then the last token
    sampling: stage_pb2.SamplingParams
    output: stage_pb2.OutputKind.ValueType
    remaining: int  # outputs still to produce
    stop_ids: frozenset[int] = frozenset()  # tokens that end the session (EOS unless ignored)
    max_tokens_total: int = 0  # prompt + outputs: what it may grow to
    events: queue.SimpleQueue[Output | BaseException] = field(default_factory=queue.SimpleQueue)
    outbox: list[Output] = field(default_factory=list)  # outputs not yet put on `events` (Scheduler._deliver)
    busy: bool = False  # in a step in flight, or being released
    done: bool = False  # no more steps: finished, failed or cancelled
    blocks: int = 0  # KV blocks of its table on every rank (ceil(tokens / block))
    dropped: int = 0  # of those, the leading ones every rank has let go (Mesh.kv_window_tokens): not held
    solo: bool = False  # its last shared step failed ARCH: run it alone
    arch_retries: int = MAX_ARCH_RETRIES
    recoveries: int = 0
    computed: int = 0
    context: telemetry.Context | None = None  # the trace context of the request (its steps join its trace)
    links: list[bytes] = field(default_factory=list)  # chain links of its whole blocks committed on every rank
    encoded: Encoded | None = None  # its encoder input, when its prompt has placeholders
    # Called (from a scheduler thread) after outputs or an error were put on `events`: a reader that waits without
    # a thread of its own (an asynchronous stream) is woken by it instead of blocking on the queue.
    waker: Callable[[], None] | None = None
    # Guided decoding (guided.py): the session's grammar matcher. Each row that samples carries the mask of its
    # token; the matcher advances on the tokens delivered, so a replay asks with the same mask again.
    guide: Guide | None = None
    # Speculative decoding (speculative.py): its proposer state; None: plain decoding. verified_epoch is the epoch of
    # its last verified chunk: the next row's folded commit keeps only the accepted rows of it (commit_length).
    speculation: Speculation | None = None
    verified_epoch: int = 0
    drafted: list[int] | None = None  # the draft model's proposals for the pass being scheduled (Scheduler._draft)
    proposal_masks: bytes = b""  # a guided session's masks of the positions its proposals' pass samples (Guide)

    def wake(self) -> None:
        waker = self.waker
        if waker is not None:
            waker()


@dataclass
class _Row:
    seq: Sequence
    row: stage_pb2.StepRow
    final: bool  # the row consumes the rest of `pending`: its output is real
    proposed: int = 0  # its last token_ids are proposals to verify (a prediction target)


@dataclass(frozen=True, eq=False)
class _Released:
    """A session whose KV the ranks are to release, and what its release gives back to the scheduler's counts."""

    seq: Sequence
    incarnation: int  # the roster its blocks were counted for
    blocks: int
    dropped: bool  # ended (no longer scheduled), not preempted: its blocks count in _releasing until released


@dataclass(frozen=True, eq=False)
class _Drafts:
    """A scheduling pass's sessions whose proposals the draft model makes first: (session, its tokens, k) each."""

    batch: list[tuple[Sequence, list[int], int]]


class Scheduler:
    def __init__(self, mesh: Mesh, max_step_tokens: int = 0, max_step_seqs: int = 0, workers: int = 8,
                 steps_in_flight: int = 0, decode_steps: int = 0) -> None:
        self.mesh = mesh
        self.steps_in_flight = steps_in_flight  # 0: by the stages and their GPUs (_micro_batches)
        # The longest decode run (tokens per row of a step without prompts); 0: by the roster's devices
        self.decode_steps = decode_steps
        self.max_step_tokens = max_step_tokens  # a step's token budget; 0: by the roster's devices
        self.max_step_seqs = max_step_seqs  # sessions per step; 0: by the roster's devices
        self.drafter: Drafter | None = None  # the draft model of --speculative draft:MODEL (draft.py)
        self.costs = speculative.PassCosts()  # whether a step of decodes verifies proposals or runs
        self._draft_passes = 0
        self._drafting = False  # a pass runs the draft model (off the lock): the others do not draft meanwhile
        self._cond = threading.Condition()
        self._seqs: list[Sequence] = []  # arrival order
        self._in_flight = 0
        # The step in flight that was sent alone (ExecuteStepRequest.alone: the ranks may queue its decode run whole
        # on a GPU they share): none other is scheduled until it is answered, even where more micro-batches fit by then
        self._alone: list[_Row] | None = None
        self._cap = 0  # the steps in flight the last scheduling pass allowed (_micro_batches)
        self._releasing = 0  # blocks of ended sessions that the ranks are still releasing
        self._to_release: list[_Released] = []  # sessions to release in the next call (Scheduler._release)
        self._releasing_now = False  # a worker is releasing; it takes `_to_release` when its call is done
        self._used: int | None = None  # used_blocks during one scheduling pass (_schedule), kept as rows take blocks
        self._incarnation = 0  # the incarnation the block counts are for
        self.steps = 0
        # By kind of step (STEP_KINDS): steps, their rows, and the seconds from sending each to its reply. Where a
        # busy mesh's time goes: prompt steps, decode runs, single decode steps (every row's last token, or decodes
        # that a waiting prompt joins).
        self.kind_steps, self.kind_rows, self.kind_seconds = ({k: 0.0 for k in STEP_KINDS} for _ in range(3))
        self.run_tokens = 0  # tokens decode runs produced past each row's first: no step of their own
        # Seconds with at least one step sent and not yet answered: with steps of several micro-batches in flight
        # their seconds overlap, and a mesh's time outside steps is the wall time less this, not less their sum.
        self.busy_seconds = 0.0
        self._busy_lock = threading.Lock()  # steps are sent and answered on several worker threads
        self._stepping, self._busy_since = 0, 0.0
        self.preemptions = 0
        self.shared_tokens = 0  # prompt tokens a new session took from another's KV blocks instead of computing
        # Whole committed blocks on every rank, by SHA-256 chain link (kvkeys.link): the local prefix cache. A new
        # session whose prompt starts with a live session's blocks shares them (Mesh.share_prefix), the KV store
        # being the second tier behind it.
        self._prefixes: dict[bytes, Sequence] = {}
        self._workers = ThreadPoolExecutor(max(workers, steps_in_flight + 4), thread_name_prefix="step")
        # Its own threads: the scheduler waits for these holding the lock that step workers need.
        self._seeders = ThreadPoolExecutor(8, thread_name_prefix="seed")
        self._stopped = False
        threading.Thread(target=self._loop, name="scheduler", daemon=True).start()

    # -- the sessions' side ------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        capacity = self.mesh.kv_pool_blocks
        need = self._most_held(seq.max_tokens_total)
        if capacity and need > capacity:
            raise ResourceExhausted(f"the request needs {need} KV blocks of {self.mesh.kv_block_tokens} tokens "
                                    f"({seq.max_tokens_total} tokens); the smallest stage pool holds {capacity}",
                                    "KV_CAPACITY_EXCEEDED")
        seq.context = seq.context or telemetry.current_context()
        with self._cond:
            self._seqs.append(seq)
            self._cond.notify_all()

    def finish(self, seq: Sequence) -> None:
        """The session wants no more outputs (finished, failed or cancelled): its KV is released."""
        with self._cond:
            seq.done = True
            if not seq.busy:
                self._drop(seq)

    @property
    def running(self) -> int:
        with self._cond:
            return sum(1 for s in self._seqs if s.blocks and not s.done)

    @property
    def waiting(self) -> int:
        with self._cond:
            return sum(1 for s in self._seqs if not s.blocks and not s.done)

    @property
    def used_blocks(self) -> int:
        """Blocks lent on every rank: derived, never kept as a running sum that could drift."""
        return sum(s.blocks - s.dropped for s in self._seqs) + self._releasing

    def _most_held(self, tokens: int) -> int:
        """The most blocks a session of `tokens` tokens holds at once on every rank. Under a sliding window a rank
        drops the blocks before the window of a row's first query when it begins the row, and this count lets go
        of them once the row is done: it holds the window, the rows of the last step and those of the next."""
        block, window = self.mesh.kv_block_tokens, self.mesh.kv_window_tokens
        whole = blocks_for(tokens, block)
        if not window:
            return whole
        row = max(self._step_tokens(), self._longest_run(), speculative.MAX_K + 1)
        return min(whole, blocks_for(window - 1 + 2 * row, block) + 2)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._seeders.shutdown(wait=False, cancel_futures=True)

    # -- schedule ------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                step: tuple[list[_Row], int] | None = None
                while not self._stopped:
                    step = self._next_step()
                    if step:
                        break
                    self._cond.wait(0.2)
                if self._stopped:
                    return
            assert step
            self._workers.submit(self._run, *step, self._incarnation)

    def _next_step(self) -> tuple[list[_Row], int] | None:
        """The next step, counted in flight (under the lock), or None. A bug in scheduling must not stop every
        session: it is logged, and the scheduler tries again later."""
        drafts: _Drafts | None = None
        try:
            step = self._schedule(draft=not self._drafting)
            if isinstance(step, _Drafts):
                drafts = step
                self._draft(drafts)
                step = self._schedule(draft=False)
        except Exception:
            log.exception("scheduling failed")
            return None
        finally:
            self._used = None  # counted again by the next pass: releases and a new roster change it meanwhile
            for s, _, _ in drafts.batch if drafts is not None else ():
                s.drafted = None  # for this pass only: a later one drafts from the tokens it will have then
        assert not isinstance(step, _Drafts)
        if step:
            self._in_flight += 1
            if self._in_flight == 1 and self._cap == 1:
                self._alone = step[0]
        return step

    def _draft(self, drafts: _Drafts) -> None:
        """Runs the draft model for these sessions without the scheduler's lock, which the caller holds once (the
        scheduling thread or a step worker): a draft pass is two round trips to the draft executor, and meanwhile
        other steps end and sessions come and go. Its sessions are busy until it returns, so no other pass takes them;
        it holds a step's place in flight, so no other pass overtakes the one it drafts for; and one pass drafts at a
        time (the Drafter's steps are one pass's), the others proposing nothing by draft meanwhile."""
        assert self.drafter is not None
        for s, _, _ in drafts.batch:
            s.busy = True
        self._in_flight += 1
        self._used, self._drafting = None, True
        self._draft_passes += 1
        self._cond.release()
        t0 = time.perf_counter()
        try:
            proposed = self.drafter.propose([(s.session.session_id, tokens, k) for s, tokens, k in drafts.batch])
            self.costs.drafted(time.perf_counter() - t0)
        finally:
            self._cond.acquire()
            self._in_flight -= 1
            self._drafting = False
            for s, _, _ in drafts.batch:
                s.busy = False
                if s.done:  # finished or cancelled meanwhile: released as a step's end releases it
                    self._drop(s)
        for s, _, _ in drafts.batch:
            s.drafted = proposed.get(s.session.session_id, [])

    def _schedule(self, draft: bool = False) -> tuple[list[_Row], int] | _Drafts | None:
        """The next step's rows and its decode run's length (1: one token per row); or, when `draft` and sessions of
        it want the draft model's proposals, those sessions (Scheduler._draft makes them, then this runs again)."""
        mesh = self.mesh
        in_flight = self._cap = self._micro_batches()
        if not mesh.ready or self._in_flight >= in_flight or self._alone is not None:
            return None
        if mesh.incarnation != self._incarnation:  # a new roster holds no session's KV
            self._incarnation, self._releasing = mesh.incarnation, 0
            self._prefixes = {}
            for s in self._seqs:
                # in flight too: a step of the old roster fails (or its session is restored anyway)
                s.blocks = s.dropped = 0
        ready = [s for s in self._seqs if not s.busy and not s.done]
        if not ready:
            return None
        for solo in (s for s in ready if s.solo):  # alone, to learn whether its row caused a shared ARCH failure
            row = self._row(solo, self._step_tokens())
            if row is not None:
                solo.busy = True
                return [row], 1
        ready = [s for s in ready if not s.solo]  # those that do not fit yet wait; the others must not
        if not ready:
            return None
        self._seed_waiting(ready)
        # Rows with logprobs, and guided rows, are sampled on the last stage's host, from the logits graph: they share
        # steps only with each other, so no other session's tokens ever come from a different graph.
        kind = (ready[0].output, ready[0].sampling.logprobs or ready[0].guide is not None)
        ready = [s for s in ready if (s.output, s.sampling.logprobs or s.guide is not None) == kind]
        live = sum(1 for s in self._seqs if not s.done)
        cap = min(self._step_seqs(), max(1, math.ceil(live / in_flight)))
        decoding = [s for s in ready if len(s.pending) == 1 and s.session.incarnation == mesh.incarnation
                    and not (s.encoded is not None and s.encoded.positions[-1] >= s.session.tokens)]
        chosen = {id(s) for s in decoding}
        others = [s for s in ready if id(s) not in chosen]
        # A step of decodes alone is a decode run: its rows take several tokens in a row without a round trip here
        # between them, each no more than it may still grow (a row that ends sooner rides along to the run's end,
        # StepRow.decode_steps: rows that began a step apart would otherwise cut every run to the nearest end).
        # Only when no prompt waits to join, or when the decodes fill the step's rows anyway (a waiting prompt
        # could not join it).
        steps = 1
        proposals, drafts = self._proposals(decoding[:cap], others, kind, draft)
        if drafts:
            return _Drafts(drafts)  # nothing of this pass is taken yet: no row made, no epoch issued
        if proposals:
            pass  # a verified chunk is one pass: its step is no decode run
        elif decoding and (not others or len(decoding) >= cap) and kind == (stage_pb2.OUTPUT_KIND_TOKEN, False):
            rows = min(len(decoding), cap)
            steps = min(self._run_length(rows), max(s.remaining for s in decoding))  # any of them may take a row
        budget = self._step_tokens()
        step: list[_Row] = []
        # A prompt never joins a decode run, not even where a decode found no blocks and left it room.
        for s in decoding + (others if steps == 1 else []):
            if len(step) >= cap or budget <= 0:
                break
            row = self._row(s, budget, steps, proposals.get(id(s), []))
            if row is None:
                if s in others:
                    break  # first come first served: a waiting session that does not fit holds back later ones
                continue
            s.busy = True  # at once: a later session of this step must not pick it for preemption
            step.append(row)
            budget -= len(row.row.token_ids)
        return (step, steps) if step else None

    def _proposals(self, decoding: list[Sequence], others: list[Sequence], kind: tuple[int, bool],
                   draft: bool) -> tuple[dict[int, list[int]], list[tuple[Sequence, list[int], int]]]:
        """The proposals of this step's speculating decodes, by id, when the step has room for verified chunks: no
        prompt waits to join and few decodes share it (on a busy mesh the step is full already); and, when `draft`,
        the decodes whose proposals the draft model is still to make (session, tokens, k; without `draft` they
        decode plainly this pass). None where a decode run gives more tokens a second (PassCosts). Rows with
        logprobs never speculate; a guided row's proposals stop where its grammar refuses one."""
        limit = SPEC_SEQS_CUDA if self._on_gpus() else SPEC_SEQS_CPU
        if others or not decoding or len(decoding) > limit or kind[0] != stage_pb2.OUTPUT_KIND_TOKEN:
            return {}, []
        drafter = self.drafter if self.drafter is not None and self.drafter.ready else None
        drafted = any(s.drafted is not None for s in decoding)  # for this pass already: verifying them was decided
        # the step's alternative: a decode run, or for guided rows (their next mask needs this turn) one token
        run = (min(self._run_length(len(decoding)), max(s.remaining for s in decoding))
               if kind == (stage_pb2.OUTPUT_KIND_TOKEN, False) else 1)
        speculating = [s.speculation for s in decoding
                       if s.speculation is not None and s.speculation.want(s.remaining - 1)]
        # As if each of them proposed: where even that would not beat a decode run, no proposal is worth looking
        # up (prompt lookup over every session's tokens costs the scheduler's turn on a busy step)
        if not speculating and not drafted:
            return {}, []
        if not drafted and not self.costs.verify_pays([self.costs.expected(spec) for spec in speculating],
                                                      len(decoding), run, draft and drafter is not None and
                                                      any(spec.draft for spec in speculating)):
            return {}, []
        budget = self._step_tokens() - len(decoding)
        out: dict[int, list[int]] = {}
        drafts: list[tuple[Sequence, list[int], int]] = []
        yields: list[float] = []  # the tokens each speculating session expects of a verified pass
        for s in decoding:
            spec = s.speculation
            if spec is None or budget <= 0:
                continue
            tokens, room = s.session.history + s.pending, min(s.remaining - 1, budget)
            if spec.draft and drafter is not None:  # else (draft lost, recovering) prompt lookup meanwhile
                k = spec.want(room) if s.drafted is None and draft else 0
                if k:
                    drafts.append((s, tokens, k))
                    yields.append(self.costs.expected(spec))
                    budget -= k
                    continue
                proposed = (s.drafted or [])[:room]  # drafted off the lock for this pass (Scheduler._draft)
            else:
                proposed = spec.proposals(tokens, room)
            if proposed and s.guide is not None:  # only what the grammar allows, each position with its mask
                proposed, s.proposal_masks = s.guide.proposals(proposed)
            if proposed:
                out[id(s)] = proposed
                yields.append(self.costs.expected(spec))
                budget -= len(proposed)
        if (out or drafts) and not drafted and not self.costs.pays(yields, len(decoding), run, bool(drafts)):
            return {}, []
        return out, drafts

    def _micro_batches(self) -> int:
        """Steps in flight at most: --steps-in-flight, else one per stage so that every stage works on a micro-batch
        of its own. Stages that share a GPU take turns on it, and a decode iteration reads all of a stage's weights
        whatever its rows: there two micro-batches of a few rows cost the GPU twice what one of them all does, so a
        micro-batch has at least SHARED_GPU_ROWS rows, and there are at least as many as the stages have GPUs. Only
        there does it count the live sessions: a pass that finds the steps in flight full costs nothing per session.
        Stages all on one GPU that queue runs (Rank.queues_runs) get one micro-batch: each step then goes alone and
        its decode run is queued whole on the GPU, twice as fast at 128 and 256 streams as two micro-batches run
        ahead on an H100 (bench/RESULTS.md, "Queued runs")."""
        if self.steps_in_flight:
            return self.steps_in_flight
        stages = max(1, len(self.mesh.ranks))
        gpus = {r.gpu_uuid for r in self.mesh.ranks}
        if "" in gpus or len(gpus) >= stages:
            return stages
        if len(gpus) == 1 and all(r.queues_runs for r in self.mesh.ranks):
            return 1
        live = sum(1 for s in self._seqs if not s.done)
        return min(stages, max(len(gpus), live // SHARED_GPU_ROWS))

    def _longest_run(self) -> int:
        return self.decode_steps or (LONGEST_RUN_CUDA if self._on_gpus() else DECODE_STEPS_CPU)

    def _run_length(self, rows: int) -> int:
        """The decode run of a step of `rows` decodes: --decode-steps, else by the devices (RUN_ROWS_CUDA)."""
        if self.decode_steps:
            return self.decode_steps
        if not self._on_gpus():
            return DECODE_STEPS_CPU
        return min(LONGEST_RUN_CUDA, DECODE_STEPS_CUDA * max(1, math.ceil(rows / RUN_ROWS_CUDA)))

    def _step_seqs(self) -> int:
        return self.max_step_seqs or (STEP_SEQS_CUDA if self._on_gpus() else STEP_SEQS_CPU)

    def _used_blocks(self) -> int:
        """used_blocks, summed once a scheduling pass: each row of a step asked for it (a sum over every session,
        per row: quadratic in the sessions)."""
        if self._used is None:
            self._used = self.used_blocks
        return self._used

    def _step_tokens(self) -> int:
        return self.max_step_tokens or (STEP_TOKENS_CUDA if self._on_gpus() else STEP_TOKENS_CPU)

    def _on_gpus(self) -> bool:
        ranks = self.mesh.ranks
        return bool(ranks) and all(r.device.startswith("cuda") for r in ranks)

    def _row(self, s: Sequence, budget: int, steps: int = 1, proposals: list[int] | None = None) -> _Row | None:
        """The row of `s` for the next step (its share of a decode run of `steps` tokens when `s` is decoding: no
        more than it may still grow; its last token and `proposals` to verify when given), its KV blocks lent; None
        when they cannot be had now."""
        mesh, session, block = self.mesh, s.session, self.mesh.kv_block_tokens
        capacity = mesh.kv_pool_blocks
        restore = session.incarnation != mesh.incarnation
        proposals = [] if restore or len(s.pending) != 1 else (proposals or [])[:max(0, budget - 1)]
        if restore and steps > 1:
            # preempted earlier in this pass, for another row of this decode run: its restore is a prompt, and a
            # run takes one token per row (an executor refuses anything else), so it waits for the next step
            return None
        tokens = session.history + s.pending if restore else s.pending + proposals
        start = 0 if restore else session.tokens
        share = max(1, min(steps, s.remaining))  # 0 would read as the whole run
        n = len(tokens) if len(tokens) == 1 else min(len(tokens), budget)
        donor, shareable = self._shareable(s, tokens) if restore else (None, 0)
        if donor is not None and blocks_for(shareable + min(len(tokens) - shareable, budget), block) > capacity:
            donor, shareable = None, 0  # a prefix longer than the pool (its window dropped it at the donor's): compute
        if restore and mesh.kvstore is not None and s.encoded is None:
            need = blocks_for(len(tokens), block)  # whatever the store seeds, it and the chunk after it fit in this
        elif donor is not None:
            need = blocks_for(shareable + min(len(tokens) - shareable, budget), block)  # the shared blocks count too
        else:
            # never below what it holds: a rank's table only grows (a decode run rolled back and retried as one
            # token keeps the blocks the run reserved), and a count that shrank would over-admit
            need = max(0, blocks_for(start + n + (0 if restore else share - 1), block) - (0 if restore else s.blocks))
        if self._used_blocks() + need > capacity and not self._preempt(s, need):
            return None
        if restore:
            # New, preempted or recovered: share what a live session holds, else seed what the KV store holds,
            # and compute the rest (chunked).
            with telemetry.span("scheduler.admit", parent=s.context, session=session.session_id):
                seeded = self._share(s, donor, tokens[:shareable]) if donor is not None else 0
                if not seeded and mesh.kvstore is not None and s.encoded is None:
                    seeded = mesh.seed_prefix(session.session_id, tokens)
            self._start(s, tokens, seeded)
            start = seeded
            n = len(s.pending) if len(s.pending) == 1 else min(len(s.pending), budget)
            need = blocks_for(start + n, block) - s.blocks
        s.blocks += need
        if self._used is not None:
            self._used += need
        session.epoch += 1
        row = stage_pb2.StepRow(session_id=session.session_id, epoch=session.epoch,
                                commit_epoch=session.delivered_epoch, start_position=start,
                                token_ids=tokens[:n] if proposals else s.pending[:n], sampling=s.sampling,
                                decode_steps=share)
        if proposals:
            row.prediction_target.proposed = len(proposals)
            row.prediction_target.proposer = (stage_pb2.PROPOSER_DRAFT_MODEL if s.speculation and s.speculation.draft
                                              and self.drafter is not None and self.drafter.ready
                                              else stage_pb2.PROPOSER_PROMPT_LOOKUP)
        if s.verified_epoch and s.verified_epoch == session.delivered_epoch and not restore:
            row.commit_length = start  # the verified chunk it commits keeps its accepted rows only
        if s.guide is not None and n == len(s.pending) + len(proposals):
            # the row samples: its token's mask (never a decode run), or the masks of its proposals' pass's positions
            row.allowed_tokens = (s.proposal_masks[:(len(proposals) + 1) * s.guide.mask_bytes] if proposals
                                  else s.guide.mask())
        if s.encoded is not None:
            offsets, features = s.encoded.slice(start, start + n)
            if offsets:
                row.encoded_offsets.extend(offsets)
                row.encoder_input.CopyFrom(tensors.to_proto(features))
        return _Row(s, row, n == len(s.pending) + len(proposals), len(proposals))

    def _start(self, s: Sequence, tokens: list[int], seeded: int) -> None:
        """`s` starts on this roster with its first `seeded` tokens already in every rank's KV (shared or seeded)."""
        session = s.session
        self._forget(s)  # after a recovery its old links name nothing: they are indexed again as it commits
        session.history, s.pending, session.delivered_epoch = tokens[:seeded], tokens[seeded:], 0
        session.incarnation, s.blocks = self.mesh.incarnation, blocks_for(seeded, self.mesh.kv_block_tokens)
        s.dropped = 0
        self._used = None  # its count was set, not added to

    def _seed_waiting(self, ready: list[Sequence]) -> None:
        """Seeds from the KV store, all at once, the sessions waiting to start (new, preempted, or every session a
        re-plan lost) that fit, in arrival order. One by one, each seed waited for the steps in flight on every
        rank's engine, and a recovery's restores queued behind each other's compute."""
        mesh, block = self.mesh, self.mesh.kv_block_tokens
        if mesh.kvstore is None:
            return
        starting: list[tuple[Sequence, list[int]]] = []
        used = self.used_blocks
        for s in ready:
            if s.session.incarnation == mesh.incarnation or s.encoded is not None:
                continue
            tokens = s.session.history + s.pending
            need = blocks_for(len(tokens), block)
            if used + need > mesh.kv_pool_blocks:
                break  # first come first served: _row preempts for it, or it waits
            if len(tokens) > block and self._shareable(s, tokens)[0] is None:  # a live session's blocks come first
                starting.append((s, tokens))
                used += need
        if len(starting) < 2:
            return  # _row seeds a single one itself

        def seed(s: Sequence, tokens: list[int]) -> int:
            with telemetry.span("scheduler.admit", parent=s.context, session=s.session.session_id):
                return mesh.seed_prefix(s.session.session_id, tokens)

        for (s, tokens), seeded in zip(starting, list(self._seeders.map(seed, *zip(*starting)))):
            self._start(s, tokens, seeded)

    def _preempt(self, s: Sequence, need: int) -> bool:
        """Frees blocks for `s` by releasing the newest session that arrived after it and holds any. Always False:
        the blocks come back once every rank released them, and `s` waits for them meanwhile."""
        for victim in reversed(self._seqs):
            if victim is s:
                break  # older sessions are never preempted for a newer one
            if victim.busy or victim.done or not victim.blocks:
                continue
            log.info("preempting", extra={"session": victim.session.session_id, "blocks": victim.blocks,
                                          "for_session": s.session.session_id})
            self.preemptions += 1
            victim.session.incarnation = 0  # its KV is gone: the next step recomputes it
            self._forget(victim)
            self._release(victim)
            return False
        return False

    # -- the local prefix cache --------------------------------------------------------------------------
    def _shareable(self, s: Sequence, tokens: list[int]) -> tuple[Sequence | None, int]:
        """The live session holding the longest run of whole blocks that `tokens` starts with on every rank, and
        that run's length in tokens (one token is always left to compute)."""
        block, donor, n, link = self.mesh.kv_block_tokens, None, 0, b""
        while n + block < len(tokens) and s.encoded is None:
            link = kvkeys.link(link, tokens[n:n + block])
            holder = self._holder(link)
            if holder is None or holder is s:
                break
            donor, n = holder, n + block  # a link names the whole prefix: its holder holds every block before it
        return donor, n

    def _holder(self, link: bytes) -> Sequence | None:
        """The live session of this roster indexed as holding the block `link` names, if any."""
        holder = self._prefixes.get(link)
        if holder is None or holder.done or holder.session.incarnation != self.mesh.incarnation:
            return None
        return holder

    def _share(self, s: Sequence, donor: Sequence, prefix: list[int]) -> int:
        """Starts `s` on every rank from `donor`'s blocks of `prefix` (0: a rank refused; then it is computed)."""
        shared = self.mesh.share_prefix(s.session.session_id, donor.session.session_id, prefix)
        self.shared_tokens += shared
        return shared

    def _register(self, s: Sequence) -> None:
        """Indexes the whole blocks of `s` that every rank has committed (its history before the row now done)."""
        block, history = self.mesh.kv_block_tokens, s.session.history
        while (len(s.links) + 1) * block <= len(history) and s.encoded is None:
            i = len(s.links)
            s.links.append(kvkeys.link(s.links[-1] if s.links else b"", history[i * block:(i + 1) * block]))
            if self._holder(s.links[-1]) is None:
                self._prefixes[s.links[-1]] = s

    def _forget(self, s: Sequence) -> None:
        """`s` holds no blocks any more (ended or preempted): nobody may share them from it."""
        for link in s.links:
            if self._prefixes.get(link) is s:
                del self._prefixes[link]
        s.links = []

    # -- execute and update ------------------------------------------------------------------------------
    def _run(self, step: list[_Row], decode_steps: int, incarnation: int) -> None:
        """Runs a step, then on this thread each next step its end makes room for, sent to the ranks before the
        outputs of the step before reach their sessions: 16 streaming threads woken at a step's end took the GIL
        ahead of the next step's dispatch, ~3 ms a step on a GPU host."""
        done: list[Sequence] = []  # the sessions with outputs of the step before, not yet delivered
        next_step: tuple[list[_Row], int, int] | None = (step, decode_steps, incarnation)
        while next_step is not None:
            next_step, done = self._execute(*next_step, done)
        self._deliver(done)

    def _deliver(self, seqs: list[Sequence]) -> None:
        """Puts the outputs waiting in these sessions' outboxes on their queues. Under the lock, in the order the
        steps' updates made them, whichever thread delivers: a session's outputs are never reordered. Their
        streams' event loop is woken once for all of them (aio_serving.deferred_wakes)."""
        with self._cond, deferred_wakes():
            for s in seqs:
                self._flush(s)

    @staticmethod
    def _flush(s: Sequence) -> None:
        for out in s.outbox:
            s.events.put(out)
        if s.outbox:
            s.wake()
        s.outbox.clear()

    def _execute(self, step: list[_Row], decode_steps: int, incarnation: int,
                 done: list[Sequence]) -> tuple[tuple[list[_Row], int, int] | None, list[Sequence]]:
        """Runs a step scheduled under `incarnation` (its rows' start positions hold for that roster only) and
        delivers `done` (the step before's) once it is sent. Returns the next step, if this one's end made room for
        one (scheduled here, counted in flight), and the sessions it left outputs for."""
        self.steps += 1
        delivered = False

        def deliver() -> None:
            nonlocal delivered
            if not delivered:
                delivered = True
                self._deliver(done)
        t0 = self._stepping_starts()
        try:
            with telemetry.span("scheduler.step", parent=step[0].seq.context, rows=len(step), decode_steps=decode_steps):
                reply = self.mesh.execute_step([r.row for r in step], step[0].seq.output, incarnation, decode_steps,
                                               sent=deliver, alone=self._alone is step)
        except InvocationFailed as failure:
            self._stepping_ends()
            deliver()
            self._failed(step, failure, incarnation)
            return None, []
        except Exception as e:  # not a protocol failure: these sessions end with it, the others go on
            self._stepping_ends()
            deliver()
            log.exception("step failed")
            self._end(step, e)
            return None, []
        replied = self._stepping_ends()
        self._tally(step, decode_steps, replied - t0)
        deliver()
        logits = tensors.from_proto(reply.logits) if reply.HasField("logits") else None
        self.run_tokens += sum(r.row.decode_steps - 1 for r in step)
        next_step: tuple[list[_Row], int, int] | None = None
        block, window = self.mesh.kv_block_tokens, self.mesh.kv_window_tokens
        with self._cond:
            draft_passes = self._draft_passes
            for i, r in enumerate(step):
                s, session, result = r.seq, r.seq.session, reply.rows[i]
                self._register(s)  # what the ranks committed: everything before this row (its commit was folded)
                sampled = [int(t) for t in result.tokens] or [int(result.token)]  # a decode run's, or the one
                if r.proposed:  # a verified chunk: the ranks keep its accepted rows once its commit is folded
                    session.history += list(r.row.token_ids[:len(sampled)])
                    s.verified_epoch = r.row.epoch
                    if s.speculation is not None:
                        s.speculation.verified(r.proposed, len(sampled) - 1)
                    self.costs.passed(len(sampled))
                else:
                    session.history += list(r.row.token_ids) + sampled[:-1]  # the KV rows the ranks now hold
                    if s.speculation is not None and r.final:
                        s.speculation.plain(len(sampled))
                session.delivered_epoch = r.row.epoch
                if window and incarnation == self._incarnation:  # every rank dropped these as it began the row
                    s.dropped = max(s.dropped, min(s.blocks, max(0, r.row.start_position - window + 1) // block))
                s.pending = s.pending[len(r.row.token_ids):]
                s.solo, s.recoveries = False, 0
                s.computed += len(r.row.token_ids)
                if r.final and not s.done:
                    # A run's tokens up to the session's end (its last, or a stop token) as one Output: this runs
                    # for every row of every step, between a step's reply and the next step's send.
                    taken = sampled[:max(1, s.remaining)]
                    if not s.stop_ids.isdisjoint(taken):
                        taken = taken[:next(j for j, t in enumerate(taken) if t in s.stop_ids) + 1]
                    if s.guide is not None:
                        for token in taken:
                            s.guide.accept(token)
                    s.outbox.append(Output(taken, None if logits is None else logits[i], s.computed, result))
                    s.computed, s.remaining = 0, s.remaining - len(taken)
                    if s.remaining <= 0 or taken[-1] in s.stop_ids:
                        s.done = True
                    s.pending = [taken[-1]]  # the last token it took feeds its next row
                s.busy = False
                if s.done:
                    self._drop(s)
            self._ended(step)
            scheduled = None if self._stopped else self._next_step()
            if scheduled:
                next_step = (*scheduled, self._incarnation)
                if self._draft_passes == draft_passes:  # a turn that drafted is the draft's cost (PassCosts)
                    self.costs.turned(time.perf_counter() - replied)
            self._cond.notify_all()
        return next_step, [r.seq for r in step]

    def _stepping_starts(self) -> float:
        """A step is sent now (perf_counter, returned)."""
        with self._busy_lock:
            now = time.perf_counter()
            if not self._stepping:
                self._busy_since = now
            self._stepping += 1
        return now

    def _stepping_ends(self) -> float:
        """A step sent by _stepping_starts is answered (or failed) now (perf_counter, returned)."""
        with self._busy_lock:
            now = time.perf_counter()
            self._stepping -= 1
            if not self._stepping:
                self.busy_seconds += now - self._busy_since
        return now

    def _tally(self, step: list[_Row], decode_steps: int, seconds: float) -> None:
        kind = ("prompt" if any(len(r.row.token_ids) > 1 and not r.proposed for r in step) else
                "decode_run" if decode_steps > 1 else "verify" if any(r.proposed for r in step) else "decode")
        self.kind_steps[kind] += 1
        self.kind_rows[kind] += len(step)
        self.kind_seconds[kind] += seconds
        if kind == "verify":
            self.costs.verified(seconds)
        elif kind == "decode_run":
            self.costs.ran(seconds, decode_steps)

    def _failed(self, step: list[_Row], failure: InvocationFailed, incarnation: int) -> None:
        ended: list[tuple[Sequence, BaseException]] = []
        if failure.action is Action.FENCE:
            try:
                self.mesh.recover(incarnation)
            except GraphmeshError as e:
                self._end(step, e)
                return
        with self._cond:
            for r in step:
                s = r.seq
                if failure.action is Action.ROLL_BACK:
                    if len(step) > 1:
                        s.solo = True  # every rank rolled back: find out alone whether this row is the cause
                    elif s.arch_retries > 0:
                        s.arch_retries -= 1
                    else:
                        ended.append((s, failure))
                else:
                    # a resolution counts as a recovery: a session that keeps failing either way must end
                    s.recoveries += 1
                    if s.recoveries > MAX_RECOVERIES:
                        ended.append((s, Unavailable(f"session {s.session.session_id} lost the mesh "
                                                     f"{s.recoveries} times in a row ({failure.cause.reason})",
                                                     "TOO_MANY_RECOVERIES")))
                s.busy = False
            for s, error in ended:
                s.done = True
                self._flush(s)
                s.events.put(error)
                s.wake()
                self._drop(s)
            self._ended(step)
            self._cond.notify_all()

    def _end(self, step: list[_Row], error: BaseException) -> None:
        with self._cond:
            for r in step:
                r.seq.busy, r.seq.done = False, True
                self._flush(r.seq)
                r.seq.events.put(error)
                r.seq.wake()
                self._drop(r.seq)
            self._ended(step)
            self._cond.notify_all()

    def _ended(self, step: list[_Row]) -> None:
        """`step` is no longer in flight (under the lock)."""
        self._in_flight -= 1
        if self._alone is step:
            self._alone = None

    def _drop(self, seq: Sequence) -> None:
        """Removes an ended session (under the lock); its blocks count until every rank released them."""
        if seq in self._seqs:
            if self.drafter is not None and seq.speculation is not None and seq.speculation.draft:
                self.drafter.forget(seq.session.session_id)
            self._seqs.remove(seq)
            self._forget(seq)
            self._releasing += seq.blocks - seq.dropped
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Releases a session's KV on every rank, off the scheduling thread (under the lock). The sessions that end
        while a release is on its way go together in the next: a step's end releases its sessions in one call a
        rank, where a call each (256 at once at 256 streams) cost the coordinator and the executors more than the
        releases."""
        seq.busy = True
        self._to_release.append(_Released(seq, self._incarnation, seq.blocks - seq.dropped, seq not in self._seqs))
        if not self._releasing_now:  # else the releasing worker takes it with the others when its call is done
            self._releasing_now = True
            self._workers.submit(self._release_pending)

    def _release_pending(self) -> None:
        while True:
            with self._cond:
                batch, self._to_release = self._to_release, []
                if not batch:
                    self._releasing_now = False
                    return
            try:
                self.mesh.release(*(r.seq.session.session_id for r in batch))
            finally:
                with self._cond:
                    for r in batch:
                        if r.dropped and self._incarnation == r.incarnation:  # a new roster already reset the counts
                            self._releasing -= r.blocks
                        r.seq.blocks, r.seq.dropped, r.seq.busy = 0, 0, False
                    self._cond.notify_all()
