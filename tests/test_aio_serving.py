"""aio_serving's streams of synchronous behaviors that yield Waits: woken many at a time, they are advanced in
batches (one pool task, one loop wakeup for all of them) and every stream still gets exactly its own items, in
order; an error after items ends the stream after them; a client that leaves closes its behavior."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from graphmesh.launcher import free_port
from graphmesh_server import aio_serving
from graphmesh_server.aio_serving import AioServer, Wait, deferred_wakes

STREAMS, ROUNDS = 48, 6


class Feeder:
    """Plays a scheduler: each round, puts one item on every stream's queue and wakes them all in one batch."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[int, list[bytes]] = {}
        self.wakers: dict[int, Any] = {}
        self.closed: list[int] = []

    def stream(self, request: bytes, context: Any) -> Iterator[Any]:
        key = int(request)
        with self.lock:
            self.queues[key] = []
        try:
            sent = 0
            while sent < ROUNDS:
                wait = Wait(5.0)
                with self.lock:
                    self.wakers[key] = wait.wake  # armed before looking, as generation.py does
                    ready, self.queues[key] = self.queues[key], []
                if not ready:
                    yield wait
                    continue
                for item in ready:
                    if item == b"boom":
                        context.abort(grpc.StatusCode.UNAVAILABLE, f"stream {key} failed")
                    yield item
                    sent += 1
        finally:
            with self.lock:
                self.closed.append(key)

    def round(self, n: int, keys: list[int], last: bytes = b"") -> None:
        with self.lock:
            for key in keys:
                self.queues[key].append(last or f"{key}:{n}".encode())
            wakers = [self.wakers.get(key) for key in keys]
        with deferred_wakes():
            for wake in wakers:
                if wake is not None:
                    wake()


@contextlib.contextmanager
def serving(stream: Callable[[bytes, Any], Iterator[Any]], pool: futures.ThreadPoolExecutor) -> Iterator[str]:
    """An AioServer on `pool` whose one method, /t.T/S, streams `stream`'s items; its address."""
    server = AioServer(pool)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"S": grpc.unary_stream_rpc_method_handler(stream)}),))
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    try:
        yield address
    finally:
        server.stop(None).wait(10)
        pool.shutdown(wait=False)


@pytest.fixture
def served() -> Iterator[tuple[str, Feeder]]:
    feeder = Feeder()
    with serving(feeder.stream, futures.ThreadPoolExecutor(8)) as address:
        yield address, feeder


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_streams_woken_together_each_get_their_own_items_in_order_with_one_loop_wakeup_a_batch(
        served: tuple[str, Feeder], monkeypatch: pytest.MonkeyPatch) -> None:
    address, feeder = served
    posts: list[int] = []
    post = aio_serving._Wakeups.post

    def counted(self: aio_serving._Wakeups) -> None:
        posts.append(1)
        post(self)
    monkeypatch.setattr(aio_serving._Wakeups, "post", counted)
    keys = list(range(STREAMS))
    with grpc.insecure_channel(address) as channel:
        call: Any = channel.unary_stream("/t.T/S")
        calls = [call(str(k).encode(), timeout=60) for k in keys]
        got: dict[int, list[bytes]] = {k: [] for k in keys}

        def read(k: int) -> None:
            got[k] = list(calls[k])
        readers = [threading.Thread(target=read, args=(k,)) for k in keys]
        for r in readers:
            r.start()
        _until(lambda: len(feeder.wakers) == STREAMS, "every stream waits")
        for n in range(ROUNDS):
            before = len(posts)
            _until(lambda: all(not q for q in feeder.queues.values()), "the last round taken")
            feeder.round(n, keys)
            assert len(posts) - before <= 1  # the whole round woke the loop once
        for r in readers:
            r.join(60)
    assert posts and got == {k: [f"{k}:{n}".encode() for n in range(ROUNDS)] for k in keys}
    _until(lambda: len(feeder.closed) == STREAMS, "every behavior ended")


def test_an_error_after_items_ends_only_its_stream_after_them(served: tuple[str, Feeder]) -> None:
    address, feeder = served
    with grpc.insecure_channel(address) as channel:
        call: Any = channel.unary_stream("/t.T/S")
        good, bad = call(b"1", timeout=60), call(b"2", timeout=60)
        _until(lambda: len(feeder.wakers) == 2, "both streams wait")
        feeder.round(0, [1, 2])
        assert next(good) == b"1:0" and next(bad) == b"2:0"
        with feeder.lock:
            feeder.queues[2].append(b"2:1")
        feeder.round(1, [2], last=b"boom")  # an item, then the failure, in one batch
        feeder.round(1, [1])
        assert next(good) == b"1:1"
        assert next(bad) == b"2:1"
        with pytest.raises(grpc.RpcError) as failed:
            next(bad)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "stream 2 failed" in str(failed.value.details())


def test_a_client_that_leaves_a_waiting_stream_closes_its_behavior(served: tuple[str, Feeder]) -> None:
    address, feeder = served
    with grpc.insecure_channel(address) as channel:
        stub: Any = channel.unary_stream("/t.T/S")
        call = stub(b"7", timeout=60)
        _until(lambda: 7 in feeder.wakers, "the stream waits")
        feeder.round(0, [7])
        assert next(call) == b"7:0"
        call.cancel()
        _until(lambda: feeder.closed == [7], "its behavior closed")


def test_code_after_a_wait_now_runs_alone_and_holds_back_no_other_stream() -> None:
    """Two batched streams each yield an item and Wait.now(); the code after it blocks in one of them (a session's
    end waiting for the scheduler's lock): the other's next item still comes."""
    unblock, wakers = threading.Event(), {}

    def stream(request: bytes, context: Any) -> Iterator[Any]:
        wait = Wait(30.0)
        wakers[request] = wait.wake
        yield wait  # from here on the stream is advanced in batches
        yield request + b":first"
        yield Wait.now()
        if request == b"B":
            unblock.wait(30)
        yield request + b":second"

    with serving(stream, futures.ThreadPoolExecutor(8)) as address, grpc.insecure_channel(address) as channel:
        try:
            stub: Any = channel.unary_stream("/t.T/S")
            a, b = stub(b"A", timeout=10), stub(b"B", timeout=30)
            _until(lambda: len(wakers) == 2, "both streams wait")
            with deferred_wakes():  # woken together: one batch
                for wake in list(wakers.values()):
                    wake()
            assert list(a) == [b"A:first", b"A:second"]  # while B's code is still blocked
            unblock.set()
            assert list(b) == [b"B:first", b"B:second"]
        finally:
            unblock.set()


def test_a_stream_that_runs_to_its_end_takes_a_pool_task_per_item_and_no_more() -> None:
    """A generator behavior is created on the loop (calling it runs none of its code) and, once it ran to its end,
    closing it is nothing to run: only its code takes pool tasks, one per item until its first Wait, and the last."""
    ended: list[bool] = []
    tasks: list[str] = []

    class Counting(futures.ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> futures.Future[Any]:
            tasks.append(getattr(fn, "__name__", repr(fn)))
            return super().submit(fn, *args, **kwargs)

    def stream(request: bytes, context: Any) -> Iterator[bytes]:
        try:
            yield b"a"
            yield b"b"
        finally:
            ended.append(True)

    with serving(stream, Counting(4)) as address:
        with grpc.insecure_channel(address) as channel:
            call: Any = channel.unary_stream("/t.T/S")
            assert list(call(b"", timeout=30)) == [b"a", b"b"]
        _until(lambda: bool(ended), "the behavior ended")
        time.sleep(0.2)  # anything the call's end would still submit
    assert tasks == ["next", "next", "next"]  # b"a", b"b", then its end
