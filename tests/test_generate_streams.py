"""GenerateStreams: many Generate calls over one stream (what a front end in a process of its own sends for its
clients). Each call's tokens are those of its own Generate call; a bad call and a cancelled one end with their
status in-band while the others go on; a cancelled call's session ends; responses of many calls share messages."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from google.rpc import status_pb2

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.model_fixtures import make_tiny_llama

CALLS, TOKENS = 12, 6


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    with LocalMesh(2, "numpy", str(model), kvstore=False) as mesh:
        yield mesh.coordinator_address


def _request(i: int, tokens: int = TOKENS) -> coordinator_pb2.GenerateRequest:
    return coordinator_pb2.GenerateRequest(prompt_token_ids=[5 + 7 * i + j for j in range(6)], max_tokens=tokens,
                                           ignore_eos=True)


def _alone(address: str, request: coordinator_pb2.GenerateRequest) -> list[int]:
    with CoordinatorClient(address, timeout=60) as client:
        return [t for chunk in client.generate(prompt_token_ids=list(request.prompt_token_ids),
                                               max_tokens=request.max_tokens, ignore_eos=True)
                for t in chunk.token_ids]


class Stream:
    """One GenerateStreams call: requests are sent as the test puts them; every event is collected by call id."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.sending: queue.Queue[coordinator_pb2.GenerateStreamsRequest | None] = queue.Queue()
        self.tokens: dict[int, list[int]] = {}
        self.statuses: dict[int, status_pb2.Status] = {}
        self.messages = 0
        self.error: grpc.RpcError | None = None
        self.changed = threading.Condition()
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)
        self.responses = stub.GenerateStreams(iter(self.sending.get, None), timeout=120)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def send(self, request: coordinator_pb2.GenerateStreamsRequest) -> None:
        self.sending.put(request)

    def _read(self) -> None:
        try:
            self._take()
        except grpc.RpcError as e:
            self.error = e

    def _take(self) -> None:
        for message in self.responses:
            with self.changed:
                self.messages += 1
                for event in message.events:
                    if event.WhichOneof("kind") == "response":
                        self.tokens.setdefault(event.id, []).extend(event.response.token_ids)
                    else:
                        self.statuses[event.id] = status_pb2.Status.FromString(event.status)
                self.changed.notify_all()

    def wait(self, condition: Callable[[], bool], what: str) -> None:
        with self.changed:
            assert self.changed.wait_for(condition, 60), what

    def close(self) -> None:
        self.sending.put(None)
        self.reader.join(60)
        self.channel.close()


def test_every_call_gets_its_own_tokens_and_many_share_a_message(address: str) -> None:
    want = {i: _alone(address, _request(i)) for i in range(CALLS)}
    stream = Stream(address)
    try:
        for i in range(CALLS):
            stream.send(coordinator_pb2.GenerateStreamsRequest(id=i, generate=_request(i)))
        stream.wait(lambda: len(stream.statuses) == CALLS, "every call ended")
    finally:
        stream.close()
    assert stream.tokens == want
    assert all(s.code == grpc.StatusCode.OK.value[0] for s in stream.statuses.values())
    # a response per token a call at most, and an end each: gathered, they took far fewer messages
    assert stream.messages < CALLS * (TOKENS + 1) // 2, stream.messages


def test_a_bad_call_and_a_cancelled_one_end_in_band_and_the_others_go_on(address: str) -> None:
    stream = Stream(address)
    try:
        stream.send(coordinator_pb2.GenerateStreamsRequest(id=1, generate=_request(1, tokens=100_000)))  # runs long
        stream.send(coordinator_pb2.GenerateStreamsRequest(id=2, generate=coordinator_pb2.GenerateRequest(
            prompt_token_ids=[1, 2], max_tokens=0)))  # refused
        stream.send(coordinator_pb2.GenerateStreamsRequest(id=3, generate=_request(3)))
        stream.send(coordinator_pb2.GenerateStreamsRequest(id=4))  # neither generate nor cancel
        stream.wait(lambda: len(stream.tokens.get(1, [])) >= 3, "the long call streams")
        stream.wait(lambda: {2, 3, 4} <= stream.statuses.keys(), "the short calls ended")
        with CoordinatorClient(address, timeout=60) as client:
            assert client.status().active_sessions == 1  # the long one
        stream.send(coordinator_pb2.GenerateStreamsRequest(id=1, cancel=True))
        stream.wait(lambda: 1 in stream.statuses, "the cancelled call ended")
    finally:
        stream.close()
    codes = {i: grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == s.code)) for i, s in
             stream.statuses.items()}
    assert codes == {1: grpc.StatusCode.CANCELLED, 2: grpc.StatusCode.INVALID_ARGUMENT,
                     3: grpc.StatusCode.OK, 4: grpc.StatusCode.INVALID_ARGUMENT}, codes
    assert "max_tokens" in stream.statuses[2].message and stream.tokens[3] == _alone(address, _request(3))
    with CoordinatorClient(address, timeout=60) as client:
        deadline = time.monotonic() + 60
        while client.status().active_sessions:
            assert time.monotonic() < deadline, "the cancelled call's session never ended"
            time.sleep(0.05)


def test_an_id_of_a_running_call_ends_the_stream_with_invalid_argument(address: str) -> None:
    """Its events could not be told from the running call's: the caller has a bug, and the stream ends."""
    stream = Stream(address)
    stream.send(coordinator_pb2.GenerateStreamsRequest(id=7, generate=_request(7, tokens=100_000)))
    stream.wait(lambda: bool(stream.tokens.get(7)), "the call streams")
    stream.send(coordinator_pb2.GenerateStreamsRequest(id=7, generate=_request(8)))
    stream.reader.join(60)
    stream.close()
    assert isinstance(stream.error, grpc.RpcError) and stream.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "7 is running already" in str(stream.error.details())
    with CoordinatorClient(address, timeout=60) as client:  # the stream's end ended its call too
        deadline = time.monotonic() + 60
        while client.status().active_sessions:
            assert time.monotonic() < deadline, "the running call's session never ended"
            time.sleep(0.05)
