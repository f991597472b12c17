"""How a rank's boundary bundles reach the next rank, chosen per pair of ranks in the boundary link's handshake.

OpenBoundaryLink carries the sender's end (host id, device, GPU UUIDs, BoundaryLinkEnd); the receiver answers its
own and the transport it chose (`choose`), so both ends know it, and the sender reports it in Status:

- CUDA IPC when both ends share a kernel (same /proc boot id and host name), both compute on CUDA, and the
  receiver can map the sender's GPU (it is among the receiver's visible devices, and is the receiver's own or
  peer access between the two is possible);
- TCP frames on the link otherwise (other hosts, a rank on the CPU, a GPU the receiver cannot see), and whenever
  GRAPHMESH_BOUNDARY_TRANSPORT=tcp is set at either end.

Why CUDA IPC and not NCCL point-to-point: NCCL needs a process group (a rendezvous of every rank, a rank number
each) made before the first send, and a communicator whose peer died can hang its collectives until a watchdog
aborts the process; the mesh re-plans over whichever executors are healthy, any time. An IPC mapping belongs to
one link: it is made when the link is, the link's TCP connection still orders and acknowledges every push (so a
dead peer is the broken connection the link already reports: COMM, fence and rebuild), and a re-plan opens a new
link and maps again.

The CUDA path: the sender keeps a few device buffers (slots) per link. A bundle of at least DEVICE_MIN_BYTES is
copied into a free slot on a stream of its own, that stream is synchronized, and a DEVICE_PUSH frame goes out
with the slot's number, its IPC handle when the slot is new to the receiver, and the PushBoundaryRequest without
its tensors' bytes. The receiver copies the bytes out of the mapped slot, on a stream of its own that it waits for,
before it answers, and the slot is free again once the answer is back: a slot is never written while the receiver
may read it. Smaller bundles stay TCP frames on the same link, in the same order, and that is every decode step's
(up to 256 f32 rows of an 8B model: 4 MiB): at 1 MiB, two executors on one H200 decoded 8-17% faster over TCP
frames than over the slots, whose path adds a copy and a stream synchronization at each end, and that was before
the frames lost their copies (bench/RESULTS.md). A prompt chunk of 2,048 tokens (16 MiB and more) takes the slots. A
failed device push breaks the link (COMM); after DEVICE_STRIKES in a row to one address the sender keeps that pair
on TCP.

Those bundles are host arrays (a step's output read back, then handed on), so the sender copies host to GPU and the
receiver GPU to host: the bundle skips serialization and the socket, not host memory.

A decode run's iterations run ahead instead (stage.py: a run whose tokens are all sampled in the graph): the stage
hands the pusher its output as a DeviceValue the moment the run is launched, and the bundle goes as a
DEVICE_CHAINED frame whatever its size. Its copy into the slot is queued on the engine's stream behind the run
that makes it, the slot's interprocess event is recorded after the copy, and nothing waits for the device. The
receiver copies the slot into its own memory on a stream that first waits for that event, hands the stage device
values whose ready event its compute stream waits for, and answers once that copy has run (the answer frees the
slot). So the GPU orders the two stages' work and neither host waits for the other's device: over two executors on
one GPU each iteration used to cost a device-to-host copy, a host wait and a host-to-device copy at each boundary.
A stream waiting on the event of a process that is killed does not hang: the driver finishes or drops the dead
process's work and the event completes (checked on an H100; the step then fails as the broken link's COMM).

A TCP frame (PUSH) carries the PushBoundaryRequest without its tensors' bytes, then the bytes themselves, each
tensor at an ALIGN offset: the sender hands the arrays to the kernel where they lie (graphmesh.links.send_frame)
and the receiver reads them into one buffer that the stage's arrays are views of. Inside the message, a 1 MiB
activation was copied five times on the way (to bytes, into the message, serialized, framed, out of the read
buffer) and parsed once more.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias, cast

import numpy as np

from graphmesh import dtypes, tensors
from graphmesh.errors import InvalidArgument, Unavailable
from graphmesh.links import Buffer
from graphmesh.v1 import stage_pb2
from graphmesh_executor.executable import DeviceValue

log = logging.getLogger("graphmesh.executor.transport")

ENV = "GRAPHMESH_BOUNDARY_TRANSPORT"  # "tcp": never the GPU path; "auto" (default): choose per pair
DEVICE_PUSH = 6  # frame kind, after graphmesh.links' 1..5: slot header + PushBoundaryRequest without tensor bytes
DEVICE_CHAINED = 7  # the same payload; the bundle stays on the GPU and the receiver's stream waits for the slot's event
# Smaller bundles go as TCP frames on the same link (the environment variable lets a test send every one through
# the GPU path).
DEVICE_MIN_BYTES = int(os.environ.get("GRAPHMESH_CUDA_IPC_MIN_BYTES", 8 << 20))
SLOTS = 4  # device buffers per link: bundles in flight at once over the GPU path
CHAINED_SLOTS = 16  # how far chained pushes may grow a link's slots (each is answered once its copy has run)
DEVICE_STRIKES = 3  # failed device pushes in a row to one address before its links stay on TCP
ALIGN = 256  # each tensor's offset in a slot or a PUSH frame
DEVICE_FAILED = "BOUNDARY_DEVICE_FAILED"
_SLOT_HEADER = struct.Struct("<III")  # slot, generation, length of the handle that follows (0: mapped already)
_PUSH_HEADER = struct.Struct("<I")  # a PUSH payload's: the length of the message that follows
_PADDING = bytes(ALIGN)

Transport: TypeAlias = stage_pb2.BoundaryTransport.ValueType
TCP: Transport = stage_pb2.BOUNDARY_TRANSPORT_TCP
CUDA_IPC: Transport = stage_pb2.BOUNDARY_TRANSPORT_CUDA_IPC
GRPC: Transport = stage_pb2.BOUNDARY_TRANSPORT_GRPC
NAMES: dict[Transport, str] = {TCP: "tcp", CUDA_IPC: "cuda_ipc", GRPC: "grpc",
                               stage_pb2.BOUNDARY_TRANSPORT_UNSPECIFIED: "tcp"}


def tcp_only() -> bool:
    """Whether this process was told never to take the GPU path."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value not in ("auto", "tcp", ""):
        raise ValueError(f"{ENV} is auto or tcp, not {value!r}")
    return value == "tcp"


def host_id() -> str:
    """The kernel this process runs on: two processes with the same id can share GPU memory. The boot id alone
    is shared by the containers of one node, which cannot map each other's memory; the host name tells them apart."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""  # not Linux: no CUDA IPC either, and an empty id never matches (see choose)
    return f"{boot}/{socket.gethostname()}" if boot else ""


def _torch_cuda() -> Any:
    """torch, when it is installed and sees a CUDA device; else None. Never initializes CUDA on a CPU executor."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _visible_gpu_uuids(device: str) -> list[str]:
    """The UUIDs of the GPUs this process sees, in its CUDA device order; none off CUDA."""
    torch = _torch_cuda() if device.startswith("cuda") else None
    if torch is None:
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def gpu_uuid(device: str) -> str:
    """The UUID of the GPU `device` names ("cuda:1"); "" off CUDA."""
    torch = _torch_cuda() if device.startswith("cuda") else None
    if torch is None:
        return ""
    return str(torch.cuda.get_device_properties(torch.device(device).index or 0).uuid)


def local_end(device: str) -> stage_pb2.BoundaryLinkEnd:
    """This executor's end of a link."""
    end = stage_pb2.BoundaryLinkEnd(host_id=host_id(), device=device, tcp_only=tcp_only(), gpu_uuid=gpu_uuid(device))
    end.visible_gpu_uuids.extend(_visible_gpu_uuids(device))
    return end


@dataclass(frozen=True)
class Choice:
    transport: Transport
    reason: str


def _peer_access(own: int, peer: int) -> bool:
    torch = _torch_cuda()
    return torch is not None and bool(torch.cuda.can_device_access_peer(own, peer))


def choose(sender: stage_pb2.BoundaryLinkEnd, receiver: stage_pb2.BoundaryLinkEnd,
           peer_access: Callable[[int, int], bool] = _peer_access) -> Choice:
    """The transport of a link from `sender` to `receiver`, decided by the receiver (it must map the sender's
    memory); `peer_access(own index, sender's index)` in the receiver's CUDA device order."""
    if sender.tcp_only or receiver.tcp_only:
        return Choice(TCP, f"{ENV}=tcp at the {'sender' if sender.tcp_only else 'receiver'}")
    if not sender.host_id or sender.host_id != receiver.host_id:
        return Choice(TCP, "ranks on different hosts")
    for name, end in (("sender", sender), ("receiver", receiver)):
        if not end.gpu_uuid:
            return Choice(TCP, f"the {name} is on {end.device or 'cpu'}")
    visible = list(receiver.visible_gpu_uuids)
    if sender.gpu_uuid not in visible or receiver.gpu_uuid not in visible:
        return Choice(TCP, f"the receiver cannot see the sender's GPU {sender.gpu_uuid}")
    own, peer = visible.index(receiver.gpu_uuid), visible.index(sender.gpu_uuid)
    if own == peer:
        return Choice(CUDA_IPC, f"same host, same GPU {sender.gpu_uuid}")
    if not peer_access(own, peer):
        return Choice(TCP, f"no peer access from GPU {receiver.gpu_uuid} to {sender.gpu_uuid}")
    return Choice(CUDA_IPC, f"same host, GPU {sender.gpu_uuid} to {receiver.gpu_uuid} (peer access)")


def _nbytes(tensor: Any) -> int:
    # math.prod (tensors.nbytes), not np.prod: numpy converts the proto's repeated field first, and every push pays
    # this per tensor at both ends
    return tensors.nbytes(dtypes.from_proto(tensor.dtype), tuple(tensor.shape))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _spans(request: stage_pb2.PushBoundaryRequest, at: int) -> list[tuple[int, int]]:
    """Where the request's tensors lie in a buffer whose bytes before `at` are not theirs, a slot's or a PUSH
    frame's: (offset, bytes) of each in order, each at the next ALIGN offset."""
    spans = []
    for t in request.tensors:
        start, n = _aligned(at), _nbytes(t.tensor)
        spans.append((start, n))
        at = start + n
    return spans


def _end(spans: list[tuple[int, int]], at: int) -> int:
    """Where the last span ends (`at` when there is none)."""
    return spans[-1][0] + spans[-1][1] if spans else at


def _views(request: stage_pb2.PushBoundaryRequest, data: memoryview, spans: list[tuple[int, int]]) -> list[np.ndarray]:
    """The request's tensors as arrays viewing `data` at their spans (no copy)."""
    return [tensors.from_bytes(dtypes.from_proto(t.tensor.dtype), t.tensor.shape, data[start:start + n])
            for t, (start, n) in zip(request.tensors, spans, strict=True)]


def _wrong_size(got: int, need: int) -> ValueError:
    return ValueError(f"a boundary value of {got} bytes where its tensor needs {need}")


def push_parts(request: stage_pb2.PushBoundaryRequest, values: Sequence[np.ndarray]) -> list[Buffer]:
    """A PUSH frame's payload for `request` (its tensors without bytes) whose tensors' bytes are `values` in order:
    the message, then each value's bytes at its span of the payload, as views of the arrays."""
    message = request.SerializeToString()
    parts: list[Buffer] = [_PUSH_HEADER.pack(len(message)), message]
    at = _PUSH_HEADER.size + len(message)
    for value, (start, n) in zip(values, _spans(request, at), strict=True):
        data = np.ascontiguousarray(value).reshape(-1).view(np.uint8).data
        if len(data) != n:
            raise _wrong_size(len(data), n)
        parts += [_PADDING[:start - at], data]
        at = start + n
    return parts


def read_push(payload: bytearray) -> tuple[stage_pb2.PushBoundaryRequest, list[np.ndarray]]:
    """The request and the tensors of a PUSH payload (push_parts), the tensors as views of `payload`."""
    if len(payload) < _PUSH_HEADER.size:
        raise InvalidArgument(f"a push of {len(payload)} bytes", "BAD_REQUEST")
    (length,) = _PUSH_HEADER.unpack_from(payload)
    at = _PUSH_HEADER.size + length
    if at > len(payload):
        raise InvalidArgument(f"a push announces a message of {length} bytes in a frame of {len(payload)}",
                              "BAD_REQUEST")
    view = memoryview(payload)
    request = stage_pb2.PushBoundaryRequest.FromString(bytes(view[_PUSH_HEADER.size:at]))  # no tensor bytes
    spans = _spans(request, at)
    end = _end(spans, at)
    if end > len(payload):
        raise InvalidArgument(f"the push's tensors need {end} bytes, its frame holds {len(payload)}", "BAD_REQUEST")
    if end != len(payload):
        raise InvalidArgument(f"{len(payload) - end} bytes follow the push's last tensor", "BAD_REQUEST")
    return request, _views(request, view, spans)


def _export(buffer: Any, gpu_uuid: str) -> bytes:
    """An IPC handle of a device buffer, as torch.multiprocessing shares a CUDA tensor (its storage's handle,
    offset in the allocation, reference counter and the event its writes are ordered by)."""
    from torch.multiprocessing import reductions

    _, args = cast(Any, reductions).reduce_tensor(buffer)
    (_, size, _, _, _, _, _, handle, size_bytes, offset_bytes, _, counter, counter_offset, event, event_sync) = args
    return json.dumps({"gpu": gpu_uuid, "size": int(size[0]), "handle": handle.hex(), "size_bytes": size_bytes,
                       "offset_bytes": offset_bytes, "counter": counter.hex(), "counter_offset": counter_offset,
                       "event": event.hex() if event else "", "event_sync": bool(event_sync)}).encode()


class DeviceSender:
    """The sending end of a link's GPU path: its slots, on the sender's device (the pusher makes one only where the
    receiver chose CUDA IPC; on a CPU device, which tests use to check the slots' layout, copies are plain)."""

    def __init__(self, device: str, gpu_uuid: str) -> None:
        import torch

        self._torch: Any = torch
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self._uuid = gpu_uuid
        self._stream = self._torch.cuda.Stream(self._device) if self._cuda else None
        self._slots: list[Any] = [None] * SLOTS
        self._events: list[Any] = [None] * SLOTS  # each slot's interprocess event: its chained bytes are in
        self._generations = [0] * SLOTS
        self._announced = [0] * SLOTS  # the generation the receiver was last sent the handle of
        self._free: deque[int] = deque(range(SLOTS))
        self._lock = threading.Lock()

    def frame(self, request: stage_pb2.PushBoundaryRequest, values: list[Any],
              chained: bool = False) -> tuple[bytes, int] | None:
        """A DEVICE_PUSH payload for `request` (its tensors without bytes) whose tensor bytes are `values` in
        order (numpy arrays, torch tensors or DeviceValues), and the slot it holds until `release`; None when the
        bundle is under DEVICE_MIN_BYTES or every slot is in flight (then it goes as a TCP frame).

        `chained` (a DEVICE_CHAINED payload): whatever its size, and nothing waits for the device. The copy into
        the slot is queued on the caller's current stream, behind the run that made the values, and the slot's
        interprocess event is recorded after it; the receiver's stream waits for that event. Such a push may
        grow the link's slots up to CHAINED_SLOTS, since its answer comes only once the copy has run."""
        spans = _spans(request, 0)
        need = _aligned(_end(spans, 0))
        if need < DEVICE_MIN_BYTES and not chained:
            return None
        with self._lock:
            if not self._free and chained and len(self._slots) < CHAINED_SLOTS:
                self._free.append(len(self._slots))
                self._slots.append(None)
                self._events.append(None)
                self._generations.append(0)
                self._announced.append(0)
            if not self._free:
                return None
            slot = self._free.popleft()
        try:
            return self._fill(slot, request, values, spans, need, chained), slot
        except BaseException:
            self.release(slot)
            raise

    def _fill(self, slot: int, request: stage_pb2.PushBoundaryRequest, values: list[Any],
              spans: list[tuple[int, int]], need: int, chained: bool) -> bytes:
        torch = self._torch
        buffer = self._slots[slot]
        if buffer is None or buffer.numel() < need:
            # Grown by powers of two so a prompt's chunks of varying length do not re-map each time.
            self._slots[slot] = buffer = torch.empty(1 << (need - 1).bit_length(), dtype=torch.uint8,
                                                     device=self._device)
            self._generations[slot] += 1
            if self._cuda and self._events[slot] is None:
                self._events[slot] = torch.cuda.Event(interprocess=True, enable_timing=False)
                self._events[slot].record()  # an event is made on its first record; its handle needs it made
        # A chained copy goes on the caller's current stream (no context needed), behind the run that made it.
        stream = torch.cuda.current_stream(self._device) if chained and self._cuda else self._stream
        with torch.cuda.stream(stream) if stream is not None and not chained else contextlib.nullcontext():
            for value, (start, n) in zip(values, spans):
                if isinstance(value, np.ndarray):
                    source = torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
                    pinned = chained and self._cuda
                    if pinned:
                        source = source.pin_memory()  # queued on the stream, not waiting for its work
                else:
                    tensor = value
                    if isinstance(value, DeviceValue):
                        tensor = value.tensor
                        if value.ready is not None and stream is not None:  # a value handed to this rank
                            stream.wait_event(value.ready)
                            tensor.record_stream(stream)  # read here: not handed out again before this copy
                    source = tensor.contiguous().reshape(-1).view(torch.uint8)
                    pinned = False
                if source.numel() != n:
                    raise _wrong_size(source.numel(), n)
                buffer[start:start + n].copy_(source, non_blocking=source.is_cuda or pinned)
        if chained and stream is not None:
            self._events[slot].record(stream)
        elif stream is not None:
            stream.synchronize()  # the bytes are in the slot before the receiver is told to read them
        handle = b""
        if self._announced[slot] != self._generations[slot]:
            handle = _export(buffer, self._uuid)
            if self._events[slot] is not None:
                handle = json.dumps({**json.loads(handle), "ipc_event": bytes(self._events[slot].ipc_handle()).hex()
                                     }).encode()
            self._announced[slot] = self._generations[slot]
        return _SLOT_HEADER.pack(slot, self._generations[slot], len(handle)) + handle + request.SerializeToString()

    def release(self, slot: int) -> None:
        """The receiver answered the push that held `slot`: it has read it."""
        with self._lock:
            self._free.append(slot)


class DeviceReceiver:
    """The receiving end of one link's GPU path: the sender's slots it mapped, by slot number."""

    def __init__(self, device: str) -> None:
        torch = _torch_cuda() if device.startswith("cuda") else None
        if torch is None:
            raise Unavailable(f"a bundle over CUDA IPC reached an executor on {device}", DEVICE_FAILED)
        self._torch = torch
        self._device = torch.device(device)  # where chained bundles are copied to: this executor's GPU
        self._uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        self._slots: dict[int, tuple[int, Any, Any]] = {}  # slot -> (generation, the mapped buffer, its event)
        # Copies out of a slot run on a stream of their own: on the legacy default stream they would wait behind
        # every kernel this process's engine has queued, though the sender synchronized before it pushed.
        self._streams: dict[int, Any] = {}

    def request(self, payload: bytes) -> tuple[stage_pb2.PushBoundaryRequest, list[np.ndarray]]:
        """The PushBoundaryRequest a DEVICE_PUSH frame carries, and its tensors copied out of the slot."""
        request, buffer, _, spans = self._guarded(lambda: self._request(payload))
        return request, self._guarded(lambda: _views(request, self._read(buffer[:_end(spans, 0)]).data, spans))

    def chained(self, payload: bytes) -> tuple[stage_pb2.PushBoundaryRequest, list[DeviceValue]]:
        """The PushBoundaryRequest a DEVICE_CHAINED frame carries, and its tensors as device values: copied out of
        the slot into this process's memory on a stream that first waits for the slot's event, each ready once
        that copy has run (`settle` waits for it). Nothing here waits for the device."""
        request, buffer, event, spans = self._guarded(lambda: self._request(payload))
        return request, self._guarded(lambda: self._copy(request, buffer, event, spans))

    @staticmethod
    def settle(values: Sequence[Any]) -> None:
        """Waits until the copies out of the slot that `values` (chained's) came from have run: then the slot may
        be written again, and the push is answered."""
        for value in values:
            if isinstance(value, DeviceValue) and value.ready is not None:
                value.ready.synchronize()

    @staticmethod
    def _guarded(read: Callable[[], Any]) -> Any:
        try:
            return read()
        except Unavailable:
            raise
        except Exception as e:  # a handle that does not map, a slot out of turn: the link's GPU path failed
            raise Unavailable(f"a bundle over CUDA IPC could not be read: {type(e).__name__}: {e}",
                              DEVICE_FAILED) from e

    def _request(self, payload: bytes) -> tuple[stage_pb2.PushBoundaryRequest, Any, Any, list[tuple[int, int]]]:
        slot, generation, length = _SLOT_HEADER.unpack_from(payload)
        at = _SLOT_HEADER.size
        if length:
            handle = json.loads(payload[at:at + length])
            self._slots[slot] = (generation, self._map(handle), self._open_event(handle))
        mapped = self._slots.get(slot)
        if mapped is None or mapped[0] != generation:
            raise ValueError(f"slot {slot} generation {generation} was never mapped on this link")
        buffer = mapped[1]
        request = stage_pb2.PushBoundaryRequest.FromString(payload[at + length:])
        spans = _spans(request, 0)
        end = _end(spans, 0)
        if end > buffer.numel():
            raise ValueError(f"the bundle's tensors need {end} bytes, its slot holds {buffer.numel()}")
        return request, buffer, mapped[2], spans

    def _stream(self, device: Any) -> Any:
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = self._torch.cuda.Stream(device)
        return stream

    def _read(self, span: Any) -> np.ndarray:
        """`span` of a slot in host memory, read before the answer frees the slot (a slot on the CPU, which tests
        use to check the layout, is read as it is)."""
        if span.device.type != "cuda":
            return cast(np.ndarray, span.numpy())
        torch = self._torch
        stream = self._stream(span.device)
        host = torch.empty(span.numel(), dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(span, non_blocking=True)
        stream.synchronize()
        return cast(np.ndarray, host.numpy())

    def _copy(self, request: stage_pb2.PushBoundaryRequest, buffer: Any, event: Any,
              spans: list[tuple[int, int]]) -> list[DeviceValue]:
        from graphmesh_executor.backends.torch_tensors import TORCH_DTYPES

        torch = self._torch
        end = _end(spans, 0)
        ready = None
        if buffer.device.type != "cuda":  # host slots, which tests use
            own = buffer[:end].clone()
        else:
            if event is None:
                raise ValueError("a chained bundle in a slot that came without its event")
            # On this executor's GPU, allocated on the copy's own stream: whoever reads it on another stream marks it
            # used there (Tensor.record_stream), so its memory is not handed to the next copy before that read. (On
            # the engine's stream, the next bundle's copy, which waits only for its sender, could overwrite it.)
            stream = self._stream(self._device)
            with torch.cuda.stream(stream):
                own = torch.empty(end, dtype=torch.uint8, device=self._device)
                stream.wait_event(event)
                own.copy_(buffer[:end], non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
        values = []
        for t, (start, n) in zip(request.tensors, spans, strict=True):
            name, shape = dtypes.from_proto(t.tensor.dtype), tuple(int(d) for d in t.tensor.shape)
            values.append(DeviceValue(own[start:start + n].view(TORCH_DTYPES[name]).view(shape), dtypes.to_numpy(name),
                                      shape, ready))
        return values

    def _open_event(self, handle: dict[str, Any]) -> Any:
        """The sender's interprocess event of a slot, opened here; None where it sent none (a host slot)."""
        if not handle.get("ipc_event"):
            return None
        torch = self._torch
        device = torch.device("cuda", self._uuids.index(handle["gpu"]))
        return torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(handle["ipc_event"]))

    def _map(self, handle: dict[str, Any]) -> Any:
        """The sender's buffer, mapped on the device that holds it in this process's order (a CUDA context there
        on first use), so torch knows where the memory is for every copy out of it."""
        from torch.multiprocessing import reductions

        torch = self._torch
        if handle["gpu"] not in self._uuids:
            raise ValueError(f"the sender's GPU {handle['gpu']} is not visible here")
        rebuild = cast(Any, reductions).rebuild_cuda_tensor
        return rebuild(torch.Tensor, (handle["size"],), (1,), 0, torch.UntypedStorage, torch.uint8,
                       self._uuids.index(handle["gpu"]), bytes.fromhex(handle["handle"]), handle["size_bytes"],
                       handle["offset_bytes"], False, bytes.fromhex(handle["counter"]), handle["counter_offset"],
                       bytes.fromhex(handle["event"]) or None, handle["event_sync"])

    def close(self) -> None:
        self._slots.clear()  # unmaps: the sender's reference counts drop, and it may free the slots


def receiver_factory(device: str) -> Callable[[], DeviceReceiver]:
    """What a link listener makes a link's DeviceReceiver with, at its first DEVICE_PUSH (off CUDA that raises
    DEVICE_FAILED, and the push is refused: the receiver never chose the GPU path)."""
    return lambda: DeviceReceiver(device)
