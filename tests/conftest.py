"""Shared fixtures: service processes on loopback, started once and waited for through grpc health."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from graphmesh.launcher import free_port, wait_healthy

STARTUP_TIMEOUT_S = 60.0


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist (make test), each worker and every process it starts keep to a share of the cores of their own:
    two workers' meshes on the same cores oversubscribe them (each mesh sizes its threads to all the cores) and
    run at half the speed of the same meshes apart (DEVELOPERS.md, Tests). Tests that need every core are `serial`."""
    worker = getattr(config, "workerinput", None)
    if worker is None:
        return
    cores, count = sorted(os.sched_getaffinity(0)), int(worker["workercount"])
    if count < 2 or len(cores) < count:
        return
    each, index = len(cores) // count, int(worker["workerid"].removeprefix("gw"))
    share = set(cores[index * each:(index + 1) * each])
    for thread in os.listdir("/proc/self/task"):  # execnet's threads too: any of them may start a process
        os.sched_setaffinity(int(thread), share)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(len(share))


def backend_targets() -> list[str]:
    """Backend names for the per-backend suites, and "torch:cuda" where torch sees a GPU."""
    from graphmesh_executor.backends import available

    names = available()
    if "torch" in names:
        import torch

        if torch.cuda.is_available():
            names.append("torch:cuda")
    return names


def health_status(address: str, service: str = "", timeout: float = 2.0) -> int:
    """The grpc.health.v1 status of `service` at `address`; raises grpc.RpcError when unreachable."""
    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout)
        return int(response.status)


@contextmanager
def start_process(args: Sequence[str], health_address: str, *, log_path: Path | None = None,
                  env: dict[str, str] | None = None, timeout: float = STARTUP_TIMEOUT_S,
                  health_service: str = "") -> Iterator[subprocess.Popen[bytes]]:
    """Runs `args` until the block ends; yields once health at `health_address` says SERVING (for
    `health_service`: a standby coordinator is SERVING only for "liveness").

    stdout and stderr go to `log_path` (a temporary file by default) and its tail is shown when the
    process dies or never turns healthy. Teardown sends SIGTERM, then SIGKILL after 10 s.
    """
    if log_path is None:
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"graphmesh-test-{os.getpid()}-{health_address.replace(':', '_')}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
    try:
        wait_healthy(health_address, process, timeout, str(list(args[:3])), service=health_service, log=log_path)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def executor_args(address: str, *extra: str, backend: str = "numpy") -> list[str]:
    return [sys.executable, "-m", "graphmesh_executor.server", "--listen", address, "--backend", backend, *extra]


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The --model-root of the shared executors: tests write checkpoints here for LoadParams."""
    return tmp_path_factory.mktemp("model_root")


@pytest.fixture(scope="session")
def numpy_executor(model_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Address of an executor process on the numpy backend, shared by the whole session."""
    address = f"127.0.0.1:{free_port()}"
    log_path = tmp_path_factory.mktemp("logs") / "numpy_executor.log"
    with start_process(executor_args(address, "--model-root", str(model_root)), address, log_path=log_path,
                       env={"OMP_NUM_THREADS": "1"}):
        yield address
