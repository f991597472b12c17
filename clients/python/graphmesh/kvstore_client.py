"""Python client of the KV store. Arrays are numpy; a failed call raises the graphmesh.errors type of its status."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc
import numpy as np

from graphmesh import dtypes, errors, tensors
from graphmesh.channels import ChannelClient, as_mesh_member, open_channel
from graphmesh.v1 import kvstore_pb2, kvstore_pb2_grpc, stage_pb2

R = TypeVar("R")
log = logging.getLogger("graphmesh.kvstore_client")

# Failures that say the store is not answering (down, frozen, overloaded), as opposed to a refusal it sent
# back: only these open the circuit.
UNREACHABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                               grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})


class CircuitBreaker:
    """Skips a cache that stopped answering. The store is an optimisation, so a call that would wait out a
    deadline on a frozen store is better not made: after a failure the breaker opens for `backoff_s`
    (doubling while probes keep failing, up to `max_backoff_s`), during which allow() says no and callers
    recompute; then one call is let through as a probe, and its success closes the breaker. Each opening and
    closing is logged once, not every skipped call."""

    def __init__(self, name: str, backoff_s: float = 5.0, max_backoff_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.base_s, self.max_s, self.clock = name, backoff_s, max_backoff_s, clock
        self._lock = threading.Lock()
        self._backoff_s = 0.0  # 0: closed
        self._retry_at = 0.0
        self._probing = False
        self.skipped = 0  # calls not made while open (a metric)
        self.opened = 0  # times it opened

    @property
    def open(self) -> bool:
        return self._backoff_s > 0

    def allow(self) -> bool:
        """Whether to call the store now: always while closed; once the back-off is over, one probe at a time."""
        with self._lock:
            if not self._backoff_s:
                return True
            if not self._probing and self.clock() >= self._retry_at:
                self._probing = True
                return True
            self.skipped += 1
            return False

    def succeeded(self) -> None:
        with self._lock:
            if self._backoff_s:
                log.warning(f"{self.name} answers again: using it again", extra={"skipped": self.skipped})
            self._backoff_s, self._probing = 0.0, False

    def failed(self, error: errors.GraphmeshError) -> None:
        """Records a failed call; one that the store itself refused (it answered) counts as an answer."""
        if error.code not in UNREACHABLE_CODES:
            self.succeeded()
            return
        with self._lock:
            self._backoff_s = min(self.max_s, self._backoff_s * 2 if self._backoff_s else self.base_s)
            self._retry_at, self._probing = self.clock() + self._backoff_s, False
            self.opened += 1
            log.warning(f"{self.name} is not answering ({error.code.name}: {error.message}): skipped for "
                        f"{self._backoff_s:.0f} s, then probed", extra={"backoff_s": self._backoff_s})


def _call(fn: Callable[[], R]) -> R:
    try:
        return fn()
    except grpc.RpcError as e:
        raise errors.from_rpc_error(e) from None


class KvStoreClient(ChannelClient):
    """A channel to one KV store. Every call has a deadline of `timeout` seconds. credentials: TLS
    (graphmesh.security.credentials(ca, cert, key)); token: a bearer token sent with every call; interceptors:
    client interceptors for the channel (the coordinator's trace propagation). Inside a mesh service the calls
    carry its mesh token; any other caller passes security.mesh_metadata(token) as metadata."""

    def __init__(self, address: str, timeout: float = 60.0, *, credentials: grpc.ChannelCredentials | None = None,
                 metadata: Sequence[tuple[str, str]] = (), token: str = "",
                 interceptors: Sequence[grpc.UnaryUnaryClientInterceptor] = ()) -> None:
        super().__init__(address, grpc.intercept_channel(as_mesh_member(open_channel(address, credentials)),
                                                         *interceptors), timeout, metadata, token)
        self._stub = kvstore_pb2_grpc.KvStoreServiceStub(self.channel)

    def put_blocks(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], first_block: int, rows: np.ndarray,
                   incarnation: int = 0, epoch: int = 0) -> tuple[int, int]:
        """Stores rows f32 [blocks * block_tokens, layers, 2, kv_dim] as blocks [first_block, first_block + blocks);
        token_ids run from the start of the sequence through the last block. Returns (stored, already_present)."""
        block_count = rows.shape[0] // ns.block_tokens if ns.block_tokens else 0

        def requests() -> Iterator[kvstore_pb2.PutBlocksRequest]:
            view = np.ascontiguousarray(rows, dtype=rows.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
            for offset in range(0, max(len(view), 1), tensors.CHUNK_BYTES):
                request = kvstore_pb2.PutBlocksRequest()
                if offset == 0:
                    request.namespace.CopyFrom(ns)
                    request.token_ids.extend(token_ids)
                    request.first_block, request.block_count = first_block, block_count
                    request.incarnation, request.epoch = incarnation, epoch
                    request.rows.name = "rows"
                    request.rows.dtype = dtypes.to_proto(dtypes.from_numpy(rows.dtype))
                    request.rows.shape.extend(rows.shape)
                # fields set in place: a 1 MiB chunk passed to a constructor is copied far more slowly
                request.rows.offset_bytes = offset
                request.rows.data = view[offset:offset + tensors.CHUNK_BYTES].tobytes()
                yield request

        response = _call(lambda: self._stub.PutBlocks(requests(), timeout=self.timeout, metadata=self.metadata))
        return response.stored, response.already_present

    def lookup(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], timeout: float | None = None) -> int:
        """The longest stored prefix of token_ids, in tokens (timeout: this call's deadline, default `timeout`)."""
        request = kvstore_pb2.LookupRequest(namespace=ns, token_ids=token_ids)
        return _call(lambda: self._stub.Lookup(request, timeout=timeout or self.timeout,
                                               metadata=self.metadata)).matched_tokens

    def get_blocks(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], max_tokens: int = 0) -> np.ndarray:
        """The rows of the longest stored prefix (at most max_tokens; 0: no cap): f32 [tokens, layers, 2, kv_dim]."""
        request = kvstore_pb2.GetBlocksRequest(namespace=ns, token_ids=token_ids, max_tokens=max_tokens)
        got = _call(lambda: tensors.assemble(a.chunk for a in self._stub.GetBlocks(request, timeout=self.timeout,
                                                                                    metadata=self.metadata)))
        if len(got) != 1:
            raise errors.Internal(f"GetBlocks returned {len(got)} tensors, expected 1")
        return got[0][1]

    def seed_executor(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], executor_address: str,
                      incarnation: int, session_id: str, max_tokens: int = 0,
                      timeout: float | None = None) -> tuple[int, int, float]:
        """Writes the longest stored prefix into a new session on an executor; returns (seeded tokens, bytes, ms)."""
        request = kvstore_pb2.SeedExecutorRequest(
            namespace=ns, token_ids=token_ids, max_tokens=max_tokens, executor_address=executor_address,
            header=stage_pb2.FencingHeader(incarnation=incarnation, session_id=session_id))
        r = _call(lambda: self._stub.SeedExecutor(request, timeout=timeout or self.timeout, metadata=self.metadata))
        return r.seeded_tokens, r.bytes, r.elapsed_ms

    def seed_stages(self, stages: Sequence[tuple[kvstore_pb2.KvNamespace, str]], token_ids: Sequence[int],
                    incarnation: int, session_id: str, max_tokens: int = 0,
                    timeout: float | None = None) -> tuple[int, int, float]:
        """Seeds a new session on every (namespace, executor address) stage at once, with the longest prefix all
        of them have stored; returns (seeded tokens, bytes of all stages, ms)."""
        request = kvstore_pb2.SeedStagesRequest(
            token_ids=token_ids, max_tokens=max_tokens,
            stages=[kvstore_pb2.StageSeed(namespace=ns, executor_address=a) for ns, a in stages],
            header=stage_pb2.FencingHeader(incarnation=incarnation, session_id=session_id))
        r = _call(lambda: self._stub.SeedStages(request, timeout=timeout or self.timeout, metadata=self.metadata))
        return r.seeded_tokens, r.bytes, r.elapsed_ms

    def copy_rows(self, source_address: str, source_session: str, source_incarnation: int, destination_address: str,
                  destination_session: str, destination_incarnation: int, from_row: int, to_row: int) -> tuple[int, float]:
        """Copies rows [from_row, to_row) of a session between executors; returns (bytes, ms)."""
        request = kvstore_pb2.CopyRowsRequest(
            source_address=source_address,
            source_header=stage_pb2.FencingHeader(incarnation=source_incarnation, session_id=source_session),
            destination_address=destination_address,
            destination_header=stage_pb2.FencingHeader(incarnation=destination_incarnation,
                                                       session_id=destination_session),
            from_row=from_row, to_row=to_row)
        r = _call(lambda: self._stub.CopyRows(request, timeout=self.timeout, metadata=self.metadata))
        return r.bytes, r.elapsed_ms

    def register_executors(self, addresses: Sequence[str], timeout: float | None = None) -> None:
        """Tells the store which executors it may seed and copy between (the coordinator's roster)."""
        request = kvstore_pb2.RegisterExecutorsRequest(addresses=list(addresses))
        _call(lambda: self._stub.RegisterExecutors(request, timeout=timeout or self.timeout, metadata=self.metadata))

    def evict(self, ns: kvstore_pb2.KvNamespace | None = None) -> int:
        """Drops the blocks of `ns`, or every block; returns how many."""
        request = kvstore_pb2.EvictRequest(namespace=ns) if ns is not None else kvstore_pb2.EvictRequest()
        return _call(lambda: self._stub.Evict(request, timeout=self.timeout, metadata=self.metadata)).evicted_blocks

    def stats(self) -> kvstore_pb2.StatsResponse:
        return _call(lambda: self._stub.Stats(kvstore_pb2.StatsRequest(), timeout=self.timeout,
                                               metadata=self.metadata))
