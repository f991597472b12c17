"""StageService.WriteSessionKv on the wire, for the two callers that stream KV rows into an executor's session: the
KV store (seeds) and a source executor (row copies, PushSessionKv).

Requests are sent as bytes: each TensorChunk of the rows is serialized once and framed as the request's `rows`
field after the first message's header (protobuf merges concatenated fields), never copied into a request
message, so rows pass through the caller at the speed of a bare stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np

from graphmesh import errors, tensors
from graphmesh.errors import GraphmeshError
from graphmesh.v1 import stage_pb2

STAGE_SERVICE = "/" + stage_pb2.DESCRIPTOR.services_by_name["StageService"].full_name
WRITE_SESSION_KV = f"{STAGE_SERVICE}/WriteSessionKv"
_ROWS_TAG = bytes([stage_pb2.WriteSessionKvRequest.DESCRIPTOR.fields_by_name["rows"].number << 3 | 2])


def raw(data: bytes) -> bytes:
    """The request serializer of a WriteSessionKv call whose requests are already bytes."""
    return data


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _write_request(first: stage_pb2.WriteSessionKvRequest | None, chunk: bytes) -> bytes:
    """A serialized WriteSessionKvRequest: `first` (header, start row, token ids; None after the first message)
    with `rows` = the serialized TensorChunk `chunk`."""
    head = first.SerializeToString() if first is not None else b""
    return b"".join((head, _ROWS_TAG, _varint(len(chunk)), chunk))


def write_requests(first: stage_pb2.WriteSessionKvRequest, rows: np.ndarray) -> Iterator[bytes]:
    """The whole call's requests for `rows`: `first` with the first chunk, then one message per chunk."""
    for i, chunk in enumerate(tensors.to_chunks("kv", rows)):
        yield _write_request(first if i == 0 else None, chunk.SerializeToString())


def executor_error(error: grpc.RpcError, address: str, method: str) -> GraphmeshError:
    """The executor's own status code and reason, with a message and metadata (executor = address) that say which
    executor failed."""
    e = errors.from_rpc_error(error)
    e.message = f"executor {address} failed {method}: {e.message}"
    e.args = (e.message,)
    e.metadata = {**e.metadata, "executor": address}
    return e
