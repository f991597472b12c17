"""The sending end of executors' links: the framing, and row copies into an executor's session over a link.

An executor with a link listener (graphmesh_executor/boundary_link.py, the receiving end) takes boundary bundles
and KV row copies over plain TCP instead of gRPC; a sender asks it for a link with StageService.OpenBoundaryLink
(authenticated like every mesh call), which answers the listener's address and a one-time ticket that the link's
first frame (HELLO) must carry. Links are plain TCP, so a TLS mesh never opens one: its senders stay on gRPC.

    frame = length (u32, little-endian, bytes of the payload) | kind (u8) | payload

Row copies (KvLink) come from two senders: an executor pushing a session's rows to another (PushSessionKv) and the
KV store seeding a session with stored rows (SeedStages, SeedExecutor). Each is one copy at a time on its link: a
KV_BEGIN frame (the WriteSessionKvRequest WriteSessionKv starts with: header, start row, token ids, and the rows'
name, dtype and shape f32 [n, layers, 2, kv_dim]), an ACK once the receiver has checked it as WriteSessionKv's
would be and reserved the session's blocks, then the rows a piece at a time, K then V of each layer, f32
[n, kv_dim] each (one or more KV_DATA frames a piece), and a final ACK carrying the WriteSessionKvResponse. No byte
is parsed or transposed on the way: a WriteSessionKv stream copies every 1 MiB chunk into and out of a message.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence

import grpc
from google.rpc import status_pb2

from graphmesh import dtypes
from graphmesh.errors import GraphmeshError, Unavailable, from_rpc_error, from_status_proto
from graphmesh.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

log = logging.getLogger("graphmesh.links")

HEADER = struct.Struct("<IB")
HELLO, PUSH, ACK, KV_BEGIN, KV_DATA = 1, 2, 3, 4, 5  # frame kinds
OPEN_TIMEOUT_S = 5.0  # at most, for OpenBoundaryLink and the connection's HELLO


class LinkError(Exception):
    """The peer broke the framing: the connection is closed."""


def read_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise LinkError("the connection closed")
        got += k


def read_exact(sock: socket.socket, n: int) -> bytes:
    return bytes(read_buffer(sock, n))


def read_buffer(sock: socket.socket, n: int) -> bytearray:
    """read_exact without the copy into bytes: what a push's tensors are read into, and stay in."""
    data = bytearray(n)
    read_into(sock, memoryview(data))
    return data


def read_frame(sock: socket.socket, max_bytes: int) -> tuple[int, bytes]:
    kind, payload = read_frame_buffer(sock, max_bytes)
    return kind, bytes(payload)


def read_frame_buffer(sock: socket.socket, max_bytes: int) -> tuple[int, bytearray]:
    length, kind = HEADER.unpack(read_exact(sock, HEADER.size))
    if length > max_bytes:
        raise LinkError(f"a frame of {length} bytes, over the limit of {max_bytes}")
    return kind, read_buffer(sock, length)


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


Buffer = bytes | bytearray | memoryview


def frame_bytes(parts: Sequence[Buffer]) -> int:
    """The length of a frame whose payload is `parts`, its header included."""
    return HEADER.size + sum(len(p) for p in parts)


def send_frame(sock: socket.socket, kind: int, parts: Sequence[Buffer]) -> None:
    """Sends frame(kind, b"".join(parts)) without joining them: the parts go to the kernel where they are (one
    sendmsg, repeated for what it did not take), so a tensor's bytes are copied only into the socket."""
    views = [memoryview(p).cast("B") for p in (HEADER.pack(frame_bytes(parts) - HEADER.size, kind), *parts) if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect(address: str, ticket: bytes, timeout_s: float) -> socket.socket:
    """A connection to the link listener at `address` that `ticket` admitted; raises what the listener answered."""
    host, port = address.rsplit(":", 1)
    sock = nodelay(socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s))
    try:
        sock.sendall(frame(HELLO, ticket))
        check_ack(sock, address)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock


def check_ack(sock: socket.socket, address: str) -> status_pb2.Status:
    """The next acknowledgement on `sock`; raises the error it carries."""
    kind, payload = read_frame(sock, 1 << 16)
    if kind != ACK:
        raise Unavailable(f"the link at {address} answered a frame of kind {kind}", "BOUNDARY_LINK_BROKEN")
    status = status_pb2.Status.FromString(payload)
    error = from_status_proto(status)
    if error is not None:
        raise error
    return status


def _send_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Sends every byte of `buffers` in order, up to IOV_MAX of them a system call."""
    pending = [b for b in buffers if len(b)]
    while pending:
        sent = sock.sendmsg(pending[:1024])
        while sent:
            if sent >= len(pending[0]):
                sent -= len(pending.pop(0))
            else:
                pending[0], sent = pending[0][sent:], 0


class KvLink:
    """The sending end of a link for row copies: one copy at a time, its caller waiting for the answer."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.address = address
        self._sock = sock

    @classmethod
    def connect(cls, address: str, ticket: bytes, timeout_s: float) -> KvLink:
        return cls(connect(address, ticket, timeout_s), address)

    def write(self, first: stage_pb2.WriteSessionKvRequest, shape: Sequence[int], pieces: Iterable[list[memoryview]],
              timeout_s: float) -> stage_pb2.WriteSessionKvResponse:
        """Writes rows f32 `shape` [n, layers, 2, kv_dim] into the session `first` names (its header, start row and
        token ids), given a piece at a time (K then V of each layer, f32 [n, kv_dim] each, as the little-endian byte
        buffers that hold it in order: one frame each, written with scatter-gather sends); raises the receiver's
        refusal as it sent it, and Unavailable when the link breaks (it is then closed)."""
        begin = stage_pb2.WriteSessionKvRequest()
        begin.CopyFrom(first)
        begin.rows.CopyFrom(tensor_pb2.TensorChunk(name="kv", dtype=dtypes.to_proto("f32"), shape=shape))
        try:
            self._sock.settimeout(timeout_s)
            self._sock.sendall(frame(KV_BEGIN, begin.SerializeToString()))
            check_ack(self._sock, self.address)  # the receiver took the header and reserved the session's blocks
            for buffers in pieces:
                self._sock.sendall(HEADER.pack(sum(len(b) for b in buffers), KV_DATA))
                _send_buffers(self._sock, buffers)
            status = check_ack(self._sock, self.address)
        except (OSError, LinkError, struct.error) as e:
            self.close()
            raise Unavailable(f"row copy link to {self.address} broke: {e}", "BOUNDARY_LINK_BROKEN") from e
        except BaseException:  # reading a piece failed half-way: the receiver's copy ends with the connection
            self.close()
            raise
        response = stage_pb2.WriteSessionKvResponse()
        if not status.details or not status.details[0].Unpack(response):
            self.close()
            raise Unavailable(f"the link at {self.address} answered a row copy without its result",
                              "BOUNDARY_LINK_BROKEN")
        return response

    def closed_by_peer(self) -> bool:
        """Whether an idle link was closed at the other end (its executor restarted, or dropped the connection):
        nothing is due on an idle link, so anything readable (the end of the stream, or bytes out of turn) means
        it cannot carry a copy."""
        try:
            self._sock.settimeout(0)  # a socket with a timeout would wait that long for something to read
            self._sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    def close(self) -> None:
        self._sock.close()


class LinkOpener:
    """Asks ranks for links (StageService.OpenBoundaryLink) and remembers which ranks have none, so that a sender
    asks those again only after NO_LINK_RETRY_S."""

    NO_LINK_RETRY_S = 30.0

    def __init__(self) -> None:
        self._no_link_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def may_have_link(self, address: str) -> bool:
        with self._lock:
            return time.monotonic() >= self._no_link_until.get(address, 0.0)

    def ticket(self, stub: stage_pb2_grpc.StageServiceStub, address: str, timeout_s: float) -> tuple[str, bytes] | None:
        """The listener address and a ticket for a link to the rank at `address`; None when it has no link (or
        could not answer: then the caller goes by gRPC this time)."""
        opened = self.open(stub, address, timeout_s)
        return None if opened is None else (opened[0], opened[1].ticket)

    def open(self, stub: stage_pb2_grpc.StageServiceStub, address: str, timeout_s: float,
             request: stage_pb2.OpenBoundaryLinkRequest | None = None,
             ) -> tuple[str, stage_pb2.OpenBoundaryLinkResponse] | None:
        """`ticket`, with the whole answer (the receiver's end and the transport it chose for `request`'s sender)."""
        try:
            answer = stub.OpenBoundaryLink(request or stage_pb2.OpenBoundaryLinkRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            error = from_rpc_error(e)
            if e.code() is grpc.StatusCode.UNIMPLEMENTED or error.reason == "NO_BOUNDARY_LINK":
                with self._lock:
                    self._no_link_until[address] = time.monotonic() + self.NO_LINK_RETRY_S
            log.info("no link: sending over gRPC", extra={"address": address, "reason": error.reason})
            return None
        host, port = answer.address.rsplit(":", 1)
        return f"{host or address.rsplit(':', 1)[0]}:{port}", answer


class KvLinks:
    """Row-copy links to executors, by address: opened on first use, kept open between copies (one copy at a time
    on each, so as many as the copies a destination takes at once). None where there can be no link: on a TLS mesh,
    or to an executor without a listener; the caller then writes over WriteSessionKv."""

    def __init__(self, tls: bool) -> None:
        self.enabled = not tls  # links are plain TCP
        self._idle: dict[str, list[KvLink]] = {}
        self._opener = LinkOpener()
        self._lock = threading.Lock()

    def take(self, address: str, stub: stage_pb2_grpc.StageServiceStub, timeout_s: float) -> KvLink | None:
        """An idle link to `address`, else a new one; None when it has none, or opening one failed."""
        if not self.enabled or not self._opener.may_have_link(address):
            return None
        while True:
            with self._lock:
                idle = self._idle.get(address)
                link = idle.pop() if idle else None
            if link is None:
                break
            if not link.closed_by_peer():
                return link
            link.close()  # an idle link outlived its executor: a copy on it would fail for nothing
        timeout_s = min(timeout_s, OPEN_TIMEOUT_S)
        try:
            ticket = self._opener.ticket(stub, address, timeout_s)
            return None if ticket is None else KvLink.connect(*ticket, timeout_s)
        except (OSError, GraphmeshError, ValueError, LinkError) as e:  # LinkError: closed before it answered
            log.warning("row copy link failed to open: copying over gRPC", extra={"address": address, "error": str(e)})
            return None

    def give_back(self, address: str, link: KvLink) -> None:
        """Returns a link that carries no copy (any more) to the idle ones."""
        with self._lock:
            self._idle.setdefault(address, []).append(link)

    def write(self, address: str, link: KvLink, first: stage_pb2.WriteSessionKvRequest, shape: Sequence[int],
              pieces: Iterable[list[memoryview]], timeout_s: float) -> stage_pb2.WriteSessionKvResponse:
        """KvLink.write on a link taken for `address`: back to the idle ones after the copy, closed when it
        failed (the receiver's refusal or a broken link, raised as KvLink.write raises them)."""
        try:
            reply = link.write(first, shape, pieces, timeout_s)
        except BaseException:
            link.close()
            raise
        self.give_back(address, link)
        return reply

    def close(self, keep: Iterable[str] = ()) -> None:
        """Closes the idle links to every address but those in `keep`."""
        kept = set(keep)
        with self._lock:
            dropped = [links for address, links in self._idle.items() if address not in kept]
            self._idle = {address: links for address, links in self._idle.items() if address in kept}
        for links in dropped:
            for link in links:
                link.close()
