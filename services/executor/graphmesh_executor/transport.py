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

Run ahead so, the hosts still take turns: a rank can queue iteration i only once the rank before has recorded its
event for it (a wait on an event waits for its last record), so each iteration paid both hosts' Python, 1.46 ms a
hop on an H100 where the GPU's share of the iteration was ~1.1 ms. Where both ranks compute on the same GPU, a run
is queued instead from its second iteration on, when every later bundle over a link has one layout (the activation
and the tokens fed, or the tokens fed back): one DEVICE_QUEUED frame announces the run's bundles, and the sender's
stream then puts each one into a slot the run holds, waiting until the receiver's stream has read the one before
(the slot's consumed word reaches its value) and setting the slot's written word after it (cuStreamWaitValue32 and
cuStreamWriteValue32). The receiver accepts every bundle at once, as device values that arrive when first read: its
stream waits for the written word, copies the slot into its own memory and sets the consumed word. So both hosts
launch a whole run without waiting for each other and the GPU alone passes the bundles along. A step that fails
releases what its stream waits for (stage.py): a sender pushes its consumed word past every value and retires the
slot, a receiver sets both words to the run's last value, and each stream runs on over what is never used. On ranks
with GPUs of their own a run stays ahead bundle by bundle: a queued run holds a rank's stream until its end, where a
rank gains more from computing another micro-batch in between. A run is queued only when its step was sent alone
(ExecuteStepRequest.alone): with two steps' runs queued, the two ranks' streams can hold them in different orders,
each waiting for a word the other would write only after the wait it is stuck behind (it hung so on an H100). The
ranks report that they queue (InstallResponse.queues_runs) and the coordinator then sends stages on one GPU one
micro-batch, each step alone. QUEUED_ENV=0 turns queueing off (as ENV=tcp does, which keeps every link on TCP).

A TCP frame (PUSH) carries the PushBoundaryRequest without its tensors' bytes, then the bytes themselves, each
tensor at an ALIGN offset: the sender hands the arrays to the kernel where they lie (graphmesh.links.send_frame)
and the receiver reads them into one buffer that the stage's arrays are views of. Inside the message, a 1 MiB
activation was copied five times on the way (to bytes, into the message, serialized, framed, out of the read
buffer) and parsed once more.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import socket
import struct
import threading
import time
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
# A decode run's bundles from one on, all in one slot held for the run: its queue header after the slot header, then
# the handle, then the PushBoundaryRequest of its first; each later one is written when the run's stream gets there
DEVICE_QUEUED = 8
# "0": decode runs between executors on one GPU run ahead bundle by bundle instead of queued (below; on by default)
QUEUED_ENV = "GRAPHMESH_QUEUED_RUNS"
# Smaller bundles go as TCP frames on the same link (the environment variable lets a test send every one through
# the GPU path).
DEVICE_MIN_BYTES = int(os.environ.get("GRAPHMESH_CUDA_IPC_MIN_BYTES", 8 << 20))
SLOTS = 4  # device buffers per link: bundles in flight at once over the GPU path
CHAINED_SLOTS = 16  # how far chained pushes may grow a link's slots (each is answered once its copy has run)
DEVICE_STRIKES = 3  # failed device pushes in a row to one address before its links stay on TCP
ALIGN = 256  # each tensor's offset in a slot or a PUSH frame
DEVICE_FAILED = "BOUNDARY_DEVICE_FAILED"
_SLOT_HEADER = struct.Struct("<III")  # slot, generation, length of the handle that follows (0: mapped already)
_QUEUE_HEADER = struct.Struct("<II")  # a DEVICE_QUEUED payload's: the slot's written-word value of its first bundle, bundles
_HALF = 1 << 31  # slot words count modulo 2**32: a word has reached a value when it is less than this past it
_RELEASED = 1 << 30  # how far a failing sender pushes its consumed word past its values: every wait on it goes on
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
    return json.dumps({"gpu": gpu_uuid, "size": int(size[0]), "dtype": str(buffer.dtype).removeprefix("torch."),
                       "handle": handle.hex(), "size_bytes": size_bytes,
                       "offset_bytes": offset_bytes, "counter": counter.hex(), "counter_offset": counter_offset,
                       "event": event.hex() if event else "", "event_sync": bool(event_sync)}).encode()


@functools.cache
def _stream_ops() -> tuple[Any, Any] | None:
    """The driver's cuStreamWaitValue32 and cuStreamWriteValue32 (stream memory operations), or None where this
    driver has neither."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    ops = []
    for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
        op = next((getattr(lib, n) for n in (f"{name}_v2", name) if hasattr(lib, n)), None)
        if op is None:
            return None
        op.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        op.restype = ctypes.c_int
        ops.append(op)
    return ops[0], ops[1]


def queued_runs(device: str) -> bool:
    """Whether this process may queue a decode run's bundles on the device (DEVICE_QUEUED): it was not told not to
    (QUEUED_ENV=0, or every link on TCP), and its driver has stream memory operations (or it computes on the CPU,
    where tests drive the slots in host memory)."""
    if os.environ.get(QUEUED_ENV, "1").strip() == "0" or tcp_only():
        return False
    return not device.startswith("cuda") or _stream_ops() is not None


def _reached(word: int, value: int) -> bool:
    return (word - value) % (1 << 32) < _HALF


def _as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= _HALF else value


def wait_word(stream: Any, word: Any, value: int) -> None:
    """Queues on `stream` a wait until `word` (an int32 of a slot's words: this process's memory or a mapping of the
    sender's) has reached `value`, counting modulo 2**32. With no stream (a slot in host memory, which tests use) it
    waits here, for another thread to write the word."""
    if stream is None:
        while not _reached(int(word.item()), value):
            time.sleep(0.0002)
        return
    ops = _stream_ops()
    assert ops is not None
    if ops[0](stream.cuda_stream, word.data_ptr(), value & 0xFFFFFFFF, 0):  # CU_STREAM_WAIT_VALUE_GEQ
        raise RuntimeError(f"cuStreamWaitValue32 failed on a slot's word (value {value})")


def write_word(stream: Any, word: Any, value: int) -> None:
    """Queues on `stream` a write of `value` to `word`, after everything queued before it (the driver fences
    memory first); with no stream, writes it now."""
    if stream is None:
        word.fill_(_as_int32(value))
        return
    ops = _stream_ops()
    assert ops is not None
    if ops[1](stream.cuda_stream, word.data_ptr(), value & 0xFFFFFFFF, 0):  # CU_STREAM_WRITE_VALUE_DEFAULT
        raise RuntimeError(f"cuStreamWriteValue32 failed on a slot's word (value {value})")


class DeviceSender:
    """The sending end of a link's GPU path: its slots, on the sender's device (the pusher makes one only where the
    receiver chose CUDA IPC; on a CPU device, which tests use to check the slots' layout, copies are plain)."""

    def __init__(self, device: str, gpu_uuid: str, same_gpu: bool = True) -> None:
        import torch

        self._torch: Any = torch
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self._uuid = gpu_uuid
        self.same_gpu = same_gpu  # the receiver computes on this GPU too (so a run's ranks take turns on it)
        self._stream = self._torch.cuda.Stream(self._device) if self._cuda else None
        self._slots: list[Any] = []
        self._events: list[Any] = []  # each slot's interprocess event: its chained bytes are in
        self._words: list[Any] = []  # each slot's two int32 words, [written, consumed]: a queued run's (QueuedRun)
        self._written: list[int] = []  # the value each slot's written word was last set to (0: never queued)
        self._generations: list[int] = []
        self._announced: list[int] = []  # the generation the receiver was last sent the handle of
        self._retired: list[tuple[Any, Any]] = []  # slots of failed queued runs: device work may still use them
        self._free: deque[int] = deque()
        self._lock = threading.Lock()
        for _ in range(SLOTS):
            self._grow()

    def _grow(self) -> None:
        self._free.append(len(self._slots))
        self._slots.append(None)
        self._events.append(None)
        self._words.append(None)
        self._written.append(0)
        self._generations.append(0)
        self._announced.append(0)

    def _take(self, grow: bool) -> int | None:
        with self._lock:
            if not self._free and grow and len(self._slots) < CHAINED_SLOTS:
                self._grow()
            return self._free.popleft() if self._free else None

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
        slot = self._take(chained)
        if slot is None:
            return None
        try:
            return self._fill(slot, request, values, spans, need, chained), slot
        except BaseException:
            self.release(slot)
            raise

    def queue(self, request: stage_pb2.PushBoundaryRequest, values: list[Any],
              bundles: int) -> tuple[bytes, QueuedRun] | None:
        """A DEVICE_QUEUED payload: `request`'s bundle (its bytes `values`) is the first of `bundles` a decode run
        sends over this link, every one through the same slot, which the run holds until it ends (QueuedRun). The
        first is written as the later ones will be (QueuedRun.put). None when every slot is in flight."""
        spans = _spans(request, 0)
        slot = self._take(True)
        if slot is None:
            return None
        try:
            buffer, words = self._slot(slot, _aligned(_end(spans, 0)))
            run = QueuedRun(self, slot, buffer, words, spans, self._written[slot], bundles)
            run.put(values)
            header = _QUEUE_HEADER.pack((run.first) & 0xFFFFFFFF, bundles)
            return self._payload(slot, buffer, header, request), run
        except BaseException:
            self.release(slot)
            raise

    def _slot(self, slot: int, need: int) -> tuple[Any, Any]:
        """Slot `slot`'s buffer, holding at least `need` bytes (a new generation when it had to grow), and its words."""
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
            if self._words[slot] is None:
                self._words[slot] = torch.zeros(2, dtype=torch.int32, device=self._device)
                self._written[slot] = 0
        return buffer, self._words[slot]

    def _copy_in(self, buffer: Any, values: list[Any], spans: list[tuple[int, int]], stream: Any,
                 pinned: bool) -> None:
        """Queues the copy of `values` into `buffer` at `spans` on `stream` (the caller's current one, or None off
        CUDA); host arrays through pinned memory when `pinned`, so that nothing waits for the stream's work."""
        torch = self._torch
        for value, (start, n) in zip(values, spans):
            if isinstance(value, np.ndarray):
                source = torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
                if pinned:
                    source = source.pin_memory()  # queued on the stream, not waiting for its work
                from_host = pinned
            else:
                tensor = value
                if isinstance(value, DeviceValue):
                    tensor = value.on(stream)  # a value handed to this rank: read once it is here
                    if stream is not None and value.ready is not None:
                        tensor.record_stream(stream)  # read here: not handed out again before this copy
                source = tensor.contiguous().reshape(-1).view(torch.uint8)
                from_host = False
            if source.numel() != n:
                raise _wrong_size(source.numel(), n)
            buffer[start:start + n].copy_(source, non_blocking=source.is_cuda or from_host)

    def _fill(self, slot: int, request: stage_pb2.PushBoundaryRequest, values: list[Any],
              spans: list[tuple[int, int]], need: int, chained: bool) -> bytes:
        buffer, words = self._slot(slot, need)
        # A chained copy goes on the caller's current stream (no context needed), behind the run that made it.
        stream = self._torch.cuda.current_stream(self._device) if chained and self._cuda else self._stream
        with self._torch.cuda.stream(stream) if stream is not None and not chained else contextlib.nullcontext():
            if self._written[slot]:  # the last queued run through this slot: its last bundle read before this write
                wait_word(stream, words[1], self._written[slot])
            self._copy_in(buffer, values, spans, stream, chained and self._cuda)
        if chained and stream is not None:
            self._events[slot].record(stream)
        elif stream is not None:
            stream.synchronize()  # the bytes are in the slot before the receiver is told to read them
        return self._payload(slot, buffer, b"", request)

    def _payload(self, slot: int, buffer: Any, header: bytes, request: stage_pb2.PushBoundaryRequest) -> bytes:
        """The slot header, `header`, the slot's handle where the receiver has not mapped this generation, and the
        request."""
        handle = b""
        if self._announced[slot] != self._generations[slot]:
            described = json.loads(_export(buffer, self._uuid))
            described["words"] = json.loads(_export(self._words[slot], self._uuid))
            if self._events[slot] is not None:
                described["ipc_event"] = bytes(self._events[slot].ipc_handle()).hex()
            handle = json.dumps(described).encode()
            self._announced[slot] = self._generations[slot]
        return (_SLOT_HEADER.pack(slot, self._generations[slot], len(handle)) + header + handle +
                request.SerializeToString())

    def release(self, slot: int) -> None:
        """The receiver answered the push that held `slot`: it has read it."""
        with self._lock:
            self._free.append(slot)

    def _ended(self, slot: int, last: int, failed: bool) -> None:
        """A queued run through `slot` ended, its last bundle written with `last`. A failed run's slot is retired
        (its streams may still write it) and the index gets a new slot at its next use."""
        with self._lock:
            self._written[slot] = last
            if failed:
                self._retired.append((self._slots[slot], self._words[slot]))
                self._slots[slot] = self._words[slot] = None
            self._free.append(slot)


class QueuedRun:
    """A decode run's bundles over one link from one on (DeviceSender.queue), all through one slot the run holds:
    each is copied in on the caller's stream once the receiver's stream has read the one before (the slot's
    consumed word reaches that one's value), and the slot's written word is then set to its value; the receiver's
    stream waits for that before it reads (DeviceReceiver.queued). Nothing here waits for the device, and no frame
    goes out after the first: the two ranks' streams pass the run's bundles to each other as the GPU reaches them."""

    def __init__(self, sender: DeviceSender, slot: int, buffer: Any, words: Any, spans: list[tuple[int, int]],
                 last: int, bundles: int) -> None:
        self._sender, self.slot, self._buffer, self._words, self._spans = sender, slot, buffer, words, spans
        self.first = last + 1  # the written word's value of the run's first bundle
        self._next = self.first
        self._end = self.first + bundles  # one past the value of its last
        self._lock = threading.Lock()
        self._open = True

    def put(self, values: list[Any]) -> None:
        """The run's next bundle, `values` in the first's layout, queued on the caller's current stream."""
        sender = self._sender
        if self._next >= self._end:
            raise ValueError(f"a queued run of {self._end - self.first} bundles was given one more")
        stream = sender._torch.cuda.current_stream(sender._device) if sender._cuda else None
        wait_word(stream, self._words[1], self._next - 1)
        sender._copy_in(self._buffer, values, self._spans, stream, sender._cuda)
        write_word(stream, self._words[0], self._next)
        self._next += 1

    def end(self) -> None:
        """The step is over here, every bundle put: the slot is free for other pushes, whose copies wait on the
        device until the receiver has read the last bundle."""
        self._close(False)

    def release(self) -> None:
        """The step fails here: the consumed word is pushed past every value, so this rank's stream goes on past
        each wait it queued for the receiver (which may never read them), and the slot is retired."""
        if self._close(True):
            side = self._sender._stream
            with self._sender._torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                write_word(side, self._words[1], self._end + _RELEASED)

    def _close(self, failed: bool) -> bool:
        with self._lock:
            was, self._open = self._open, False
        if was:
            self._sender._ended(self.slot, self._next - 1, failed)
        return was


class _ReceivedRun:
    """The receiving end of a queued run: its slot and words as mapped here, and its bundles' values."""

    def __init__(self, receiver: DeviceReceiver, buffer: Any, words: Any, first: int, bundles: int,
                 request: stage_pb2.PushBoundaryRequest, spans: list[tuple[int, int]]) -> None:
        self._receiver, self._buffer, self._words, self._first = receiver, buffer, words, first
        self._last = first + bundles - 1
        self._request, self._spans, self._end = request, spans, _end(spans, 0)
        self._released = False
        self.arrivals = [_Arrival(self, first + k, receiver._placeholders(request, buffer, spans))
                         for k in range(bundles)]

    def take(self, stream: Any, value: int, values: list[DeviceValue]) -> None:
        """Queues on `stream` the wait for bundle `value`, its copy out of the slot into this process's memory and
        the consumed word's write; `values` then hold views of that copy."""
        torch = self._receiver._torch
        wait_word(stream, self._words[0], value)
        if stream is None:
            own = self._buffer[:self._end].clone()
        else:
            own = torch.empty(self._end, dtype=torch.uint8, device=stream.device)  # on this stream: read there
            own.copy_(self._buffer[:self._end], non_blocking=True)
        write_word(stream, self._words[1], value)
        for v, copied in zip(values, self._receiver._placeholders(self._request, own, self._spans)):
            v.tensor = copied.tensor

    def release(self) -> None:
        """The step fails here: both words are set to the run's last value, the written one first, so this rank's
        stream goes on past each wait it queued for the sender (reading what the slot holds: the step's outputs are
        never used), and the sender may use the slot again as though every bundle had been read."""
        if self._released:
            return
        self._released = True
        stream = self._receiver._stream(self._words.device) if self._words.device.type == "cuda" else None
        with self._receiver._torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            write_word(stream, self._words[0], self._last)
            write_word(stream, self._words[1], self._last)


class _Arrival:
    """One bundle of a queued run (executable.Arrival): its values arrive on the first stream that reads one."""

    def __init__(self, run: _ReceivedRun, value: int, values: list[DeviceValue]) -> None:
        self._run, self._value, self.values, self._taken = run, value, values, False
        self.release = run.release  # the run's, one for all its bundles
        for v in values:
            v.arrival = self

    def arrive(self, stream: Any) -> None:
        if not self._taken:
            self._taken = True
            self._run.take(stream, self._value, self.values)


class DeviceReceiver:
    """The receiving end of one link's GPU path: the sender's slots it mapped, by slot number."""

    def __init__(self, device: str) -> None:
        torch = _torch_cuda() if device.startswith("cuda") else None
        if torch is None:
            raise Unavailable(f"a bundle over CUDA IPC reached an executor on {device}", DEVICE_FAILED)
        self._torch = torch
        self._device = torch.device(device)  # where chained bundles are copied to: this executor's GPU
        self._uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        # slot -> (generation, the mapped buffer, its event, its words)
        self._slots: dict[int, tuple[int, Any, Any, Any]] = {}
        # Copies out of a slot run on a stream of their own: on the legacy default stream they would wait behind
        # every kernel this process's engine has queued, though the sender synchronized before it pushed.
        self._streams: dict[int, Any] = {}

    def request(self, payload: bytes) -> tuple[stage_pb2.PushBoundaryRequest, list[np.ndarray]]:
        """The PushBoundaryRequest a DEVICE_PUSH frame carries, and its tensors copied out of the slot."""
        request, mapped, spans = self._guarded(lambda: self._request(payload, 0))
        return request, self._guarded(lambda: _views(request, self._read(mapped[1][:_end(spans, 0)]).data, spans))

    def chained(self, payload: bytes) -> tuple[stage_pb2.PushBoundaryRequest, list[DeviceValue]]:
        """The PushBoundaryRequest a DEVICE_CHAINED frame carries, and its tensors as device values: copied out of
        the slot into this process's memory on a stream that first waits for the slot's event, each ready once
        that copy has run (`settle` waits for it). Nothing here waits for the device."""
        request, mapped, spans = self._guarded(lambda: self._request(payload, 0))
        return request, self._guarded(lambda: self._copy(request, mapped[1], mapped[2], spans))

    def queued(self, payload: bytes) -> tuple[stage_pb2.PushBoundaryRequest, list[list[DeviceValue]]]:
        """The PushBoundaryRequest of a DEVICE_QUEUED frame's first bundle, and every bundle's values, in order:
        device values whose bytes are not here yet. The first stream that reads one of a bundle (DeviceValue.on)
        queues its arrival: a wait for the slot's written word to reach the bundle's value, the copy out of the
        slot, the consumed word's write. Nothing here touches the device."""
        first, bundles = _QUEUE_HEADER.unpack_from(payload, _SLOT_HEADER.size)
        request, mapped, spans = self._guarded(lambda: self._request(payload, _QUEUE_HEADER.size))
        if mapped[3] is None:
            raise Unavailable("a queued bundle in a slot that came without its words", DEVICE_FAILED)
        run = _ReceivedRun(self, mapped[1], mapped[3], first, bundles, request, spans)
        return request, [arrival.values for arrival in run.arrivals]

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

    def _request(self, payload: bytes, header: int) -> tuple[stage_pb2.PushBoundaryRequest, tuple[int, Any, Any, Any],
                                                              list[tuple[int, int]]]:
        """The request after the slot header and `header` more bytes, the slot as mapped, the tensors' spans."""
        slot, generation, length = _SLOT_HEADER.unpack_from(payload)
        at = _SLOT_HEADER.size + header
        if length:
            handle = json.loads(payload[at:at + length])
            words = self._map(handle["words"]) if "words" in handle else None
            self._slots[slot] = (generation, self._map(handle), self._open_event(handle), words)
        mapped = self._slots.get(slot)
        if mapped is None or mapped[0] != generation:
            raise ValueError(f"slot {slot} generation {generation} was never mapped on this link")
        request = stage_pb2.PushBoundaryRequest.FromString(payload[at + length:])
        spans = _spans(request, 0)
        end = _end(spans, 0)
        if end > mapped[1].numel():
            raise ValueError(f"the bundle's tensors need {end} bytes, its slot holds {mapped[1].numel()}")
        return request, mapped, spans

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

    def _placeholders(self, request: stage_pb2.PushBoundaryRequest, buffer: Any,
                      spans: list[tuple[int, int]]) -> list[DeviceValue]:
        """The request's tensors as device values over `buffer` at `spans`."""
        from graphmesh_executor.backends.torch_tensors import TORCH_DTYPES

        values = []
        for t, (start, n) in zip(request.tensors, spans, strict=True):
            name, shape = dtypes.from_proto(t.tensor.dtype), tuple(int(d) for d in t.tensor.shape)
            values.append(DeviceValue(buffer[start:start + n].view(TORCH_DTYPES[name]).view(shape),
                                      dtypes.to_numpy(name), shape))
        return values

    def _copy(self, request: stage_pb2.PushBoundaryRequest, buffer: Any, event: Any,
              spans: list[tuple[int, int]]) -> list[DeviceValue]:
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
        values = self._placeholders(request, own, spans)
        for v in values:
            v.ready = ready
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
        dtype = getattr(torch, handle.get("dtype", "uint8"))
        return rebuild(torch.Tensor, (handle["size"],), (1,), 0, torch.UntypedStorage, dtype,
                       self._uuids.index(handle["gpu"]), bytes.fromhex(handle["handle"]), handle["size_bytes"],
                       handle["offset_bytes"], False, bytes.fromhex(handle["counter"]), handle["counter_offset"],
                       bytes.fromhex(handle["event"]) or None, handle["event_sync"])

    def close(self) -> None:
        self._slots.clear()  # unmaps: the sender's reference counts drop, and it may free the slots


def receiver_factory(device: str) -> Callable[[], DeviceReceiver]:
    """What a link listener makes a link's DeviceReceiver with, at its first DEVICE_PUSH (off CUDA that raises
    DEVICE_FAILED, and the push is refused: the receiver never chose the GPU path)."""
    return lambda: DeviceReceiver(device)
