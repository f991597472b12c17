"""numpy arrays <-> graphmesh.v1.Tensor, and chunked streaming of big tensors."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

import numpy as np

from graphmesh import dtypes
from graphmesh.v1 import tensor_pb2

CHUNK_BYTES = 1 << 20  # grpcio moves ~4x more bytes/s in 1 MiB chunks than in one big message
MAX_DIM = 1 << 40
MAX_TENSOR_BYTES = 1 << 36  # 64 GiB: anything larger is a mistake, not a model


class TensorError(ValueError):
    """A tensor whose dtype, shape and bytes do not agree."""


def check_shape(shape: Iterable[int]) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    for d in dims:
        if d < 0:
            raise TensorError(f"negative dimension {d} in shape {list(dims)}")
        if d > MAX_DIM:
            raise TensorError(f"dimension {d} in shape {list(dims)} exceeds {MAX_DIM}")
    count = 1
    for d in dims:
        count *= d
        if count > MAX_TENSOR_BYTES:
            raise TensorError(f"shape {list(dims)} has too many elements")
    return dims


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtypes.itemsize(dtype)


def from_bytes(dtype: str, shape: Iterable[int], data: bytes | bytearray | memoryview) -> np.ndarray:
    dims = check_shape(shape)
    expected = nbytes(dtype, dims)
    if len(data) != expected:
        raise TensorError(
            f"{dtype}{list(dims)} needs {expected} bytes, got {len(data)}"
        )
    return np.frombuffer(data, dtype=dtypes.to_numpy(dtype).newbyteorder("<")).reshape(dims)


def to_proto(array: np.ndarray) -> tensor_pb2.Tensor:
    dtype = dtypes.from_numpy(array.dtype)
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return tensor_pb2.Tensor(dtype=dtypes.to_proto(dtype), shape=array.shape, data=data)


def from_proto(tensor: tensor_pb2.Tensor) -> np.ndarray:
    return from_bytes(dtypes.from_proto(tensor.dtype), tensor.shape, tensor.data)


def chunk_fields(name: str, array: np.ndarray,
                 chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[tensor_pb2.TensorChunk, memoryview]]:
    """The tensor's chunks, each as (every field but `data`, the data as a view of the array): to_chunks fills the
    data in; a caller that frames requests as bytes (serialized_chunk) copies the tensor's bytes once."""
    dtype = dtypes.from_numpy(array.dtype)
    view = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
    total = len(view)
    offset = 0
    while True:
        end = min(offset + chunk_bytes, total)
        if offset == 0:
            head = tensor_pb2.TensorChunk(name=name, dtype=dtypes.to_proto(dtype), shape=array.shape, offset_bytes=0)
        else:
            head = tensor_pb2.TensorChunk(offset_bytes=offset)
        yield head, view[offset:end].data
        offset = end
        if offset >= total:
            return


def to_chunks(name: str, array: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tensor_pb2.TensorChunk]:
    """Yields the tensor as chunks; the first one carries name, dtype and shape."""
    for head, data in chunk_fields(name, array, chunk_bytes):
        head.data = bytes(data)
        yield head


class ChunkMessage(Protocol):
    """A streaming read RPC's answer: one chunk of the tensor."""

    @property
    def chunk(self) -> tensor_pb2.TensorChunk: ...


M = TypeVar("M", bound=ChunkMessage)


def chunk_messages(message: Callable[[], M], name: str, array: np.ndarray) -> Iterator[M]:
    """The tensor's chunks, each in a new `message` (ReadOutputResponse, GetBlocksResponse...): the data is copied
    into it once, as to_chunks does."""
    for head, data in chunk_fields(name, array):
        out = message()
        out.chunk.MergeFrom(head)  # every field but the data: a few bytes
        out.chunk.data = bytes(data)
        yield out


_CHUNK_DATA_TAG = bytes([tensor_pb2.TensorChunk.DESCRIPTOR.fields_by_name["data"].number << 3 | 2])


def varint(n: int) -> bytes:
    """n (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def serialized_chunk(head: tensor_pb2.TensorChunk, data: memoryview) -> list[bytes | memoryview]:
    """The pieces of a serialized TensorChunk (head's fields, then `data`): protobuf reads a field appended to a
    message's bytes as set, so joining these once (with whatever frames them) is the only copy of the data."""
    return [head.SerializeToString(), _CHUNK_DATA_TAG, varint(len(data)), data]


class ChunkAssembler:
    """Reassembles tensors from a chunk stream into preallocated buffers."""

    def __init__(self, max_bytes: int = MAX_TENSOR_BYTES) -> None:
        self._max_bytes = max_bytes
        self._name = ""
        self._dtype = ""
        self._shape: tuple[int, ...] = ()
        self._buffer = np.empty(0, np.uint8)
        self._filled = 0
        self._active = False

    def feed(self, chunk: tensor_pb2.TensorChunk) -> tuple[str, np.ndarray] | None:
        """Takes one chunk; returns (name, array) when a tensor is complete."""
        if chunk.name:
            if self._active:
                raise TensorError(f"tensor {self._name!r} ended after {self._filled} of {len(self._buffer)} bytes")
            self._name = chunk.name
            self._dtype = dtypes.from_proto(chunk.dtype)
            self._shape = check_shape(chunk.shape)
            size = nbytes(self._dtype, self._shape)
            if size > self._max_bytes:
                raise TensorError(f"tensor {self._name!r} of {size} bytes exceeds the limit of {self._max_bytes}")
            self._buffer = np.empty(size, np.uint8)  # not zero-filled: every byte is written before use
            self._filled = 0
            self._active = True
        elif not self._active:
            raise TensorError("chunk without a tensor header (the first chunk of a tensor must carry its name)")
        if chunk.offset_bytes != self._filled:
            raise TensorError(f"tensor {self._name!r}: chunk at offset {chunk.offset_bytes}, expected {self._filled}")
        data = chunk.data  # each access to a bytes field copies it
        end = self._filled + len(data)
        if end > len(self._buffer):
            raise TensorError(f"tensor {self._name!r}: {end} bytes received for a tensor of {len(self._buffer)}")
        self._buffer[self._filled:end] = np.frombuffer(data, np.uint8)
        self._filled = end
        if self._filled == len(self._buffer):
            self._active = False
            array = self._buffer.view(dtypes.to_numpy(self._dtype)).reshape(self._shape)
            return self._name, array
        return None

    def close(self) -> None:
        if self._active:
            raise TensorError(f"stream ended inside tensor {self._name!r} ({self._filled} of {len(self._buffer)} bytes)")


def assemble(chunks: Iterable[tensor_pb2.TensorChunk], max_bytes: int = MAX_TENSOR_BYTES) -> list[tuple[str, np.ndarray]]:
    assembler = ChunkAssembler(max_bytes)
    out = [t for t in (assembler.feed(c) for c in chunks) if t is not None]
    assembler.close()
    return out
