"""Indeterminate commits, against real executor processes on loopback: a rank that never learns how a session's
epoch ended (its abort was lost, or the coordinator went away between deciding and telling it) marks the session
INDETERMINATE and refuses it until the coordinator resolves the epoch from its durable decision log, also when
that coordinator is a restarted one reading the log back from disk; the session's tokens are those of a fault-free
run, and the roster is never rebuilt for it."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from graphmesh.errors import from_rpc_error
from graphmesh.launcher import free_port
from graphmesh.models.config import ModelConfig
from graphmesh.v1 import stage_pb2, stage_pb2_grpc
from graphmesh_coordinator import state as state_module
from graphmesh_coordinator.pipeline import InvocationFailed, Mesh, Rank
from graphmesh_coordinator.scheduler import Scheduler, SessionInfo
from graphmesh_coordinator.scheduler import Sequence as Seq
from graphmesh_coordinator.state import Decision, DurableState
from tests.conftest import executor_args, start_process
from tests.model_fixtures import tiny_llama_config

PROMPT = [5, 17, 42, 99, 7, 3]
SAMPLING = stage_pb2.SamplingParams(temperature=0.8, top_k=40, seed=7)  # seeded per position: a replay draws the same
TOKEN = stage_pb2.OUTPUT_KIND_TOKEN


@dataclass
class Cluster:
    root: Path
    config: ModelConfig
    addresses: list[str]
    state_dir: Path  # every test's coordinator keeps its state here: the executors outlive them, incarnations grow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("indeterminate")
    config = tiny_llama_config(tmp / "models" / "tiny-llama")
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    env = {"OMP_NUM_THREADS": "1"}
    args = ["--model-root", str(tmp / "models"), "--enable-fault-injection"]
    with start_process(executor_args(addresses[0], *args), addresses[0], log_path=tmp / "a.log", env=env), \
         start_process(executor_args(addresses[1], *args), addresses[1], log_path=tmp / "b.log", env=env):
        yield Cluster(tmp / "models", config, addresses, tmp / "state")


def _mesh(cluster: Cluster) -> Mesh:
    return Mesh("tiny-llama", cluster.config, cluster.addresses, DurableState(cluster.state_dir))


def _row(session: str, epoch: int, commit: int, start: int, tokens: list[int]) -> stage_pb2.StepRow:
    return stage_pb2.StepRow(session_id=session, epoch=epoch, commit_epoch=commit, start_position=start,
                             token_ids=tokens, sampling=SAMPLING)


def _session(stub: stage_pb2_grpc.StageServiceStub, session: str) -> stage_pb2.StageSessionStatus:
    return next(s for s in stub.Status(stage_pb2.StageServiceStatusRequest()).sessions if s.session_id == session)


def _generate(scheduler: Scheduler, tokens: list[int], n: int, on_token: threading.Event | None = None) -> list[int]:
    seq = Seq(SessionInfo(uuid.uuid4().hex), list(tokens), SAMPLING, TOKEN, n, max_tokens_total=len(tokens) + n)
    scheduler.submit(seq)
    out: list[int] = []
    try:
        while len(out) < n:
            event = seq.events.get(timeout=60)
            assert not isinstance(event, BaseException), event
            out += event.tokens
            if on_token is not None and len(out) >= 3:
                on_token.set()
    finally:
        scheduler.finish(seq)
        deadline = time.monotonic() + 30
        while seq.busy:  # released on every rank (in the background): a channel closed meanwhile crashes grpc
            assert time.monotonic() < deadline, "the session was never released"
            time.sleep(0.01)
    return out


def test_an_undecided_epoch_is_refused_until_the_coordinator_resolves_it_from_its_log(
        cluster: Cluster) -> None:
    mesh = _mesh(cluster)
    mesh.install()
    try:
        k = mesh.incarnation
        first = mesh.execute_step([_row("s", 1, 0, 0, PROMPT)], TOKEN, k).rows[0].token
        # Epoch 1 ran on both ranks and its token came back: they wait for its decision. A row of a later epoch
        # that does not commit it (as after an abort that never reached them) cannot be answered either way.
        later = stage_pb2.ExecuteStepRequest(incarnation=k, step_id=10_000, output=TOKEN,
                                             rows=[_row("s", 2, 0, 0, PROMPT)])
        for _ in range(2):  # marked by the first refusal, refused again until resolved
            with pytest.raises(grpc.RpcError) as e:
                mesh.ranks[0].stub.ExecuteStep(later, timeout=10)
            refusal = from_rpc_error(e.value)
            assert refusal.reason == "SESSION_INDETERMINATE"
            assert (refusal.metadata["session_id"], refusal.metadata["epoch"]) == ("s", "1")
            status = _session(mesh.ranks[0].stub, "s")
            assert (status.phase, status.epoch, status.kv_length) == (stage_pb2.SESSION_PHASE_INDETERMINATE, 1, 0)
        # Through the coordinator: both ranks refuse, the step is rolled back, and each is sent the log's outcome.
        # Epoch 1 was never committed (the log would hold it: commits are written ahead), so it is aborted.
        assert mesh.state.outcome("s", 1) == "ABORTED"
        with pytest.raises(InvocationFailed) as failed:
            mesh.execute_step([_row("s", 3, 0, 0, PROMPT)], TOKEN, k)
        assert failed.value.error_class == "INDETERMINATE"
        for rank in mesh.ranks:
            status = _session(rank.stub, "s")
            assert (status.phase, status.last_outcome, status.kv_length) == (
                stage_pb2.SESSION_PHASE_IDLE, stage_pb2.EPOCH_OUTCOME_ABORTED, 0)
        # The retried row draws the same token, and nothing was fenced for it.
        assert mesh.execute_step([_row("s", 4, 0, 0, PROMPT)], TOKEN, k).rows[0].token == first
        assert mesh.incarnation == k and mesh.recoveries == 0
        assert all(r.stub.Status(stage_pb2.StageServiceStatusRequest()).state == stage_pb2.AUTHORITY_STATE_ACTIVE
                   for r in mesh.ranks)
    finally:
        mesh.close()


def test_a_lost_abort_is_resolved_without_a_rebuild_and_changes_no_token(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ARCH failure on rank 1 whose AbortStep never reaches rank 0: rank 0 holds the epoch voted, finds the
    retried row undecided, and is resolved; the decision log of the whole run stays a few lines."""
    monkeypatch.setattr(state_module, "COMPACT_MIN_LINES", 8)
    mesh = _mesh(cluster)
    mesh.install()
    # One token a step: in a decode run, a rank whose abort is lost waits for its next iteration's input instead of
    # voting, and fails COMM at the boundary timeout (the roster is rebuilt): the path of a lost abort is this one.
    scheduler = Scheduler(mesh, decode_steps=1)
    try:
        reference = _generate(scheduler, PROMPT, 12)
        k = mesh.incarnation
        lost, resolved = threading.Event(), []
        abort_step, resolve = mesh._abort_step, mesh._resolve

        def abort_losing_rank_0(ranks: list[Rank], step: stage_pb2.ExecuteStepRequest) -> None:
            if not lost.is_set():
                lost.set()
                ranks = ranks[1:]
            abort_step(ranks, step)

        def counted(ranks: list[Rank], incarnation: int, refusal: InvocationFailed) -> None:
            resolved.append(refusal.cause.metadata["epoch"])
            resolve(ranks, incarnation, refusal)

        monkeypatch.setattr(mesh, "_abort_step", abort_losing_rank_0)
        monkeypatch.setattr(mesh, "_resolve", counted)
        started = threading.Event()

        def fault() -> None:
            started.wait(60)
            mesh.ranks[1].stub.InjectFault(stage_pb2.InjectFaultRequest(kind=stage_pb2.FAULT_KIND_ARCH_FAILURE,
                                                                        count=1))
        threading.Thread(target=fault, daemon=True).start()
        assert _generate(scheduler, PROMPT, 12, started) == reference
        assert lost.is_set() and resolved, "the abort was never lost: the test proved nothing"
        assert mesh.incarnation == k and mesh.recoveries == 0
        for _ in range(4):  # more sessions through the real coordinator: the log stays bounded
            assert _generate(scheduler, PROMPT, 12) == reference
        assert mesh.state.log_lines <= 8 + 1
    finally:
        scheduler.close()
        mesh.close()


def test_a_restarted_coordinator_resolves_from_the_log_on_disk_and_the_session_continues(
        cluster: Cluster) -> None:
    """The coordinator decides to commit epoch 2 (logged, fsynced) and dies before any rank hears of it. Its
    successor on the same state dir fences the old incarnation, which leaves epoch 2 INDETERMINATE on both ranks,
    resolves it COMMITTED from the log it read back, and the session resumes token-identically."""
    mesh = _mesh(cluster)
    mesh.install()
    scheduler = Scheduler(mesh)
    try:
        reference = _generate(scheduler, PROMPT, 8)
    finally:
        scheduler.close()
    k = mesh.incarnation
    t1 = mesh.execute_step([_row("s", 1, 0, 0, PROMPT)], TOKEN, k).rows[0].token
    t2 = mesh.execute_step([_row("s", 2, 1, len(PROMPT), [t1])], TOKEN, k).rows[0].token
    assert [t1, t2] == reference[:2]
    mesh.state.record(Decision("s", 2, "COMMITTED"))  # the next step's write-ahead; then the crash, before it is sent
    mesh.close()
    mesh.state.close()

    again = _mesh(cluster)  # the restart: the log is read back from disk
    try:
        assert again.state.incarnation == k and again.state.outcome("s", 2) == "COMMITTED"
        stubs = [stage_pb2_grpc.StageServiceStub(again.channels[a]) for a in cluster.addresses]
        again.fence(k, "coordinator restarted")
        for stub in stubs:
            status = _session(stub, "s")
            assert (status.phase, status.epoch) == (stage_pb2.SESSION_PHASE_INDETERMINATE, 2)
        assert again.resolve_indeterminate(k) == 2
        for stub in stubs:
            status = _session(stub, "s")
            assert (status.phase, status.last_outcome, status.kv_length) == (
                stage_pb2.SESSION_PHASE_IDLE, stage_pb2.EPOCH_OUTCOME_COMMITTED, len(PROMPT) + 1)
        again.install()
        assert again.incarnation == k + 1
        # The client resumes on the new coordinator with the tokens it has: the rest is the fault-free run's.
        scheduler = Scheduler(again)
        try:
            assert _generate(scheduler, [*PROMPT, t1, t2], 6) == reference[2:]
        finally:
            scheduler.close()
    finally:
        again.close()
