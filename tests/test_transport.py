"""The boundary transport chosen per pair of ranks (graphmesh_executor/transport.py): the decision from both ends of
a link, what real executors choose and report in Status, the GPU path refused where the receiver never chose it,
and meshes whose fast path is unavailable or forced off serving the same tokens over links. On a CUDA host, two
executors on one GPU take the CUDA IPC path and serve the same tokens as over TCP."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from graphmesh import dtypes, security, tensors
from graphmesh import plan as dag
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import GraphmeshError, Unavailable
from graphmesh.launcher import LocalMesh, free_port, gpu_env, parse_gpus
from graphmesh.links import PUSH
from graphmesh.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from graphmesh_executor import transport
from graphmesh_executor.boundary_link import BoundaryLink
from graphmesh_executor.executable import DeviceValue
from graphmesh_executor.stage_servicer import BoundaryPusher
from graphmesh_executor.stage_types import Boundary
from graphmesh_executor.transport import CUDA_IPC, ENV, TCP, choose, local_end
from tests.conftest import executor_args, start_process
from tests.host_slots import HostSlots
from tests.model_fixtures import make_tiny_llama

PROMPT = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
TOKENS = 24
GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"


def _end(host: str = "boot/host", device: str = "cuda:0", gpu: str = GPU_A, visible: tuple[str, ...] = (GPU_A, GPU_B),
         tcp_only: bool = False) -> stage_pb2.BoundaryLinkEnd:
    return stage_pb2.BoundaryLinkEnd(host_id=host, device=device, gpu_uuid=gpu, visible_gpu_uuids=visible,
                                     tcp_only=tcp_only)


@pytest.mark.parametrize(("sender", "receiver", "peer_access", "transport_", "reason"), [
    (_end(gpu=GPU_A), _end(gpu=GPU_B), True, CUDA_IPC, f"GPU {GPU_A} to {GPU_B} (peer access)"),
    (_end(gpu=GPU_A), _end(gpu=GPU_A), False, CUDA_IPC, f"same GPU {GPU_A}"),
    (_end(gpu=GPU_A), _end(gpu=GPU_B), False, TCP, f"no peer access from GPU {GPU_B} to {GPU_A}"),
    (_end(gpu=GPU_A), _end(gpu=GPU_B, visible=(GPU_B,)), True, TCP, f"cannot see the sender's GPU {GPU_A}"),
    (_end(host="boot/a"), _end(host="boot/b", gpu=GPU_B), True, TCP, "ranks on different hosts"),
    (_end(host=""), _end(host="", gpu=GPU_B), True, TCP, "ranks on different hosts"),  # no boot id: never shared
    (_end(device="cpu", gpu="", visible=()), _end(gpu=GPU_B), True, TCP, "the sender is on cpu"),
    (_end(gpu=GPU_A), _end(device="cpu", gpu="", visible=()), True, TCP, "the receiver is on cpu"),
    (_end(gpu=GPU_A, tcp_only=True), _end(gpu=GPU_B), True, TCP, f"{ENV}=tcp at the sender"),
    (_end(gpu=GPU_A), _end(gpu=GPU_B, tcp_only=True), True, TCP, f"{ENV}=tcp at the receiver"),
])
def test_the_receiver_chooses_from_both_ends(sender: stage_pb2.BoundaryLinkEnd, receiver: stage_pb2.BoundaryLinkEnd,
                                             peer_access: bool, transport_: int, reason: str) -> None:
    asked: list[tuple[int, int]] = []

    def access(own: int, peer: int) -> bool:
        asked.append((own, peer))
        return peer_access

    choice = choose(sender, receiver, access)
    assert (choice.transport, reason in choice.reason) == (transport_, True), choice
    if sender.gpu_uuid != receiver.gpu_uuid and choice.reason.startswith(("same host", "no peer")):
        # asked in the receiver's device order: its own GPU, then the sender's
        visible = list(receiver.visible_gpu_uuids)
        assert asked == [(visible.index(receiver.gpu_uuid), visible.index(sender.gpu_uuid))]


def test_this_host_end(monkeypatch: pytest.MonkeyPatch) -> None:
    end = local_end("cpu")
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert end.host_id == f"{boot}/{socket.gethostname()}" and end.device == "cpu"
    assert not end.gpu_uuid and not end.visible_gpu_uuids and not end.tcp_only
    monkeypatch.setenv(ENV, "tcp")
    assert local_end("cpu").tcp_only
    monkeypatch.setenv(ENV, "nvlink")
    with pytest.raises(ValueError, match=f"{ENV} is auto or tcp, not 'nvlink'"):
        local_end("cpu")


def test_runs_are_queued_unless_told_not_to_or_every_link_is_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Queued runs are on by default (on the CPU, where tests drive the slots in host memory, whatever the driver);
    off with QUEUED_ENV=0, and with every link on TCP, where no run can be queued: the rank then reports that it does
    not queue (InstallResponse.queues_runs), so a coordinator does not give up its micro-batches for nothing."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(transport.QUEUED_ENV, raising=False)
    assert transport.queued_runs("cpu")
    monkeypatch.setenv(transport.QUEUED_ENV, "0")
    assert not transport.queued_runs("cpu")
    monkeypatch.setenv(transport.QUEUED_ENV, "1")
    monkeypatch.setenv(ENV, "tcp")
    assert not transport.queued_runs("cpu")


@pytest.mark.parametrize(("text", "gpus"), [("2", [0, 1]), ("1", [0]), ("0,1", [0, 1]), ("3,", [3]), ("2, 0", [2, 0])])
def test_gpus_are_a_count_or_ids(text: str, gpus: list[int]) -> None:
    assert parse_gpus(text) == gpus


@pytest.mark.parametrize(("text", "message"), [("0", "starts no executor"), ("two", "a count (2) or GPU ids"),
                                               ("1,1", "names a GPU twice"), (",", "a count (2) or GPU ids"),
                                               ("-1", "a count (2) or GPU ids")])
def test_bad_gpus_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_gpus(text)


def test_each_executor_sees_its_gpu_first_and_the_others_for_ipc() -> None:
    assert [gpu_env([2, 5, 7], rank) for rank in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "2,5,7"}, {"CUDA_VISIBLE_DEVICES": "5,2,7"}, {"CUDA_VISIBLE_DEVICES": "7,2,5"}]
    with pytest.raises(ValueError, match=r"2 GPUs \[0, 1\] need 2 torch executors, not \['numpy', 'numpy'\]"):
        LocalMesh(backend="numpy", gpus=[0, 1], kvstore=False).start()


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "2", "--executors", "3"], "--executors 3 and --gpus 2: one executor runs per GPU"),
    (["--gpus", "2", "--backend", "numpy"], "--gpus runs torch executors, not --backend numpy"),
    (["--gpus", "0"], "argument --gpus: --gpus 0 starts no executor"),
])
def test_graphmesh_up_refuses_gpus_it_cannot_pin(args: list[str], message: str) -> None:
    run = subprocess.run([sys.executable, "-m", "graphmesh.cli", "up", *args], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and message in run.stderr, run.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("transport-llama"), layers=4)


def _mesh(model: Path, executors: int, env: dict[str, str] | None = None, backend: str = "numpy",
          executor_args: tuple[str, ...] = (), coordinator_args: tuple[str, ...] = ()) -> LocalMesh:
    return LocalMesh(executors, backend, str(model), weights="f32", kvstore=False, env=env or {},
                     extra_executor_args=("--kv-cache-bytes", "8Mi", *executor_args),
                     extra_coordinator_args=coordinator_args)


def _tokens(mesh: LocalMesh, prompts: int = 3) -> list[list[int]]:
    """Greedy, and seeded sampled, tokens of a few prompts."""
    out = []
    with CoordinatorClient(mesh.coordinator_address) as client:
        for i in range(prompts):
            ids: list[int] = []
            for chunk in client.generate(prompt_token_ids=[*PROMPT, i + 20], max_tokens=TOKENS, ignore_eos=True,
                                         temperature=0.8 if i % 2 else 0.0, top_k=40, seed=i + 1):
                ids += chunk.token_ids
            out.append(ids)
    return out


def _stage(mesh: LocalMesh, rank: int) -> tuple[stage_pb2_grpc.StageServiceStub, tuple[tuple[str, str], ...]]:
    channel = grpc.insecure_channel(mesh.executor_addresses[rank])
    return stage_pb2_grpc.StageServiceStub(channel), security.mesh_metadata(mesh.mesh_token)


def _links(mesh: LocalMesh, rank: int) -> list[tuple[str, int, str]]:
    stub, metadata = _stage(mesh, rank)
    status = stub.Status(stage_pb2.StageServiceStatusRequest(), metadata=metadata, timeout=10)
    return [(link.address, link.transport, link.reason) for link in status.links]


@pytest.fixture(scope="module")
def solo_tokens(model: Path) -> list[list[int]]:
    with _mesh(model, 1) as mesh:
        return _tokens(mesh)


def test_cpu_ranks_choose_tcp_per_pair_and_say_why(model: Path, solo_tokens: list[list[int]]) -> None:
    with _mesh(model, 3) as mesh:
        assert _tokens(mesh) == solo_tokens
        for rank in range(3):
            # the last rank pushes back to the first only in a decode run (its sampled tokens)
            links = _links(mesh, rank)
            following = mesh.executor_addresses[(rank + 1) % 3]
            assert (following, TCP, "the sender is on cpu") in links, (rank, links)


def test_a_mesh_forced_off_the_fast_path_serves_the_same_tokens_over_links(model: Path,
                                                                          solo_tokens: list[list[int]]) -> None:
    with _mesh(model, 2, env={ENV: "tcp"}) as mesh:
        assert _tokens(mesh) == solo_tokens
        assert (mesh.executor_addresses[1], TCP, f"{ENV}=tcp at the sender") in _links(mesh, 0)


def test_a_rank_without_a_listener_is_reported_on_grpc(model: Path, solo_tokens: list[list[int]]) -> None:
    with _mesh(model, 2, executor_args=("--boundary-link-port", "off")) as mesh:
        assert _tokens(mesh) == solo_tokens
        assert (mesh.executor_addresses[1], transport.GRPC, "the next rank has no boundary link listener") in \
            _links(mesh, 0)


def test_a_gpu_push_to_a_cpu_executor_is_refused_and_the_link_goes_on(model: Path) -> None:
    """The GPU path never runs where the receiver did not choose it: a DEVICE_PUSH frame is refused
    (BOUNDARY_DEVICE_FAILED, which makes the sender break the link: COMM), and the connection still carries frames."""
    with _mesh(model, 2) as mesh:
        stub, metadata = _stage(mesh, 1)
        answer = stub.OpenBoundaryLink(stage_pb2.OpenBoundaryLinkRequest(sender=local_end("cpu")), metadata=metadata,
                                       timeout=10)
        assert (answer.transport, answer.transport_reason) == (TCP, "the sender is on cpu")
        assert answer.receiver.device == "cpu" and answer.receiver.host_id == local_end("cpu").host_id
        link = BoundaryLink.connect(f"127.0.0.1:{answer.address.rsplit(':', 1)[1]}", answer.ticket, 10.0)
        value = np.zeros((2, 64), np.float32)
        request = stage_pb2.PushBoundaryRequest(step_id=1)
        request.tensors.add(role=dag.role_proto(dag.ACTIVATION), tensor=tensors.to_proto(value)).tensor.ClearField("data")
        errors = []
        for kind, parts in ((transport.DEVICE_PUSH, [b"\0" * 12 + request.SerializeToString()]),
                            (PUSH, transport.push_parts(request, [value]))):
            done: Future[Exception | None] = Future()
            assert link.push(parts, 10.0, done.set_result, kind=kind)
            errors.append(done.result(timeout=30))
        assert isinstance(errors[0], GraphmeshError) and errors[0].reason == transport.DEVICE_FAILED
        assert "reached an executor on cpu" in errors[0].message
        # the plain push is answered on the same connection: the stage's own refusal (no such incarnation)
        assert isinstance(errors[1], GraphmeshError) and errors[1].reason != transport.DEVICE_FAILED
        assert link.broken is None
        link.fail(Unavailable("the test is done", "TEST_DONE"))


def test_a_push_frame_carries_each_tensor_after_the_message_byte_exact() -> None:
    """A PUSH payload (push_parts) read back (read_push): every tensor's dtype, shape and bits, bf16 and an empty
    one included, each starting at an ALIGN offset of the payload and read as a view of it (no copy); the frame the
    link sends is the same bytes, joined. A payload whose lengths do not add up is refused BAD_REQUEST."""
    rng = np.random.default_rng(3)
    values = [rng.standard_normal((5, 37)).astype(np.float32),
              rng.standard_normal((3, 8)).astype(np.float32).astype(dtypes.to_numpy("bf16")),
              rng.integers(-9, 9, 7, dtype=np.int64), np.zeros((0, 4), np.float32),
              rng.standard_normal((2, 3)).astype(np.float32).T]  # not contiguous: sent as its C-order copy
    request = stage_pb2.PushBoundaryRequest(step_id=7, route_id=2)
    for value in values:
        request.tensors.add(role=dag.role_proto(dag.ACTIVATION), tensor=tensors.to_proto(value)).tensor.ClearField("data")
    payload = bytearray(b"".join(bytes(p) for p in transport.push_parts(request, values)))
    got, arrays = transport.read_push(payload)
    assert got == request
    for array, value in zip(arrays, values, strict=True):
        assert array.dtype == value.dtype and array.shape == value.shape
        assert array.tobytes() == np.ascontiguousarray(value).tobytes()
        if array.size:
            assert array.base is not None and np.shares_memory(array, np.frombuffer(payload, np.uint8))
            assert (array.__array_interface__["data"][0] - np.frombuffer(payload, np.uint8).ctypes.data) \
                % transport.ALIGN == 0
    with pytest.raises(ValueError, match="a boundary value of 8 bytes where its tensor needs 24"):
        transport.push_parts(request, [*values[:-1], np.zeros(2, np.float32)])  # not what the message says it is
    for bad in (payload[:3], payload[:-1], payload + b"\0", b"\xff\xff\xff\xff" + payload[4:]):
        with pytest.raises(GraphmeshError) as e:
            transport.read_push(bytearray(bad))
        assert e.value.reason == "BAD_REQUEST"


def _host_slots(monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], transport.DeviceSender,
                                                             transport.DeviceReceiver]:
    """A link's two GPU ends with their slots in host memory, and the buffers exported so far."""
    slots = HostSlots(monkeypatch)
    return slots.exported, *slots.link(GPU_A)


def test_bundles_cross_a_links_slots_byte_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path's layout, on host memory: each tensor at its aligned offset in a slot, the slot's handle sent
    only when the receiver has not mapped that generation, a slot grown for a bigger bundle mapped anew, a slot
    never reused before its push was answered, small bundles left to TCP frames. (The device copies and the IPC
    handles themselves need CUDA: test_two_executors_on_one_gpu_take_cuda_ipc_with_the_same_tokens.)"""
    exported, sender, receiver = _host_slots(monkeypatch)
    monkeypatch.setattr(transport, "DEVICE_MIN_BYTES", 4096)
    rng = np.random.default_rng(7)

    def bundle(rows: int) -> tuple[stage_pb2.PushBoundaryRequest, list[np.ndarray]]:
        values: list[np.ndarray] = [rng.standard_normal((rows, 37)).astype(np.float32),
                                    rng.integers(0, 1000, rows, dtype=np.int64)]
        request = stage_pb2.PushBoundaryRequest(step_id=rows, route_id=1)
        for role, value in zip((dag.ACTIVATION, dag.RUN_TOKENS), values):
            request.tensors.add(role=dag.role_proto(role), tensor=tensors.to_proto(value)).tensor.ClearField("data")
        return request, values

    def through(rows: int) -> tuple[int, int]:
        request, values = bundle(rows)
        framed = sender.frame(request, values)
        assert framed is not None
        payload, slot = framed
        handle = int.from_bytes(payload[8:12], "little")
        got, arrays = receiver.request(payload)
        assert got.step_id == rows and [t.role for t in got.tensors] == [t.role for t in request.tensors]
        for array, value in zip(arrays, values, strict=True):
            assert array.dtype == value.dtype and np.array_equal(array, value)
        return slot, handle

    def buffers() -> list[torch.Tensor]:  # the slots' buffers exported, without their words (queued runs')
        return [e for e in exported if e.dtype == torch.uint8]

    first, handle = through(100)  # 14,800 + 800 bytes: the second tensor at offset 14,848
    assert handle and len(buffers()) == 1 and buffers()[0].numel() == 16384
    sender.release(first)
    slots = [through(90) for _ in range(transport.SLOTS)]  # the free ones first, each new to the receiver
    assert [s for s, _ in slots] == [1, 2, 3, 0] and all(h for s, h in slots if s) and not slots[-1][1]
    assert sender.frame(*bundle(100)) is None  # every slot in flight: this one goes as a TCP frame
    sender.release(1)
    grown, handle = through(1000)  # 156,416 bytes: slot 1 grows to 256 KiB, a new generation the receiver maps
    assert grown == 1 and handle and len(buffers()) == 5 and buffers()[-1].numel() == 262144
    sender.release(1)
    assert sender.frame(*bundle(10)) is None  # 1,480 + 80 bytes: under DEVICE_MIN_BYTES


def test_chained_bundles_stay_device_values_and_grow_the_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chained push (a decode run's iteration run ahead) takes a slot whatever its size, of device values or host
    arrays, grows the link's slots while every one is in flight (up to CHAINED_SLOTS: its answer comes only once
    the receiver's copy has run), and reaches the receiver as device values holding the same bytes, described as
    the host arrays they stand for. (The stream's wait for the slot's event needs CUDA:
    test_two_executors_on_one_gpu_run_decode_runs_ahead_with_the_same_tokens.)"""
    _, sender, receiver = _host_slots(monkeypatch)
    rng = np.random.default_rng(3)
    slots = []
    for rows in range(1, transport.CHAINED_SLOTS + 1):
        activation = torch.from_numpy(rng.standard_normal((rows, 8)).astype(np.float32))
        tokens = rng.integers(0, 1000, rows, dtype=np.int64)
        values: list[Any] = [DeviceValue(activation, np.dtype(np.float32), (rows, 8)), tokens]
        request = stage_pb2.PushBoundaryRequest(step_id=rows, route_id=1)
        for role, value in zip((dag.ACTIVATION, dag.RUN_TOKENS), (activation.numpy(), tokens)):
            request.tensors.add(role=dag.role_proto(role), tensor=tensors.to_proto(value)).tensor.ClearField("data")
        assert sender.frame(request, values) is None  # under DEVICE_MIN_BYTES: not chained, a TCP frame
        framed = sender.frame(request, values, chained=True)
        assert framed is not None
        payload, slot = framed
        slots.append(slot)
        got, arrays = receiver.chained(payload)
        assert got.step_id == rows and all(isinstance(a, DeviceValue) and a.ready is None for a in arrays)
        assert [(a.dtype, a.shape) for a in arrays] == [(np.dtype(np.float32), (rows, 8)), (np.dtype(np.int64), (rows,))]
        assert torch.equal(arrays[0].tensor, activation) and np.array_equal(arrays[1].tensor.numpy(), tokens)
    assert slots == list(range(transport.CHAINED_SLOTS))  # none answered: each push took a new slot
    request = stage_pb2.PushBoundaryRequest(step_id=99, route_id=1)
    request.tensors.add(role=dag.role_proto(dag.RUN_TOKENS), tensor=tensors.to_proto(tokens)).tensor.ClearField("data")
    assert sender.frame(request, [tokens], chained=True) is None  # every slot in flight
    sender.release(5)
    framed = sender.frame(request, [tokens], chained=True)
    assert framed is not None and framed[1] == 5


def test_a_queued_run_hands_its_bundles_through_one_slot_by_its_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """A queued run (a decode run's bundles from its second iteration on) holds one slot: the first bundle's frame
    announces them all, each reaches the receiver as device values that arrive when first read, and the next is
    written only once the one before was read (the slot's consumed word), never over it. Ended, the slot takes other
    pushes; released by a failing receiver, the sender may use it again at once; released by a failing sender, it is
    retired and its index gets a new buffer. (The stream waits on the words need CUDA:
    test_two_executors_on_one_gpu_queue_decode_runs_on_the_device_with_the_same_tokens.)"""
    exported, sender, receiver = _host_slots(monkeypatch)
    rng = np.random.default_rng(5)
    request = stage_pb2.PushBoundaryRequest(step_id=1, iteration=1, route_id=0)
    for role, shape, dtype in ((dag.ACTIVATION, (3, 8), np.float32), (dag.RUN_TOKENS, (3,), np.int64)):
        request.tensors.add(role=dag.role_proto(role), tensor=tensor_pb2.Tensor(
            dtype=dtypes.to_proto(dtypes.from_numpy(np.dtype(dtype))), shape=shape))

    def bundle() -> list[Any]:
        return [DeviceValue(torch.from_numpy(rng.standard_normal((3, 8)).astype(np.float32)), np.dtype(np.float32),
                            (3, 8)), rng.integers(0, 1000, 3, dtype=np.int64)]

    def read(values: list[DeviceValue]) -> list[np.ndarray]:
        return [v.on(None).numpy() for v in values]

    def same(got: list[np.ndarray], sent: list[Any]) -> bool:
        return all(np.array_equal(g, s.tensor.numpy() if isinstance(s, DeviceValue) else s) for g, s in zip(got, sent))

    for _ in range(transport.SLOTS - 1):  # every slot in flight but one: each run and push below takes that one
        sender._take(False)
    sent = [bundle() for _ in range(3)]
    queued = sender.queue(request, sent[0], 3)
    assert queued is not None
    payload, run = queued
    got, bundles = receiver.queued(payload)
    assert got.iteration == 1 and len(bundles) == 3
    assert all(v.arrival is not None and (v.dtype, v.shape) in (((np.dtype(np.float32), (3, 8))),
                                                                (np.dtype(np.int64), (3,))) for b in bundles for v in b)
    assert same(read(bundles[0]), sent[0])
    run.put(sent[1])
    later = threading.Thread(target=run.put, args=(sent[2],))
    later.start()
    time.sleep(0.2)
    assert later.is_alive()  # bundle 1 is not read yet: the slot holds it
    assert same(read(bundles[1]), sent[1])
    later.join(5)
    assert not later.is_alive() and same(read(bundles[2]), sent[2])
    run.end()
    chained = sender.frame(request, bundle(), chained=True)
    assert chained is not None and chained[1] == run.slot  # the slot is free again
    sender.release(chained[1])

    # a receiver whose step fails releases what it waits for; the sender may start another run in the slot at once
    queued = sender.queue(request, sent[0], 4)
    assert queued is not None and queued[1].slot == run.slot
    _, bundles = receiver.queued(queued[0])
    bundles[0][0].arrival.release()  # type: ignore[union-attr]
    read(bundles[3])  # never written: goes on, reading what the slot holds
    queued[1].end()
    again = sender.queue(request, sent[1], 2)
    assert again is not None
    _, bundles = receiver.queued(again[0])
    assert same(read(bundles[0]), sent[1])

    # a sender whose step fails retires the slot: the index gets a new buffer, announced anew
    buffers = len(exported)
    again[1].release()
    queued = sender.queue(request, sent[2], 2)
    assert queued is not None and queued[1].slot == again[1].slot and len(exported) == buffers + 2
    _, bundles = receiver.queued(queued[0])
    assert same(read(bundles[0]), sent[2])


def test_a_failed_gpu_push_breaks_the_link_and_the_next_push_opens_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device push the receiver cannot read fails as the link's failure (BOUNDARY_DEVICE_FAILED: the step is COMM),
    the link is broken and the strike counted, and the next push opens a new link, whose handshake chooses again."""
    monkeypatch.setattr(transport, "_export", lambda buffer, gpu: json.dumps({"gpu": gpu}).encode())
    monkeypatch.setattr(transport, "DEVICE_MIN_BYTES", 4096)
    address = f"127.0.0.1:{free_port()}"
    with start_process(executor_args(address), address):
        pusher = BoundaryPusher()

        def push(rows: int) -> Exception | None:
            done: Future[Exception | None] = Future()
            pusher(address, 7, Boundary(1, values={dag.ACTIVATION: np.zeros((rows, 64), np.float32)}), 10.0,
                   done.set_result)
            return done.result(timeout=30)

        # nothing is installed there: every push that arrives is answered NOT_INSTALLED
        assert getattr(push(2), "reason", None) == "NOT_INSTALLED"
        first = pusher._links[address]
        assert pusher.transports[address] == transport.Choice(TCP, "the sender is on cpu")
        pusher._device[address] = (first, transport.DeviceSender("cpu", GPU_A))  # as if the receiver chose CUDA IPC
        error = push(64)
        assert isinstance(error, GraphmeshError) and error.reason == transport.DEVICE_FAILED, error
        assert first.broken is not None and pusher._strikes[address] == 1
        assert getattr(push(64), "reason", None) == "NOT_INSTALLED"  # over a new link, TCP frames again
        assert pusher._links[address] is not first and pusher._links[address].broken is None
        assert address not in pusher._device


@pytest.fixture(scope="module")
def cuda_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    yield make_tiny_llama(tmp_path_factory.mktemp("transport-cuda-llama"), layers=4)


def test_two_executors_on_one_gpu_take_cuda_ipc_with_the_same_tokens(cuda_model: Path) -> None:
    """Every bundle through the GPU path (GRAPHMESH_CUDA_IPC_MIN_BYTES=0), against the same mesh over TCP."""
    args = ("--device", "cuda:0")
    coordinator = ("--dtype", "f32")
    with _mesh(cuda_model, 2, env={ENV: "tcp"}, backend="torch", executor_args=args,
               coordinator_args=coordinator) as mesh:
        over_tcp = _tokens(mesh, 4)
    with _mesh(cuda_model, 2, env={"GRAPHMESH_CUDA_IPC_MIN_BYTES": "0"}, backend="torch", executor_args=args,
               coordinator_args=coordinator) as mesh:
        assert _tokens(mesh, 4) == over_tcp
        links = _links(mesh, 0)
        assert [(a, t) for a, t, _ in links] == [(mesh.executor_addresses[1], CUDA_IPC)], links
        assert "same GPU" in links[0][2]
        assert "boundary link offered" in mesh.log("executor-1").read_text()


def test_two_executors_on_one_gpu_queue_decode_runs_on_the_device_with_the_same_tokens(cuda_model: Path) -> None:
    """With the defaults, two executors on one GPU queue a decode run's iterations on the device from its second on
    (each rank's stream waiting for the slot word the other's writes, no message per iteration), and with queued runs
    off (transport.QUEUED_ENV=0) they run ahead (each iteration's output handed on as a device value at launch, the
    receiver's stream waiting for the slot's event): greedy and seeded tokens are those of the same mesh over TCP,
    where every iteration lands on the host, also with the coordinator sending two micro-batches at once (its steps
    then not alone: none is queued)."""
    args = ("--device", "cuda:0")
    coordinator = ("--dtype", "f32")
    with _mesh(cuda_model, 2, env={ENV: "tcp"}, backend="torch", executor_args=args,
               coordinator_args=coordinator) as mesh:
        over_tcp = _tokens(mesh, 4)
    with _mesh(cuda_model, 2, backend="torch", executor_args=args, coordinator_args=coordinator) as mesh:
        assert _tokens(mesh, 4) == over_tcp
        for rank in (0, 1):
            assert "decode runs queued on the device" in mesh.log(f"executor-{rank}").read_text(), rank
    for env, flags in (({transport.QUEUED_ENV: "0"}, ()), ({}, ("--steps-in-flight", "2"))):
        with _mesh(cuda_model, 2, env=env, backend="torch", executor_args=args,
                   coordinator_args=coordinator + flags) as mesh:
            assert _tokens(mesh, 4) == over_tcp
            for rank in (0, 1):
                log = mesh.log(f"executor-{rank}").read_text()
                assert "decode runs run ahead" in log and "queued on the device" not in log, (env, flags, rank)
