"""Moves KV rows into executors: a stored prefix into a session (seed), a session's rows to another executor (copy).

Both use the executors' StageService: a seed streams stored rows into WriteSessionKv, which appends rows to an
idle session; a copy asks the source executor to push its rows, with their token ids, straight into the
destination (PushSessionKv), so the rows cross the network once and never pass through this process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent import futures

import grpc
import numpy as np

from graphmesh import errors, security, telemetry
from graphmesh.errors import InvalidArgument, PermissionDenied
from graphmesh.session_kv import STAGE_SERVICE, WRITE_SESSION_KV, executor_error, raw, write_requests
from graphmesh.v1 import kvstore_pb2, stage_pb2
from graphmesh_kvstore.store import Store

log = logging.getLogger("graphmesh.kvstore")


class _Stage:
    """The two StageService methods the store calls (WriteSessionKv with raw-bytes chunk framing, PushSessionKv) on one
    channel."""

    def __init__(self, address: str, max_message_bytes: int, tls: security.Tls | None = None) -> None:
        self.channel = telemetry.traced(security.channel(
            address, tls, [("grpc.max_send_message_length", max_message_bytes),
                           ("grpc.max_receive_message_length", max_message_bytes)]))
        self.write = self.channel.stream_unary(
            WRITE_SESSION_KV, request_serializer=raw,
            response_deserializer=stage_pb2.WriteSessionKvResponse.FromString)
        self.push = self.channel.unary_unary(
            f"{STAGE_SERVICE}/PushSessionKv", request_serializer=stage_pb2.PushSessionKvRequest.SerializeToString,
            response_deserializer=stage_pb2.PushSessionKvResponse.FromString)


class Mover:
    def __init__(self, store: Store, timeout_s: float = 120.0, max_message_bytes: int = 64 << 20,
                 tls: security.Tls | None = None) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.tls = tls  # the store's own certificate, presented to executors (mutual TLS)
        self._stages: dict[str, _Stage] = {}
        self._lock = threading.Lock()
        # SeedStages writes every stage of a session at once: one thread per stage of the call at a time
        self._writers = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kv-seed")
        # The executors the coordinator registered: the only addresses the store reads rows from or writes
        # them to. It calls them with its own identity, so an address taken from a request unchecked would
        # make it stream users' KV rows to whoever asked (a confused deputy), or write theirs into a session.
        self.executors: frozenset[str] = frozenset()

    def register(self, addresses: Sequence[str]) -> None:
        """Replaces the registered executors; channels to executors no longer registered are closed."""
        if any(not a for a in addresses):
            raise InvalidArgument("an executor address is empty", "BAD_ADDRESS")
        with self._lock:
            self.executors = frozenset(addresses)
            for address in [a for a in self._stages if a not in self.executors]:
                self._stages.pop(address).channel.close()

    def _stage(self, address: str) -> _Stage:
        if not address:
            raise InvalidArgument("executor address is empty", "BAD_ADDRESS")
        with self._lock:
            if address not in self.executors:
                raise PermissionDenied(f"{address} is not a registered executor: the store seeds and copies only "
                                       f"between the executors the coordinator registered ({len(self.executors)})",
                                       "UNREGISTERED_EXECUTOR", {"executor": address})
            if address not in self._stages:
                self._stages[address] = _Stage(address, self.max_message_bytes, self.tls)
            return self._stages[address]

    def seed(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], max_tokens: int, address: str,
             header: stage_pb2.FencingHeader, timeout_s: float | None = None) -> tuple[int, int, float]:
        """Writes the longest stored prefix (up to max_tokens, in whole blocks) into a new session at row 0;
        returns (seeded tokens, bytes, seconds). Nothing stored: nothing is sent."""
        with telemetry.span("kv.seed", session=header.session_id, incarnation=header.incarnation,
                            executor=address, max_tokens=max_tokens) as span:
            started = time.perf_counter()
            stage = self._stage(address)  # first: an unregistered address is refused whatever the store holds
            rows = self.store.get_blocks(ns, token_ids, max_tokens)  # f32 [tokens, layers, 2, kv_dim]
            n = rows.shape[0]
            span.set_attributes({"tokens": n, "bytes": rows.nbytes})
            if n == 0:
                return 0, 0, time.perf_counter() - started
            first = stage_pb2.WriteSessionKvRequest(header=header, start_row=0, token_ids=token_ids[:n])
            try:
                stage.write(write_requests(first, rows), timeout=timeout_s or self.timeout_s)
            except grpc.RpcError as e:
                raise executor_error(e, address, "WriteSessionKv") from None
            seconds = time.perf_counter() - started
            self.store.record_transfer("seed", rows.nbytes, seconds)
            return n, rows.nbytes, seconds

    def seed_stages(self, stages: Sequence[tuple[kvstore_pb2.KvNamespace, str]], token_ids: Sequence[int],
                    max_tokens: int, header: stage_pb2.FencingHeader,
                    timeout_s: float | None = None) -> tuple[int, int, float]:
        """Seeds a new session on every (namespace, executor address) stage with the longest prefix that all of
        them have stored (up to max_tokens), writing the stages in parallel; returns (seeded tokens, bytes of all
        stages, seconds). Nothing common stored: nothing is sent. A failure of any write is raised (the caller
        releases the session everywhere)."""
        if not stages:
            raise InvalidArgument("SeedStages names no stage", "NO_STAGES")
        with telemetry.span("kv.seed_stages", session=header.session_id, incarnation=header.incarnation,
                            stages=len(stages), max_tokens=max_tokens) as span:
            started = time.perf_counter()
            targets = [self._stage(address) for _, address in stages]  # first: every address must be registered
            # Every stage's rows read at once: from Redis, a stage's ~900 tokens are ~0.1 s of round trips and
            # checksums, and one after another they were most of a seed.
            reads = [self._writers.submit(self.store.get_blocks, ns, token_ids, max_tokens) for ns, _ in stages]
            rows = [read.result() for read in reads]
            read_s = time.perf_counter() - started
            n = min(r.shape[0] for r in rows)
            span.set_attribute("tokens", n)
            if n == 0:
                return 0, 0, time.perf_counter() - started
            first = stage_pb2.WriteSessionKvRequest(header=header, start_row=0, token_ids=token_ids[:n])
            timeout = timeout_s or self.timeout_s

            def write(stage: _Stage, r: np.ndarray) -> None:
                stage.write(write_requests(first, r[:n]), timeout=timeout)

            calls = [self._writers.submit(write, t, r) for t, r in zip(targets, rows)]
            nbytes = sum(r[:n].nbytes for r in rows)
            for (_, address), call in zip(stages, calls):
                try:
                    call.result()
                except grpc.RpcError as e:
                    raise executor_error(e, address, "WriteSessionKv") from None
            seconds = time.perf_counter() - started
            span.set_attribute("bytes", nbytes)
            self.store.record_transfer("seed", nbytes, seconds)
            log.info("seeded", extra={"session": header.session_id, "tokens": n, "stages": len(stages),
                                      "bytes": nbytes, "read_ms": round(read_s * 1e3, 1),
                                      "write_ms": round((seconds - read_s) * 1e3, 1)})
            return n, nbytes, seconds

    def copy_rows(self, source: str, source_header: stage_pb2.FencingHeader, destination: str,
                  destination_header: stage_pb2.FencingHeader, from_row: int, to_row: int,
                  timeout_s: float | None = None) -> tuple[int, float]:
        """Copies rows [from_row, to_row) of the source session to the same rows of the destination session
        (K rows carry their rotary position, so they keep their row index); returns (bytes, seconds)."""
        if to_row < from_row:
            raise InvalidArgument(f"rows [{from_row}, {to_row}) are reversed", "BAD_ROWS")
        with telemetry.span("kv.copy_rows", source=source, destination=destination, from_row=from_row, to_row=to_row,
                            session=destination_header.session_id, incarnation=destination_header.incarnation):
            started = time.perf_counter()
            src, _ = self._stage(source), self._stage(destination)  # both must be registered executors
            # The source streams the rows, with their token ids, into the destination itself: one hop instead of
            # two through this process, and the destination keeps writing the session's blocks behind.
            request = stage_pb2.PushSessionKvRequest(header=source_header, from_row=from_row, to_row=to_row,
                                                     destination_address=destination,
                                                     destination_header=destination_header)
            try:
                reply = src.push(request, timeout=timeout_s or self.timeout_s)
            except grpc.RpcError as e:
                error = errors.from_rpc_error(e)
                if error.metadata.get("executor") == destination:
                    raise error from None  # the destination's own failure, named by the source
                raise executor_error(e, source, "PushSessionKv") from None
            seconds = time.perf_counter() - started
            self.store.record_transfer("copy", reply.bytes, seconds)
            return reply.bytes, seconds

    def close(self) -> None:
        self._writers.shutdown(wait=False)
        with self._lock:
            for stage in self._stages.values():
                stage.channel.close()
            self._stages.clear()
