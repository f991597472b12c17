"""gRPC translation of KvStoreService over Store (blocks) and Mover (rows into and between executors)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TypeVar

import grpc

from graphmesh import dtypes, tensors
from graphmesh.errors import InvalidArgument, rpc
from graphmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from graphmesh_kvstore.mover import Mover
from graphmesh_kvstore.store import Store

log = logging.getLogger("graphmesh.kvstore")
R = TypeVar("R")


def _deadline(context: grpc.ServicerContext) -> float | None:
    """The caller's remaining time, passed on to the executors."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e9 else None


class KvStoreServicer(kvstore_pb2_grpc.KvStoreServiceServicer):
    def __init__(self, store: Store, mover: Mover) -> None:
        self.store = store
        self.mover = mover

    @rpc
    def PutBlocks(self, request_iterator: Iterator[kvstore_pb2.PutBlocksRequest],
                  context: grpc.ServicerContext) -> kvstore_pb2.PutBlocksResponse:
        first = next(request_iterator, None)
        if first is None or not first.rows.name:
            raise InvalidArgument("PutBlocks must start with the namespace, tokens and the rows' first chunk",
                                  "EMPTY_STREAM")
        ns, chunk = first.namespace, first.rows
        # checked before any row is buffered: a wrong or oversized stream is refused at its first message
        layout = self.store.check_put(ns, len(first.token_ids), first.first_block, first.block_count,
                                      dtypes.from_proto(chunk.dtype), chunk.shape)
        assembler = tensors.ChunkAssembler(max_bytes=first.block_count * layout.block_bytes)
        done = assembler.feed(chunk)
        for message in request_iterator:
            if done is not None:
                raise InvalidArgument("PutBlocks carried more than one rows tensor", "BAD_PUT")
            done = assembler.feed(message.rows)
        assembler.close()
        if done is None:
            raise InvalidArgument("PutBlocks ended before its rows", "BAD_PUT")
        stored, present = self.store.put_blocks(ns, first.token_ids, first.first_block, first.block_count, done[1],
                                                first.incarnation, first.epoch)
        return kvstore_pb2.PutBlocksResponse(stored=stored, already_present=present)

    @rpc
    def Lookup(self, request: kvstore_pb2.LookupRequest, context: grpc.ServicerContext) -> kvstore_pb2.LookupResponse:
        return kvstore_pb2.LookupResponse(matched_tokens=self.store.lookup(request.namespace, request.token_ids))

    @rpc
    def GetBlocks(self, request: kvstore_pb2.GetBlocksRequest,
                  context: grpc.ServicerContext) -> Iterator[kvstore_pb2.GetBlocksResponse]:
        rows = self.store.get_blocks(request.namespace, request.token_ids, request.max_tokens)
        return tensors.chunk_messages(kvstore_pb2.GetBlocksResponse, "rows", rows)

    @rpc
    def SeedExecutor(self, request: kvstore_pb2.SeedExecutorRequest,
                     context: grpc.ServicerContext) -> kvstore_pb2.SeedExecutorResponse:
        tokens, nbytes, seconds = self.mover.seed(request.namespace, request.token_ids, request.max_tokens,
                                                  request.executor_address, request.header, _deadline(context))
        return kvstore_pb2.SeedExecutorResponse(seeded_tokens=tokens, bytes=nbytes, elapsed_ms=seconds * 1e3)

    @rpc
    def SeedStages(self, request: kvstore_pb2.SeedStagesRequest,
                   context: grpc.ServicerContext) -> kvstore_pb2.SeedStagesResponse:
        stages = [(s.namespace, s.executor_address) for s in request.stages]
        tokens, nbytes, seconds = self.mover.seed_stages(stages, request.token_ids, request.max_tokens,
                                                         request.header, _deadline(context))
        return kvstore_pb2.SeedStagesResponse(seeded_tokens=tokens, bytes=nbytes, elapsed_ms=seconds * 1e3)

    @rpc
    def CopyRows(self, request: kvstore_pb2.CopyRowsRequest,
                 context: grpc.ServicerContext) -> kvstore_pb2.CopyRowsResponse:
        nbytes, seconds = self.mover.copy_rows(request.source_address, request.source_header,
                                               request.destination_address, request.destination_header,
                                               request.from_row, request.to_row, _deadline(context))
        return kvstore_pb2.CopyRowsResponse(bytes=nbytes, elapsed_ms=seconds * 1e3)

    @rpc
    def RegisterExecutors(self, request: kvstore_pb2.RegisterExecutorsRequest,
                          context: grpc.ServicerContext) -> kvstore_pb2.RegisterExecutorsResponse:
        self.mover.register(list(request.addresses))
        log.info("executors registered", extra={"executors": list(request.addresses)})
        return kvstore_pb2.RegisterExecutorsResponse()

    @rpc
    def Evict(self, request: kvstore_pb2.EvictRequest, context: grpc.ServicerContext) -> kvstore_pb2.EvictResponse:
        ns = request.namespace if request.HasField("namespace") else None
        return kvstore_pb2.EvictResponse(evicted_blocks=self.store.evict(ns))

    @rpc
    def Stats(self, request: kvstore_pb2.StatsRequest, context: grpc.ServicerContext) -> kvstore_pb2.StatsResponse:
        s = self.store.stats()
        return kvstore_pb2.StatsResponse(
            blocks=s.blocks, memory_bytes=s.memory_bytes, disk_bytes=s.disk_bytes, capacity_bytes=s.capacity_bytes,
            lookups=s.lookups, hit_tokens=s.hit_tokens, miss_tokens=s.miss_tokens, hit_ratio=s.hit_ratio,
            evictions=s.evictions, corrupt_blocks=s.corrupt_blocks, seed_bytes_per_s=s.seed_bytes_per_s,
            copy_bytes_per_s=s.copy_bytes_per_s, shared_configured=s.shared_configured, shared_up=s.shared_up,
            shared_hit_blocks=s.shared_hit_blocks, shared_errors=s.shared_errors)
