"""Write-behind of committed KV blocks to the KV store, off the decode path."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import grpc
import numpy as np

from graphmesh import channels, kvkeys, security, tensors
from graphmesh.errors import from_rpc_error
from graphmesh.kvstore_client import CircuitBreaker
from graphmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from graphmesh_executor.stage_types import KvBlocks
from graphmesh_server import telemetry

log = logging.getLogger("graphmesh.executor.kv")
PUT_TIMEOUT_S = 10.0  # a put of a few blocks takes milliseconds; a store that takes longer is not answering
_FLUSH = KvBlocks("", "", 0, 0, 0, 0, [], -1, np.zeros((0, 0, 2, 0), np.float32), 0, 0)  # a marker, never written


class KvWriteBehind:
    """A queue and one thread; a failed put is logged and counted, never retried into the hot path."""

    def __init__(self, max_queued: int = 256, tls: security.Tls | None = None) -> None:
        # each entry keeps the trace context of the commit that produced it: the put joins that request's trace
        self._queue: queue.Queue[tuple[KvBlocks, telemetry.Context]] = queue.Queue(max_queued)
        self._stubs: dict[str, kvstore_pb2_grpc.KvStoreServiceStub] = {}
        self.tls = tls
        self.failures = 0
        self.dropped = 0
        self.written_blocks = 0
        # A frozen store must not hold every put for its whole deadline: after a failure, puts are dropped
        # (counted) for the back-off, then one probes the store again.
        self.breaker = CircuitBreaker("kvstore (write-behind)")
        self._flushed = threading.Event()
        threading.Thread(target=self._run, name="kv-write-behind", daemon=True).start()

    def __call__(self, blocks: KvBlocks) -> None:
        try:
            self._queue.put_nowait((blocks, telemetry.current_context()))
        except queue.Full:
            self.dropped += 1  # the store is behind: drop rather than stall generation
            log.warning("kv write-behind queue full; blocks dropped", extra={"dropped": self.dropped})

    def flush(self, timeout_s: float = 10.0) -> None:
        """Waits until everything queued so far was written (tests and shutdown)."""
        self._flushed.clear()
        self._queue.put((_FLUSH, telemetry.current_context()))
        self._flushed.wait(timeout_s)

    def _run(self) -> None:
        while True:
            blocks, ctx = self._queue.get()
            if blocks is _FLUSH:
                self._flushed.set()
                continue
            if not self.breaker.allow():
                self.dropped += 1
                continue
            try:
                with telemetry.span("stage.kv_write_behind", parent=ctx, first_block=blocks.first_block,
                                    incarnation=blocks.incarnation, epoch=blocks.epoch,
                                    tokens=int(blocks.rows.shape[0])):
                    self._put(blocks)
            except grpc.RpcError as e:
                self.failures += 1
                self.breaker.failed(from_rpc_error(e))
                log.warning("kv write-behind failed", extra={"address": blocks.address, "code": e.code().name,
                                                             "failures": self.failures})
            else:
                self.breaker.succeeded()

    def _put(self, blocks: KvBlocks) -> None:
        if blocks.address not in self._stubs:
            channel = channels.channel(blocks.address, self.tls)
            self._stubs[blocks.address] = kvstore_pb2_grpc.KvStoreServiceStub(telemetry.traced(channel))
        ns = kvkeys.namespace(blocks.model_identity, blocks.layer_start, blocks.layer_end, blocks.kv_dim,
                              block_tokens=blocks.block_tokens)
        count = blocks.rows.shape[0] // blocks.block_tokens

        def requests() -> Iterator[kvstore_pb2.PutBlocksRequest]:
            for i, chunk in enumerate(tensors.to_chunks("rows", blocks.rows)):
                if i == 0:
                    yield kvstore_pb2.PutBlocksRequest(namespace=ns, token_ids=blocks.token_ids,
                                                       first_block=blocks.first_block, block_count=count,
                                                       incarnation=blocks.incarnation, epoch=blocks.epoch, rows=chunk)
                else:
                    yield kvstore_pb2.PutBlocksRequest(rows=chunk)

        self._stubs[blocks.address].PutBlocks(requests(), timeout=PUT_TIMEOUT_S)
        self.written_blocks += count

