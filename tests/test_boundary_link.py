"""Boundary links (graphmesh_executor/boundary_link.py), the data plane between ranks: what a link takes and
answers, its deadlines, and the gRPC path a rank without one is pushed to. The links a mesh opens carry every
boundary of the other mesh tests; test_fault_tolerance.py checks a link's tickets and bad frames on a live mesh."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.rpc import status_pb2

from graphmesh import channels
from graphmesh import plan as dag
from graphmesh.errors import DeadlineExceeded, GraphmeshError, from_rpc_error
from graphmesh.launcher import LocalMesh, free_port
from graphmesh.links import ACK, HEADER, HELLO, PUSH, KvLink, KvLinks, LinkError, frame, read_frame
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from graphmesh_executor import boundary_link, transport
from graphmesh_executor.boundary_link import BoundaryLink
from graphmesh_executor.stage_servicer import BoundaryPusher
from graphmesh_executor.stage_types import Boundary
from graphmesh_server import faults
from tests.conftest import executor_args, start_process
from tests.model_fixtures import make_tiny_llama


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
    assert link.push([b"first"], 0.3, results[0].set_result)
    assert link.push([b"second"], 30.0, results[1].set_result)
    errors = [r.result(timeout=10) for r in results]
    assert time.monotonic() - t0 < 5.0  # the first deadline broke the link, the second push with it
    assert all(isinstance(e, DeadlineExceeded) and e.reason == "BOUNDARY_LINK_TIMEOUT" for e in errors), errors
    assert listener.frames == [PUSH, PUSH]
    assert not link.push([b"third"], 1.0, lambda _: None)  # a broken link sends nothing more


def test_a_push_now_never_blocks_on_a_next_rank_that_stopped_reading() -> None:
    """push_now is how the engine sends: it must decline (send nothing) once the link's buffers are full, never
    block; what it sent is taken, and acknowledged in order, when the next rank reads again."""
    listener = _Listener(acks=True, stalled=True)
    link = BoundaryLink.connect(listener.address, b"t" * 32, 5.0)
    payload = b"x" * (256 << 10)
    delivered: list[Future[Exception | None]] = []
    for _ in range(1000):  # the send buffer (4 MiB) and the peer's receive buffer fill long before this
        done: Future[Exception | None] = Future()
        if not link.push_now([payload], 30.0, done.set_result):
            break
        delivered.append(done)
    else:
        pytest.fail("push_now kept sending to a next rank that reads nothing")
    assert delivered, "an idle link took nothing at once"
    assert not any(d.done() for d in delivered)
    listener.reading.set()
    assert [d.result(timeout=30) for d in delivered] == [None] * len(delivered)
    assert link.push_now([payload], 30.0, lambda _: None)  # room again once the next rank reads
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


class _Flood:
    """A connection flood on a link listener, kept up until closed: `junk` connections that never send a byte
    and `slow` ones that send a HELLO header announcing a ticket, then a byte every `every_s`. Each one the
    listener closes is opened again (at most `reopen` a tick), as a hostile client would."""

    def __init__(self, address: str, junk: int = 300, slow: int = 24, every_s: float = 2.0, reopen: int = 20) -> None:
        host, port = address.rsplit(":", 1)
        self.target = (host or "127.0.0.1", int(port))
        self.wanted, self.every_s, self.reopen = {"junk": junk, "slow": slow}, every_s, reopen
        self.conns: dict[str, list[socket.socket]] = {"junk": [], "slow": []}
        self.closed = {"junk": 0, "slow": 0}  # connections the listener closed
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self, kind: str) -> None:
        try:
            conn = socket.create_connection(self.target, timeout=5)
        except OSError:
            return
        conn.setblocking(False)
        if kind == "slow":
            conn.send(HEADER.pack(32, HELLO)[:1])
        self.conns[kind].append(conn)

    def _run(self) -> None:
        last_byte = time.monotonic()
        while not self.stop.is_set():
            for kind, conns in self.conns.items():
                if conns:
                    readable, _, _ = select.select(conns, [], [], 0)
                    for conn in readable:  # nothing is ever sent to a flood connection: readable means closed
                        conns.remove(conn)
                        conn.close()
                        self.closed[kind] += 1
                for _ in range(min(self.reopen, self.wanted[kind] - len(conns))):
                    self._open(kind)
            if time.monotonic() - last_byte >= self.every_s:
                last_byte = time.monotonic()
                for conn in self.conns["slow"]:
                    try:
                        conn.send(b"\0")
                    except OSError:
                        pass
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for conns in self.conns.values():
            for conn in conns:
                conn.close()


def test_a_link_opens_while_its_listener_is_flooded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42 item 5: junk connections fill every pre-ticket slot and slow senders dribble a HELLO a byte every
    2 s; a connection that presents a valid ticket still gets a link, and the slow ones are closed once their
    HELLO_TIMEOUT_S is up, however often they send a byte."""
    monkeypatch.setattr(boundary_link, "HELLO_TIMEOUT_S", 3.0)
    taken: list[stage_pb2.PushBoundaryRequest] = []
    listener = boundary_link.LinkListener("127.0.0.1", 0, lambda request, values: taken.append(request),
                                           1 << 20)
    address = f"127.0.0.1:{listener.port}"
    flood = _Flood(address, junk=2 * boundary_link.MAX_HANDSHAKES, slow=24)
    try:
        deadline = time.monotonic() + 30
        while len(flood.conns["junk"]) + len(flood.conns["slow"]) < boundary_link.MAX_HANDSHAKES:
            assert time.monotonic() < deadline, "the flood never filled the slots"
            time.sleep(0.05)
        for step in range(3):  # again and again while the flood goes on
            link = BoundaryLink.connect(address, listener.ticket(), 5.0)
            done: Future[Exception | None] = Future()
            assert link.push(transport.push_parts(stage_pb2.PushBoundaryRequest(step_id=step), []), 10.0,
                             done.set_result)
            assert done.result(timeout=10) is None
            link.fail(DeadlineExceeded("done", "TEST"))
            time.sleep(1.0)
        assert [r.step_id for r in taken] == [0, 1, 2]
        while flood.closed["slow"] < 24:  # each slow sender is closed at its deadline (or evicted sooner)
            assert time.monotonic() < deadline, f"slow senders kept their slots: {flood.closed}"
            time.sleep(0.1)
        assert listener.evicted >= 24 + boundary_link.MAX_HANDSHAKES
        # A wrong ticket during the flood is still refused, and answered so.
        with pytest.raises(GraphmeshError) as e:
            BoundaryLink.connect(address, b"x" * 32, 5.0)
        assert e.value.reason == "BAD_LINK_TICKET"
    finally:
        flood.close()


def _listener_address(mesh: LocalMesh, address: str) -> str:
    """An executor's link listener, asked for as a mesh member (OpenBoundaryLink)."""
    with channels.channel(address, None, mesh_token=mesh.mesh_token) as channel:
        answer = stage_pb2_grpc.StageServiceStub(channel).OpenBoundaryLink(stage_pb2.OpenBoundaryLinkRequest(),
                                                                           timeout=10)
    host, port = answer.address.rsplit(":", 1)
    return f"{host or '127.0.0.1'}:{port}"


def _generate(mesh: LocalMesh) -> list[list[int]]:
    with grpc.insecure_channel(mesh.coordinator_address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        return [[t for r in stub.Generate(coordinator_pb2.GenerateRequest(
            prompt_token_ids=[5, 17, 99, 3, 42 + seed], max_tokens=12, ignore_eos=True,
            sampling=stage_pb2.SamplingParams(temperature=0.8, top_k=50, seed=seed)), timeout=60) for t in r.token_ids]
                for seed in range(2)]


def _links_opened(log: Path) -> list[str]:
    """The links an executor opened to next ranks (their listeners' addresses), and any it failed to open."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [line["link"] if "link" in line else f"FAILED {line.get('error')}" for line in lines
            if line.get("msg") in ("boundary link open", "boundary link failed to open: pushing over gRPC")]


def test_a_replan_links_under_a_connection_flood(tmp_path: Path) -> None:
    """Issue 42 item 5, end to end: a flood on the link listener of executor 2 (junk connections, and slow senders
    dribbling a HELLO), then executor 1 is killed: the re-plan over executors 0 and 2 opens a link from 0 to 2
    through the flood (not a fallback to gRPC), and every token is what it was before."""
    model = make_tiny_llama(tmp_path / "llama", layers=3)
    with LocalMesh(3, "numpy", str(model), kvstore=False, log_dir=str(tmp_path / "logs")) as mesh:
        baseline = _generate(mesh)
        target = _listener_address(mesh, mesh.executor_addresses[2])
        flood = _Flood(target, junk=300, slow=24)
        try:
            deadline = time.monotonic() + 30
            while flood.closed["junk"] < 300:  # 300 junk connections turned away, and more coming
                assert time.monotonic() < deadline, f"the flood never filled the slots: {flood.closed}"
                time.sleep(0.1)
            before = _links_opened(mesh.log("executor-0"))
            faults.kill9(mesh.executor_processes[1])
            assert _generate(mesh) == baseline
            opened = _links_opened(mesh.log("executor-0"))[len(before):]
            assert target in opened and not [o for o in opened if o.startswith("FAILED")], opened
            # and a fresh link from a member, during the same flood, is answered on its first push
            link = BoundaryLink.connect(target, _ticket(mesh, mesh.executor_addresses[2]), 10.0)
            done: Future[Exception | None] = Future()
            stale = stage_pb2.PushBoundaryRequest(header=stage_pb2.FencingHeader(incarnation=1), step_id=1)
            assert link.push(transport.push_parts(stale, []), 10.0, done.set_result)
            error = done.result(timeout=30)
            assert isinstance(error, GraphmeshError) and error.reason == "STALE_INCARNATION", error
            link.fail(DeadlineExceeded("done", "TEST"))
            assert flood.closed["slow"] > 0, "slow senders kept their slots"
        finally:
            flood.close()
        assert _generate(mesh) == baseline


def _ticket(mesh: LocalMesh, address: str) -> bytes:
    with channels.channel(address, None, mesh_token=mesh.mesh_token) as channel:
        return stage_pb2_grpc.StageServiceStub(channel).OpenBoundaryLink(stage_pb2.OpenBoundaryLinkRequest(),
                                                                         timeout=10).ticket


def test_a_link_closed_before_its_answer_falls_back_to_grpc() -> None:
    """A listener that closes a new connection before answering its HELLO (as a flooded one did) is a link that
    could not be opened: the row copy goes over gRPC (take answers None), it does not fail with LinkError."""
    server = socket.create_server(("127.0.0.1", 0))

    def close_at_once() -> None:
        conn, _ = server.accept()
        conn.close()

    class Stub:  # answers OpenBoundaryLink with that listener and a ticket
        def OpenBoundaryLink(self, request: stage_pb2.OpenBoundaryLinkRequest,
                             timeout: float) -> stage_pb2.OpenBoundaryLinkResponse:
            return stage_pb2.OpenBoundaryLinkResponse(address=f"127.0.0.1:{server.getsockname()[1]}",
                                                      ticket=b"t" * 32)

    with server:
        accepting = threading.Thread(target=close_at_once, daemon=True)
        accepting.start()
        assert KvLinks(tls=False).take("127.0.0.1:1", Stub(), 5.0) is None  # type: ignore[arg-type]
        accepting.join(5)


_LOW_LIMIT_LISTENER = """
import resource, sys
from graphmesh_executor.boundary_link import LinkListener
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
listener = LinkListener("127.0.0.1", 0, lambda request, values: None, 1 << 20)
print(listener.port, flush=True)
for _ in sys.stdin:  # a line asks for a ticket
    print(listener.ticket().hex(), flush=True)
"""


def test_a_link_opens_while_the_flood_has_taken_every_descriptor() -> None:
    """A listener whose process runs out of descriptors before its slots fill (a limit of 64, 128 slots) frees the
    oldest pre-ticket connection's to accept the next: a connection with a ticket still links."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", _LOW_LIMIT_LISTENER, "64"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdin is not None and process.stdout is not None
    flood = None
    try:
        address = f"127.0.0.1:{int(process.stdout.readline())}"
        flood = _Flood(address, junk=200, slow=0)
        deadline = time.monotonic() + 30
        while flood.closed["junk"] < 200:  # past the descriptor limit, and more coming
            assert time.monotonic() < deadline, f"the flood never reached the limit: {flood.closed}"
            time.sleep(0.05)
        for _ in range(3):
            process.stdin.write("ticket\n")
            process.stdin.flush()
            link = BoundaryLink.connect(address, bytes.fromhex(process.stdout.readline()), 5.0)
            done: Future[Exception | None] = Future()
            assert link.push(transport.push_parts(stage_pb2.PushBoundaryRequest(step_id=1), []), 10.0,
                             done.set_result)
            assert done.result(timeout=10) is None
            link.fail(DeadlineExceeded("done", "TEST"))
    finally:
        if flood is not None:
            flood.close()
        process.kill()
        process.wait()
