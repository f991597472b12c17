"""How the HTTP API accepts connections: on a thread of its own (the Acceptor), which bounds the open connections
(refused as they are accepted), closes one that sends nothing in time, answers `GET /health` itself and hands
every other connection to uvicorn's event loop, where one that completes no request's headers in time is closed too.

uvicorn closes a connection that idles after a response (timeout_keep_alive) but starts no timer before the first
request, so connections that never send one (or send their headers a byte at a time) were held for good: ~20,000
of them took the coordinator to its descriptor limit, where gRPC health and /health could no longer be accepted
(issue 42). And while a thousand streams start at once the API's loop runs a second behind: a probe answered there
timed out (a kubelet's default timeout is 1 s) though the mesh served. The Acceptor peeks at a plain-HTTP
connection's first bytes (MSG_PEEK), so a connection it hands on reaches uvicorn's protocol untouched. Under TLS the
bytes are encrypted: every connection goes to the loop, /health included (the chart probes gRPC health, or under
TLS the plain health port).
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("graphmesh.coordinator.http")

MAX_CONNECTIONS_CAP = 4096  # the default bound, at most: well below the usual descriptor limits
REQUEST_TIMEOUT_S = 10.0  # a connection must complete a request's headers within this, or go
H11_MAX_HEADER_BYTES = 64 << 10  # h11's bound on a request's head (its default is 16 KiB; uvicorn's too)
ACCEPT_BATCH = 256  # connections accepted at a time before the pending ones' bytes are looked at
PEEK_BYTES = 4096  # a health probe's request fits; a longer head is not one
START_TIMEOUT_S = 30.0
_HEALTH = re.compile(rb"GET /health(?:\?\S*)? HTTP/1\.[01]\r\n")
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


def default_max_connections() -> int:
    """A quarter of the soft descriptor limit, at most MAX_CONNECTIONS_CAP: the rest stays for gRPC calls, the
    executors' channels, the state files and health, however many HTTP clients connect."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CAP
    return max(16, min(MAX_CONNECTIONS_CAP, soft // 4))


def guarded_protocol(request_timeout_s: float = REQUEST_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection that has not completed a request's headers within
    `request_timeout_s` of being handed to the loop, or of the end of its previous response."""

    class Guarded(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
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
            self._idle_timer.cancel()
            super().connection_lost(exc)

    return Guarded


def response_bytes(response: Response) -> bytes:
    """`response` as HTTP/1.1 bytes that close the connection (the Acceptor's answers)."""
    status = HTTPStatus(response.status_code)
    head = [f"HTTP/1.1 {status.value} {status.phrase}".encode(), *(k + b": " + v for k, v in response.raw_headers),
            b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + bytes(response.body)


def is_health_probe(head: bytes) -> bool:
    """Whether `head` (a connection's first bytes) is one whole `GET /health` request and nothing more."""
    end = head.find(b"\r\n\r\n")
    lowered = head.lower()
    return (end + 4 == len(head) and _HEALTH.match(head) is not None
            and b"content-length" not in lowered and b"transfer-encoding" not in lowered)


class _Server(uvicorn.Server):
    """uvicorn's server with no listener of its own: the Acceptor hands it its connections."""

    loop: asyncio.AbstractEventLoop

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=[])

    def protocol(self) -> asyncio.Protocol:
        """What uvicorn's own listener would make of a connection."""
        return self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state)


class Acceptor:
    """Accepts the connections of `sock` (bound, listening) on a thread of its own; see the module's docstring."""

    def __init__(self, sock: socket.socket, server: _Server, health: Callable[[], bytes] | None,
                 max_connections: int, request_timeout_s: float) -> None:
        self._sock, self._server, self._health = sock, server, health
        self._tls: ssl.SSLContext | None = server.config.ssl
        self._max, self._timeout = max_connections, request_timeout_s
        self._pending: dict[socket.socket, float] = {}  # accepted, no byte yet: by deadline (insertion order)
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()
        self._stopping = False
        self._resume_at = 0.0  # accepting paused (out of descriptors) until then
        self._tasks: set[asyncio.Task[None]] = set()
        # connections handed to the loop, and those of them it took on or dropped: each written by one thread, so
        # the difference (the ones in between, not yet among the server's connections) needs no lock
        self._handed = self._landed = 0
        self.refused = 0
        sock.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="http-accept", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._waker.send(b"x")
        self._thread.join(5.0)

    def _run(self) -> None:
        self._selector.register(self._sock, selectors.EVENT_READ, self._accept)
        self._selector.register(self._wake, selectors.EVENT_READ, None)
        try:
            while not self._stopping:
                for key, _ in self._selector.select(self._wait_s()):
                    if key.data is not None:
                        self._handle(key.data, key.fileobj)
                self._expire()
        finally:
            for conn in list(self._pending):
                self._forget(conn)
                conn.close()
            self._selector.close()
            self._sock.close()
            self._wake.close()
            self._waker.close()

    def _handle(self, handler: Callable[[Any], None], fileobj: Any) -> None:
        try:
            handler(fileobj)
        except Exception:  # a bug with one connection must not end the thread that accepts every one
            log.exception("an HTTP connection could not be accepted")

    def _wait_s(self) -> float | None:
        due = [t for t in (next(iter(self._pending.values()), None), self._resume_at or None) if t is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            conn, deadline = next(iter(self._pending.items()))
            if deadline > now:
                break
            self._forget(conn)  # it sent nothing within the request timeout
            conn.close()
        if self._resume_at and now >= self._resume_at:
            self._resume_at = 0.0
            self._selector.register(self._sock, selectors.EVENT_READ, self._accept)

    def _accept(self, _listening: Any) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: accept again a little later, as asyncio's servers do
                log.warning("HTTP connections not accepted for now", extra={"error": str(e)})
                self._selector.unregister(self._sock)
                self._resume_at = time.monotonic() + 0.5
                return
            conn.setblocking(False)
            open_now = len(self._pending) + self._handed - self._landed + len(self._server.server_state.connections)
            if open_now >= self._max:
                self.refused += 1
                log.warning("HTTP connection refused: too many open", extra={"open": open_now,
                                                                             "max_connections": self._max})
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                conn.close()
            elif self._tls is not None or self._health is None:
                self._hand_on(conn)
            else:
                self._pending[conn] = time.monotonic() + self._timeout
                self._selector.register(conn, selectors.EVENT_READ, self._look)

    def _look(self, conn: Any) -> None:
        """A pending connection's first bytes came: a health probe is answered here, any other request handed on."""
        try:
            head = conn.recv(PEEK_BYTES, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            head = b""
        self._forget(conn)
        if not head:  # closed before it sent a request
            conn.close()
        elif is_health_probe(head):
            self._answer(conn, len(head))
        else:
            self._hand_on(conn)

    def _answer(self, conn: socket.socket, length: int) -> None:
        assert self._health is not None
        try:
            conn.recv(length)  # the request, read
            conn.send(self._health())
        except OSError:
            pass
        finally:
            conn.close()

    def _forget(self, conn: socket.socket) -> None:
        del self._pending[conn]
        self._selector.unregister(conn)

    def _hand_on(self, conn: socket.socket) -> None:
        try:
            self._server.loop.call_soon_threadsafe(self._adopt, conn)
            self._handed += 1
        except RuntimeError:  # the loop has ended: the server is stopping
            conn.close()

    def _adopt(self, conn: socket.socket) -> None:  # on the loop
        task = self._server.loop.create_task(self._connect(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._server.loop.connect_accepted_socket(
                self._server.protocol, conn, ssl=self._tls,
                ssl_handshake_timeout=self._timeout if self._tls is not None else None)
        except OSError as e:  # reset, or a failed or too slow TLS handshake
            log.debug("HTTP connection not taken on", extra={"error": str(e)})
            conn.close()
        finally:
            self._landed += 1


@dataclass
class Serving:
    server: _Server
    thread: threading.Thread
    acceptor: Acceptor

    def stop(self) -> None:
        self.acceptor.stop()
        self.server.should_exit = True
        self.thread.join(timeout=5.0)


def serve(app: Any, sock: socket.socket, health: Callable[[], bytes] | None = None, max_connections: int = 0,
          request_timeout_s: float = REQUEST_TIMEOUT_S, **config: Any) -> Serving:
    """Serves the ASGI `app` on `sock` (bound, listening): uvicorn's loop on a thread, the Acceptor on another.
    `health` answers `GET /health` on the Acceptor's thread (None: the app answers everything); at most
    `max_connections` are open (0: default_max_connections()); `config`: uvicorn.Config's other arguments."""
    server = _Server(uvicorn.Config(app, lifespan="off", http=guarded_protocol(request_timeout_s),
                                    h11_max_incomplete_event_size=H11_MAX_HEADER_BYTES, **config))
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise OSError(f"the HTTP API did not start on {sock.getsockname()}")
        time.sleep(0.01)
    return Serving(server, thread, Acceptor(sock, server, health, max_connections or default_max_connections(),
                                            request_timeout_s))
