"""The KV store process: `graphmesh-kvstore --listen HOST:PORT [--capacity-bytes N] [--dir DIR] [--block-tokens 16]
[--redis-url redis://HOST:PORT/DB [--redis-password-file F] [--redis-ttl S]]`.

With --redis-url, blocks live in Redis or Valkey behind this process's memory tier, so several replicas on one
Redis share them; the memory (and disk) tiers then cache the shared one."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from graphmesh import channels
from graphmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from graphmesh_kvstore.mover import Mover
from graphmesh_kvstore.servicer import KvStoreServicer
from graphmesh_kvstore.shared import SharedTier
from graphmesh_kvstore.store import DEFAULT_MAX_PUT_BYTES, Store
from graphmesh_server import bootstrap, logs, telemetry
from graphmesh_server.bootstrap import ServerSecurity
from graphmesh_server.serving import byte_size, run_until_signalled, starting

log = logging.getLogger("graphmesh.kvstore")

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KvStoreService"].full_name


@dataclass(frozen=True)
class KvStoreConfig:
    listen: str = "127.0.0.1:0"
    capacity_bytes: int = 1 << 30  # memory tier
    directory: Path | None = None  # disk tier; none without it
    disk_capacity_bytes: int = 0  # 0: unbounded
    block_tokens: int = 16  # the only block size accepted; 0 accepts any
    max_put_bytes: int = DEFAULT_MAX_PUT_BYTES
    max_message_bytes: int = channels.MAX_MESSAGE_BYTES
    executor_timeout_s: float = 120.0  # for seeds and copies whose caller set no deadline
    workers: int = 16
    metrics_port: int = 0  # Prometheus /metrics; 0: off
    redis_url: str = ""  # the shared tier; "": none
    redis_password_file: Path | None = None
    redis_ttl_s: float = 0.0  # 0: entries live until Redis's maxmemory policy evicts them
    redis_timeout_s: float = 0.25  # per call: a slow Redis turns into misses, never into slow generations
    security: ServerSecurity = field(default_factory=ServerSecurity)


def build_server(config: KvStoreConfig) -> tuple[grpc.Server, int, Store]:
    """Creates, binds and starts the server; health turns SERVING once it accepts calls."""
    shared = SharedTier(config.redis_url, password_file=config.redis_password_file, ttl_s=config.redis_ttl_s,
                        timeout_s=config.redis_timeout_s) if config.redis_url else None
    store = Store(config.capacity_bytes, config.directory, config.disk_capacity_bytes, config.block_tokens,
                  config.max_put_bytes, shared)
    mover = Mover(store, config.executor_timeout_s, config.max_message_bytes, config.security.tls)
    options = channels.message_options(config.max_message_bytes)
    server = config.security.server(config.workers, options, telemetry.server_interceptors(config.metrics_port > 0),
                                    "kvstore-rpc")
    kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server(KvStoreServicer(store, mover), server)
    port, _ = config.security.start(server, config.listen, (SERVICE_NAME,))
    if config.metrics_port:
        telemetry.expose(
            ("graphmesh_kv_blocks", "gauge", "KV blocks stored (memory and disk tiers)", lambda: store.stats().blocks),
            ("graphmesh_kv_memory_bytes", "gauge", "Bytes of KV in the memory tier", lambda: store.stats().memory_bytes),
            ("graphmesh_kv_disk_bytes", "gauge", "Bytes of KV in the disk tier", lambda: store.stats().disk_bytes),
            ("graphmesh_kv_capacity_bytes", "gauge", "Size of the memory tier", lambda: store.capacity_bytes),
            ("graphmesh_kv_hit_ratio", "gauge", "Looked-up tokens found stored, over all lookups",
             lambda: store.stats().hit_ratio),
            ("graphmesh_kv_hit_tokens", "counter", "Looked-up tokens found stored", lambda: store.stats().hit_tokens),
            ("graphmesh_kv_miss_tokens", "counter", "Looked-up tokens not stored", lambda: store.stats().miss_tokens),
            ("graphmesh_kv_evictions", "counter", "Blocks evicted", lambda: store.stats().evictions),
            ("graphmesh_kv_corrupt_blocks", "counter", "Blocks dropped for a bad checksum",
             lambda: store.stats().corrupt_blocks),
            ("graphmesh_kv_shared_up", "gauge", "1 while the shared tier (Redis/Valkey) answers",
             lambda: int(store.stats().shared_up)),
            ("graphmesh_kv_shared_hit_blocks", "counter", "Entries served from the shared tier",
             lambda: store.stats().shared_hit_blocks),
            ("graphmesh_kv_shared_errors", "counter", "Failed calls to the shared tier (served as misses)",
             lambda: store.stats().shared_errors))
    return server, port, store


def parse_args(argv: list[str] | None = None) -> KvStoreConfig:
    p = argparse.ArgumentParser(prog="graphmesh-kvstore", description="Stores committed KV blocks by token prefix.")
    p.add_argument("--listen", default="127.0.0.1:50060", help="HOST:PORT; port 0 picks a free port")
    p.add_argument("--capacity-bytes", type=byte_size, default=1 << 30, help="memory tier size (e.g. 4Gi)")
    p.add_argument("--dir", type=Path, help="disk tier directory; blocks there survive restarts")
    p.add_argument("--disk-capacity-bytes", type=byte_size, default=0, help="disk tier size; 0 is unbounded")
    p.add_argument("--block-tokens", type=int, default=16, help="the block size accepted; 0 accepts any")
    p.add_argument("--max-put-bytes", type=byte_size, default=DEFAULT_MAX_PUT_BYTES, help="largest PutBlocks")
    p.add_argument("--max-message-bytes", type=byte_size, default=channels.MAX_MESSAGE_BYTES, help="largest gRPC message")
    p.add_argument("--executor-timeout", type=float, default=120.0, help="seconds for a seed or copy without deadline")
    p.add_argument("--workers", type=int, default=16, help="calls served at once (--max-concurrent-rpcs overrides)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 is off")
    p.add_argument("--redis-url", default="", help="shared tier: redis://HOST:PORT/DB (Redis or Valkey; rediss:// for TLS)")
    p.add_argument("--redis-password-file", type=Path, help="file holding the shared tier's password")
    p.add_argument("--redis-ttl", type=float, default=0.0, help="seconds an entry lives in the shared tier; 0: until evicted")
    p.add_argument("--redis-timeout", type=float, default=0.25, help="seconds per shared-tier call before it is a miss")
    bootstrap.add_arguments(p)
    a = p.parse_args(argv)
    return KvStoreConfig(listen=a.listen, capacity_bytes=a.capacity_bytes, directory=a.dir,
                         disk_capacity_bytes=a.disk_capacity_bytes, block_tokens=a.block_tokens,
                         max_put_bytes=a.max_put_bytes, max_message_bytes=a.max_message_bytes,
                         executor_timeout_s=a.executor_timeout, workers=a.workers, metrics_port=a.metrics_port,
                         redis_url=a.redis_url, redis_password_file=a.redis_password_file, redis_ttl_s=a.redis_ttl,
                         redis_timeout_s=a.redis_timeout, security=bootstrap.from_args(a))


def main(argv: list[str] | None = None) -> None:
    with starting("graphmesh-kvstore"):
        config = parse_args(argv)
        logs.configure("kvstore")
        telemetry.setup("graphmesh-kvstore")
        telemetry.serve_metrics(config.metrics_port)
        started = time.monotonic()
        server, port, store = build_server(config)
    host = config.listen.rsplit(":", 1)[0]
    s = store.stats()
    log.info("serving", extra={"listen": f"{host}:{port}", "capacity_bytes": config.capacity_bytes,
                               "dir": str(config.directory or ""), "disk_capacity_bytes": config.disk_capacity_bytes,
                               "block_tokens": config.block_tokens, "blocks": s.blocks, "disk_bytes": s.disk_bytes,
                               "shared": bool(config.redis_url),
                               "startup_ms": round((time.monotonic() - started) * 1e3, 1)})
    print(f"graphmesh-kvstore listening on {host}:{port}", file=sys.stderr, flush=True)
    run_until_signalled(server, grace_s=5.0)


if __name__ == "__main__":
    main()
