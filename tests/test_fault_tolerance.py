"""Fencing and recovery with real processes: an executor dies, freezes or misbehaves mid-generation and no
client sees a lost, duplicated or different token; stale or fenced participants never change state."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from graphmesh import channels, tensors
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import GraphmeshError, Unavailable, from_rpc_error
from graphmesh.launcher import LocalMesh
from graphmesh.links import HEADER, HELLO, Buffer
from graphmesh.v1 import stage_pb2, stage_pb2_grpc
from graphmesh_executor import transport
from graphmesh_executor.boundary_link import BoundaryLink
from graphmesh_server import faults
from tests.model_fixtures import make_tiny_llama
from tests.streams import run_streams

PROMPT = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
SESSIONS = 8
TOKENS = 120


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama6"), seed=3, max_position=512, layers=6)


@pytest.fixture
def mesh(model: Path) -> Iterator[LocalMesh]:
    # 8 sessions of 131 tokens hold 72 blocks of 16 on every rank; the pool's default size (up to 512 MiB) would only
    # cost the numpy backend a copy of it on every step
    with LocalMesh(3, "numpy", str(model), fault_injection=True, proxied=True,
                   extra_executor_args=("--kv-cache-bytes", "8Mi")) as m:
        yield m


def _request(seed: int) -> dict[str, Any]:
    return {"prompt_token_ids": PROMPT, "max_tokens": TOKENS, "temperature": 0.8, "top_k": 50, "seed": seed,
            "ignore_eos": True}


def _run_all(address: str, progress: list[int] | None = None) -> list[list[int]]:
    return run_streams(address, [_request(seed) for seed in range(SESSIONS)], progress)


def _during_generation(mesh: LocalMesh, fault: Any) -> list[list[int]]:
    """Runs the 8 sessions and fires `fault` once every session has streamed a few tokens."""
    progress = [0] * SESSIONS
    fired = threading.Event()

    def trigger() -> None:
        while min(progress) < 5:
            time.sleep(0.01)
        fault()
        fired.set()

    threading.Thread(target=trigger, daemon=True).start()
    results = _run_all(mesh.coordinator_address, progress)
    assert fired.is_set(), "the fault fired after generation ended: the test proved nothing"
    return results


def _status(mesh: LocalMesh) -> Any:
    with CoordinatorClient(mesh.coordinator_address) as client:
        return client.status()


def _stage(mesh: LocalMesh, address: str) -> stage_pb2_grpc.StageServiceStub:
    """StageService of one of the mesh's executors, called as a mesh member (with its mesh token)."""
    return stage_pb2_grpc.StageServiceStub(channels.channel(address, None, mesh_token=mesh.mesh_token))


def _link(mesh: LocalMesh, address: str) -> tuple[str, bytes]:
    """The address of an executor's boundary link and a ticket for it, asked for as a mesh member."""
    answer = _stage(mesh, address).OpenBoundaryLink(stage_pb2.OpenBoundaryLinkRequest(), timeout=10)
    host, port = answer.address.rsplit(":", 1)
    return f"{host or '127.0.0.1'}:{port}", answer.ticket


def _over_link(link: BoundaryLink, request: stage_pb2.PushBoundaryRequest | bytes) -> Exception | None:
    """Pushes `request` as a PUSH frame (its tensors' bytes after the message), or bytes as the frame's payload."""
    if isinstance(request, bytes):
        parts: list[Buffer] = [request]
    else:
        bare = stage_pb2.PushBoundaryRequest()
        bare.CopyFrom(request)
        for t in bare.tensors:
            t.tensor.ClearField("data")
        parts = transport.push_parts(bare, [tensors.from_proto(t.tensor) for t in request.tensors])
    done: Future[Exception | None] = Future()
    assert link.push(parts, 10.0, done.set_result)
    return done.result(timeout=30)


def _idle_status(stub: stage_pb2_grpc.StageServiceStub) -> stage_pb2.StageServiceStatusResponse:
    """The rank's status once the coordinator has released every finished session there (it does so in the
    background after each stream ends), so that two reads compare equal unless something else changed."""
    deadline = time.monotonic() + 30
    while (status := stub.Status(stage_pb2.StageServiceStatusRequest())).sessions:
        assert time.monotonic() < deadline, [s.session_id for s in status.sessions]
        time.sleep(0.05)
    return status


def _step(incarnation: int, session: str, token_ids: list[int], step_id: int = 1) -> stage_pb2.ExecuteStepRequest:
    """A one-row step as an intruder or a coordinator of another incarnation would send it."""
    return stage_pb2.ExecuteStepRequest(incarnation=incarnation, step_id=step_id, output=stage_pb2.OUTPUT_KIND_TOKEN,
                                        rows=[stage_pb2.StepRow(session_id=session, epoch=1, token_ids=token_ids)])


@pytest.mark.parametrize("victim,how", [(1, "kill"), (2, "kill"), (1, "freeze")])
def test_losing_an_executor_mid_generation_loses_no_token(mesh: LocalMesh, victim: int, how: str) -> None:
    baseline = _run_all(mesh.coordinator_address)
    before = _status(mesh)
    process = mesh.executor_processes[victim]
    fault = {"kill": lambda: faults.kill9(process), "freeze": lambda: faults.freeze(process)}[how]
    try:
        assert _during_generation(mesh, fault) == baseline
    finally:
        if how == "freeze":
            faults.thaw(process)
    after = _status(mesh)
    assert after.incarnation > before.incarnation and after.recoveries >= 1
    if how == "kill":
        assert len(after.stages) == 2 and mesh.executor_addresses[victim] not in [s.address for s in after.stages]
        return
    # a frozen executor that runs again is taken back into the roster (the health watch re-plans over all three)
    deadline = time.monotonic() + 30
    while [s.address for s in after.stages] != mesh.executor_addresses or not after.ready:
        assert time.monotonic() < deadline, "the thawed executor was never taken back into the roster"
        time.sleep(0.2)
        after = _status(mesh)
    assert _run_all(mesh.coordinator_address) == baseline


def test_a_cut_off_link_is_recovered_like_a_dead_executor(mesh: LocalMesh) -> None:
    baseline = _run_all(mesh.coordinator_address)
    assert _during_generation(mesh, lambda: mesh.proxies[1].set_mode("blackhole")) == baseline
    assert _status(mesh).recoveries >= 1


def test_a_slow_link_only_slows(mesh: LocalMesh) -> None:
    baseline = _run_all(mesh.coordinator_address)
    mesh.proxies[2].set_mode("delay", 0.01)
    assert _run_all(mesh.coordinator_address) == baseline
    assert _status(mesh).recoveries == 0


def test_injected_deterministic_failure_rolls_back_and_stays_active(mesh: LocalMesh) -> None:
    baseline = _run_all(mesh.coordinator_address)
    before = _status(mesh)
    stub = _stage(mesh, mesh.executor_addresses[1])
    stub.InjectFault(stage_pb2.InjectFaultRequest(kind=stage_pb2.FAULT_KIND_ARCH_FAILURE, count=1))
    assert _run_all(mesh.coordinator_address) == baseline
    after = _status(mesh)
    assert after.incarnation == before.incarnation and after.recoveries == 0  # ARCH: no fence, no rebuild
    status = stub.Status(stage_pb2.StageServiceStatusRequest())
    assert status.state == stage_pb2.AUTHORITY_STATE_ACTIVE


def _rerun_after_fault(mesh: LocalMesh, rank: int, kind: stage_pb2.FaultKind.ValueType) -> tuple[Any, Any]:
    """The sessions generated, `kind` injected once at executor `rank`, and the same sessions generated again: the
    same tokens. The coordinator's status before and after."""
    baseline = _run_all(mesh.coordinator_address)
    before = _status(mesh)
    _stage(mesh, mesh.executor_addresses[rank]).InjectFault(stage_pb2.InjectFaultRequest(kind=kind, count=1))
    assert _run_all(mesh.coordinator_address) == baseline
    return before, _status(mesh)


def test_a_corrupted_boundary_is_refused_and_recovered(mesh: LocalMesh) -> None:
    before, after = _rerun_after_fault(mesh, 0, stage_pb2.FAULT_KIND_CORRUPT_BOUNDARY)
    assert after.incarnation > before.incarnation and len(after.stages) == 3  # CONTRACT: fenced and rebuilt


def test_a_device_failure_is_fenced_rebuilt_and_changes_no_token(mesh: LocalMesh) -> None:
    before, after = _rerun_after_fault(mesh, 1, stage_pb2.FAULT_KIND_DEVICE_FAILURE)
    assert after.incarnation > before.incarnation and after.recoveries > before.recoveries
    assert "DEVICE_FAILURE" in (Path(mesh.log_dir or "") / "coordinator.log").read_text()  # its own reason, logged


def test_stale_or_poisoned_messages_are_refused_and_change_nothing(mesh: LocalMesh) -> None:
    _run_all(mesh.coordinator_address)
    k = _status(mesh).incarnation
    stub = _stage(mesh, mesh.executor_addresses[1])
    before = _idle_status(stub)
    boundary = stage_pb2.BoundaryTensor(role=stage_pb2.BOUNDARY_ROLE_ACTIVATION,
                                        tensor=tensors.to_proto(np.zeros((3, 64), np.float32)))
    for incarnation in (k - 1, k + 5):
        calls: list[tuple[Any, Any]] = [
            (stub.ExecuteStep, _step(incarnation, "intruder", [1, 2, 3])),
            (stub.AbortStep, stage_pb2.AbortStepRequest(incarnation=incarnation, step_id=1,
                                                        rows=_step(incarnation, "intruder", [1]).rows)),
            (stub.PushBoundary, stage_pb2.PushBoundaryRequest(header=stage_pb2.FencingHeader(incarnation=incarnation),
                                                              step_id=1, tensors=[boundary]))]
        for method, request in calls:
            with pytest.raises(grpc.RpcError) as e:
                method(request, timeout=10)
            error = from_rpc_error(e.value)
            assert error.code == grpc.StatusCode.FAILED_PRECONDITION and error.reason == "STALE_INCARNATION"
        # the same bundle over the executor's boundary link gets the same answer
        link = BoundaryLink.connect(*_link(mesh, mesh.executor_addresses[1]), 10.0)
        answer = _over_link(link, calls[-1][1])
        assert isinstance(answer, GraphmeshError) and answer.reason == "STALE_INCARNATION"
        assert answer.code == grpc.StatusCode.FAILED_PRECONDITION
        link.fail(Unavailable("done", "TEST"))
    assert stub.Status(stage_pb2.StageServiceStatusRequest()) == before
    stub.Fence(stage_pb2.FenceRequest(incarnation=k, reason="test"))
    poisoned = stub.Status(stage_pb2.StageServiceStatusRequest())
    assert poisoned.state == stage_pb2.AUTHORITY_STATE_POISONED and poisoned.poison_cause == "test"
    with pytest.raises(grpc.RpcError) as e:
        stub.ExecuteStep(_step(k, "intruder", [1]), timeout=10)
    assert from_rpc_error(e.value).reason == "POISONED"
    stub.Fence(stage_pb2.FenceRequest(incarnation=k, reason="second cause"))
    assert stub.Status(stage_pb2.StageServiceStatusRequest()) == poisoned  # first cause wins, nothing else moved
    # the coordinator notices on the next request, rebuilds under k+1 and serves
    assert _run_all(mesh.coordinator_address)
    assert _status(mesh).incarnation > k


def test_a_boundary_link_takes_only_its_ticket_and_survives_bad_frames(mesh: LocalMesh) -> None:
    baseline = _run_all(mesh.coordinator_address)
    k = _status(mesh).incarnation
    address, ticket = _link(mesh, mesh.executor_addresses[1])
    host, port = address.rsplit(":", 1)

    def refused(hello: bytes) -> GraphmeshError:
        with pytest.raises(GraphmeshError) as e:
            BoundaryLink.connect(address, hello, 10.0)
        return e.value

    for wrong in (b"", b"x" * 32, ticket[:-1] + bytes([ticket[-1] ^ 1])):
        refusal = refused(wrong)
        assert refusal.code == grpc.StatusCode.UNAUTHENTICATED and refusal.reason == "BAD_LINK_TICKET", refusal
    link = BoundaryLink.connect(address, ticket, 10.0)  # the ticket was not used up by the wrong ones...
    assert refused(ticket).reason == "BAD_LINK_TICKET"  # ... and opens one link only
    # A frame that is not a PushBoundaryRequest is answered INVALID_ARGUMENT, and the link goes on.
    error = _over_link(link, b"\xff\xff\xff\xff")
    assert isinstance(error, GraphmeshError) and error.reason == "BAD_REQUEST"
    stale = stage_pb2.PushBoundaryRequest(header=stage_pb2.FencingHeader(incarnation=k - 1), step_id=1)
    error = _over_link(link, stale)
    assert isinstance(error, GraphmeshError) and error.reason == "STALE_INCARNATION"
    link.fail(Unavailable("done", "TEST"))
    # A connection whose first frame claims to be bigger than a ticket is closed before it sends it.
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(HEADER.pack(1 << 31, HELLO))
        assert raw.recv(1) == b""
    # None of it touched the mesh: no fence, no rebuild, the same tokens.
    assert _run_all(mesh.coordinator_address) == baseline
    assert _status(mesh).incarnation == k


def test_coordinator_restart_never_reuses_an_incarnation(mesh: LocalMesh) -> None:
    baseline = _run_all(mesh.coordinator_address)
    k = _status(mesh).incarnation
    assert mesh.coordinator_process is not None
    faults.kill9(mesh.coordinator_process)
    mesh.start_coordinator()
    k2 = _status(mesh).incarnation
    assert k2 > k
    for address in mesh.executor_addresses:  # the old coordinator's incarnation is refused everywhere
        with pytest.raises(grpc.RpcError) as e:
            _stage(mesh, address).ExecuteStep(_step(k, "old", [1]), timeout=10)
        assert from_rpc_error(e.value).reason == "STALE_INCARNATION"
    assert _run_all(mesh.coordinator_address) == baseline
