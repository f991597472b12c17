"""The end of every service's main(): serve until SIGTERM or SIGINT, then drain and flush telemetry."""

from __future__ import annotations

import logging
import signal
import threading

import grpc

from graphmesh import telemetry

log = logging.getLogger("graphmesh")


def run_until_signalled(server: grpc.Server, grace_s: float) -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping", extra={"grace_s": grace_s})
    server.stop(grace=grace_s).wait()
    telemetry.shutdown()
