"""Boundary links (graphmesh_executor/boundary_link.py), the data plane between ranks: what a link takes and
answers, its deadlines, and the gRPC path a rank without one is pushed to. The links a mesh opens carry every
boundary of the other mesh tests; test_fault_tolerance.py checks a link's tickets and bad frames on a live mesh."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import grpc
import numpy as np
import pytest
from google.rpc import status_pb2

from graphmesh import channels
from graphmesh import plan as dag
from graphmesh.errors import DeadlineExceeded, GraphmeshError, from_rpc_error
from graphmesh.launcher import free_port
from graphmesh.links import ACK, HELLO, PUSH, KvLink, KvLinks, LinkError, frame, read_frame
from graphmesh.v1 import stage_pb2, stage_pb2_grpc
from graphmesh_executor.boundary_link import BoundaryLink
from graphmesh_executor.stage import Boundary
from graphmesh_executor.stage_servicer import BoundaryPusher
from tests.conftest import executor_args, start_process


@pytest.fixture(scope="module")
def linkless_executor() -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    with start_process(executor_args(address, "--boundary-link-port", "off"), address):
        yield address


def _pushed(pusher: BoundaryPusher, address: str, boundary: Boundary) -> Exception | None:
    done: Future[Exception | None] = Future()
    pusher(address, 7, boundary, 10.0, done.set_result)
    return done.result(timeout=30)


def test_a_rank_without_a_link_is_pushed_to_over_grpc(linkless_executor: str) -> None:
    stub = stage_pb2_grpc.StageServiceStub(channels.channel(linkless_executor, None))
    with pytest.raises(grpc.RpcError) as e:
        stub.OpenBoundaryLink(stage_pb2.OpenBoundaryLinkRequest(), timeout=10)
    assert from_rpc_error(e.value).reason == "NO_BOUNDARY_LINK"
    pusher = BoundaryPusher()
    boundary = Boundary(1, values={dag.ACTIVATION: np.zeros((2, 8), np.float32)})
    for _ in range(2):  # the second push does not ask for a link again, and goes the same way
        error = _pushed(pusher, linkless_executor, boundary)
        # PushBoundary's own answer: this executor was never installed, so no incarnation is current
        assert isinstance(error, GraphmeshError) and error.code is grpc.StatusCode.FAILED_PRECONDITION
        assert error.reason == "NOT_INSTALLED"
    assert not pusher._links


class _Listener:
    """A link listener that admits any ticket, then reads pushes (once `reading` is set: at once unless `stalled`)
    and acknowledges them if `acks` (a frozen next rank never does)."""

    def __init__(self, acks: bool, stalled: bool = False) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.frames: list[int] = []
        self.acks = acks
        self.reading = threading.Event()
        if not stalled:
            self.reading.set()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        kind, _ = read_frame(conn, 64)
        assert kind == HELLO
        conn.sendall(frame(ACK, status_pb2.Status().SerializeToString()))
        self.reading.wait()
        try:
            while True:
                kind, _ = read_frame(conn, 1 << 20)
                self.frames.append(kind)
                if self.acks:
                    conn.sendall(frame(ACK, status_pb2.Status().SerializeToString()))
        except LinkError:
            pass  # the sender gave up on this link


def test_a_push_that_is_never_taken_fails_at_its_deadline_and_breaks_the_link() -> None:
    listener = _Listener(acks=False)
    link = BoundaryLink.connect(listener.address, b"t" * 32, 5.0)
    results: list[Future[Exception | None]] = [Future(), Future()]
    t0 = time.monotonic()
    assert link.push(b"first", 0.3, results[0].set_result)
    assert link.push(b"second", 30.0, results[1].set_result)
    errors = [r.result(timeout=10) for r in results]
    assert time.monotonic() - t0 < 5.0  # the first deadline broke the link, the second push with it
    assert all(isinstance(e, DeadlineExceeded) and e.reason == "BOUNDARY_LINK_TIMEOUT" for e in errors), errors
    assert listener.frames == [PUSH, PUSH]
    assert not link.push(b"third", 1.0, lambda _: None)  # a broken link sends nothing more


def test_a_push_now_never_blocks_on_a_next_rank_that_stopped_reading() -> None:
    """push_now is how the engine sends: it must decline (send nothing) once the link's buffers are full, never
    block; what it sent is taken, and acknowledged in order, when the next rank reads again."""
    listener = _Listener(acks=True, stalled=True)
    link = BoundaryLink.connect(listener.address, b"t" * 32, 5.0)
    payload = b"x" * (256 << 10)
    delivered: list[Future[Exception | None]] = []
    for _ in range(1000):  # the send buffer (4 MiB) and the peer's receive buffer fill long before this
        done: Future[Exception | None] = Future()
        if not link.push_now(payload, 30.0, done.set_result):
            break
        delivered.append(done)
    else:
        pytest.fail("push_now kept sending to a next rank that reads nothing")
    assert delivered, "an idle link took nothing at once"
    assert not any(d.done() for d in delivered)
    listener.reading.set()
    assert [d.result(timeout=30) for d in delivered] == [None] * len(delivered)
    assert link.push_now(payload, 30.0, lambda _: None)  # room again once the next rank reads
    assert link.broken is None


def test_an_idle_row_copy_link_whose_executor_went_away_is_not_used_again(linkless_executor: str) -> None:
    """A row copy (an executor's PushSessionKv, the store's seeds) reuses an idle link unless its executor closed it
    (it restarted): a copy on that link would fail, failing a seed that a fresh link (or gRPC) would carry."""
    server = socket.create_server(("127.0.0.1", 0))
    stub = stage_pb2_grpc.StageServiceStub(channels.channel(linkless_executor, None))
    links = KvLinks(tls=False)
    with server:
        kept, dropped = (KvLink(socket.create_connection(server.getsockname()), linkless_executor) for _ in range(2))
        peers = [server.accept()[0] for _ in range(2)]
        links.give_back(linkless_executor, kept)
        assert links.take(linkless_executor, stub, 5.0) is kept  # its peer is still there
        peers[1].close()  # the executor at the other end of `dropped` is gone
        select.select([dropped._sock], [], [], 5.0)  # its end of the stream has arrived
        links.give_back(linkless_executor, dropped)
        # dropped is closed and not handed out; the executor has no listener now, so the copy goes by gRPC
        assert links.take(linkless_executor, stub, 5.0) is None
        assert dropped._sock.fileno() == -1 and kept._sock.fileno() != -1
        kept.close()
        peers[0].close()
    assert KvLinks(tls=True).take(linkless_executor, stub, 5.0) is None  # never on a TLS mesh: links are plain TCP
