"""Real etcd members on free loopback ports (Debian's etcd-server, installed by `make etcd-server`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from graphmesh.launcher import free_port


@dataclass
class EtcdMember:
    name: str
    client_url: str
    peer_url: str
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None


@dataclass
class EtcdCluster:
    """`size` members of one cluster; stop() and start() one member (by index) or all keep their data dirs, so a
    restarted member rejoins with what it had."""

    root: Path
    size: int = 3
    members: list[EtcdMember] = field(default_factory=list)

    def __post_init__(self) -> None:
        for i in range(self.size):
            self.members.append(EtcdMember(f"m{i}", f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}",
                                           self.root / f"m{i}", self.root / f"m{i}.log"))

    @property
    def urls(self) -> list[str]:
        return [m.client_url for m in self.members]

    def start(self, index: int | None = None) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members if index is None else [self.members[index]]:
            if m.process is not None and m.process.poll() is None:
                continue
            with open(m.log_path, "ab") as log:
                m.process = subprocess.Popen(
                    [_etcd(), "--name", m.name, "--data-dir", str(m.data_dir), "--listen-client-urls", m.client_url,
                     "--advertise-client-urls", m.client_url, "--listen-peer-urls", m.peer_url,
                     "--initial-advertise-peer-urls", m.peer_url, "--initial-cluster", initial,
                     "--initial-cluster-token", f"graphmesh-test-{self.root.name}", "--log-level", "warn"],
                    stdout=log, stderr=subprocess.STDOUT)
        self.wait_healthy(index)

    def wait_healthy(self, index: int | None = None, timeout_s: float = 60.0) -> None:
        """Until every started member (or `index`) says it is healthy: it is in a cluster with a leader."""
        deadline = time.monotonic() + timeout_s
        for m in self.members if index is None else [self.members[index]]:
            while True:
                assert m.process is not None
                if m.process.poll() is not None:
                    raise RuntimeError(f"etcd {m.name} exited with {m.process.returncode}:\n{m.log_path.read_text()[-3000:]}")
                try:
                    with urllib.request.urlopen(m.client_url + "/health", timeout=1.0) as reply:
                        if json.loads(reply.read()).get("health") == "true":
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd {m.name} not healthy after {timeout_s} s:\n{m.log_path.read_text()[-3000:]}")
                time.sleep(0.1)

    def follower(self) -> int:
        """The index of a running member that is not the cluster's raft leader (stopping it costs no election)."""
        for i, m in enumerate(self.members):
            if m.process is None or m.process.poll() is not None:
                continue
            request = urllib.request.Request(m.client_url + "/v3/maintenance/status", data=b"{}",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=2.0) as reply:
                status = json.loads(reply.read())
            if status["header"]["member_id"] != status["leader"]:
                return i
        raise RuntimeError("no running follower")

    def stop(self, index: int | None = None) -> None:
        for m in self.members if index is None else [self.members[index]]:
            if m.process is not None and m.process.poll() is None:
                m.process.kill()
                m.process.wait()


@contextmanager
def running(root: Path, size: int) -> Iterator[EtcdCluster]:
    """A started cluster of `size` members under `root`, stopped when the block ends (however it ends)."""
    cluster = EtcdCluster(root, size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def module_cluster(size: int) -> Any:
    """A module-scoped fixture named etcd: a cluster of `size` members that the module's tests share."""
    @pytest.fixture(scope="module")
    def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
        with running(tmp_path_factory.mktemp("etcd"), size) as cluster:
            yield cluster

    return etcd


def _etcd() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise RuntimeError("etcd is not installed: `make etcd-server` (Debian's etcd-server) installs it")
    return path
