"""StageService.WriteSessionKv on the wire, for the two callers that stream KV rows into an executor's session: the
KV store (seeds) and a source executor (row copies, PushSessionKv).

Requests are sent as bytes: each TensorChunk of the rows is framed by hand as the request's `rows` field after the
first message's header (protobuf merges concatenated fields), its data joined straight from the rows array, never
copied into a message first, so rows pass through the caller at the speed of a bare stream.
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


def write_requests(first: stage_pb2.WriteSessionKvRequest, rows: np.ndarray) -> Iterator[bytes]:
    """The whole call's requests for `rows` as bytes: `first` (header, start row, token ids) with the first chunk,
    then one message per chunk; each chunk's rows are copied once, into its message."""
    for i, (head, data) in enumerate(tensors.chunk_fields("kv", rows)):
        chunk = tensors.serialized_chunk(head, data)
        size = sum(len(piece) for piece in chunk)
        yield b"".join([first.SerializeToString() if i == 0 else b"", _ROWS_TAG, tensors.varint(size), *chunk])


def executor_error(error: grpc.RpcError | GraphmeshError, address: str, method: str) -> GraphmeshError:
    """The executor's own status code and reason, with a message and metadata (executor = address) that say which
    executor failed."""
    e = errors.from_rpc_error(error) if isinstance(error, grpc.RpcError) else error
    e.message = f"executor {address} failed {method}: {e.message}"
    e.args = (e.message,)
    e.metadata = {**e.metadata, "executor": address}
    return e
