"""Coordinators elected through a real 3-member etcd cluster, with real coordinator and executor processes: the
leader dies (kill -9) or is paused past its lease (SIGSTOP) while sessions stream, and clients given both
addresses resume on the new leader without a changed token; a paused leader that wakes is refused everywhere
and steps down; etcd losing a member changes nothing, etcd gone makes the leader step down with UNAVAILABLE."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import Unavailable, from_rpc_error
from graphmesh.launcher import free_port
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from graphmesh_server import faults
from tests import etcd_fixtures
from tests.conftest import executor_args, health_status, start_process
from tests.etcd_fixtures import EtcdCluster
from tests.model_fixtures import make_tiny_llama

PROMPT = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
SESSIONS = 4
TOKENS = 48
CLUSTER = "election-test"
LEASE_TTL = "2"
# Streams that outlast a lease (2 s) with seconds to spare: 200 tokens ran out before the leader stepped down once
# boundaries went over links (the streams finished on the old leader and nothing had to resume).
LONG_TOKENS = 800


etcd = etcd_fixtures.module_cluster(3)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", max_position=1024)  # LONG_TOKENS fit


@pytest.fixture(scope="module")
def executors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two executors shared by the module's coordinators (one cluster: its incarnation only grows)."""
    logs = tmp_path_factory.mktemp("executor-logs")
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    env = {"OMP_NUM_THREADS": "1"}
    with start_process(executor_args(addresses[0], "--kv-cache-bytes", "8Mi"), addresses[0], log_path=logs / "a.log",
                       env=env), \
         start_process(executor_args(addresses[1], "--kv-cache-bytes", "8Mi"), addresses[1], log_path=logs / "b.log",
                       env=env):
        yield addresses


@dataclass
class Coordinator:
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def coordinators(etcd: EtcdCluster, model: Path, executors: list[str], tmp_path: Path) -> Iterator[list[Coordinator]]:
    """Two coordinators of CLUSTER campaigning on etcd; the first is started first, so it usually leads."""
    started: list[Coordinator] = []

    def start(name: str) -> Coordinator:
        address = f"127.0.0.1:{free_port()}"
        log_path = tmp_path / f"{name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "graphmesh_coordinator.server", "--listen", address, "--executors",
                 ",".join(executors), "--model", str(model), "--state-dir", str(tmp_path / f"{name}-state"),
                 "--etcd", ",".join(etcd.urls), "--cluster-name", CLUSTER, "--lease-ttl", LEASE_TTL],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        started.append(Coordinator(address, process, log_path))
        return started[-1]

    try:
        first = start("coordinator-a")
        _wait_serving([first])  # a leader first, so the test knows which one it is
        start("coordinator-b")
        _wait_answering(started[1])
        yield started
    finally:
        for c in started:
            if c.process.poll() is None:
                if _paused(c.process):  # a test that failed while it was paused would leave it stopped
                    faults.thaw(c.process)
                c.process.terminate()
        for c in started:
            try:
                c.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                c.process.kill()
                c.process.wait()


def _paused(process: subprocess.Popen[bytes]) -> bool:
    """Stopped by SIGSTOP. (A SIGCONT sent to a running coordinator just before its SIGTERM can leave the SIGTERM to
    a thread other than the main one, which then never wakes from its wait for the signal.)"""
    stat = Path(f"/proc/{process.pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


def _health(address: str) -> int | None:
    try:
        return health_status(address, timeout=1.0)
    except grpc.RpcError:
        return None


def _wait_serving(candidates: list[Coordinator], timeout_s: float = 60.0) -> Coordinator:
    """The coordinator among `candidates` that reports SERVING: the leader."""
    deadline = time.monotonic() + timeout_s
    while True:
        for c in candidates:
            if c.process.poll() is not None:
                raise RuntimeError(f"{c.address} exited with {c.process.returncode}:\n{c.log()[-3000:]}")
            if _health(c.address) == health_pb2.HealthCheckResponse.SERVING:
                return c
        if time.monotonic() > deadline:
            raise RuntimeError("no coordinator became leader:\n" + "\n".join(c.log()[-2000:] for c in candidates))
        time.sleep(0.1)


def _wait_answering(c: Coordinator, timeout_s: float = 60.0) -> None:
    """Until the standby answers health (NOT_SERVING): it has loaded the config and is campaigning."""
    deadline = time.monotonic() + timeout_s
    while _health(c.address) is None:
        if c.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"standby {c.address} never answered:\n{c.log()[-3000:]}")
        time.sleep(0.1)


def _request(i: int, tokens: int) -> dict[str, Any]:
    """Sessions 0 and 1 greedy, 2 and 3 seeded sampling."""
    sampling: dict[str, Any] = {"temperature": 0.8, "top_k": 50, "seed": 1000 + i} if i >= 2 else {}
    return {"prompt_token_ids": PROMPT[: 6 + i], "max_tokens": tokens, "ignore_eos": True, **sampling}


def _run_all(addresses: list[str], progress: list[int] | None = None,
             tokens: int = TOKENS) -> tuple[list[list[int]], int]:
    """The sessions' tokens through one client per session given every address, and how many streams resumed."""
    resumes = [0] * SESSIONS

    def one(i: int) -> list[int]:
        out: list[int] = []
        with CoordinatorClient(addresses) as client:
            for chunk in client.generate(**_request(i, tokens)):
                out += chunk.token_ids
                if progress is not None:
                    progress[i] = len(out)
            resumes[i] = client.resumes
        return out

    with ThreadPoolExecutor(SESSIONS) as pool:
        results = list(pool.map(one, range(SESSIONS)))
    return results, sum(resumes)


def _during(addresses: list[str], fault: Any, after: int = 5, tokens: int = TOKENS) -> tuple[list[list[int]], int]:
    """Runs the sessions and calls `fault` once every session has streamed `after` tokens (and before any ended);
    an assertion that fails inside `fault` fails the test."""
    progress = [0] * SESSIONS
    fired = threading.Event()
    errors: list[BaseException] = []

    def trigger() -> None:
        while min(progress) < after:
            time.sleep(0.01)
        fired.set()
        early = max(progress) < tokens
        try:
            fault()
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)
        if not early:
            errors.append(AssertionError("the fault came after a session ended: the test proved nothing"))

    thread = threading.Thread(target=trigger, daemon=True)
    thread.start()
    results = _run_all(addresses, progress, tokens)
    assert fired.is_set(), "the fault never fired: the test proved nothing"
    thread.join(60)
    if errors:
        raise errors[0]
    return results


def _incarnation(address: str) -> int:
    with CoordinatorClient(address) as client:
        return int(client.status().incarnation)


def _old_step_refused(executors: list[str], incarnation: int) -> None:
    """Every executor refuses a step of `incarnation` as stale."""
    for address in executors:
        with grpc.insecure_channel(address) as channel:
            request = stage_pb2.ExecuteStepRequest(incarnation=incarnation, step_id=1,
                                                   output=stage_pb2.OUTPUT_KIND_TOKEN,
                                                   rows=[stage_pb2.StepRow(session_id="zombie", epoch=1, token_ids=[1])])
            with pytest.raises(grpc.RpcError) as e:
                stage_pb2_grpc.StageServiceStub(channel).ExecuteStep(request, timeout=10)
            assert from_rpc_error(e.value).reason == "STALE_INCARNATION", e.value


def test_a_standby_refuses_until_it_leads(coordinators: list[Coordinator]) -> None:
    leader, standby = coordinators
    assert _health(standby.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert health_status(standby.address, "liveness") == health_pb2.HealthCheckResponse.SERVING  # not restarted
    with CoordinatorClient(standby.address) as client, pytest.raises(Unavailable) as e:
        list(client.generate(prompt_token_ids=PROMPT, max_tokens=2))
    assert e.value.reason == "NOT_LEADER" and leader.address in e.value.message, e.value.message
    # a client given the standby first finds the leader (the standby names it)
    with CoordinatorClient([standby.address, leader.address]) as client:
        assert len([t for c in client.generate(prompt_token_ids=PROMPT, max_tokens=3) for t in c.token_ids]) == 3
    # resuming with the whole completion already delivered is a bad request, not a hang
    with grpc.insecure_channel(leader.address) as channel, pytest.raises(grpc.RpcError) as bad:
        request = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=3, resume_token_ids=[4, 5, 6])
        list(coordinator_pb2_grpc.CoordinatorServiceStub(channel).Generate(request, timeout=30))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(bad.value).reason == "RESUME_COMPLETE"


def test_killing_the_leader_mid_stream_changes_no_token(coordinators: list[Coordinator], executors: list[str]) -> None:
    leader, standby = coordinators
    addresses = [leader.address, standby.address]
    baseline, resumed = _run_all(addresses)
    assert resumed == 0 and all(len(t) == TOKENS for t in baseline)
    before = _incarnation(leader.address)
    results, resumed = _during(addresses, lambda: faults.kill9(leader.process))
    assert results == baseline
    assert resumed >= 1, "no stream broke: the kill happened after every session ended"
    assert _wait_serving([standby]) is standby
    assert _incarnation(standby.address) > before
    _old_step_refused(executors, before)
    # the dead leader's address refused connections: the standby revoked its lease instead of waiting out the TTL
    assert "the leader's process is gone" in standby.log()


def test_a_leader_paused_past_its_lease_is_refused_and_steps_down(coordinators: list[Coordinator],
                                                                  executors: list[str]) -> None:
    leader, standby = coordinators
    addresses = [leader.address, standby.address]
    baseline, _ = _run_all(addresses)
    before = _incarnation(leader.address)

    def pause_past_the_lease() -> None:
        faults.freeze(leader.process)
        _wait_serving([standby])  # the lease lapsed in etcd, the standby fenced `before` and installed its own
        faults.thaw(leader.process)  # while sessions still stream: the old leader wakes believing it leads

    results, resumed = _during(addresses, pause_past_the_lease)
    assert results == baseline
    assert resumed >= 1
    after = _incarnation(standby.address)
    assert after > before
    # the woken leader stepped down by itself: it reports NOT_SERVING, refuses with a clear UNAVAILABLE, and every
    # executor refuses its incarnation
    deadline = time.monotonic() + 30
    while _health(leader.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, leader.log()[-3000:]
        time.sleep(0.05)
    assert "stepping down" in leader.log()
    assert _health(standby.address) == health_pb2.HealthCheckResponse.SERVING
    # alive for a supervisor while it waited as a standby; not any more: a restart makes it a standby again
    assert health_status(standby.address, "liveness") == health_pb2.HealthCheckResponse.SERVING
    assert health_status(leader.address, "liveness") == health_pb2.HealthCheckResponse.NOT_SERVING
    with CoordinatorClient(leader.address) as client, pytest.raises(Unavailable) as e:
        list(client.generate(prompt_token_ids=PROMPT, max_tokens=2))
    assert e.value.reason == "NOT_LEADER" and "stepped down" in e.value.message, e.value.message
    _old_step_refused(executors, before)
    # the new leader was never disturbed: same incarnation, and it still serves the same tokens
    assert _incarnation(standby.address) == after
    assert _run_all([standby.address, leader.address])[0] == baseline


def test_etcd_losing_a_member_changes_nothing_and_losing_all_only_pauses_the_streams(
        coordinators: list[Coordinator], etcd: EtcdCluster) -> None:
    leader, standby = coordinators
    addresses = [leader.address, standby.address]
    baseline, _ = _run_all(addresses, tokens=LONG_TOKENS)
    k = _incarnation(leader.address)
    follower = etcd.follower()
    try:
        results, resumed = _during(addresses, lambda: etcd.stop(follower), tokens=LONG_TOKENS)
        assert results == baseline and resumed == 0
        assert _incarnation(leader.address) == k  # quorum held: the leader kept its lease, nothing re-planned
        assert _health(leader.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        etcd.start(follower)
    refusal: list[str] = []

    def etcd_down_then_back() -> None:
        etcd.stop()
        # The leader cannot renew its lease: once it lapses it steps down and refuses new work with UNAVAILABLE
        # (no standby can win meanwhile: nothing can be elected without etcd)
        deadline = time.monotonic() + 30
        while _health(leader.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, leader.log()[-3000:]
            time.sleep(0.05)
        assert _health(standby.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with CoordinatorClient(leader.address) as client, pytest.raises(Unavailable) as e:
            list(client.generate(prompt_token_ids=PROMPT, max_tokens=2))
        refusal.append(f"{e.value.reason}: {e.value.message}")
        etcd.start()  # etcd back: the standby wins, and the paused streams resume there

    results, resumed = _during(addresses, etcd_down_then_back, tokens=LONG_TOKENS)
    assert refusal and refusal[0].startswith("NOT_LEADER") and "lease lapsed" in refusal[0], refusal
    assert results == baseline
    assert resumed >= 1
    assert _wait_serving([standby]) is standby and _incarnation(standby.address) > k


def test_a_new_cluster_counter_starts_past_what_the_executors_hold(etcd: EtcdCluster, model: Path,
                                                                   executors: list[str], tmp_path: Path) -> None:
    """A coordinator that takes over executors installed before its cluster's counter existed (their previous
    coordinator ran on its file state, or under another cluster name) issues a newer incarnation, not 1."""
    address = f"127.0.0.1:{free_port()}"
    base = [sys.executable, "-m", "graphmesh_coordinator.server", "--listen", address, "--executors", ",".join(executors),
            "--model", str(model)]
    if max(_stage_incarnation(a) for a in executors) == 0:  # run alone: a coordinator on its file state installs first
        with start_process([*base, "--state-dir", str(tmp_path / "file-state")], address,
                           log_path=tmp_path / "file-coordinator.log", env={"OMP_NUM_THREADS": "1"}):
            pass
    held = max(_stage_incarnation(a) for a in executors)
    assert held > 0
    with start_process([*base, "--state-dir", str(tmp_path / "state"), "--etcd", ",".join(etcd.urls),
                        "--cluster-name", "another-cluster"], address, log_path=tmp_path / "coordinator.log",
                       env={"OMP_NUM_THREADS": "1"}):
        assert _incarnation(address) > held
        tokens = [t for c in CoordinatorClient(address).generate(prompt_token_ids=PROMPT, max_tokens=3) for t in c.token_ids]
        assert len(tokens) == 3


def _stage_incarnation(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(stage_pb2_grpc.StageServiceStub(channel).Status(stage_pb2.StageServiceStatusRequest(), timeout=10).incarnation)
