"""Executor -> executor KV row copies (StageService.PushSessionKv): the source streams its rows, with their token
ids, into the destination's WriteSessionKv over one channel per destination. One hop: a copy relayed through
the KV store crossed the network twice and was parsed on the way, at half the bandwidth of a bare stream.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc
import numpy as np

from graphmesh import security, telemetry
from graphmesh.errors import InvalidArgument
from graphmesh.session_kv import WRITE_SESSION_KV, executor_error, raw, write_requests
from graphmesh.v1 import stage_pb2

MAX_MESSAGE_BYTES = 64 << 20


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
                    WRITE_SESSION_KV, request_serializer=raw,
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
            raise executor_error(e, address, "WriteSessionKv") from None
        return int(reply.kv_length)

