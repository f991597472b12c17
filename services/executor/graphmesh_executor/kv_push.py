"""Executor -> executor KV row copies (StageService.PushSessionKv): the source writes its rows, with their token ids,
straight into the destination's session, one hop (a copy relayed through the KV store crossed the network twice
and was parsed on the way). Over a link (graphmesh.links.KvLink) where the destination has a link listener: each
layer's K and V go from the source's pool blocks to the destination's engine a piece at a time, with no message
around them; else over WriteSessionKv, a stream of 1 MiB chunks over one channel per destination.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from graphmesh import channels, security
from graphmesh.channels import MAX_MESSAGE_BYTES
from graphmesh.errors import GraphmeshError, InvalidArgument
from graphmesh.links import KvLinks
from graphmesh.session_kv import WRITE_SESSION_KV, executor_error, raw, write_requests
from graphmesh.v1 import stage_pb2, stage_pb2_grpc
from graphmesh_server import telemetry


@dataclass(frozen=True)
class KvSource:
    """A session's committed rows on this executor, read the way the copy sends them."""

    shape: tuple[int, int, int, int]  # [rows, layers, 2, kv_dim]
    rows: Callable[[], np.ndarray]  # all at once, f32 [rows, layers, 2, kv_dim]: a WriteSessionKv stream
    pieces: Iterator[list[memoryview]]  # a pool at a time (StageRuntime.read_kv_pieces), for graphmesh.links.KvLink

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)


class KvPusher:
    """Writes rows into sessions on other executors, presenting this executor's own identity (mutual TLS or the
    mesh token): the destination's policy lets executors call WriteSessionKv for exactly this."""

    def __init__(self, tls: security.Tls | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.tls = tls
        self.max_message_bytes = max_message_bytes
        self._writes: dict[str, tuple[grpc.StreamUnaryMultiCallable[bytes, stage_pb2.WriteSessionKvResponse],
                                      stage_pb2_grpc.StageServiceStub]] = {}
        self._links = KvLinks(tls is not None)
        self._lock = threading.Lock()

    def _write(self, address: str) -> tuple[grpc.StreamUnaryMultiCallable[bytes, stage_pb2.WriteSessionKvResponse],
                                            stage_pb2_grpc.StageServiceStub]:
        with self._lock:
            if address not in self._writes:
                channel = telemetry.traced(channels.channel(
                    address, self.tls, channels.message_options(self.max_message_bytes)))
                self._writes[address] = (channel.stream_unary(
                    WRITE_SESSION_KV, request_serializer=raw,
                    response_deserializer=stage_pb2.WriteSessionKvResponse.FromString),
                    stage_pb2_grpc.StageServiceStub(channel))
            return self._writes[address]

    def push(self, address: str, header: stage_pb2.FencingHeader, start_row: int, rows: KvSource,
             token_ids: Sequence[int], timeout_s: float) -> int:
        """Writes `rows` and their token ids (all n, or none) into the session of `header` on `address` at
        `start_row`; returns its committed KV length. A failure there is raised with the destination's code and
        reason, naming it (metadata executor = address)."""
        if not address:
            raise InvalidArgument("destination_address is empty", "BAD_ADDRESS")
        first = stage_pb2.WriteSessionKvRequest(header=header, start_row=start_row, token_ids=token_ids)
        write, stub = self._write(address)
        link = self._links.take(address, stub, timeout_s) if rows.nbytes else None
        if link is not None:
            try:
                reply = self._links.write(address, link, first, rows.shape, rows.pieces, timeout_s)
            except GraphmeshError as e:  # the destination's refusal, or the link broke
                raise executor_error(e, address, "WriteSessionKv") from None
            return int(reply.kv_length)
        try:
            reply = write(write_requests(first, rows.rows()), timeout=timeout_s)
        except grpc.RpcError as e:
            raise executor_error(e, address, "WriteSessionKv") from None
        return int(reply.kv_length)

