"""Boundary links: the data plane from a rank to the next, and the receiving end of every link to an executor.

A gRPC unary PushBoundary costs ~1 ms a hop on the 2-core VM and ~1.4 ms on the H200 host, more than a decode
step's compute on a GPU, and a decode run makes two hops per token (the activation on, the sampled tokens back).
A link is one TCP connection from a rank to the next carrying length-prefixed frames (graphmesh.links: the framing
and the senders other services need): each PUSH frame is the PushBoundaryRequest that PushBoundary takes, its
tensors' bytes after the message (transport.push_parts), and the receiver answers every one, in order, with an ACK
frame holding the google.rpc.Status PushBoundary would have answered. A round trip costs ~0.07 ms.

The control plane stays gRPC. The sender asks the next rank for a link with StageService.OpenBoundaryLink, which
is authenticated like every mesh call (mesh token or mutual TLS) and answers the link's address and a one-time
ticket; the link's first frame (HELLO) must carry that ticket, so only a caller the mesh admitted can open one.
A link that breaks or misses a deadline fails the pushes it carries, as a failed PushBoundary would (COMM: the
step's order is no longer provable); the next push opens a new link. A rank that has no link listener is pushed to
over gRPC, and so is every rank of a mesh that runs TLS: links are plain TCP.

The listener also takes KV row copies (graphmesh.links.KvLink: KV_BEGIN, the rows a piece at a time, K then V of
each layer, then the answer), from another executor (PushSessionKv) or from the KV store (seeds), checked as
WriteSessionKv checks its rows. Each piece is read into one of two buffers and handed to the engine while the next
is read, and no byte is parsed or transposed on the way: a WriteSessionKv stream gathered every row into
[n, layers, 2, kv_dim], copied each 1 MiB chunk into and out of a message, and scattered the rows back, one step
after another.
"""

from __future__ import annotations

import fcntl
import logging
import secrets
import selectors
import socket
import struct
import termios
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
from google.rpc import status_pb2

from graphmesh.errors import (
    DeadlineExceeded,
    GraphmeshError,
    InvalidArgument,
    Unauthenticated,
    Unavailable,
    from_status_proto,
    refusal,
)
from graphmesh.links import (
    ACK,
    HEADER,
    HELLO,
    KV_BEGIN,
    KV_DATA,
    PUSH,
    Buffer,
    LinkError,
    connect,
    frame,
    frame_bytes,
    nodelay,
    read_exact,
    read_frame,
    read_frame_buffer,
    read_into,
    send_frame,
)
from graphmesh.v1 import stage_pb2
from graphmesh_executor.executable import DeviceValue
from graphmesh_executor.stage_types import BoundaryValue
from graphmesh_executor.transport import (
    DEVICE_CHAINED,
    DEVICE_FAILED,
    DEVICE_PUSH,
    DEVICE_QUEUED,
    DeviceReceiver,
    read_push,
    receiver_factory,
)

log = logging.getLogger("graphmesh.executor.boundary_link")

TICKET_BYTES = 32
TICKET_TTL_S = 30.0
HELLO_TIMEOUT_S = 5.0  # for a new connection to present its ticket, counted from its accept (not per byte)
# Connections at once that have not presented a ticket yet. When all are taken, the oldest is closed to make room
# for the newest: a sender with a ticket presents it at once, so the connection that has waited longest is the
# least likely to be one, and a flood (junk, or one byte every few seconds) can never keep a legitimate link out.
MAX_HANDSHAKES = 128
ACCEPT_BACKLOG = 1024  # the kernel's queue of connections not yet accepted (capped by net.core.somaxconn)
WATCH_PERIOD_S = 0.1  # how often pushes are checked against their deadlines
# A link's send buffer (SO_SNDBUF; the kernel doubles it for its bookkeeping): pushes that fit in what is free
# are sent on the pushing thread, without blocking it (BoundaryLink.push_now).
SEND_BUFFER_BYTES = 4 << 20
_OK = status_pb2.Status().SerializeToString()

Delivered = Callable[[Exception | None], None]
# a bundle: the request, its tensors (host arrays, or a chained bundle's device values)
Accept = Callable[[stage_pb2.PushBoundaryRequest, Sequence[BoundaryValue]], None]


def _answer(e: Exception, what: str) -> bytes:
    """The serialized status a frame that raised `e` is answered with."""
    error = InvalidArgument(f"the frame is not a valid {what}: {e}", "BAD_REQUEST") if _undecodable(e) else e
    return refusal(error, "BoundaryLink").to_status_proto().SerializeToString()


def _undecodable(e: Exception) -> bool:
    return type(e).__name__ == "DecodeError"  # google.protobuf.message.DecodeError, whichever implementation


@dataclass
class KvWrite:
    """A row copy the receiver accepted: the link reads each piece into a buffer and hands it to `put`, then calls
    `finish` once every put is done."""

    pieces: int  # K and V of every layer
    piece_bytes: int
    put: Callable[[int, np.ndarray], Future[None]]  # piece j (its bytes, uint8); the buffer is kept until it is done
    finish: Callable[[], stage_pb2.WriteSessionKvResponse]


KvWriter = Callable[[stage_pb2.WriteSessionKvRequest], KvWrite]  # checks a copy's first message, sets its buffer


@dataclass
class _Handshake:
    """A connection that has not presented its ticket yet: the bytes of its HELLO frame read so far."""

    conn: socket.socket
    peer: str
    deadline: float  # monotonic; closed then if it has not presented a ticket
    received: bytearray = field(default_factory=bytearray)

    def needed(self) -> int:
        """Bytes still missing from the HELLO frame (its header first, then the length it announces)."""
        if len(self.received) < HEADER.size:
            return HEADER.size - len(self.received)
        length, _ = HEADER.unpack_from(self.received)
        return HEADER.size + length - len(self.received)


class LinkListener:
    """The receiving end: accepts links from previous ranks and hands every pushed bundle to `accept` (what
    PushBoundary runs), one connection thread per link.

    Connections that have not presented a ticket cost no thread: one thread accepts them and reads their HELLO
    frames without blocking, so a flood of them (the listener is reachable by anyone who can reach the executor)
    cannot delay a ticket's check. A HELLO that has arrived by the time its connection is accepted is checked at
    once; the others wait in at most MAX_HANDSHAKES slots, for at most HELLO_TIMEOUT_S in all, the oldest closed
    first when a new connection needs a slot."""

    def __init__(self, host: str, port: int, accept: Accept,
                 max_frame_bytes: int, advertise: str = "", kv_writer: KvWriter | None = None) -> None:
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.create_server((host, port), family=family, backlog=ACCEPT_BACKLOG)
        self._server.setblocking(False)
        self.port = self._server.getsockname()[1]
        # An empty host: the sender connects to the host it reached this executor's gRPC port at.
        self.address = advertise or f":{self.port}"
        self._accept = accept
        self._kv_writer = kv_writer
        # Makes a link's end of the GPU path at its first DEVICE_PUSH (transport.py); listen_for_links gives it the
        # executor's device. On the CPU it refuses: the receiver never chose that path.
        self.device_receiver: Callable[[], DeviceReceiver] = receiver_factory("cpu")
        self._max_frame_bytes = max_frame_bytes
        self._tickets: dict[bytes, float] = {}  # ticket -> when it expires (monotonic)
        self._handshakes: OrderedDict[socket.socket, _Handshake] = OrderedDict()  # oldest first; accept thread only
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self.links = 0  # links open now
        self.pushes = 0  # bundles taken over links
        self.evicted = 0  # connections closed without a ticket: timed out, or the oldest when the slots were full
        threading.Thread(target=self._accept_loop, name="boundary-link-accept", daemon=True).start()

    def ticket(self) -> bytes:
        """A one-time ticket for OpenBoundaryLink to hand out."""
        now, ticket = time.monotonic(), secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._tickets = {t: until for t, until in self._tickets.items() if until > now}
            self._tickets[ticket] = now + TICKET_TTL_S
        return ticket

    def _redeem(self, ticket: bytes) -> bool:
        with self._lock:
            until = self._tickets.pop(ticket, None) if len(ticket) == TICKET_BYTES else None
        return until is not None and until > time.monotonic()

    def _accept_loop(self) -> None:
        self._selector.register(self._server, selectors.EVENT_READ)
        while True:
            timeout = None
            if self._handshakes:
                timeout = max(0.0, next(iter(self._handshakes.values())).deadline - time.monotonic())
            try:
                ready = self._selector.select(timeout)
            except (OSError, ValueError):
                return  # closed
            for key, _ in ready:
                if key.fileobj is self._server:
                    if not self._accept_all():
                        return
                else:
                    self._read_hello(key.data)
            now = time.monotonic()
            while self._handshakes and next(iter(self._handshakes.values())).deadline <= now:
                self._evict(next(iter(self._handshakes.values())), "no ticket in time")

    def _accept_all(self) -> bool:
        """Accepts every connection waiting; False once the listener is closed."""
        while True:
            try:
                conn, peer = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                if self._server.fileno() == -1:
                    return False
                # Out of descriptors, most likely: the oldest connection without a ticket gives its own back (the
                # next accept then succeeds); with none to give, a pause keeps the listener from spinning this thread.
                log.warning("boundary link accept failed", extra={"error": str(e)})
                if self._handshakes:
                    self._evict(next(iter(self._handshakes.values())), "no descriptor was left to accept with")
                else:
                    time.sleep(0.01)
                return True
            conn.setblocking(False)
            pending = _Handshake(conn, f"{peer[0]}:{peer[1]}", time.monotonic() + HELLO_TIMEOUT_S)
            if self._read_hello(pending, waiting=False):
                continue
            if len(self._handshakes) >= MAX_HANDSHAKES:
                self._evict(next(iter(self._handshakes.values())), "the slots were full and it was the oldest")
            self._handshakes[conn] = pending
            self._selector.register(conn, selectors.EVENT_READ, pending)

    def _read_hello(self, pending: _Handshake, waiting: bool = True) -> bool:
        """Reads what has arrived of `pending`'s HELLO, never more than the frame, and settles it once it is
        whole: a link served on its own thread, or refused. True when it is settled (or closed)."""
        while True:
            try:
                data = pending.conn.recv(pending.needed())
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                data = b""
            if not data:  # closed by the peer before its ticket
                self._settle(pending, waiting)
                pending.conn.close()
                return True
            pending.received += data
            length, kind = HEADER.unpack_from(pending.received) if len(pending.received) >= HEADER.size else (0, 0)
            if length > TICKET_BYTES:  # not a HELLO: closed before the rest of it is read
                self._settle(pending, waiting)
                pending.conn.close()
                return True
            if len(pending.received) >= HEADER.size and pending.needed() == 0:
                break
        self._settle(pending, waiting)
        ticket = bytes(pending.received[HEADER.size:])
        if kind == HELLO and self._redeem(ticket):
            threading.Thread(target=self._serve, args=(pending.conn, pending.peer), name="boundary-link",
                             daemon=True).start()
            return True
        log.warning("boundary link refused: no valid ticket", extra={"peer": pending.peer})
        try:  # a few hundred bytes into an empty send buffer: never blocks
            pending.conn.send(frame(ACK, Unauthenticated("a boundary link must open with a ticket from "
                                                         "OpenBoundaryLink", "BAD_LINK_TICKET")
                                    .to_status_proto().SerializeToString()))
        except OSError:
            pass
        pending.conn.close()
        return True

    def _settle(self, pending: _Handshake, waiting: bool) -> None:
        """Takes `pending` out of the slots (it has presented its ticket, or is being closed)."""
        if waiting and self._handshakes.pop(pending.conn, None) is not None:
            self._selector.unregister(pending.conn)

    def _evict(self, pending: _Handshake, why: str) -> None:
        self._settle(pending, waiting=True)
        pending.conn.close()
        with self._lock:
            self.evicted += 1
        log.info("boundary link connection closed before its ticket", extra={"peer": pending.peer, "reason": why})

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            with nodelay(conn):
                conn.setblocking(True)
                conn.sendall(frame(ACK, _OK))
                with self._lock:
                    self.links += 1
                try:
                    self._serve_pushes(conn)
                finally:
                    with self._lock:
                        self.links -= 1
        except (OSError, LinkError, struct.error) as e:
            log.info("boundary link closed", extra={"peer": peer, "reason": str(e)})

    def _serve_pushes(self, conn: socket.socket) -> None:
        device: list[DeviceReceiver] = []  # the sender's GPU buffers this link mapped (transport.py), if any
        try:
            while True:
                kind, payload = read_frame_buffer(conn, self._max_frame_bytes)
                if kind == KV_BEGIN and self._kv_writer is not None:
                    self._serve_kv_write(conn, bytes(payload))
                    continue
                if kind not in (PUSH, DEVICE_PUSH, DEVICE_CHAINED, DEVICE_QUEUED):
                    raise LinkError(f"a frame of kind {kind} where a push was expected")
                copied: list[DeviceValue] = []  # a chained bundle's copies out of the sender's slot
                try:
                    bundles, copied = self._bundles(kind, payload, device)
                    for request, values in bundles:
                        self._accept(request, values)
                    with self._lock:
                        self.pushes += 1
                    answer = _OK
                except Exception as e:  # the sender's step fails with it; this link and everyone else go on
                    answer = _answer(e, "PushBoundaryRequest")
                if copied:  # answered once copied out: the answer frees the sender's slot
                    try:
                        DeviceReceiver.settle(copied)
                    except Exception as e:
                        answer = _answer(Unavailable(f"a chained bundle's copy failed: {type(e).__name__}: {e}",
                                                     DEVICE_FAILED), "PushBoundaryRequest")
                conn.sendall(frame(ACK, answer))
        finally:
            for d in device:
                d.close()

    def _bundles(self, kind: int, payload: bytearray, device: list[DeviceReceiver]
                 ) -> tuple[list[tuple[stage_pb2.PushBoundaryRequest, Sequence[BoundaryValue]]], list[DeviceValue]]:
        """The bundles a push frame brings (a DEVICE_QUEUED frame: a decode run's from its first on, each as its
        iteration's), and a chained bundle's copies out of the sender's slot. Where the bytes are in the sender's GPU
        buffer, the link's DeviceReceiver is made at its first such frame."""
        if kind == PUSH:
            return [read_push(payload)], []
        if not device:
            device.append(self.device_receiver())
        if kind == DEVICE_CHAINED:
            request, copied = device[0].chained(bytes(payload))
            return [(request, copied)], copied
        if kind == DEVICE_PUSH:
            return [device[0].request(bytes(payload))], []
        request, values = device[0].queued(bytes(payload))
        bundles: list[tuple[stage_pb2.PushBoundaryRequest, Sequence[BoundaryValue]]] = [(request, values[0])]
        for k, later in enumerate(values[1:], 1):
            each = stage_pb2.PushBoundaryRequest()
            each.CopyFrom(request)
            each.iteration += k
            bundles.append((each, later))
        return bundles, []

    def _serve_kv_write(self, conn: socket.socket, first: bytes) -> None:
        """One row copy: its first message checked and answered, then its pieces read into two buffers in turn,
        each handed to the engine while the next is read."""
        assert self._kv_writer is not None
        try:
            write = self._kv_writer(stage_pb2.WriteSessionKvRequest.FromString(first))
        except Exception as e:  # refused before any row is sent: the link goes on
            conn.sendall(frame(ACK, _answer(e, "WriteSessionKvRequest")))
            return
        conn.sendall(frame(ACK, _OK))
        buffers = [np.empty(write.piece_bytes, np.uint8) for _ in range(2)]
        puts: list[Future[None] | None] = [None, None]
        error: Exception | None = None
        for j in range(write.pieces):
            b = j % 2
            error = error or _failure(puts[b])  # the engine is done with this buffer
            view, filled = buffers[b].data, 0
            while filled < len(view):
                length, kind = HEADER.unpack(read_exact(conn, HEADER.size))
                if kind != KV_DATA or filled + length > len(view):
                    raise LinkError(f"a frame of kind {kind} and {length} bytes inside a row copy's piece of "
                                    f"{len(view)} bytes")
                read_into(conn, view[filled:filled + length])
                filled += length
            if error is None:  # after a failed piece the rest are read (the framing goes on) but not written
                puts[b] = write.put(j, buffers[b])
        for put in puts:
            error = error or _failure(put)
        try:
            if error is not None:
                raise error
            status = status_pb2.Status()
            status.details.add().Pack(write.finish())
            answer = status.SerializeToString()
            log.info("row copy taken over a link", extra={"bytes": write.pieces * write.piece_bytes})
        except Exception as e:
            answer = _answer(e, "WriteSessionKvRequest")
        conn.sendall(frame(ACK, answer))


def _failure(put: Future[None] | None) -> Exception | None:
    """What a piece's write raised, once it is done; None if it succeeded (or there was none)."""
    if put is None:
        return None
    error = put.exception()
    return error if isinstance(error, Exception) or error is None else RuntimeError(repr(error))


class BoundaryLink:
    """The sending end of one link: pushes go out in the callers' order, and their acknowledgements come back in
    the same order to a reader thread, which calls each push's `delivered`."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.address = address
        self._sock = sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        self._lock = threading.Lock()
        self._pending: deque[tuple[float, Delivered]] = deque()  # (deadline, delivered) in the order sent
        self.broken: GraphmeshError | None = None
        self._cause: GraphmeshError | None = None  # what broke it first
        self._cause_lock = threading.Lock()
        threading.Thread(target=self._read_acks, name=f"boundary-link-{address}", daemon=True).start()
        _watch(self)

    @classmethod
    def connect(cls, address: str, ticket: bytes, timeout_s: float) -> BoundaryLink:
        """Connects to the listener at `address` and presents `ticket`; raises what the listener answered."""
        return cls(connect(address, ticket, timeout_s), address)

    def push(self, parts: Sequence[Buffer], timeout_s: float, delivered: Delivered, kind: int = PUSH) -> bool:
        """Sends a frame of `kind` whose payload is `parts` (transport.push_parts, or a DEVICE_PUSH payload); False
        (nothing sent) when the link is already broken."""
        with self._lock:
            if self.broken is not None:
                return False
            self._pending.append((time.monotonic() + timeout_s, delivered))
            try:
                send_frame(self._sock, kind, parts)
                return True
            except OSError as e:
                reason = str(e)
        self.fail(Unavailable(f"boundary link to {self.address} broke: {reason}", "BOUNDARY_LINK_BROKEN"))
        return True

    def push_now(self, parts: Sequence[Buffer], timeout_s: float, delivered: Delivered) -> bool:
        """Sends a PUSH frame of `parts` only if that cannot block: the link is free (no sender is in `push`) and
        its send buffer has room for the frame. False: nothing was sent (push it the blocking way)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self.broken is not None or self._room() < frame_bytes(parts):
                return False
            self._pending.append((time.monotonic() + timeout_s, delivered))
            try:
                send_frame(self._sock, PUSH, parts)
                return True
            except OSError as e:
                reason = str(e)
        finally:
            self._lock.release()
        self.fail(Unavailable(f"boundary link to {self.address} broke: {reason}", "BOUNDARY_LINK_BROKEN"))
        return True

    def _room(self) -> int:
        """Bytes the send buffer takes now without blocking: half the kernel's figure (the rest is its bookkeeping)
        less what is queued and not yet acknowledged by the peer; 0 where that cannot be read."""
        try:
            queued = struct.unpack("i", fcntl.ioctl(self._sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
            return self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2 - queued
        except (OSError, AttributeError):  # TIOCOUTQ (SIOCOUTQ on a socket) is Linux's
            return 0

    def fail(self, error: GraphmeshError) -> None:
        """Breaks the link: every push it carries fails with `error` (the first cause given, when several threads
        find it broken)."""
        with self._cause_lock:
            self._cause = self._cause or error
        try:
            # Without the lock: this wakes the reader, and a sender blocked (holding the lock) on a peer that
            # stopped reading.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._lock:
            if self.broken is not None:
                return
            self.broken = error = self._cause
            pending, self._pending = list(self._pending), deque()
        self._sock.close()
        for _, delivered in pending:
            delivered(error)

    def overdue(self, now: float) -> bool:
        with self._lock:
            return bool(self._pending) and self._pending[0][0] < now

    def _read_acks(self) -> None:
        try:
            while True:
                kind, payload = read_frame(self._sock, 1 << 20)
                if kind != ACK:
                    raise LinkError(f"a frame of kind {kind} where an acknowledgement was expected")
                error = from_status_proto(status_pb2.Status.FromString(payload))
                with self._lock:
                    if not self._pending:
                        raise LinkError("an acknowledgement of nothing")
                    _, delivered = self._pending.popleft()
                delivered(error)
        except Exception as e:
            self.fail(Unavailable(f"boundary link to {self.address} broke: {e}", "BOUNDARY_LINK_BROKEN"))


_links: list[BoundaryLink] = []
_watch_lock = threading.Lock()


def _watch(link: BoundaryLink) -> None:
    """Checks `link` against its pushes' deadlines from one thread for every link of the process."""
    with _watch_lock:
        _links.append(link)
        if len(_links) == 1:
            threading.Thread(target=_watch_loop, name="boundary-link-deadlines", daemon=True).start()


def _watch_loop() -> None:
    while True:
        time.sleep(WATCH_PERIOD_S)
        now = time.monotonic()
        with _watch_lock:
            _links[:] = [link for link in _links if link.broken is None]
            overdue = [link for link in _links if link.overdue(now)]
            if not _links:
                return
        for link in overdue:
            link.fail(DeadlineExceeded(f"a boundary pushed to {link.address} was not taken in time",
                                       "BOUNDARY_LINK_TIMEOUT"))
