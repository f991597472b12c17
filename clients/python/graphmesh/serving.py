"""The end of every service's main(): serve until SIGTERM or SIGINT, then drain and flush telemetry."""

from __future__ import annotations

import logging
import signal
import threading

import grpc

from graphmesh import telemetry

log = logging.getLogger("graphmesh")


def byte_size(text: str) -> int:
    """A command-line size in bytes, with an optional binary suffix: 4096, 64Mi, 1Gi."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def run_until_signalled(server: grpc.Server, grace_s: float) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping", extra={"grace_s": grace_s})
    server.stop(grace=grace_s).wait()
    telemetry.shutdown()
