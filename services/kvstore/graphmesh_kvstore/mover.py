"""Moves KV rows into executors: a stored prefix into a session (seed), a session's rows to another executor (copy).

A seed reads every stage's stored prefix at once and writes it into an idle session at row 0, as WriteSessionKv
would (the executor checks it the same way): over a link (graphmesh.links.KvLink) where the executor has a link
listener, each layer's K and V one piece, sent in place from rows the store assembled layer-major (Store.get_layers)
and handed to the executor's engine while the next arrives; else, and always on a TLS mesh (links are plain TCP),
as a WriteSessionKv stream of 1 MiB chunks. A copy asks the source executor to push its rows, with their token ids,
straight into the destination (PushSessionKv), so the rows cross the network once and never pass through this
process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
import numpy as np

from graphmesh import channels, errors, security
from graphmesh.errors import GraphmeshError, InvalidArgument, PermissionDenied
from graphmesh.links import KvLink, KvLinks
from graphmesh.session_kv import STAGE_SERVICE, WRITE_SESSION_KV, executor_error, raw, write_requests
from graphmesh.v1 import kvstore_pb2, stage_pb2, stage_pb2_grpc
from graphmesh_kvstore.store import Store
from graphmesh_server import telemetry

log = logging.getLogger("graphmesh.kvstore")


class _Stage:
    """The StageService methods the store calls on one channel: WriteSessionKv with raw-bytes chunk framing,
    PushSessionKv, and OpenBoundaryLink (through the stub) for a seed's link."""

    def __init__(self, address: str, max_message_bytes: int, tls: security.Tls | None = None) -> None:
        self.channel = telemetry.traced(channels.channel(address, tls, channels.message_options(max_message_bytes)))
        self.stub = stage_pb2_grpc.StageServiceStub(self.channel)
        self.write = self.channel.stream_unary(
            WRITE_SESSION_KV, request_serializer=raw,
            response_deserializer=stage_pb2.WriteSessionKvResponse.FromString)
        self.push = self.channel.unary_unary(
            f"{STAGE_SERVICE}/PushSessionKv", request_serializer=stage_pb2.PushSessionKvRequest.SerializeToString,
            response_deserializer=stage_pb2.PushSessionKvResponse.FromString)


@dataclass
class _Stored:
    """One stage's stored prefix, read in the layout its write sends: layer-major, f32 [layers, 2, tokens, kv_dim]
    (Store.get_layers), when it goes over a link, else f32 [tokens, layers, 2, kv_dim] (Store.get_blocks) for a
    WriteSessionKv stream."""

    address: str
    stage: _Stage
    link: KvLink | None
    rows: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.rows.shape[2] if self.link is not None else self.rows.shape[0])

    def nbytes(self, n: int) -> int:
        """Bytes of its first n rows."""
        return self.rows.nbytes // max(self.tokens, 1) * n


class Mover:
    def __init__(self, store: Store, timeout_s: float = 120.0, max_message_bytes: int = channels.MAX_MESSAGE_BYTES,
                 tls: security.Tls | None = None) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.tls = tls  # the store's own certificate, presented to executors (mutual TLS)
        self._stages: dict[str, _Stage] = {}
        self._links = KvLinks(tls is not None)  # a seed's rows go over a link where the executor takes one
        self._lock = threading.Lock()
        # SeedStages writes every stage of a session at once: one thread per stage of the call at a time
        self._writers = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="kv-seed")
        # The executors the coordinator registered: the only addresses the store reads rows from or writes
        # them to. It calls them with its own identity, so an address taken from a request unchecked would
        # make it stream users' KV rows to whoever asked (a confused deputy), or write theirs into a session.
        self.executors: frozenset[str] = frozenset()

    def register(self, addresses: Sequence[str]) -> None:
        """Replaces the registered executors; channels and links to executors no longer registered are closed."""
        if any(not a for a in addresses):
            raise InvalidArgument("an executor address is empty", "BAD_ADDRESS")
        with self._lock:
            self.executors = frozenset(addresses)
            for address in [a for a in self._stages if a not in self.executors]:
                self._stages.pop(address).channel.close()
        self._links.close(keep=addresses)

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

    def _read(self, ns: kvstore_pb2.KvNamespace, address: str, stage: _Stage, token_ids: Sequence[int],
              max_tokens: int, timeout_s: float) -> _Stored:
        """A stage's stored prefix, and a link to its executor where it takes one: taken before the rows are read,
        so that they are assembled in the layout the link or the stream sends, in one copy."""
        link = self._links.take(address, stage.stub, timeout_s)
        try:
            read = self.store.get_layers if link is not None else self.store.get_blocks
            return _Stored(address, stage, link, read(ns, token_ids, max_tokens))
        except BaseException:
            if link is not None:
                self._links.give_back(address, link)
            raise

    def _unused(self, stored: Sequence[_Stored]) -> None:
        """Gives back the links of reads that are not written."""
        for s in stored:
            if s.link is not None:
                self._links.give_back(s.address, s.link)

    def _write(self, stored: _Stored, first: stage_pb2.WriteSessionKvRequest, n: int, timeout_s: float) -> None:
        """Writes the first n stored rows into the session `first` names: over the link, each layer's K and V as
        one piece sent from the assembled rows in place, else as a WriteSessionKv stream. A failure is raised with
        the executor's code and reason, naming it."""
        if stored.link is None:
            try:
                stored.stage.write(write_requests(first, stored.rows[:n]), timeout=timeout_s)
            except grpc.RpcError as e:
                raise executor_error(e, stored.address, "WriteSessionKv") from None
            return
        layers, _, _, kv_dim = stored.rows.shape
        pieces = ([stored.rows[j, k, :n].reshape(-1).view(np.uint8).data] for j in range(layers) for k in (0, 1))
        try:
            self._links.write(stored.address, stored.link, first, (n, layers, 2, kv_dim), pieces, timeout_s)
        except GraphmeshError as e:  # the executor's refusal, or the link broke
            raise executor_error(e, stored.address, "WriteSessionKv") from None

    def seed(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], max_tokens: int, address: str,
             header: stage_pb2.FencingHeader, timeout_s: float | None = None) -> tuple[int, int, float]:
        """Writes the longest stored prefix (up to max_tokens, in whole blocks) into a new session at row 0;
        returns (seeded tokens, bytes, seconds). Nothing stored: nothing is sent."""
        with telemetry.span("kv.seed", session=header.session_id, incarnation=header.incarnation,
                            executor=address, max_tokens=max_tokens) as span:
            started = time.perf_counter()
            timeout = timeout_s or self.timeout_s
            stage = self._stage(address)  # first: an unregistered address is refused whatever the store holds
            stored = self._read(ns, address, stage, token_ids, max_tokens, timeout)
            n, nbytes = stored.tokens, stored.nbytes(stored.tokens)
            span.set_attributes({"tokens": n, "bytes": nbytes, "link": stored.link is not None})
            if n == 0:
                self._unused([stored])
                return 0, 0, time.perf_counter() - started
            self._write(stored, stage_pb2.WriteSessionKvRequest(header=header, start_row=0, token_ids=token_ids[:n]),
                        n, timeout)
            seconds = time.perf_counter() - started
            self.store.record_transfer("seed", nbytes, seconds)
            return n, nbytes, seconds

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
            timeout = timeout_s or self.timeout_s
            targets = [self._stage(address) for _, address in stages]  # first: every address must be registered
            # Every stage's rows read at once (each after taking its executor's link): from Redis, a stage's ~900
            # tokens are ~0.1 s of round trips and checksums, and one after another they were most of a seed.
            reads = [self._writers.submit(self._read, ns, address, stage, token_ids, max_tokens, timeout)
                     for (ns, address), stage in zip(stages, targets)]
            futures.wait(reads)
            stored = [read.result() for read in reads if read.exception() is None]
            failed = next((read.exception() for read in reads if read.exception() is not None), None)
            if failed is not None:
                self._unused(stored)
                raise failed
            read_s = time.perf_counter() - started
            n = min(s.tokens for s in stored)
            span.set_attribute("tokens", n)
            if n == 0:
                self._unused(stored)
                return 0, 0, time.perf_counter() - started
            first = stage_pb2.WriteSessionKvRequest(header=header, start_row=0, token_ids=token_ids[:n])
            calls = [self._writers.submit(self._write, s, first, n, timeout) for s in stored]
            for call in calls:
                call.result()
            nbytes = sum(s.nbytes(n) for s in stored)
            seconds = time.perf_counter() - started
            span.set_attribute("bytes", nbytes)
            self.store.record_transfer("seed", nbytes, seconds)
            log.info("seeded", extra={"session": header.session_id, "tokens": n, "stages": len(stages),
                                      "links": sum(s.link is not None for s in stored), "bytes": nbytes,
                                      "read_ms": round(read_s * 1e3, 1),
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
        self._links.close()
        with self._lock:
            for stage in self._stages.values():
                stage.channel.close()
            self._stages.clear()
