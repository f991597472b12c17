"""Executor -> executor KV row copies (StageService.PushSessionKv): the source streams its rows, with their token
ids, into the destination's WriteSessionKv over one channel per destination. One hop: a copy relayed through
the KV store crossed the network twice and was parsed on the way, at half the bandwidth of a bare stream.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import grpc
import numpy as np

from graphmesh import errors, security, telemetry, tensors
from graphmesh.errors import GraphmeshError, InvalidArgument
from graphmesh.v1 import stage_pb2

_SERVICE = "/" + stage_pb2.DESCRIPTOR.services_by_name["StageService"].full_name
_ROWS_TAG = bytes([stage_pb2.WriteSessionKvRequest.DESCRIPTOR.fields_by_name["rows"].number << 3 | 2])
MAX_MESSAGE_BYTES = 64 << 20


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def write_requests(first: stage_pb2.WriteSessionKvRequest, rows: np.ndarray) -> Iterator[bytes]:
    """Serialized WriteSessionKvRequests: `first` (header, start row, token ids) with the first chunk of `rows`,
    then one per chunk. Each chunk is serialized once and framed as the `rows` field (protobuf merges
    concatenated fields), never copied into a request message."""
    head = first.SerializeToString()
    for i, chunk in enumerate(tensors.to_chunks("kv", rows)):
        data = chunk.SerializeToString()
        yield b"".join((head if i == 0 else b"", _ROWS_TAG, _varint(len(data)), data))


def _raw(data: bytes) -> bytes:
    return data


class KvPusher:
    """Writes rows into sessions on other executors, presenting this executor's own identity (mutual TLS or the
    mesh token): the destination's policy lets executors call WriteSessionKv for exactly this."""

    def __init__(self, tls: security.Tls | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self._writes: dict[str, grpc.StreamUnaryMultiCallable[bytes, stage_pb2.WriteSessionKvResponse]] = {}
        self._lock = threading.Lock()

    def _write(self, address: str) -> grpc.StreamUnaryMultiCallable[bytes, stage_pb2.WriteSessionKvResponse]:
        with self._lock:
            if address not in self._writes:
                channel = telemetry.traced(security.channel(
                    address, self.tls, [("grpc.max_send_message_length", self.max_message_bytes),
                                        ("grpc.max_receive_message_length", self.max_message_bytes)]))
                self._writes[address] = channel.stream_unary(
                    f"{_SERVICE}/WriteSessionKv", request_serializer=_raw,
                    response_deserializer=stage_pb2.WriteSessionKvResponse.FromString)
            return self._writes[address]

    def push(self, address: str, header: stage_pb2.FencingHeader, start_row: int, rows: np.ndarray,
             token_ids: Sequence[int], timeout_s: float) -> int:
        """Writes `rows` (f32 [n, layers, 2, kv_dim]) and their token ids (all n, or none) into the session of
        `header` on `address` at `start_row`; returns its committed KV length. A failure there is raised with
        the destination's code and reason, naming it (metadata executor = address)."""
        if not address:
            raise InvalidArgument("destination_address is empty", "BAD_ADDRESS")
        first = stage_pb2.WriteSessionKvRequest(header=header, start_row=start_row, token_ids=token_ids)
        try:
            reply = self._write(address)(write_requests(first, rows), timeout=timeout_s)
        except grpc.RpcError as e:
            raise destination_error(e, address) from None
        return int(reply.kv_length)


def destination_error(error: grpc.RpcError, address: str) -> GraphmeshError:
    e = errors.from_rpc_error(error)
    e.message = f"executor {address} failed WriteSessionKv: {e.message}"
    e.args = (e.message,)
    e.metadata = {**e.metadata, "executor": address}
    return e
