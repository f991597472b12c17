"""The draft model of speculative decoding (--speculative draft:MODEL): a smaller model of the target's tokenizer,
run as a one-stage plan of its own through the stage protocol; its greedy tokens are a session's proposals.

Placement: one stage holding the whole draft, on its own executor (--draft-executor), not a group of the target's
plan on one of the target's ranks. Why: an executor runs one stage per incarnation (StageRuntime) and an Install
replaces it; a draft beside a target stage would need a second runtime and a namespace on every StageService call.
A one-rank Mesh over its own executor reuses the protocol unchanged: incarnations and fencing, epochs with folded
commits, commit_length rollback, the health watch and recovery.

Each target session has a draft session ("draft/" + its id, and a generation after a reset) whose KV holds the
tokens the draft has seen. A pass with k proposals runs two batched greedy steps over every speculating session of
the target's step at once: the first rolls each draft session back to the longest prefix the target's tokens
agree with (the folded commit's commit_length), feeds it the tokens it has not seen (the accepted ones and the
target's correction) and samples proposal 1; the second is a decode run of k - 1 tokens, the draft executor feeding
each sample back (no call from here per token). Proposals are guesses the target verifies exactly, so nothing the
draft does (fail, lag, restart from nothing) changes a token: a failed draft step drops the draft sessions it held,
a lost draft executor is recovered in the background, and meanwhile the scheduler falls back to prompt lookup.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client import Counter

from graphmesh import security
from graphmesh.errors import GraphmeshError
from graphmesh.models.config import ModelConfig
from graphmesh.protocol import Action
from graphmesh.v1 import stage_pb2
from graphmesh_coordinator.pipeline import InvocationFailed, Mesh, wait_for_executors
from graphmesh_coordinator.state import DurableState

log = logging.getLogger("graphmesh.coordinator.draft")

DRAFT_STEPS = Counter("graphmesh_speculative_draft_steps", "Batched greedy steps of the draft model, every "
                      "speculating session together (two a pass: the first proposal, then a decode run of the rest)")
DRAFT_FAILURES = Counter("graphmesh_speculative_draft_failures", "Draft steps that failed (their sessions fell back "
                         "to prompt lookup until the draft was recomputed)")
GREEDY = stage_pb2.SamplingParams()  # temperature 0: the draft's argmax, deterministic
RECOVER_DEADLINE_S = 30.0  # one attempt to rebuild a lost draft executor's stage; retried until closed


@dataclass
class _Session:
    id: str  # the draft session's id on the draft executor
    incarnation: int
    tokens: list[int] = field(default_factory=list)  # what its KV holds once its newest epoch commits (folded)
    epoch: int = 0  # the newest epoch issued
    delivered: int = 0  # the newest epoch that completed: committed by the next row's fold


class Drafter:
    """Greedy proposals of the draft model for many sessions at once. Called by one scheduling pass at a time."""

    def __init__(self, model: str, config: ModelConfig, address: str, state_dir: str, weights: str = "f32",
                 rpc_timeout_s: float = 10.0, max_context_tokens: int = 0, dtype: str = "",
                 tls: security.Tls | None = None, health_window_s: float = 1.0) -> None:
        self.model, self.address, self.health_window_s = model, address, health_window_s
        self.context = max_context_tokens or config.max_position
        # Its own state dir: the draft's incarnations and decisions are another mesh's
        self.mesh = Mesh(model, config, [address], DurableState(state_dir), None, weights, rpc_timeout_s,
                         max_context_tokens=max_context_tokens, dtype=dtype, tls=tls)
        self._sessions: dict[str, _Session] = {}
        self._generation = 0  # a reset session's next draft id is new: none of its old epochs can be confused
        self._lock = threading.Lock()
        self._recovering = False
        self._closed = threading.Event()
        self._releases = ThreadPoolExecutor(2, thread_name_prefix="draft-release")

    # -- life ----------------------------------------------------------------------------------------------------
    def start(self, wait_s: float = 60.0) -> None:
        """Installs the draft stage; when its executor does not answer yet, keeps trying in the background (the
        mesh serves meanwhile, speculating by prompt lookup)."""
        try:
            wait_for_executors([self.address], wait_s, self.mesh.tls)
            self.mesh.install()
        except GraphmeshError as e:
            log.warning("draft model not installed yet; retrying in the background", extra={"error": e.message})
            self._recover(0)
        else:
            log.info("draft model installed", extra={"model": self.model, "address": self.address,
                                                     "incarnation": self.mesh.incarnation})
        self.mesh.watch(window_s=self.health_window_s)

    @property
    def ready(self) -> bool:
        return self.mesh.ready

    def close(self) -> None:
        self._closed.set()
        self._releases.shutdown(wait=False, cancel_futures=True)
        self.mesh.close()

    def _recover(self, incarnation: int) -> None:
        """Rebuilds the draft stage in the background, as long as it takes."""
        with self._lock:
            if self._recovering:
                return
            self._recovering = True

        def run() -> None:
            try:
                while not self._closed.is_set():
                    try:
                        if incarnation:
                            self.mesh.recover(incarnation, deadline_s=RECOVER_DEADLINE_S)
                        else:
                            wait_for_executors([self.address], RECOVER_DEADLINE_S, self.mesh.tls)
                            self.mesh.install()
                        log.warning("draft model back", extra={"incarnation": self.mesh.incarnation})
                        return
                    except GraphmeshError as e:
                        log.warning("draft model still lost", extra={"error": e.message})
                        self._closed.wait(1.0)
            finally:
                with self._lock:
                    self._recovering = False
        threading.Thread(target=run, name="draft-recover", daemon=True).start()

    # -- sessions -------------------------------------------------------------------------------------------------
    def forget(self, session_id: str) -> None:
        """The target session ended: its draft session is released (off the caller's thread)."""
        with self._lock:
            ds = self._sessions.pop(session_id, None)
        if ds is not None and ds.incarnation == self.mesh.incarnation and not self._closed.is_set():
            self._releases.submit(self.mesh.release, ds.id)

    def _session(self, session_id: str, incarnation: int) -> _Session:
        with self._lock:
            ds = self._sessions.get(session_id)
            if ds is None or ds.incarnation != incarnation:  # new, or its KV went with an older draft roster
                self._generation += 1
                ds = self._sessions[session_id] = _Session(f"draft/{session_id}/{self._generation}", incarnation)
            return ds

    def _drop(self, sessions: Sequence[tuple[str, _Session]]) -> None:
        """After a failed draft step: these start from nothing at their next pass, under new ids (the old ones'
        epochs may be undecided on the executor: released, never asked about again)."""
        for session_id, ds in sessions:
            with self._lock:
                if self._sessions.get(session_id) is ds:
                    del self._sessions[session_id]
            if not self._closed.is_set():
                self._releases.submit(self.mesh.release, ds.id)

    # -- proposals ------------------------------------------------------------------------------------------------
    def propose(self, batch: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        """Up to k greedy draft tokens after each session's tokens (its committed history and its last token), by
        session id, in two batched steps for the whole batch: one that feeds each draft session what it has not seen
        and samples proposal 1, then a decode run for the rest (the draft executor feeds each sample back, with no
        round trip here per token). A session asking fewer than the longest k is fed the extra tokens too and keeps
        its k: the next pass rolls its draft back to what the target agreed with anyway. {} for every session
        while the draft is not installed."""
        mesh = self.mesh
        if not mesh.ready or not batch:
            return {}
        incarnation = mesh.incarnation
        longest = max(k for _, _, k in batch)
        work: list[tuple[str, _Session, int]] = []
        first: list[stage_pb2.StepRow] = []
        for session_id, tokens, k in batch:
            if k <= 0 or not tokens or len(tokens) + longest > self.context:
                continue  # past the draft's context: no proposals (the target decodes plainly)
            ds = self._session(session_id, incarnation)
            agree = 0
            for a, b in zip(ds.tokens, tokens[:-1]):  # at least the last token is fed: its sample is proposal 1
                if a != b:
                    break
                agree += 1
            ds.epoch += 1
            row = stage_pb2.StepRow(session_id=ds.id, epoch=ds.epoch, commit_epoch=ds.delivered, start_position=agree,
                                    token_ids=list(tokens[agree:]), sampling=GREEDY)
            if ds.delivered:
                row.commit_length = agree  # the rows past what the target accepted are the draft's no more
            work.append((session_id, ds, k))
            first.append(row)
        out: dict[str, list[int]] = {session_id: [] for session_id, _, _ in work}
        if not self._draft_step(work, first, 1, out, incarnation):
            return {}
        more = [(session_id, ds, k) for session_id, ds, k in work if k > 1]
        if more:
            steps = max(k for _, _, k in more) - 1
            rows = []
            for session_id, ds, _ in more:
                ds.epoch += 1
                rows.append(stage_pb2.StepRow(session_id=ds.id, epoch=ds.epoch, commit_epoch=ds.delivered,
                                              start_position=len(ds.tokens), token_ids=[out[session_id][-1]],
                                              sampling=GREEDY))
            self._draft_step(more, rows, steps, out, incarnation)
        return {session_id: out[session_id][:k] for session_id, _, k in work if out[session_id]}

    def _draft_step(self, work: Sequence[tuple[str, _Session, int]], rows: list[stage_pb2.StepRow], steps: int,
                    out: dict[str, list[int]], incarnation: int) -> bool:
        """One batched greedy step (a decode run of `steps` tokens a row when more than 1): each session's samples
        appended to `out`, what its KV now holds to its tokens. False when it failed (its sessions start over)."""
        active = [(session_id, ds) for session_id, ds, _ in work]
        try:
            reply = self.mesh.execute_step(rows, stage_pb2.OUTPUT_KIND_TOKEN, incarnation, steps)
        except InvocationFailed as failure:
            self._failed(active, incarnation, failure.action is Action.FENCE, failure.cause.message)
            return False
        except GraphmeshError as e:  # not a protocol failure: these sessions start over, the others go on
            self._failed(active, incarnation, False, e.message)
            return False
        DRAFT_STEPS.inc()
        for (session_id, ds), row, result in zip(active, rows, reply.rows):
            sampled = [int(t) for t in result.tokens] or [int(result.token)]  # a decode run's, or the one
            # fed: the row's tokens, then each sample but the last (a decode run feeds them back)
            ds.tokens = ds.tokens[:row.start_position] + list(row.token_ids) + sampled[:-1]
            ds.delivered = row.epoch
            out[session_id] += sampled
        return True

    def _failed(self, active: Sequence[tuple[str, _Session]], incarnation: int, fenced: bool, why: str) -> None:
        DRAFT_FAILURES.inc()
        log.warning("draft step failed; its sessions fall back to prompt lookup", extra={
            "sessions": len(active), "error": why, "fenced": fenced})
        if fenced:
            self._recover(incarnation)  # every draft session goes with the roster (a new incarnation holds none)
        else:
            self._drop(active)
