"""A coordinator's health, probed from a process of its own while a test loads the coordinator: what a kubelet's
probe would see. In the test's own process the probe would wait for the GIL behind the load the test generates
(a thousand asyncio streams), and time the test client, not the server."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

INTERVAL_S = 0.05


@dataclass
class HealthProbe:
    """Checks gRPC health at `address` (1 s deadline) and, given `http_url`, its /health, every 50 ms while the
    block runs: the slowest answer and every failure."""

    address: str
    http_url: str = ""
    slowest: dict[str, float] = field(default_factory=dict)  # by probe: "grpc", "http"
    failures: list[str] = field(default_factory=list)
    probes: int = 0

    def __enter__(self) -> HealthProbe:
        self._process = subprocess.Popen([sys.executable, str(Path(__file__)), self.address, self.http_url],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        ready = self._process.stdout.readline()  # after its first probes: the block's load is probed throughout
        assert ready == "ready\n", f"the health probe did not start: {ready!r}"
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._process.communicate("", timeout=30)  # stdin closed: the probe stops and reports
        report = json.loads(out)
        self.slowest, self.failures, self.probes = report["slowest"], report["failures"], report["probes"]

    @property
    def slowest_s(self) -> float:
        """The slowest answer of any probe."""
        return max(self.slowest.values(), default=0.0)

    def check(self) -> None:
        """Asserts health answered, and within 1 s, every time it was asked."""
        assert self.probes, "health was never probed"
        assert not self.failures and self.slowest_s < 1.0, (self.failures[:5], self.slowest)


def _main(address: str, http_url: str) -> None:
    """Probes until stdin closes, then writes what it saw as one JSON object."""
    stop = threading.Event()

    def wait_for_stdin() -> None:
        sys.stdin.read()
        stop.set()
    threading.Thread(target=wait_for_stdin, daemon=True).start()
    slowest: dict[str, float] = {}
    failures: list[str] = []

    def probe(kind: str, call: Callable[[], None]) -> None:
        """One probe, timed on its own as a kubelet times each of its probes."""
        t0 = time.monotonic()
        try:
            call()
        except Exception as e:  # every failure is a finding
            failures.append(f"{kind}: {type(e).__name__}: {e}")
        slowest[kind] = max(slowest.get(kind, 0.0), time.monotonic() - t0)

    def grpc_health() -> None:
        answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        if answer.status != health_pb2.HealthCheckResponse.SERVING:
            failures.append(f"grpc health {answer.status}")

    def http_health() -> None:
        with urllib.request.urlopen(f"{http_url}/health", timeout=1.0) as r:
            if r.status != 200:
                failures.append(f"/health {r.status}")

    probes = 0
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            probe("grpc", grpc_health)
            if http_url:
                probe("http", http_health)
            probes += 1
            if probes == 1:
                print("ready", flush=True)
            stop.wait(INTERVAL_S)
    print(json.dumps({"slowest": slowest, "failures": failures, "probes": probes}), flush=True)


if __name__ == "__main__":
    _main(*sys.argv[1:3])
