"""One rank of the partitioned pipeline: its layers, its paged KV, a step's rows begun and its iterations run. Its
other jobs live beside it: the weights (stage_weights.py), a run's inputs (stage_inputs.py), the phases of a session's
epochs after a step (stage_phases.py), KV import, export and sharing (stage_kv.py).

A step is one invocation of the protocol over rows of many sessions (decode tokens and prompt chunks mixed).
Every session's KV lives in the stage's pools (kv_pool.KvPool lends their blocks); compiled stage graphs are
shared by every step of the same bucketed shape (tokens, sequences, blocks per sequence) and write new K/V
rows into the pools in place (kv_scatter), so no KV is ever copied on the hot path. All device work runs on
the executor's one engine thread (engine.Engine): handler threads begin and commit the rows' epochs, and each
iteration of a step (one, or a decode run's several) is an engine task posted by whoever brings its input. The
engine launches it (_launch) and the iteration lands once its output is on the host (_landed: on CUDA on the
engine's completion thread, so the engine may launch another step meanwhile), its boundary pushed on
(stage_servicer.BoundaryPusher). While a decode run waits for its next boundary, the engine builds that
iteration's inputs (_prepare), so the boundary's arrival starts the run at once.

Across ranks whose links map one another's GPU memory (transport.py), a decode run whose tokens are all sampled in
the graph runs ahead (_ran_ahead): each iteration's output goes on as a device value the moment it is launched, the
next rank's stream waiting for it on the GPU, and the host goes on to the next iteration without waiting for the
device; the tokens each rank's KV rows hold reach its host once, at the run's end (_settle_fed). Where a link can
queue a run (both ranks on one GPU, the step sent alone), the run's bundles over it from its second iteration
on go as one queue (_send_ahead): every one is accepted at once, each rank's stream waits on the device for the
other's writes, and no host waits for another's in the rest of the run; a step that fails releases those waits
(_fail).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from graphmesh import plan as dag
from graphmesh.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    GraphmeshError,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
)
from graphmesh.models.config import ModelConfig
from graphmesh.protocol import ACTIONS, METADATA_KEY, Action, ErrorClass, ProtocolError
from graphmesh_executor.encoder_group import EncoderGroup
from graphmesh_executor.engine import Engine
from graphmesh_executor.executable import DeviceValue, Executable, HostOutput, RngOptions
from graphmesh_executor.fencing import Authority, AuthorityState, SessionPhase
from graphmesh_executor.kv_pool import KvPool
from graphmesh_executor.logprobs import RowLogprobs, RowSampling, sample_with_logprobs
from graphmesh_executor.stage_inputs import Prepared, seed_for
from graphmesh_executor.stage_phases import StagePhases
from graphmesh_executor.stage_types import (
    BlockWriter,
    Boundary,
    BoundaryValue,
    Pusher,
    Queue,
    Queuer,
    StageSession,
    StageSpec,
    StepResult,
    StepRow,
    copied,
)
from graphmesh_executor.stage_weights import StageWeights
from graphmesh_server import telemetry

log = logging.getLogger("graphmesh.executor.stage")
R = TypeVar("R")

# A step of this many sessions at most is light: the host's other stages are likely idle (one or two streams), so its
# products may borrow a core (cpu_kernels' helper thread; on a busy host it costs only the chunk it has begun).
LIGHT_STEP_SESSIONS = 2


@dataclass(eq=False)
class _InFlight:
    """A step in flight on this rank. Each iteration is an engine task posted by whoever brings its input: the
    step's handler (the first stage's first iteration), the PushBoundary handler that delivered its boundary, or
    the engine itself (a stage feeding itself). No handler thread sits between an input arriving and its compute,
    and pushes go out without waiting: the step is done once every iteration ran and every push was taken."""

    incarnation: int
    step_id: int
    rows: list[StepRow]  # the rows of the iteration running or next to run
    want_logits: bool
    steps: int  # iterations: a decode run's length, else 1
    timeout_s: float  # how long it may wait for an input
    waves: list[dag.Wave]  # the step's waves, every rank's (the plan's schedule of its active groups)
    result: StepResult = field(default_factory=StepResult)
    sampled: list[list[int]] = field(default_factory=list)  # per row, the tokens a decode run sampled (last stage)
    iteration: int = 0  # the iteration running or next to run
    waiting_since: float | None = None  # monotonic time it began waiting for its next input; None while not
    pushes: int = 0  # pushes sent and not yet taken
    computed: bool = False  # every iteration ran
    done: Future[StepResult] = field(default_factory=Future)
    prepared: Prepared | None = None  # the next iteration's run, built while its boundary was on the way
    last_run: Prepared | None = None  # the run of the iteration that ran last: a decode run's next one follows it
    # (iteration, tokens) fed to a decode run that ran ahead, whose sessions' pending tokens are written at its end:
    # the tokens came as device values, or after some that did (the pending tokens keep the iterations' order)
    fed_later: list[tuple[int, np.ndarray | DeviceValue]] = field(default_factory=list)
    # A decode run queued on the device: its queues by route (this rank's bundles, put as its iterations launch), the
    # releases of the queued runs it takes bundles from, and since when (the device, not a boundary, is then waited on)
    queues: dict[int, Queue] = field(default_factory=dict)
    releases: set[Callable[[], None]] = field(default_factory=set)  # one per run, however many bundles it took
    device_since: float | None = None
    alone: bool = False  # no other step in flight on any rank until this one is answered (ExecuteStepRequest.alone)


@dataclass(eq=False)
class _Launch:
    """An iteration launched on the device, and what landing it needs once its output is on the host."""

    output: HostOutput | None  # None: an iteration run ahead whose output only goes on (not the last stage)
    rows: list[StepRow]
    tokens: int  # the rows' tokens: the output's real rows
    t0: float  # perf_counter at launch
    host: bool  # the last stage samples on the host (logprobs, guided)
    ahead: DeviceValue | None = None  # the output of an iteration run ahead, to push on at once
    fed: np.ndarray | DeviceValue | None = None  # the tokens a decode run's later iteration was fed


class StageRuntime(StageWeights, StagePhases):
    def __init__(self, backend: str, device: str = "cpu", model_root: str | None = None,
                 pusher: Pusher | None = None, block_writer: BlockWriter | None = None,
                 faults_enabled: bool = False, kv_cache_bytes: int = 0, standby_weights: bool | None = None,
                 device_links: Callable[[str], bool] | None = None, queue: Queuer | None = None) -> None:
        self.backend = backend
        self.device = device
        self.model_root = model_root
        self.authority = Authority()
        self.rank = 0
        self.world_size = 0
        self.spec: StageSpec | None = None
        self.plan: dag.Plan | None = None
        self.group: dag.Group | None = None  # this rank's decoder group of the plan
        self.config: ModelConfig | None = None
        self.model_identity = ""
        self.param_bytes = 0
        self.dtype = "f32"
        self._pusher = pusher
        # Whether a bundle to an address may stay on the GPU (BoundaryPusher.on_device): a decode run runs ahead
        self._device_links = device_links or (lambda address: False)
        # A run ahead's bundles from its second iteration on, queued whole on the device (BoundaryPusher.queue)
        self._queue: Queuer = queue or (lambda *args: None)
        self._block_writer = block_writer
        self.faults_enabled = faults_enabled
        self.kv_cache_bytes = kv_cache_bytes  # 0: stage_weights.default_kv_cache_bytes()
        # Standby weights: after install, the rest of the model is read in the background, so that a re-plan
        # after losing a peer (which hands this rank new layers) costs no checkpoint reads. Memory for speed;
        # None: on when the whole model's f32 weights take at most a quarter of the available memory.
        self.standby_weights = standby_weights
        self._standby: dict[str, np.ndarray] = {}
        self._weights_path: Path | None = None  # the checkpoint the loaded stage and _standby hold weights of
        self.standby_ready = threading.Event()  # set once the whole model is held
        self._faults: dict[str, int] = {}
        self._lock = threading.Condition()
        self._sessions: dict[str, StageSession] = {}
        self._mailbox: dict[tuple[int, int, int], Boundary] = {}  # (step id, iteration, route id) -> its bundle
        self._in_flight: dict[int, _InFlight] = {}  # step id -> the step, while its handler waits for it
        self._aborted: set[int] = set()
        self.engine = Engine(f"engine-{backend}")
        # Everything below is touched on the engine thread only.
        self._executables: dict[tuple[int, int, int, bool, bool, bool], Executable[Any]] = {}
        self._holder: Executable[Any] | None = None
        self._encoder: EncoderGroup | None = None  # the plan's encoder group, when this rank owns it
        self._pools: dict[str, Any] = {}
        self.pool = KvPool(2, 16)
        self._loaded_key: StageSpec | None = None
        self._packed_schemes: dict[str, str] = {}
        self._packed = False  # the installed stage keeps packed blocks (see install)
        self._wide_tables = False
        self.compiles, self.compile_seconds = 0, 0.0

    # -- install ---------------------------------------------------------------------------------------
    def install(self, incarnation: int, rank: int, world_size: int, spec: StageSpec,
                plan: dag.Plan | None = None) -> float:
        """Loads weights and compiles (reusing both when the stage is unchanged), then activates `incarnation`.
        `plan` is the incarnation's DAG, in which `spec` is rank `rank`'s decoder group; a single rank may go
        without one (its plan is then that group alone)."""
        if plan is None:
            if world_size != 1:
                raise InvalidArgument(f"rank {rank} of {world_size} needs the partition plan", "NO_PLAN")
            plan = dag.pipeline([(spec.layer_start, spec.layer_end)], [""], 0)  # no route: no schema needs the width
        group = plan.decoder(rank)
        if len(plan.addresses) != world_size or (group.layer_start, group.layer_end) != (spec.layer_start,
                                                                                          spec.layer_end):
            raise InvalidArgument(f"the plan gives rank {rank} of {len(plan.addresses)} layers [{group.layer_start}, "
                                  f"{group.layer_end}); the stage is rank {rank} of {world_size} with layers "
                                  f"[{spec.layer_start}, {spec.layer_end})", "BAD_PLAN")
        with self._lock:
            self.authority.check_install(incarnation)  # refuses before any work: stale or out of range
        t0 = time.perf_counter()
        if spec != self._loaded_key:
            with telemetry.span("stage.load_weights", model=spec.model, layer_start=spec.layer_start,
                                layer_end=spec.layer_end, weights=spec.weights):
                self.engine.run("stage.load", lambda: self._load(spec))
        encoder = plan.encoder()
        self.engine.run("stage.load_encoder", lambda: self._load_encoder(spec, encoder is not None and
                                                                        encoder.rank == rank))
        with self._lock:
            self.authority.install(incarnation)
            self.rank, self.world_size, self.spec, self.plan, self.group = rank, world_size, spec, plan, group
            # Sessions of an older incarnation are not trusted: the coordinator restores them.
            self._sessions.clear()
            self._mailbox.clear()
            self._aborted.clear()
            for step in self._in_flight.values():  # of an older incarnation: it must not go on under the new one
                self._fail(step, ProtocolError(ErrorClass.COMM, FailedPrecondition(
                    "a new incarnation was installed", "POISONED")))
            self.pool.clear()
            self._lock.notify_all()
        return (time.perf_counter() - t0) * 1000.0

    # -- protocol --------------------------------------------------------------------------------------
    def execute_step(self, incarnation: int, step_id: int, rows: list[StepRow], logits: bool,
                     timeout_s: float, decode_steps: int = 1, active_groups: frozenset[int] = frozenset(),
                     alone: bool = False) -> StepResult:
        """Begin every row (after its folded commit), take this rank's part of each of the step's waves (run its
        groups for all rows, push their bundles on), finish. `active_groups` are the optional groups the step
        activates. A decode run (`decode_steps` > 1) runs the decoder groups that many times, each row's epoch
        spanning every token. `alone`: no other step is in flight on any rank until this one is answered (only then
        may its run be queued on the device, _send_ahead)."""
        decode_steps = max(1, decode_steps)
        with self._lock:
            self.authority.check(incarnation)
            plan = self.plan
            assert plan is not None
            self._check_rows(rows, logits, decode_steps, active_groups)
            rows = _own_steps(rows, decode_steps)
            waves = plan.schedule(active_groups)
            self._begin(incarnation, rows)
        ends = [row.start + len(row.token_ids) + row.steps - 1 for row in rows]
        # A prediction-target row runs as one single-token row per position (same session, same block table): each is
        # computed, and sampled with its own seed, exactly as a plain decode of that position would be.
        run_rows = [p for row in rows for p in _positions(row)] if any(r.proposed for r in rows) else rows
        try:
            result = self._run_step(incarnation, step_id, run_rows, logits, timeout_s, decode_steps, waves, alone)
        except ProtocolError as e:
            if plan.cross_stage_collective_waves and e.error_class is ErrorClass.ARCH:
                # peers may wait inside a wave's collective this rank never joined: nothing is provable any more
                e = ProtocolError(ErrorClass.COMM, e.cause)
            with self._lock:
                self._forget_step(step_id)
                if ACTIONS[e.error_class] is Action.FENCE:
                    self._poison(incarnation, f"{e.error_class}: {e}")
                for row in rows:
                    session = self._sessions.get(row.session_id)
                    if session is not None and session.txn.epoch == row.epoch:
                        session.txn.abort(row.epoch)
            raise e
        result.waves = [(w.ordinal, w.group.id, w.group.rank == self.rank) for w in waves
                        if w.group.rank == self.rank or plan.cross_stage_collective_waves]
        if run_rows is not rows and result.tokens:
            _verify(rows, result)
        with self._lock:
            for row, end in zip(rows, ends):
                self._sessions[row.session_id].txn.advance(row.epoch, end)
            if self.authority.state is not AuthorityState.ACTIVE:
                self._mark_undecided()  # fenced while this step ran: its decision can no longer come
            result.kv_lengths = ends
        return result

    def _poison(self, incarnation: int, reason: str, terminal: bool = False) -> None:
        """Poisons `incarnation` here (under the lock) and, if that lost the authority, marks the voted epochs
        undecided: every loss of the authority goes through this."""
        self.authority.poison(incarnation, reason, terminal)
        if self.authority.state is not AuthorityState.ACTIVE:
            self._mark_undecided()
            for step in self._in_flight.values():
                if step.waiting_since is not None or step.device_since is not None:
                    self._fail(step, self._fenced())

    def _mark_undecided(self) -> None:
        """The authority is lost (under the lock): no step of its incarnation will run again, so no folded commit
        can reach an epoch that voted here and waits for its decision. Those turn INDETERMINATE: the coordinator
        (restarted, its log read back) resolves them before it fences and replaces the incarnation."""
        for session in self._sessions.values():
            if session.txn.phase is SessionPhase.IN_TXN and session.txn.voted:
                session.txn.mark_indeterminate(session.txn.epoch)

    def _check_rows(self, rows: list[StepRow], logits: bool, decode_steps: int, active_groups: frozenset[int]) -> None:
        """What makes a step impossible, refused before any row begins (ARCH: nothing changed anywhere)."""
        assert self.spec is not None and self.config is not None and self.plan is not None
        limit = self.spec.max_context_tokens or self.config.max_position
        self._check_activity(rows, decode_steps, active_groups)
        if not rows:
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument("a step needs at least one row", "EMPTY_STEP"))
        if len({row.session_id for row in rows}) != len(rows):
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument("a session appears twice in one step",
                                                                 "DUPLICATE_SESSION"))
        if decode_steps > 1 and (logits or any(len(r.token_ids) != 1 or r.sampling.logprobs or r.allowed_tokens
                                               for r in rows)):
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                "a decode run takes rows of one token each, sampled in the graph (no logits, no logprobs, no "
                "allowed_tokens)", "BAD_DECODE_RUN"))
        if any(r.steps > decode_steps for r in rows):
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                f"a row takes more tokens of a decode run than its {decode_steps}", "BAD_DECODE_RUN"))
        for row in rows:
            if row.proposed and (decode_steps > 1 or logits or row.sampling.logprobs
                                 or row.proposed >= len(row.token_ids)):
                raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                    f"row of session {row.session_id!r} proposes {row.proposed} of its {len(row.token_ids)} tokens; "
                    "a prediction target takes fewer proposals than tokens, sampled (no decode run, logits or "
                    "logprobs)", "BAD_PREDICTION_TARGET"))
            if row.commit_length and row.commit_length != row.start:
                raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                    f"row of session {row.session_id!r} commits to {row.commit_length} rows but starts at {row.start}",
                    "BAD_COMMIT_LENGTH"))
        words = -(-self.config.vocab_size // 32)
        for row in rows:
            masks = row.proposed + 1 if row.proposed else 1  # a prediction target's: one a sampled position
            if row.allowed_tokens and len(row.allowed_tokens) != 4 * words * masks:
                raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                    f"row of session {row.session_id!r}: allowed_tokens holds {len(row.allowed_tokens)} bytes; "
                    f"{masks} mask(s) of the vocabulary of {self.config.vocab_size} take {4 * words * masks}",
                    "BAD_ALLOWED_TOKENS"))
            n = len(row.token_ids)
            if n == 0:
                raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                    f"row of session {row.session_id!r} has no tokens", "EMPTY_INPUT"))
            n += (row.steps or decode_steps) - 1  # the KV rows the step writes
            if row.start + n > limit:
                raise ProtocolError(ErrorClass.ARCH, OutOfRange(
                    f"{row.start + n} tokens exceed the context of {limit}", "CONTEXT_EXCEEDED"))
            if self.spec.first and (max(row.token_ids) >= self.config.vocab_size or min(row.token_ids) < 0):
                raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                    f"token id outside the vocabulary of {self.config.vocab_size}", "BAD_TOKEN_ID"))
        if self._take_fault("arch"):
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument("injected deterministic failure", "INJECTED_FAULT"))

    def _check_activity(self, rows: list[StepRow], decode_steps: int, active_groups: frozenset[int]) -> None:
        """request_group_active, checked: the step activates the plan's encoder exactly when a row brings encoder
        input, and every such row is well formed (every rank checks the same request, so all agree)."""
        assert self.plan is not None and self.config is not None and self.spec is not None
        encoder, enc = self.plan.encoder(), self.config.encoder

        def refuse(why: str, reason: str = "BAD_ENCODER_INPUT") -> ProtocolError:
            return ProtocolError(ErrorClass.ARCH, InvalidArgument(why, reason))
        if not active_groups <= self.plan.optional_ids():
            raise refuse(f"the step activates groups {sorted(active_groups)}; the plan's optional groups are "
                         f"{sorted(self.plan.optional_ids())}", "BAD_ACTIVE_GROUPS")
        encoding = any(r.encoded_offsets for r in rows)
        if encoding != (encoder is not None and encoder.id in active_groups):
            raise refuse("the step's active groups and its rows disagree on running the encoder", "BAD_ACTIVE_GROUPS")
        if not encoding:
            return
        if enc is None:
            raise refuse("rows bring encoder input; the model has no encoder")
        if decode_steps > 1:
            raise refuse("a decode run takes no encoder input")
        for r in rows:
            offsets, features = r.encoded_offsets, r.encoder_input
            n = len(offsets)
            if not n:
                continue
            if features is None or features.dtype != np.float32 or features.shape != (n, enc.input_dim):
                shape = None if features is None else f"{features.dtype}{list(features.shape)}"
                raise refuse(f"row of session {r.session_id!r} places {n} encoded rows; its encoder input is {shape}, "
                             f"not f32[{n}, {enc.input_dim}]")
            if list(offsets) != sorted(set(offsets)) or offsets[0] < 0 or offsets[-1] >= len(r.token_ids):
                raise refuse(f"row of session {r.session_id!r} has encoded offsets {list(offsets)} outside its "
                             f"{len(r.token_ids)} tokens or out of order")
            if any(r.token_ids[o] != enc.token_id for o in offsets):
                raise refuse(f"row of session {r.session_id!r} places encoded rows on tokens other than the "
                             f"placeholder {enc.token_id}")

    def _begin(self, incarnation: int, rows: list[StepRow]) -> None:
        """Commits each row's folded epoch and begins its epoch with its KV blocks reserved; a row that cannot
        begin rolls back the rows already begun, so the step changes nothing but the folded commits."""
        begun: list[tuple[StageSession, int]] = []
        try:
            for row in rows:
                session = self._session(row.session_id)
                if row.commit_epoch:
                    self._commit(incarnation, row.session_id, session, row.commit_epoch)
                    if row.commit_length:
                        self._truncate(session, row.commit_length)
                try:
                    # before the length check: an undecided epoch explains a mismatch, and is what to resolve
                    session.txn.check_decided(row.epoch)
                except FailedPrecondition as e:
                    raise FailedPrecondition(e.message, e.reason, {**e.metadata, "session_id": row.session_id}) from e
                if row.start != session.txn.kv_length:
                    raise FailedPrecondition(f"session {row.session_id!r} has {session.txn.kv_length} committed "
                                             f"tokens here, the row starts at {row.start}", "KV_LENGTH_MISMATCH")
                session.txn.begin(row.epoch)
                begun.append((session, row.epoch))
                session.pending_tokens = list(row.token_ids)
                if row.encoded_offsets:
                    # its KV rows depend on the encoder input as well as the tokens: no token key may name them
                    session.untokened = True
                self._drop_outside_window(row.session_id, session, row.start)  # first: the row may reuse them
                try:
                    self.pool.reserve(row.session_id, row.start + len(row.token_ids) + row.steps - 1)
                except ResourceExhausted as e:
                    raise ProtocolError(ErrorClass.ARCH, e) from e
        except Exception:
            for session, epoch in begun:
                session.txn.abort(epoch)
            raise

    def _run_step(self, incarnation: int, step_id: int, rows: list[StepRow], want_logits: bool,
                  timeout_s: float, decode_steps: int, waves: list[dag.Wave], alone: bool = False) -> StepResult:
        """This rank's part of a step: its encoder wave when it owns an active one, then its decoder group once, or
        `decode_steps` times in a decode run. Iteration i > 0 of a run feeds each row the token iteration i - 1
        sampled: the last stage pushes those back to the first over the feedback route, and every stage hands them
        on beside its activation, so each rank knows the tokens its KV rows hold."""
        step = _InFlight(incarnation, step_id, rows, want_logits, decode_steps, timeout_s, waves,
                         sampled=[[] for _ in rows], alone=alone)
        with self._lock:
            self._in_flight[step_id] = step
            encoder = next((w for w in waves if w.group.kind == dag.ENCODER and w.group.rank == self.rank), None)
            if encoder is not None:  # posted first: the engine runs it before this rank's decoder wave
                self.engine.post("stage.encode", lambda: self._encode(step, encoder))
            self._next_input(step)
        try:
            while True:
                try:
                    return step.done.result(timeout=min(timeout_s, 1.0))
                except FutureTimeout:
                    with self._lock:
                        since = step.waiting_since if step.waiting_since is not None else step.device_since
                        if since is not None and time.monotonic() - since >= timeout_s:
                            what = "no boundary" if step.waiting_since is not None else "a run queued on the device"
                            self._fail(step, ProtocolError(ErrorClass.COMM, DeadlineExceeded(
                                f"{what} for step {step_id} (iteration {step.iteration}) within {timeout_s:.1f} s",
                                "BOUNDARY_TIMEOUT")))
        finally:
            with self._lock:
                del self._in_flight[step_id]
                failed = not step.done.done() or step.done.exception() is not None
                for queue in step.queues.values():
                    if failed:
                        queue.release()  # again: one made as the step failed may have missed _fail's
                    else:
                        queue.end()

    def _inputs(self, step: _InFlight) -> list[dag.Route]:
        """The routes whose bundles the decoder group's next iteration of `step` consumes: in the first, those from
        the step's active groups it depends on; in a decode run's later ones, the previous decoder group's (its
        activation and the tokens) or, on the first decoder group, the feedback of the last."""
        assert self.plan is not None and self.group is not None
        plan, group = self.plan, self.group
        if step.iteration == 0:
            active = {w.group.id for w in step.waves}
            return [r for r in plan.routes_into(group.id) if r.source_group in active]
        return [r for r in plan.routes_into(group.id) if plan.groups[r.source_group].kind == dag.DECODER] + \
            plan.routes_into(group.id, feedback=True)

    def _next_input(self, step: _InFlight) -> None:
        """Posts the step's next iteration when its inputs are here (or it needs none), else leaves it waiting for
        them (under the lock)."""
        i = step.iteration
        if self.authority.state is not AuthorityState.ACTIVE:
            self._fail(step, self._fenced())
            return
        if step.step_id in self._aborted:
            self._fail(step, ProtocolError(ErrorClass.ARCH, FailedPrecondition(
                f"step {step.step_id} was aborted", "EPOCH_ABORTED")))
            return
        keys = [(step.step_id, i, r.id) for r in self._inputs(step)]
        if any(k not in self._mailbox for k in keys):
            if i and step.waiting_since is None:  # queued behind what the engine has to do now, never before it
                self.engine.post("stage.prepare", lambda: self._prepare(step, i))
            step.waiting_since = time.monotonic()
            return
        bundles = {k[2]: self._mailbox.pop(k) for k in keys}
        for b in bundles.values():  # a queued run's: once taken, this rank's stream will wait for its bytes
            arrival = next((v.arrival for v in b.values.values() if isinstance(v, DeviceValue) and v.arrival), None)
            if arrival is not None:
                step.releases.add(arrival.release)
                step.device_since = step.device_since or time.monotonic()
        step.waiting_since = None
        self.engine.post("stage.iteration", lambda: self._advance(step, bundles))

    def _fenced(self) -> ProtocolError:
        return ProtocolError(ErrorClass.COMM, FailedPrecondition(
            f"fenced while waiting for a boundary: {self.authority.cause}", "POISONED"))

    def _fail(self, step: _InFlight, error: ProtocolError) -> None:
        if not step.done.done():
            step.done.set_exception(error)
        # What this rank's streams wait for in a queued run may never come: they go on (computing what is never used)
        for queue in step.queues.values():
            queue.release()
        for release in step.releases:
            release()

    def _finish(self, step: _InFlight) -> None:
        """Completes the step once every iteration ran and every push was taken (under the lock)."""
        if step.computed and not step.pushes and not step.done.done():
            step.done.set_result(step.result)

    def _wave(self, step: _InFlight, group: dag.Group) -> int:
        return next(w.ordinal for w in step.waves if w.group.id == group.id)

    def _dims(self, step: _InFlight, encoded: int = 0) -> dict[str, int]:
        """The symbolic dimensions of the step's bundles (graphmesh.plan) in its current iteration."""
        return {dag.TOKENS: sum(len(r.token_ids) for r in step.rows), dag.ROWS: len(step.rows), dag.ENCODED: encoded}

    def _encode(self, step: _InFlight, wave: dag.Wave) -> None:
        """The encoder wave (engine thread): every row's encoder input, in row order, through the encoder, pushed to
        the group that consumes it."""
        assert self.plan is not None and self._encoder is not None
        if step.done.done():
            return
        try:
            features = np.concatenate([r.encoder_input for r in step.rows if r.encoder_input is not None])
            encoder, t0 = self._encoder, time.perf_counter()
            with telemetry.span("stage.encode", step=step.step_id, rows=features.shape[0]):
                encoded = self._guarded(lambda: encoder.run(features))
            step.result.compute_us += (time.perf_counter() - t0) * 1e6
            for route in self.plan.routes_from(wave.group.id):
                self._send(step, route, {dag.ENCODED_ROWS: encoded}, self._dims(step, len(features)), wave.ordinal)
        except Exception as e:
            self._failed(step, e)

    def _advance(self, step: _InFlight, bundles: dict[int, Boundary]) -> None:
        """Launches the step's next iteration (engine thread), or runs all of a decode run's chained; the rest of an
        iteration (its output pushed on, or the step's result) follows once the device is done (Engine.after), so
        the engine may launch another step's meanwhile."""
        if step.done.done():
            return  # aborted or fenced while it was queued
        try:
            if not step.iteration and not bundles and self._chains(step) and self._chain(step):
                self._advanced(step)  # every iteration ran chained
                return
            launch = self._launch(step, bundles)
        except Exception as e:
            self._failed(step, e)
            return
        if launch.ahead is not None:
            self._ran_ahead(step, launch)
            return
        assert launch.output is not None
        output = launch.output
        self.engine.after("stage.iteration_done", output, lambda: self._landed(step, launch))

    def _failed(self, step: _InFlight, e: Exception) -> None:
        with self._lock:
            self._fail(step, e if isinstance(e, ProtocolError) else ProtocolError(ErrorClass.COMM, e))

    def _landed(self, step: _InFlight, launch: _Launch) -> None:
        """The rest of a launched iteration once its output is on the host (the engine's completion thread on CUDA,
        else the engine thread): its output pushed on or its result filled, and on the last stage of a decode run
        its samples and their feedback to the first; then the step's next iteration or its end."""
        assert self.spec is not None and self.plan is not None and self.group is not None
        if step.done.done():
            return
        try:
            i = step.iteration
            out = self._land(step, launch)
            if i + 1 == step.steps:
                self._settle_fed(step)
            if step.steps > 1 and self.spec.last:
                self._sampled(step, out)
                if i + 1 < step.steps:
                    tokens = np.asarray([t[-1] for t in step.sampled], np.int64)
                    for route in self.plan.routes_from(self.group.id, feedback=True):
                        self._send(step, route, {dag.RUN_TOKENS: tokens}, self._dims(step),
                                   self._wave(step, self.group), iteration=i + 1)
        except Exception as e:
            self._failed(step, e)
            return
        self._advanced(step)

    def _sampled(self, step: _InFlight, out: np.ndarray) -> None:
        """A decode run's iteration's tokens, on the last stage."""
        for t, token in zip(step.sampled, out):
            t.append(int(token))

    def _ahead(self, step: _InFlight, run: Prepared, encoded: bool) -> bool:
        """Whether iteration `step.iteration` runs ahead: its output goes on as a device value at launch and the host
        does not wait for it. So in a decode run whose every token is sampled in the graph, on an executable that
        keeps outputs on its GPU, where every next rank's link maps that GPU. The last stage's last iteration feeds
        nothing back, and lands as any other."""
        assert self.spec is not None and self.plan is not None and self.group is not None
        spec, plan = self.spec, self.plan
        if step.steps < 2 or encoded or step.want_logits or not run.exe.keeps_on_device():
            return False
        if spec.last and step.iteration + 1 >= step.steps:
            return False
        if any(r.sampling.logprobs or r.allowed_tokens for r in step.rows):  # the last stage samples on the host
            return False
        routes = plan.routes_from(self.group.id, feedback=spec.last)
        return bool(routes) and all(r.destination_rank != self.rank and
                                    self._device_links(plan.addresses[r.destination_rank]) for r in routes)

    def _ran_ahead(self, step: _InFlight, launch: _Launch) -> None:
        """An iteration launched ahead (engine thread): its output pushed on at once (the last stage's tokens fed back
        to the first), and the step on to its next iteration without waiting for the device. The last stage's
        tokens still land on the completion thread, in launch order; a run's last iteration ends the step once the
        tokens fed to this rank are on the host."""
        assert self.spec is not None and self.plan is not None and self.group is not None and launch.ahead is not None
        spec, plan, i = self.spec, self.plan, step.iteration
        try:
            if spec.last:
                for route in plan.routes_from(self.group.id, feedback=True):
                    self._send_ahead(step, route, {dag.RUN_TOKENS: launch.ahead.head(len(launch.rows))}, i + 1)
            else:
                values: dict[str, BoundaryValue] = {dag.ACTIVATION: launch.ahead.head(launch.tokens)}
                if i:
                    assert launch.fed is not None
                    values[dag.RUN_TOKENS] = launch.fed
                for route in plan.routes_from(self.group.id):
                    self._send_ahead(step, route, values, i)
        except Exception as e:
            self._failed(step, e)
            return
        if spec.last:
            assert launch.output is not None
            output = launch.output
            self.engine.after("stage.iteration_done", output, lambda: self._took(step, output))
        elif i + 1 == step.steps and step.fed_later:
            fed = self._fed_on_host(step)
            self.engine.after("stage.run_done", fed, lambda: self._settled(step, fed))
            return
        self._advanced(step)

    def _took(self, step: _InFlight, output: HostOutput) -> None:
        """The tokens of an iteration the last stage ran ahead, on the host (completion thread)."""
        if step.done.done():
            return
        try:
            self._sampled(step, self._guarded(output.result))
        except Exception as e:
            self._failed(step, e)

    def _fed_on_host(self, step: _InFlight) -> HostOutput:
        """The device values among the tokens fed to a run that ran ahead, on their way to the host."""
        assert step.last_run is not None
        on_device = [v for _, v in step.fed_later if isinstance(v, DeviceValue)]
        return step.last_run.exe.host_async(on_device) if on_device else HostOutput(np.zeros((0, 0), np.int64))

    def _settle_fed(self, step: _InFlight, fed: HostOutput | None = None) -> None:
        """Adds the tokens fed to a run that ran ahead to their sessions' pending tokens, in the iterations' order,
        once they are on the host (waiting for them here when `fed` was not read yet)."""
        if not step.fed_later:
            return
        host = iter(self._guarded((fed or self._fed_on_host(step)).result))
        for i, tokens in step.fed_later:
            self._pend(step.rows, (next(host) if isinstance(tokens, DeviceValue) else tokens)[None], i)
        step.fed_later = []

    def _settled(self, step: _InFlight, fed: HostOutput) -> None:
        """A run that ran ahead, on a rank before the last, at its end (completion thread)."""
        if step.done.done():
            return
        try:
            self._settle_fed(step, fed)
        except Exception as e:
            self._failed(step, e)
            return
        self._advanced(step)

    def _advanced(self, step: _InFlight) -> None:
        """After an iteration (or a chained run's last): waits for the next one's input, or ends the step."""
        assert self.spec is not None
        with self._lock:
            step.iteration += 1
            if step.iteration < step.steps:
                self._next_input(step)
                return
            if step.steps > 1 and self.spec.last:
                step.result.tokens = [t[0] for t in step.sampled]
                step.result.run_tokens = [t[:r.steps] for t, r in zip(step.sampled, step.rows)]
            step.computed = True
            self._finish(step)

    def _feed(self, rows: list[StepRow], fed: np.ndarray, iteration: int) -> None:
        """Writes a decode run's fed tokens into `iteration`'s rows, and into their sessions' pending tokens while
        the iteration is within a row's share (a row past its own run writes no KV row)."""
        for r, t in zip(rows, fed.tolist()):
            r.token_ids[0] = t
        self._pend(rows, fed[None], iteration)

    def _pend(self, rows: list[StepRow], fed: np.ndarray, iteration: int) -> None:
        """Adds the tokens fed to a decode run's rows from `iteration` on (fed[k, b]: row b's at iteration + k) to
        their sessions' pending tokens, those within each row's share."""
        with self._lock:
            for b, r in enumerate(rows):
                session = self._sessions.get(r.session_id)
                if session is not None and iteration < r.steps:
                    session.pending_tokens += fed[:r.steps - iteration, b].tolist()

    def _prepare(self, step: _InFlight, iteration: int) -> None:
        """Builds `iteration`'s run ahead of its boundary (engine thread), unless the step is over or that
        iteration already ran (a boundary that came meanwhile posted it behind this task: it runs what was built
        here). A run that cannot be built now is built when the boundary comes, where its error counts."""
        assert self.spec is not None
        if step.done.done() or step.iteration != iteration or step.prepared is not None:
            return
        try:
            rows = self._next_rows(step.rows)
            step.prepared = self._inputs_for(step.last_run, rows, self._samples(step, rows), iteration)
        except Exception as e:
            log.debug("iteration not prepared", extra={"step": step.step_id, "error": repr(e)})

    def _received(self, step: _InFlight, bundles: dict[int, Boundary]) -> dict[str, BoundaryValue]:
        """The values of this iteration's bundles by role, each bundle checked whole against its route's schema
        resolved for the step (CONTRACT: a bundle its sender should never have sent)."""
        assert self.plan is not None
        dims = self._dims(step, sum(len(r.encoded_offsets) for r in step.rows))
        values: dict[str, BoundaryValue] = {}
        for route_id, b in bundles.items():
            why = self.plan.routes[route_id].schema.check(b.values, dims, step.iteration)
            if why:
                raise ProtocolError(ErrorClass.CONTRACT, InvalidArgument(
                    f"route {route_id} bundle for step {step.step_id}: {why}", "SCHEMA_MISMATCH"))
            values.update(b.values)
        return values

    def _launch(self, step: _InFlight, bundles: dict[int, Boundary]) -> _Launch:
        """Launches iteration `step.iteration` alone (engine thread): its rows (a decode run's later iteration: one
        position on, fed the tokens the one before sampled) and its run over them."""
        assert self.spec is not None
        spec, i = self.spec, step.iteration
        fed: np.ndarray | DeviceValue | None = None
        if i:
            fed = next((b.values.get(dag.RUN_TOKENS) for b in bundles.values()), None) if bundles else \
                np.array([t[-1] for t in step.sampled], np.int64)
            if fed is None or tuple(fed.shape) != (len(step.rows),):
                raise ProtocolError(ErrorClass.CONTRACT, InvalidArgument(
                    f"iteration {i} of decode run {step.step_id} came without its {len(step.rows)} tokens",
                    "SCHEMA_MISMATCH"))
            prepared = step.prepared if step.prepared is not None and step.prepared.iteration == i else None
            step.rows = self._next_rows(step.rows) if prepared is None else prepared.rows
            if isinstance(fed, DeviceValue) or step.fed_later:
                if not isinstance(fed, DeviceValue):
                    for r, t in zip(step.rows, fed.tolist()):
                        r.token_ids[0] = t
                step.fed_later.append((i, fed))
            else:
                self._feed(step.rows, fed, i)
        rows = step.rows
        total = sum(len(row.token_ids) for row in rows)
        received = self._received(step, bundles)
        hidden, encoded = received.get(dag.ACTIVATION), received.get(dag.ENCODED_ROWS)
        if isinstance(encoded, DeviceValue):  # only a decode run's later iterations run ahead, and those encode nothing
            raise ProtocolError(ErrorClass.CONTRACT, InvalidArgument(
                f"step {step.step_id} brought encoder rows on a device", "SCHEMA_MISMATCH"))
        if not spec.first and hidden is None:
            raise ProtocolError(ErrorClass.CONTRACT, InvalidArgument(
                f"step {step.step_id} reached rank {self.rank} without an activation", "SCHEMA_MISMATCH"))
        sample = self._samples(step, rows)
        t0 = time.perf_counter()
        with telemetry.span("stage.compute", step=step.step_id, iteration=i, rows=len(rows)):
            prepared = step.prepared
            run = prepared if prepared is not None and prepared.rows is rows and prepared.sample == sample and \
                encoded is None else self._inputs_for(step.last_run, rows, sample, i, encoded is not None)
            ahead = self._ahead(step, run, encoded is not None)
            output, kept = self._guarded(lambda: self._compute(rows, hidden, encoded, run, fed, ahead))
        step.prepared, step.last_run = None, run
        step.result.computed_tokens += total
        return _Launch(output, rows, total, t0, host=spec.last and not step.want_logits and not sample,
                       ahead=kept if ahead else None, fed=fed)

    def _land(self, step: _InFlight, launch: _Launch) -> np.ndarray:
        """A launched iteration's output, pushed on with the rows' tokens after a decode run's first iteration (the
        next ranks know those from the request), or, on the last stage, the step's result filled; returns it."""
        assert self.spec is not None and self.plan is not None and self.group is not None
        spec, rows, result, output = self.spec, launch.rows, step.result, launch.output
        assert output is not None
        out = self._guarded(output.result)
        result.compute_us += (time.perf_counter() - launch.t0) * 1e6
        if not spec.last:
            values: dict[str, BoundaryValue] = {dag.ACTIVATION: out[:launch.tokens]}
            if step.iteration:  # as fed: tokens that came on a device are not in the rows' ids
                assert launch.fed is not None
                values[dag.RUN_TOKENS] = launch.fed
            for route in self.plan.routes_from(self.group.id):
                self._send(step, route, values, self._dims(step), self._wave(step, self.group))
        elif step.want_logits:
            result.logits = out[: len(rows)].astype(np.float32)
        elif launch.host:
            # Stage executables draw with the default RngOptions (they never set_rng), as sample_with_logprobs does.
            result.tokens, result.logprobs = sample_with_logprobs(RngOptions(), out[: len(rows)], [
                RowSampling(r.sampling.temperature, r.sampling.top_k, r.sampling.top_p,
                            seed_for(r.sampling.seed, r.start + len(r.token_ids)), r.sampling.logprobs,
                            r.sampling.top_logprobs, r.allowed_tokens) for r in rows])
        else:
            result.tokens = [int(t) for t in out[: len(rows)]]
        return out

    def _chains(self, step: _InFlight) -> bool:
        """Whether `step` is a decode run this rank runs whole, its iterations chained on the device: it holds every
        layer (its own tokens feed it) and samples in the graph."""
        assert self.spec is not None
        return self.spec.first and self.spec.last and step.steps > 1 and self._samples(step, step.rows)

    def _chain(self, step: _InFlight) -> bool:
        """Every iteration of a decode run in one engine task (engine thread): their runs are built ahead (within a
        run each row's positions, slots and seeds are known from the first, its blocks reserved when it began) and
        chained with Executable.run_fed, each iteration's ids the tokens the one before sampled, read back once.
        False, nothing run, when an iteration's run was built row by row (another executable): then the iterations
        go one by one, the first with the run built here. True leaves the step at its last iteration, as though
        each had run alone (its rows the first's: the later ones, each a position on, are only the runs' inputs)."""
        first = self._inputs_for(step.last_run, step.rows, True, 0)
        runs = [first]
        while first.tokens == first.seqs and len(runs) < step.steps:
            run = self._next_run(runs[-1], step.rows, len(runs))
            if run is None:
                break
            runs.append(run)
        if len(runs) < step.steps:
            step.prepared = first
            return False
        t0 = time.perf_counter()
        with telemetry.span("stage.compute", step=step.step_id, iteration=0, rows=len(step.rows), chained=len(runs)):
            tokens = self._guarded(lambda: self._compute_chain(runs))
        step.result.compute_us += (time.perf_counter() - t0) * 1e6
        n = len(step.rows)
        step.result.computed_tokens += n * len(runs)
        self._pend(step.rows, tokens[:-1, :n], 1)
        for t, row_tokens in zip(step.sampled, tokens[:, :n].T.tolist()):
            t.extend(row_tokens)
        step.last_run, step.iteration = runs[-1], len(runs) - 1
        return True

    def _compute_chain(self, runs: list[Prepared]) -> np.ndarray:
        """The chained runs of a decode run on the engine thread: output 0 of each (the tokens it sampled)."""
        first, n = runs[0], len(runs[0].rows)
        ids = np.zeros(first.tokens, np.int64)
        ids[:n] = [row.token_ids[0] for row in first.rows]
        input_sets = [{**run.inputs, "input_ids": ids} for run in runs]  # later ids come from the device
        return self._on_device(first, n, lambda exe: exe.run_fed(
            input_sets, "input_ids", n, extent=first.extent, light=n <= LIGHT_STEP_SESSIONS))

    def _samples(self, step: _InFlight, rows: list[StepRow]) -> bool:
        """Whether the run samples in the graph: a step for tokens, unless a row wants logprobs or is guided (then the
        last stage runs the logits graph and samples on the host)."""
        assert self.spec is not None
        return not step.want_logits and not (self.spec.last and any(r.sampling.logprobs or r.allowed_tokens
                                                                    for r in rows))

    def _guarded(self, compute: Callable[[], R]) -> R:
        """Runs a group's compute, its failure classified: a bad shape or input is ARCH, a device error COMM."""
        try:
            return compute()
        except (InvalidArgument, OutOfRange, NotFound, FailedPrecondition, ResourceExhausted) as e:
            raise ProtocolError(ErrorClass.ARCH, e) from e
        except GraphmeshError:
            raise
        except Exception as e:
            raise self._device_failure(e) from e

    def _send(self, step: _InFlight, route: dag.Route, values: dict[str, BoundaryValue], dims: dict[str, int],
              wave: int, iteration: int | None = None) -> None:
        """Validates a bundle against `route`'s schema resolved for the step, then sends it (ARCH when it breaks the
        schema: nothing has left the rank)."""
        iteration = step.iteration if iteration is None else iteration
        why = route.schema.check(values, dims, iteration)
        if why:
            raise ProtocolError(ErrorClass.ARCH, InvalidArgument(
                f"rank {self.rank} produced a bundle for route {route.id} that breaks its schema: {why}",
                "SCHEMA_MISMATCH"))
        activation = values.get(dag.ACTIVATION)
        if isinstance(activation, np.ndarray) and self._take_fault("corrupt"):  # in transit: the receiver must refuse
            values = {**values, dag.ACTIVATION: activation[:, :-1]}
        boundary = Boundary(step.step_id, iteration, route.id, values, route.schema.identity, wave)
        if route.destination_rank == self.rank:  # a route within this rank: delivered in place
            self.accept_boundary(step.incarnation, boundary)
            return
        assert self.plan is not None
        self._push(step, self.plan.addresses[route.destination_rank], boundary)

    def _send_ahead(self, step: _InFlight, route: dag.Route, values: dict[str, BoundaryValue], iteration: int) -> None:
        """A bundle of an iteration run ahead (engine thread). From a run's second iteration on, every bundle over a
        route has one layout: where two or more are still to come and the step is alone, the first goes as the start
        of a queue on the device when the link can take one (BoundaryPusher.queue), and the later ones are put in it
        with no message at all, so that neither rank's host waits for the other's in the rest of the run. Else pushed
        as any other. Only alone: a queued run's waits hold each rank's stream, and another step's work queued behind
        them on the two ranks in different orders would never run (each stream waiting for what the other holds)."""
        assert self.plan is not None and self.group is not None
        queue = step.queues.get(route.id)
        if queue is not None:
            queue.put(list(values.values()))
            return
        dims, wave = self._dims(step), self._wave(step, self.group)
        bundles = step.steps - iteration
        if iteration and bundles >= 2 and step.alone:
            why = route.schema.check(values, dims, iteration)
            if not why:
                boundary = Boundary(step.step_id, iteration, route.id, values, route.schema.identity, wave)
                with self._lock:
                    step.pushes += 1
                delivered = self._delivery(step)
                try:
                    queue = self._queue(self.plan.addresses[route.destination_rank], step.incarnation, boundary,
                                        bundles, step.timeout_s, delivered)
                except Exception as e:
                    delivered(e)
                    return
                if queue is not None:
                    with self._lock:  # _fail reads them on other threads
                        step.queues[route.id] = queue
                        step.device_since = step.device_since or time.monotonic()
                        if step.done.done():  # failed meanwhile: its releases may have gone by
                            queue.release()
                    return
                with self._lock:
                    step.pushes -= 1  # nothing was sent
        self._send(step, route, values, dims, wave, iteration)

    def _push(self, step: _InFlight, address: str, boundary: Boundary) -> None:
        """Sends `boundary` without waiting for it: a bundle that cannot be delivered fails the step as COMM (it
        leaves the order unprovable), and the step is not done before every bundle it sent was taken."""
        assert self._pusher is not None
        with self._lock:
            step.pushes += 1
        delivered = self._delivery(step)
        try:
            self._pusher(address, step.incarnation, boundary, step.timeout_s, delivered)
        except Exception as e:
            delivered(e)

    def _delivery(self, step: _InFlight) -> Callable[[Exception | None], None]:
        """What a push of `step`'s (counted in step.pushes) calls once it was taken or failed."""
        def delivered(error: Exception | None) -> None:
            with self._lock:
                step.pushes -= 1
                if error is not None:
                    self._fail(step, ProtocolError(ErrorClass.COMM, error))
                self._finish(step)
        return delivered

    def _device_failure(self, e: Exception) -> ProtocolError:
        """What a compute that raised something other than a graphmesh error means: the device ran out of
        memory (ARCH: the rows are retried alone, this rank stays usable) or failed (a CUDA error: COMM, so the
        incarnation is fenced and rebuilt, with its own reason: the link did nothing wrong)."""
        what = f"{type(e).__name__}: {e}"
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError
            return ProtocolError(ErrorClass.ARCH, ResourceExhausted(
                f"device {self.device} out of memory: {what}", "DEVICE_OUT_OF_MEMORY"))
        log.error("device failure", extra={"device": self.device, "error": what})
        return ProtocolError(ErrorClass.COMM, Internal(f"device {self.device} failed: {what}", "DEVICE_FAILURE"))

    def _compute(self, rows: list[StepRow], hidden: np.ndarray | DeviceValue | None, encoded: np.ndarray | None,
                 run: Prepared, fed: np.ndarray | DeviceValue | None = None,
                 ahead: bool = False) -> tuple[HostOutput | None, DeviceValue | None]:
        """One run over every row, on the engine thread, with `run`'s executable and inputs: its output on its way
        to the host, and where the run went ahead or was given device values (`hidden`, or the first stage's `fed`
        tokens), kept on the device too (the host's copy then only where this is the last stage or not ahead).
        `encoded`: the encoder's rows for the rows' placeholder tokens, in order (first stage), which replace those
        tokens' embeddings."""
        assert self.spec is not None and self.config is not None
        spec, config = self.spec, self.config
        inputs, tokens = dict(run.inputs), run.tokens
        counts = [len(row.token_ids) for row in rows]
        total = sum(counts)
        on_device: dict[str, DeviceValue] = {}
        if spec.first:
            ids = np.zeros(tokens, np.int64)
            ids[:total] = [t for row in rows for t in row.token_ids]
            inputs["input_ids"] = ids
            if isinstance(fed, DeviceValue):
                on_device["input_ids"] = fed
            if encoded is not None:
                at_rows = np.cumsum([0, *counts[:-1]])
                where = np.array([a + o for a, row in zip(at_rows, rows) for o in row.encoded_offsets], np.int64)
                inputs["encoded"] = np.zeros((tokens, config.hidden_size), np.float32)
                inputs["encoded"][where] = encoded
                inputs["encoded_mask"] = np.zeros(tokens, np.float32)
                inputs["encoded_mask"][where] = 1.0
        else:
            assert hidden is not None
            padded = np.zeros((tokens, config.hidden_size), np.float32)
            if isinstance(hidden, DeviceValue):
                on_device["hidden_in"] = hidden
            else:
                padded[:total] = hidden
            inputs["hidden_in"] = padded
        light = len(rows) <= LIGHT_STEP_SESSIONS
        if ahead or on_device:
            kept, host = self._on_device(run, len(rows), lambda exe: exe.run_on_device(
                inputs, 0, on_device, extent=run.extent, light=light, host=spec.last or not ahead))
            return host, kept
        return self._on_device(run, len(rows), lambda exe: exe.run_async(
            inputs, 0, extent=run.extent, light=light)), None

    def _on_device(self, run: Prepared, rows: int, call: Callable[[Executable[Any]], R]) -> R:
        """`call` on `run`'s executable with the KV pools swapped in (engine thread), in the run's span."""
        if self._take_fault("device"):
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        with telemetry.span("stage.run", tokens=run.tokens, seqs=run.seqs, blocks=run.blocks, rows=rows):
            return self._with_pools(run.exe, call)

    def _forget_step(self, step_id: int) -> None:
        """Drops what was pushed for `step_id` and not taken (under the lock): a run that failed part-way."""
        for key in [k for k in self._mailbox if k[0] == step_id]:
            del self._mailbox[key]

    def accept_boundary(self, incarnation: int, boundary: Boundary) -> None:
        """Validates a pushed bundle against its route before accepting it: the route is the plan's and ends here,
        the sender's schema identity is this rank's, and every value has a role of the schema with its dtype and
        fixed sizes (the sizes fixed per step are checked when the step consumes it). A bad bundle poisons: it
        breaks the contract."""
        with self._lock:
            self.authority.check(incarnation)
            cause = self._breach(boundary)
            if cause:
                self._poison(incarnation, f"CONTRACT: {cause}")
                raise InvalidArgument(cause, "SCHEMA_MISMATCH", {METADATA_KEY: ErrorClass.CONTRACT})
            if boundary.step_id in self._aborted:
                return  # a late push for a step already rolled back
            self._mailbox[(boundary.step_id, boundary.iteration, boundary.route_id)] = boundary
            step = self._in_flight.get(boundary.step_id)
            if step is not None and step.waiting_since is not None and step.iteration == boundary.iteration:
                self._next_input(step)

    def _breach(self, boundary: Boundary) -> str:
        """Why `boundary` cannot be a bundle of its route to this rank, or ""."""
        assert self.plan is not None
        routes = self.plan.routes
        if not 0 <= boundary.route_id < len(routes) or routes[boundary.route_id].destination_rank != self.rank:
            return f"route {boundary.route_id} does not lead to rank {self.rank}"
        schema = routes[boundary.route_id].schema
        if boundary.schema_identity != schema.identity:
            return (f"route {boundary.route_id} bundle has schema {boundary.schema_identity!r}, this rank's is "
                    f"{schema.identity!r}")
        if not boundary.values:
            return f"route {boundary.route_id} bundle holds no tensors"
        why = schema.admits(boundary.values)
        return f"route {boundary.route_id} bundle: {why}" if why else ""

    def abort_step(self, incarnation: int, step_id: int, rows: list[StepRow]) -> None:
        """Rolls back every row of a step and wakes a wait for its boundary; allowed under poison."""
        with self._lock:
            if incarnation != self.authority.incarnation:
                self.authority.check(incarnation)
            self._aborted.add(step_id)
            self._forget_step(step_id)
            step = self._in_flight.get(step_id)
            if step is not None:
                self._fail(step, ProtocolError(ErrorClass.ARCH, FailedPrecondition(
                    f"step {step_id} was aborted", "EPOCH_ABORTED")))
        for row in rows:
            self.abort(incarnation, row.session_id, row.epoch, row.commit_epoch, row.commit_length)

    def fence(self, incarnation: int, reason: str, terminal: bool) -> None:
        with self._lock:
            self._poison(incarnation, reason or "fenced by the coordinator", terminal)
            self._lock.notify_all()

    def inject_fault(self, kind: str, count: int) -> None:
        if not self.faults_enabled:
            raise FailedPrecondition("fault injection is off; start the executor with --enable-fault-injection",
                                     "FAULT_INJECTION_DISABLED")
        if count < 1 or kind not in ("arch", "corrupt", "device"):
            raise InvalidArgument(f"bad fault {kind!r} x {count}", "BAD_FAULT")
        with self._lock:
            self._faults[kind] = self._faults.get(kind, 0) + count

    def _take_fault(self, kind: str) -> bool:
        if not self._faults.get(kind):
            return False
        with self._lock:
            if self._faults.get(kind, 0) <= 0:
                return False
            self._faults[kind] -= 1
            return True

    def sessions(self) -> list[tuple[str, StageSession]]:
        with self._lock:
            return list(self._sessions.items())


def _own_steps(rows: list[StepRow], decode_steps: int) -> list[StepRow]:
    """The rows, each with its own share of the run (StepRow.steps: 0 becomes all `decode_steps` of it); a row whose
    share is unset is copied, not changed: its caller's rows stay theirs."""
    if all(r.steps for r in rows):
        return rows
    return [r if r.steps else copied(r, steps=decode_steps) for r in rows]


def _positions(row: StepRow) -> list[StepRow]:
    """A prediction-target row as the single-token rows of its positions, a guided one's sampled positions each
    with its own mask (the grammar's after the proposals before it); any other row as itself."""
    if not row.proposed:
        return [row]
    first = len(row.token_ids) - row.proposed - 1  # the first sampled position: after the last real token
    size = len(row.allowed_tokens) // (row.proposed + 1)
    return [StepRow(row.session_id, row.epoch, row.commit_epoch, row.start + i, [t], row.sampling,
                    allowed_tokens=row.allowed_tokens[(i - first) * size:(i - first + 1) * size] if i >= first else b"")
            for i, t in enumerate(row.token_ids)]


def _verify(rows: list[StepRow], result: StepResult) -> None:
    """The prediction-only operation on the owner rank: regroups the samples of each row's positions and keeps a
    prediction-target row's proposals while each equals the sample drawn before it. Greedy, that is the target's
    argmax; sampled, the proposal is accepted with the target's probability of it and otherwise the sample is a
    draw from the rest of the distribution: speculative sampling's rule for a deterministic proposer, and the
    very token plain decoding would have drawn there with the same seed."""
    samples = iter(result.tokens)
    logprobs = iter(result.logprobs or [None] * len(result.tokens))
    tokens: list[int] = []
    runs: list[list[int]] = []
    accepted: list[int] = []
    kept_logprobs: list[RowLogprobs | None] = []  # a prediction target asks for none (_check_rows)
    for row in rows:
        if not row.proposed:
            tokens.append(next(samples))
            kept_logprobs.append(next(logprobs))
            runs.append([])
            accepted.append(0)
            continue
        drawn = [next(samples) for _ in row.token_ids]
        kept_logprobs.append(None)
        for _ in row.token_ids:
            next(logprobs)
        base = len(row.token_ids) - row.proposed  # drawn[base - 1] follows the last real token
        a = 0
        while a < row.proposed and drawn[base - 1 + a] == row.token_ids[base + a]:
            a += 1
        kept = drawn[base - 1: base + a]
        tokens.append(kept[0])
        runs.append(kept)
        accepted.append(a)
    result.tokens, result.run_tokens, result.accepted = tokens, runs, accepted
    if result.logprobs:
        result.logprobs = kept_logprobs



