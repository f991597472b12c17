"""Executors that join and leave a live mesh through etcd membership, with a real etcd and real coordinator,
executor and kvstore processes: executors started with --etcd register themselves; the leader (started with no
--executors at all) plans over them, takes in a third executor that starts while sessions stream and plans out
one that is stopped (SIGTERM: it deregisters, then drains until the re-plan) without a changed token or a client
error; a standby refuses KServe and the OpenAI HTTP API with NOT_LEADER, naming the leader."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import from_rpc_error
from graphmesh.kserve import grpc_service_pb2 as kserve_pb2
from graphmesh.kserve import grpc_service_pb2_grpc as kserve_grpc
from graphmesh.launcher import free_port
from graphmesh_server.etcd import EtcdClient
from graphmesh_server.membership import members_prefix, registered
from tests import etcd_fixtures
from tests.conftest import executor_args, health_status, start_process
from tests.etcd_fixtures import EtcdCluster
from tests.model_fixtures import make_tiny_llama

PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1][: 6 + i] for i in range(4)]
TOKENS = 40


def _request(i: int) -> dict[str, Any]:
    """Sessions 0 and 1 greedy, 2 and 3 seeded sampling."""
    sampling: dict[str, Any] = {"temperature": 0.8, "top_k": 50, "seed": 2000 + i} if i >= 2 else {}
    return {"prompt_token_ids": PROMPTS[i], "max_tokens": TOKENS, "ignore_eos": True, **sampling}


etcd = etcd_fixtures.module_cluster(1)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four layers: enough for a plan of three ranks."""
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-4", layers=4)


@dataclass
class Cluster:
    name: str  # the cluster's name in etcd: one per test, so that no test sees another's registrations
    etcd: EtcdCluster
    model: Path
    logs: Path
    stack: ExitStack
    coordinator: str = ""
    executors: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start_executor(self, *extra: str) -> str:
        address = f"127.0.0.1:{free_port()}"
        process = self.stack.enter_context(start_process(
            executor_args(address, "--etcd", ",".join(self.etcd.urls), "--cluster-name", self.name,
                          "--kv-cache-bytes", "8Mi", "--drain-timeout", "20", *extra),
            address, log_path=self.logs / f"executor-{len(self.executors)}.log", env={"OMP_NUM_THREADS": "1"}))
        self.executors[address] = process
        return address

    def start_coordinator(self, name: str, *extra: str) -> str:
        address = f"127.0.0.1:{free_port()}"
        args = [sys.executable, "-m", "graphmesh_coordinator.server", "--listen", address, "--model", str(self.model),
                "--state-dir", str(self.logs / f"{name}-state"), "--etcd", ",".join(self.etcd.urls),
                "--cluster-name", self.name, "--min-executors", "2", *extra]
        self.stack.enter_context(start_process(args, address, log_path=self.logs / f"{name}.log",
                                               env={"OMP_NUM_THREADS": "1"}, health_service="liveness"))
        return address

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")


@pytest.fixture
def cluster(etcd: EtcdCluster, model: Path, tmp_path: Path) -> Iterator[Cluster]:
    with ExitStack() as stack:
        c = Cluster(f"membership-{tmp_path.name}", etcd, model, tmp_path, stack)
        kvstore = f"127.0.0.1:{free_port()}"
        stack.enter_context(start_process([sys.executable, "-m", "graphmesh_kvstore.server", "--listen", kvstore],
                                          kvstore, log_path=tmp_path / "kvstore.log"))
        c.start_executor()
        c.start_executor()
        c.coordinator = c.start_coordinator("coordinator", "--kvstore", kvstore)
        _wait(lambda: _health(c.coordinator) == health_pb2.HealthCheckResponse.SERVING, 60,
              lambda: "the leader never served:\n" + c.log("coordinator")[-3000:])
        yield c
        for process in c.executors.values():  # killed, not stopped: with its coordinator gone it would drain in vain
            process.kill()


def _health(address: str) -> int | None:
    try:
        return health_status(address, timeout=1.0)
    except grpc.RpcError:
        return None


def _wait(ok: Any, timeout_s: float, why: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, why()
        time.sleep(0.1)


def _stages(address: str) -> list[str]:
    with CoordinatorClient(address) as client:
        status = client.status()
    return [s.address for s in status.stages] if status.ready else []


def _generate(address: str, i: int) -> list[int]:
    with CoordinatorClient(address, timeout=120) as client:
        return [t for chunk in client.generate(**_request(i)) for t in chunk.token_ids]


def test_executors_join_and_leave_a_live_mesh_without_a_changed_token(cluster: Cluster) -> None:
    first_two = list(cluster.executors)
    assert sorted(_stages(cluster.coordinator)) == sorted(first_two)
    assert sorted(m.address for m in registered(EtcdClient(cluster.etcd.urls), cluster.name)) == sorted(first_two)
    expected = [_generate(cluster.coordinator, i) for i in range(4)]

    # Four sessions stream without a pause while the mesh grows and shrinks: each generation is checked
    stop, errors = threading.Event(), []
    finished = [0] * 4

    def stream(i: int) -> None:
        while not stop.is_set():
            try:
                tokens = _generate(cluster.coordinator, i)
            except Exception as e:  # any client error fails the test
                errors.append(e)
                return
            if tokens != expected[i]:
                errors.append(AssertionError(f"session {i} changed: {tokens} != {expected[i]}"))
                return
            finished[i] += 1

    def streamed_again() -> None:
        done = list(finished)
        _wait(lambda: errors or all(f > d for f, d in zip(finished, done)), 120, lambda: "the sessions stalled")

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        streamed_again()
        joined = cluster.start_executor("--preload-model", str(cluster.model))  # it reads the model, then registers
        _wait(lambda: len(_stages(cluster.coordinator)) == 3, 60,
              lambda: "the mesh never took the new executor in:\n" + cluster.log("coordinator")[-3000:])
        assert _stages(cluster.coordinator)[-1] == joined  # the newest member is planned last
        streamed_again()

        leaving = first_two[0]
        process = cluster.executors[leaving]
        process.send_signal(signal.SIGTERM)
        _wait(lambda: sorted(_stages(cluster.coordinator)) == sorted([first_two[1], joined]), 60,
              lambda: "the mesh never planned the leaving executor out:\n" + cluster.log("coordinator")[-3000:])
        assert process.wait(timeout=30) == 0  # it drained and stopped by itself
        streamed_again()
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not errors, errors[0]
    coordinator_log = cluster.log("coordinator")
    assert "executor joined" in coordinator_log and "executor left" in coordinator_log
    executor_log = cluster.log("executor-0")
    assert "leaving the mesh" in executor_log and "left the mesh" in executor_log
    newcomer_log = cluster.log("executor-2")  # installed from what it preloaded, before it registered
    assert newcomer_log.index("model preloaded") < newcomer_log.index("registered in etcd")
    assert '"mb": 0.0' in newcomer_log.split("registered in etcd")[1]
    assert leaving not in [m.address for m in registered(EtcdClient(cluster.etcd.urls), cluster.name)]


def test_an_executor_that_dies_is_dropped_from_membership_when_its_lease_lapses(cluster: Cluster) -> None:
    etcd = EtcdClient(cluster.etcd.urls)
    survivor, victim = list(cluster.executors)
    cluster.executors[victim].kill()
    _wait(lambda: victim not in [m.address for m in registered(etcd, cluster.name)], 30,
          lambda: f"{victim} is still registered under {members_prefix(cluster.name)}")
    _wait(lambda: _stages(cluster.coordinator) == [survivor], 60,
          lambda: "the mesh did not re-plan onto the survivor:\n" + cluster.log("coordinator")[-3000:])
    assert _generate(cluster.coordinator, 0)  # still serving
    assert "executor left" in cluster.log("coordinator")


def _http_answers(url: str) -> bool:
    """The HTTP API listens (it starts a moment after gRPC health does): any HTTP status will do."""
    try:
        urllib.request.urlopen(url, timeout=2)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def _infer_status(address: str) -> tuple[grpc.StatusCode, str, str]:
    request = kserve_pb2.ModelInferRequest(model_name="tiny-llama-4")
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            kserve_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
    error = from_rpc_error(e.value)
    return e.value.code(), error.reason, error.message


def test_a_standby_refuses_kserve_and_http_naming_the_leader(cluster: Cluster) -> None:
    http = f"127.0.0.1:{free_port()}"
    standby = cluster.start_coordinator("standby", "--http-listen", http)
    code, reason, message = _infer_status(standby)
    assert code == grpc.StatusCode.UNAVAILABLE and reason == "NOT_LEADER", (code, reason, message)
    assert cluster.coordinator in message
    body = json.dumps({"model": "tiny-llama-4", "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"http://{http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    _wait(lambda: _http_answers(f"http://{http}/health"), 60, lambda: "the standby's HTTP API never answered")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 503
    assert cluster.coordinator in json.loads(e.value.read())["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{http}/health", timeout=10)
    assert e.value.code == 503
    # the leader serves KServe as before
    with grpc.insecure_channel(cluster.coordinator) as channel:
        ready = kserve_grpc.GRPCInferenceServiceStub(channel).ServerReady(kserve_pb2.ServerReadyRequest(), timeout=10)
    assert ready.ready


def test_a_registration_that_is_not_json_is_skipped_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """The watch reads every 0.2 s: a stray key under the prefix is one log line, not five a second."""
    from graphmesh_server.etcd import KeyValue

    class Etcd:
        def get_prefix(self, prefix: str) -> list[KeyValue]:
            return [KeyValue(prefix + "junk", "not json", 5, 0, 5),
                    KeyValue(prefix + "10.0.0.1:7000", json.dumps({"address": "10.0.0.1:7000"}), 7, 0, 7)]

    with caplog.at_level("WARNING", logger="graphmesh"):
        for _ in range(3):
            assert [m.address for m in registered(Etcd(), "lonely")] == ["10.0.0.1:7000"]  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records].count("ignoring a registration that is not JSON") == 1
