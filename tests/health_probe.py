"""A coordinator's health, probed from a thread of its own while a test loads the coordinator: what a kubelet's
probe would see."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass
class HealthProbe:
    """Checks gRPC health at `address` (1 s deadline) and, given `http_url`, its /health, every 50 ms while the
    block runs: the slowest answer and every failure."""

    address: str
    http_url: str = ""
    slowest: dict[str, float] = field(default_factory=dict)  # by probe: "grpc", "http"
    failures: list[str] = field(default_factory=list)
    probes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                self._probe("grpc", lambda: self._grpc(stub))
                if self.http_url:
                    self._probe("http", self._http)
                self.probes += 1
                self._stop.wait(0.05)

    def _probe(self, kind: str, probe: Callable[[], None]) -> None:
        """One probe, timed on its own as a kubelet times each of its probes."""
        t0 = time.monotonic()
        try:
            probe()
        except Exception as e:  # every failure is a finding
            self.failures.append(f"{kind}: {type(e).__name__}: {e}")
        self.slowest[kind] = max(self.slowest.get(kind, 0.0), time.monotonic() - t0)

    @property
    def slowest_s(self) -> float:
        """The slowest answer of any probe."""
        return max(self.slowest.values(), default=0.0)

    def _grpc(self, stub: health_pb2_grpc.HealthStub) -> None:
        answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        if answer.status != health_pb2.HealthCheckResponse.SERVING:
            self.failures.append(f"grpc health {answer.status}")

    def _http(self) -> None:
        with urllib.request.urlopen(f"{self.http_url}/health", timeout=1.0) as r:
            if r.status != 200:
                self.failures.append(f"/health {r.status}")

    def __enter__(self) -> HealthProbe:
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def check(self) -> None:
        """Asserts health answered, and within 1 s, every time it was asked."""
        assert self.probes, "health was never probed"
        assert not self.failures and self.slowest_s < 1.0, (self.failures[:5], self.slowest)
