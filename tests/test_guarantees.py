"""Tests that fail when one of the README's guarantees breaks, written against mutations of the code that every
other test let through (issue 36). Each test's docstring names the guarantee and the mutation it catches.

The mesh tests run two executors in this process (build_server: real gRPC on loopback, real boundary links), so a
test can look at what a rank holds at the moment its ExecuteStep arrives."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from graphmesh import plan as dag
from graphmesh import tensors
from graphmesh.errors import GraphmeshError
from graphmesh.models.config import ModelConfig
from graphmesh.v1 import stage_pb2, stage_pb2_grpc
from graphmesh_coordinator.pipeline import InvocationFailed, Mesh
from graphmesh_coordinator.scheduler import MAX_ARCH_RETRIES
from graphmesh_coordinator.state import Decision, DurableState
from graphmesh_executor import stage_inputs
from graphmesh_executor.executable import RngOptions
from graphmesh_executor.logprobs import RowSampling, sample_with_logprobs
from graphmesh_executor.server import ExecutorConfig, build_server
from graphmesh_executor.stage_servicer import BoundaryPusher, StageServicer
from graphmesh_executor.stage_types import Boundary
from tests.model_fixtures import tiny_llama_config
from tests.test_scheduler import FakeMesh, FakeRank, run, solo

PROMPT = [5, 17, 42, 99, 7, 3]
TOKEN = stage_pb2.OUTPUT_KIND_TOKEN
LOGITS = stage_pb2.OUTPUT_KIND_LOGITS
HIDDEN = 64  # make_tiny_llama's


def _fd(fd: int | object) -> int:
    return fd if isinstance(fd, int) else int(fd.fileno())  # type: ignore[attr-defined]


# -- the decision log's fsync ----------------------------------------------------------------------------

def test_record_fsyncs_the_log_holding_the_decisions_before_it_returns(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Guarantee: a commit decision is durable (written and fsynced) before record() returns, so before the step
    that folds it is sent. Catches: os.fsync removed from DurableState.record (its counter `fsyncs` rises either
    way), an fsync of another file, or an fsync before the line is written and flushed."""
    state = DurableState(tmp_path)
    log_path = (tmp_path / "decisions.jsonl").resolve()
    real_fsync = os.fsync
    returned = threading.Event()
    synced: list[tuple[Path, bytes, bool]] = []  # (file, its bytes when fsync was called, record() had returned)

    def fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{_fd(fd)}"))
        synced.append((path, path.read_bytes() if path.is_file() else b"", returned.is_set()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    state.record(Decision("a", 3, "COMMITTED"), Decision("b", 5, "COMMITTED"))
    returned.set()
    of_log = [(data, late) for path, data, late in synced if path == log_path]
    assert of_log, f"record() never fsynced {log_path}: {[p for p, _, _ in synced]}"
    data, late = of_log[0]
    assert not late
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert {"session_id": "a", "epoch": 3, "outcome": "COMMITTED"} in lines
    assert {"session_id": "b", "epoch": 5, "outcome": "COMMITTED"} in lines
    state.close()


def test_an_incarnation_is_fsynced_with_its_directory_before_it_is_issued(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Guarantee: an incarnation is persisted with fsync before it is used, so a restarted coordinator never issues
    it twice: the file holding the new number is fsynced, renamed over incarnation.json, and the directory fsynced
    (the rename durable), all before next_incarnation() returns. Catches: the file's fsync removed from
    _fsync_write, next_incarnation writing with fsync=False, or the directory's fsync dropped."""
    state = DurableState(tmp_path)
    real_fsync, real_replace = os.fsync, os.replace
    returned = threading.Event()
    events: list[tuple[str, Path, bytes, bool]] = []  # (fsync | replace, path, a file's bytes, returned already)

    def fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{_fd(fd)}"))
        events.append(("fsync", path, path.read_bytes() if path.is_file() else b"", returned.is_set()))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        real_replace(src, dst)
        events.append(("replace", Path(dst).resolve(), b"", returned.is_set()))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    for issued in (1, 2):
        events.clear()
        returned.clear()
        assert state.next_incarnation() == issued
        returned.set()
        target = (tmp_path / "incarnation.json").resolve()
        kinds = [(kind, path) for kind, path, _, _ in events]
        assert ("replace", target) in kinds, kinds
        renamed = kinds.index(("replace", target))
        synced_file = [data for kind, path, data, _ in events[:renamed] if kind == "fsync" and path.is_relative_to(
            tmp_path.resolve())]
        assert any(json.loads(data or b"{}").get("incarnation") == issued for data in synced_file), events
        assert ("fsync", tmp_path.resolve()) in kinds[renamed:], f"the directory was not fsynced after the rename: {kinds}"
        assert not any(late for _, _, _, late in events)
    state.close()
    assert DurableState(tmp_path).incarnation == 2


def test_a_decision_appended_after_a_torn_line_survives_the_next_restart(tmp_path: Path) -> None:
    """Guarantee: a commit fsynced to the decision log is read back after any restart. A crash can leave the last
    line without its newline (all of its JSON written, the newline not): that line was never acknowledged, and it
    must be cut away at start, or the next decision is appended onto it and the line they make is unreadable, losing
    that fsynced commit at the following restart. Catches: the newline check removed from DurableState's reader
    (the other torn-line test tears inside the JSON, which the JSON parser alone refuses)."""
    state = DurableState(tmp_path)
    state.record(Decision("a", 1, "COMMITTED"))
    state.close()
    with open(tmp_path / "decisions.jsonl", "a") as f:
        f.write(json.dumps({"session_id": "b", "epoch": 1, "outcome": "COMMITTED"}))  # the crash: no newline
    again = DurableState(tmp_path)
    assert again.outcome("a", 1) == "COMMITTED"
    again.record(Decision("c", 4, "COMMITTED"))
    again.close()
    last = DurableState(tmp_path)
    assert last.outcome("a", 1) == "COMMITTED" and last.outcome("c", 4) == "COMMITTED"
    last.close()


# -- a mesh of two in-process executors ------------------------------------------------------------------

@dataclass
class Probe:
    """Runs `hook` on every ExecuteStep a rank receives, before the rank handles it."""

    hook: Callable[[stage_pb2.ExecuteStepRequest], None] | None = None


@dataclass
class Cluster:
    config: ModelConfig
    addresses: list[str]
    state_dir: Path  # every test's coordinator keeps its state here: the executors outlive them, incarnations grow
    probe: Probe = field(default_factory=Probe)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("guarantees")
    config = tiny_llama_config(tmp / "models" / "tiny-llama")
    probe = Probe()
    handle = StageServicer.ExecuteStep

    def execute_step(self: StageServicer, request: stage_pb2.ExecuteStepRequest,
                     context: grpc.ServicerContext) -> stage_pb2.ExecuteStepResponse:
        hook = probe.hook
        if hook is not None:
            hook(request)
        return handle(self, request, context)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StageServicer, "ExecuteStep", execute_step)  # before the servers bind their handlers
        servers = [build_server(ExecutorConfig(listen="127.0.0.1:0", model_root=tmp / "models", standby_weights=False,
                                               kv_cache_bytes=16 << 20)) for _ in range(2)]
    try:
        yield Cluster(config, [f"127.0.0.1:{port}" for _, port, _ in servers], tmp / "state", probe)
    finally:
        for server, _, _ in servers:
            server.stop(None).wait()


def _mesh(cluster: Cluster) -> Mesh:
    mesh = Mesh("tiny-llama", cluster.config, cluster.addresses, DurableState(cluster.state_dir))
    mesh.install()
    return mesh


def _row(session: str, epoch: int, commit: int, start: int, tokens: list[int],
         sampling: stage_pb2.SamplingParams) -> stage_pb2.StepRow:
    return stage_pb2.StepRow(session_id=session, epoch=epoch, commit_epoch=commit, start_position=start,
                             token_ids=tokens, sampling=sampling)


def test_a_folded_commit_is_durable_in_the_log_before_any_rank_receives_its_step(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guarantee (write-ahead, presumed abort): a commit is fsynced to the decision log before the step that folds it
    is sent, so an epoch the log does not hold committed was committed nowhere. Checked by each rank the moment its
    ExecuteStep arrives, through Mesh.execute_step's own write (not one written by hand): the log file read back
    from disk holds the folded commit, and an fsync of that file covering it has returned. Catches: the record
    moved after the step is sent to the ranks, or deleted. (The fsync of the log is held up a little, so a record
    made after the sends is still unsynced when a rank receives the step, whatever the machine's load.)"""
    mesh = _mesh(cluster)
    log_path = cluster.state_dir / "decisions.jsonl"
    real_fsync = os.fsync
    synced: list[tuple[int, int]] = []  # (inode, size) of each file whose fsync returned

    def fsync(fd: int) -> None:
        n = _fd(fd)
        stat = os.fstat(n)
        if os.readlink(f"/proc/self/fd/{n}").endswith("decisions.jsonl"):
            time.sleep(0.2)
        real_fsync(fd)
        synced.append((stat.st_ino, stat.st_size))

    checked: list[tuple[str, int, bool, bool]] = []  # (session, folded epoch, in the file, fsynced)

    def on_arrival(request: stage_pb2.ExecuteStepRequest) -> None:
        data, inode = log_path.read_bytes(), os.stat(log_path).st_ino
        ends: dict[tuple[str, int], int] = {}  # a committed decision's line -> where it ends in the file
        offset = 0
        for line in data.splitlines(keepends=True):
            offset += len(line)
            record = json.loads(line)
            if record["outcome"] == "COMMITTED":
                ends[(record["session_id"], int(record["epoch"]))] = offset
        for row in request.rows:
            if row.commit_epoch:
                end = ends.get((row.session_id, row.commit_epoch))
                durable = end is not None and any(i == inode and size >= end for i, size in synced)
                checked.append((row.session_id, row.commit_epoch, end is not None, durable))

    monkeypatch.setattr(os, "fsync", fsync)
    cluster.probe.hook = on_arrival
    try:
        k = mesh.incarnation
        greedy = stage_pb2.SamplingParams()
        first = mesh.execute_step([_row("a", 1, 0, 0, PROMPT, greedy), _row("b", 1, 0, 0, PROMPT[:3], greedy)],
                                  TOKEN, k)
        a, b = (r.token for r in first.rows)
        second = mesh.execute_step([_row("a", 2, 1, len(PROMPT), [a], greedy),
                                    _row("b", 2, 1, 3, [b], greedy)], TOKEN, k)
        a, b = (r.token for r in second.rows)
        mesh.execute_step([_row("a", 3, 2, len(PROMPT) + 1, [a], greedy),  # a decode run folds them too
                           _row("b", 3, 2, 4, [b], greedy)], TOKEN, k, decode_steps=3)
    finally:
        cluster.probe.hook = None
        mesh.close()
        mesh.state.close()
    folded = {("a", 1), ("b", 1), ("a", 2), ("b", 2)}
    assert {(s, e) for s, e, _, _ in checked} == folded and len(checked) == 2 * len(folded), checked
    missing = [(s, e) for s, e, in_file, _ in checked if not in_file]
    assert not missing, f"a rank received a step folding commits its coordinator had not logged: {missing}"
    unsynced = [(s, e) for s, e, _, durable in checked if not durable]
    assert not unsynced, f"a rank received a step folding commits not yet fsynced: {unsynced}"


def _push(pusher: BoundaryPusher, address: str, incarnation: int, route: dag.Route,
          activation: np.ndarray) -> Exception | None:
    """Pushes one bundle of `route` carrying `activation` to `address`, as a previous stage does: its error or None."""
    done: Future[Exception | None] = Future()
    pusher(address, incarnation, Boundary(10**6, 0, route.id, {dag.ACTIVATION: activation}, route.schema.identity),
           10.0, done.set_result)
    return done.result(timeout=30)


def _assert_refused_as_contract(error: Exception | None, stub: stage_pb2_grpc.StageServiceStub, says: str) -> None:
    """`error` is the SCHEMA_MISMATCH of a CONTRACT breach that names what was wrong (`says`), and the receiving
    rank (`stub`) poisoned its incarnation."""
    assert isinstance(error, GraphmeshError), error
    assert (error.reason, error.metadata.get("error_class")) == ("SCHEMA_MISMATCH", "CONTRACT"), error
    assert says in error.message
    status = stub.Status(stage_pb2.StageServiceStatusRequest(), timeout=10)
    assert status.state == stage_pb2.AUTHORITY_STATE_POISONED


def test_a_boundary_bundle_of_the_wrong_dtype_is_refused_on_arrival_over_a_link(cluster: Cluster) -> None:
    """Guarantee: the receiver checks every role's dtype of an arriving bundle against the route's schema (CONTRACT:
    the incarnation is poisoned), before any step consumes it. Pushed to a live rank over the real boundary link
    (BoundaryPusher, as a previous stage pushes), for a step that never comes, so only the arrival check can refuse
    it. Catches: the dtype comparison removed from BoundarySchema.admits (the consumer's check() still has one, so
    every mesh test kept passing)."""
    mesh = _mesh(cluster)
    pusher = BoundaryPusher()
    try:
        assert mesh.plan is not None
        route = mesh.plan.routes[0]
        receiver = mesh.ranks[route.destination_rank]
        good = _push(pusher, receiver.plan.address, mesh.incarnation, route, np.zeros((2, HIDDEN), np.float32))
        assert good is None  # the schema's dtype: taken (into the mailbox)
        assert receiver.plan.address in pusher._links  # over the link, not gRPC
        error = _push(pusher, receiver.plan.address, mesh.incarnation, route, np.zeros((2, HIDDEN), np.float64))
        _assert_refused_as_contract(error, receiver.stub, "float64")
    finally:
        mesh.close()
        mesh.state.close()


def test_a_boundary_bundle_on_a_route_that_does_not_lead_to_the_rank_is_refused_on_arrival(cluster: Cluster) -> None:
    """Guarantee: the receiver checks the route of an arriving bundle (the plan's, and ending at this rank) before
    anything else (CONTRACT: poisoned). Route 0's bundle, with route 0's own schema identity and a good activation,
    pushed over a link to rank 0, where route 0 does not lead. Catches: the destination check removed from the
    stage's _breach (the identity and admits() checks pass such a bundle)."""
    mesh = _mesh(cluster)
    pusher = BoundaryPusher()
    try:
        assert mesh.plan is not None
        route = mesh.plan.routes[0]
        wrong = next(r for r in mesh.ranks if r.plan.rank != route.destination_rank)
        error = _push(pusher, wrong.plan.address, mesh.incarnation, route, np.zeros((2, HIDDEN), np.float32))
        _assert_refused_as_contract(error, wrong.stub, "does not lead to rank")
    finally:
        mesh.close()
        mesh.state.close()


def test_each_sampled_token_is_drawn_with_the_seed_of_its_own_position(cluster: Cluster) -> None:
    """Guarantee: sampling is seeded per session and position (stage.seed_for), so a replay draws the same tokens
    and no two positions of a session share a draw. End to end through the mesh: every token a sampled stream gets
    (a prompt step, single decode steps, a decode run, and a row sampled on the host for its logprobs) is the one
    the row's logits give with seed_for(seed, its position), and the stream differs from the one a position-free
    seed would give. Catches: the position dropped from seed_for, or a call site passing another position (a
    decode run's start for all of its tokens)."""
    assert len({stage_inputs.seed_for(7, p) for p in range(256)}) == 256
    mesh = _mesh(cluster)
    try:
        k = mesh.incarnation
        sampled = stage_pb2.SamplingParams(temperature=1.5, seed=7)
        with_logprobs = stage_pb2.SamplingParams(temperature=1.5, seed=7, logprobs=True)
        tokens = list(PROMPT)
        reply = mesh.execute_step([_row("s", 1, 0, 0, tokens, sampled)], TOKEN, k)
        tokens.append(reply.rows[0].token)
        epoch = 2
        for _ in range(2):  # decode steps of one token
            reply = mesh.execute_step([_row("s", epoch, epoch - 1, len(tokens) - 1, tokens[-1:], sampled)], TOKEN, k)
            tokens.append(reply.rows[0].token)
            epoch += 1
        reply = mesh.execute_step([_row("s", epoch, epoch - 1, len(tokens) - 1, tokens[-1:], sampled)], TOKEN, k,
                                  decode_steps=4)
        tokens.extend(reply.rows[0].tokens)
        epoch += 1
        reply = mesh.execute_step([_row("s", epoch, epoch - 1, len(tokens) - 1, tokens[-1:], with_logprobs)], TOKEN, k)
        tokens.append(reply.rows[0].token)
        stream = tokens[len(PROMPT):]
        assert len(stream) == 8, stream

        # Each position's logits, from prompts that end just before it (fresh sessions: greedy, nothing sampled)
        positions = range(len(PROMPT), len(tokens))
        rows = [_row(f"ref{p}", 1, 0, 0, tokens[:p], stage_pb2.SamplingParams()) for p in positions]
        logits = tensors.from_proto(mesh.execute_step(rows, LOGITS, k).logits)
    finally:
        mesh.close()
        mesh.state.close()

    def drawn(seed_of: Callable[[int], int]) -> list[int]:
        return [sample_with_logprobs(RngOptions(), logits[i:i + 1],
                                     [RowSampling(1.5, 0, 1.0, seed_of(p), False, 0)])[0][0]
                for i, p in enumerate(positions)]

    assert stream == drawn(lambda p: stage_inputs.seed_for(7, p))
    assert stream != drawn(lambda p: stage_inputs.seed_for(7, len(PROMPT)))  # one seed for every position


def test_a_rank_undecided_about_a_logged_commit_is_told_committed(cluster: Cluster) -> None:
    """Guarantee (INDETERMINATE resolution): a rank that ran an epoch but never learned its decision refuses the
    session until the coordinator sends the outcome its decision log holds; an epoch the log holds committed is
    committed there, its rows kept. Through Mesh.execute_step's own resolution (_resolve): both ranks hold epoch 1
    voted, the log holds it committed (its folding step was lost on the way to every rank), and a row that does not
    fold it arrives. Catches: _resolve sending ABORTED (or anything but the log's outcome); the other tests only
    resolve epochs the log holds aborted this way."""
    mesh = _mesh(cluster)
    try:
        k = mesh.incarnation
        greedy = stage_pb2.SamplingParams()
        mesh.execute_step([_row("s", 1, 0, 0, PROMPT, greedy)], TOKEN, k)
        mesh.state.record(Decision("s", 1, "COMMITTED"))  # the write-ahead of the step that was lost
        with pytest.raises(InvocationFailed) as failed:
            mesh.execute_step([_row("s", 2, 0, 0, PROMPT, greedy)], TOKEN, k)
        assert failed.value.error_class == "INDETERMINATE"
        for rank in mesh.ranks:
            status = next(s for s in rank.stub.Status(stage_pb2.StageServiceStatusRequest(), timeout=10).sessions
                          if s.session_id == "s")
            assert (status.phase, status.last_outcome, status.kv_length) == (
                stage_pb2.SESSION_PHASE_IDLE, stage_pb2.EPOCH_OUTCOME_COMMITTED, len(PROMPT))
        assert mesh.incarnation == k
    finally:
        mesh.close()
        mesh.state.close()


def test_a_step_scheduled_for_a_replaced_roster_fails_as_comm_without_reaching_a_rank(cluster: Cluster) -> None:
    """Guarantee (stale incarnations): a step scheduled for an incarnation the mesh no longer runs fails as COMM at
    once, so its sessions are restored and replayed, and no rank is sent it. Catches: the incarnation check removed
    from Mesh.execute_step (the ranks would be sent the stale step)."""
    mesh = _mesh(cluster)
    received: list[int] = []
    cluster.probe.hook = lambda request: received.append(request.incarnation)
    try:
        k = mesh.incarnation
        with pytest.raises(InvocationFailed) as failed:
            mesh.execute_step([_row("s", 1, 0, 0, PROMPT, stage_pb2.SamplingParams())], TOKEN, k - 1)
        assert (failed.value.error_class, failed.value.cause.reason) == ("COMM", "STALE_INCARNATION")
        assert received == []
    finally:
        cluster.probe.hook = None
        mesh.close()
        mesh.state.close()


# -- ARCH failures retry alone ---------------------------------------------------------------------------

MARK = 999  # a prompt starting with it is the bad session's


class OneBadSession(FakeMesh):
    """test_scheduler's simulated mesh, where one session's rows fail ARCH from its first decode on (every rank rolls
    the step back, as for an invalid row), a deterministic failure of that session alone. After a few such failures
    of shared steps it stops failing, so a scheduler that never isolates the row still ends (and the test says why)."""

    GIVE_UP = 4

    def __init__(self) -> None:
        super().__init__(ranks=2, blocks=64)
        self.bad: set[str] = set()
        self.shared_failures = self.solo_failures = 0

    def _begin(self, rank: FakeRank, r: stage_pb2.StepRow, decode_steps: int) -> None:
        if r.start_position == 0 and r.token_ids and r.token_ids[0] == MARK:
            self.bad.add(r.session_id)
        super()._begin(rank, r, decode_steps)

    def _finish(self, ids: list[str]) -> None:
        super()._finish(ids)
        fails = any(s in self.bad and self._ranks[0].kv.get(s, 0) > 0 for s in ids) \
            and self.shared_failures < self.GIVE_UP
        if fails:
            self.shared_failures += len(ids) > 1
            self.solo_failures += len(ids) == 1
        self.arch_every = 1 if fails else 0  # read by execute_step right after this, under the same lock


def test_an_arch_failure_of_a_shared_step_is_retried_alone_and_fails_only_its_own_session() -> None:
    """Guarantee: a deterministic (ARCH) failure rolls every row of the step back on every rank and each of its
    sessions is retried alone, so a bad row fails only its own session; the others keep their solo tokens. Catches:
    the scheduler not marking a failed shared step's sessions solo (the bad row is then retried among the others,
    failing them again and again; test_scheduler's injected ARCH failures are transient, so a shared retry passed)."""
    jobs = [([MARK, 5, 6], 8), ([1, 2, 3], 8), ([7, 8], 8), ([9, 10, 11, 12], 8)]
    mesh = OneBadSession()
    results = run(mesh, jobs, 64)
    assert not mesh.violations, mesh.violations[:3]
    bad, *good = results
    assert isinstance(bad, InvocationFailed) and bad.error_class == "ARCH", bad
    assert good == [solo(p, n) for p, n in jobs[1:]]
    assert mesh.shared_failures <= 1, f"the bad row failed {mesh.shared_failures} shared steps: it was not isolated"
    assert mesh.solo_failures == 1 + MAX_ARCH_RETRIES
