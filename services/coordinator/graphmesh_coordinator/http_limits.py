"""Connection hygiene for the HTTP API (issue 42): a bound on open connections, refused as they are accepted, and
a deadline on a connection that sends no complete request, on plain HTTP as under TLS.

uvicorn closes a connection that idles after a response (timeout_keep_alive) but starts no timer before the first
request, so connections that never send one (or send their headers a byte at a time) were held for good: ~20,000
of them took the coordinator to its descriptor limit, where gRPC health and /health could no longer be accepted.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("graphmesh.coordinator.http")

MAX_CONNECTIONS_CAP = 4096  # the default bound, at most: well below the usual descriptor limits
REQUEST_TIMEOUT_S = 10.0  # a connection must complete a request's headers within this, or go
H11_MAX_HEADER_BYTES = 64 << 10  # h11's bound on a request's head (its default is 16 KiB; uvicorn's too)


def default_max_connections() -> int:
    """A quarter of the soft descriptor limit, at most MAX_CONNECTIONS_CAP: the rest stays for gRPC calls, the
    executors' channels, the state files and health, however many HTTP clients connect."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CAP
    return max(16, min(MAX_CONNECTIONS_CAP, soft // 4))


def guarded_protocol(max_connections: int, request_timeout_s: float = REQUEST_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the two guards: a connection accepted beyond `max_connections` open ones is
    closed at once (RST, counted in refused()), and one that has not completed a request's headers within
    `request_timeout_s` of its start, or of the end of its previous response, is closed."""

    class Guarded(H11Protocol):
        refused = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections:
                Guarded.refused += 1
                log.warning("HTTP connection refused: too many open", extra={"open": len(self.connections),
                                                                             "max_connections": max_connections})
                transport.abort()
                self.transport = transport
                return
            super().connection_made(transport)
            self._idle_cycle: Any = None
            self._idle_timer = self.loop.call_later(request_timeout_s, self._check_idle)

        def _check_idle(self) -> None:
            """Closes the connection when no request began since the last check and none is being answered."""
            cycle = self.cycle
            busy = cycle is not None and not cycle.response_complete
            if not busy and cycle is self._idle_cycle and not self.transport.is_closing():
                self.transport.close()
                return
            self._idle_cycle = cycle
            self._idle_timer = self.loop.call_later(request_timeout_s, self._check_idle)

        def connection_lost(self, exc: Exception | None) -> None:
            timer = getattr(self, "_idle_timer", None)
            if timer is None:  # refused at accept: never joined the server's connections
                return
            timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if getattr(self, "_idle_timer", None) is None:
                return
            super().data_received(data)

    return Guarded
