"""The KV store process: `graphmesh-kvstore --listen HOST:PORT [--capacity-bytes N] [--dir DIR] [--block-tokens 16]`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from graphmesh import logs
from graphmesh.v1 import kvstore_pb2, kvstore_pb2_grpc
from graphmesh_kvstore.mover import Mover
from graphmesh_kvstore.servicer import KvStoreServicer
from graphmesh_kvstore.store import DEFAULT_MAX_PUT_BYTES, Store

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
    max_message_bytes: int = 64 << 20
    executor_timeout_s: float = 120.0  # for seeds and copies whose caller set no deadline
    workers: int = 16


def build_server(config: KvStoreConfig) -> tuple[grpc.Server, int, Store]:
    """Creates, binds and starts the server; health turns SERVING once it accepts calls."""
    store = Store(config.capacity_bytes, config.directory, config.disk_capacity_bytes, config.block_tokens,
                  config.max_put_bytes)
    mover = Mover(store, config.executor_timeout_s, config.max_message_bytes)
    options = [("grpc.max_receive_message_length", config.max_message_bytes),
               ("grpc.max_send_message_length", config.max_message_bytes)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="kvstore-rpc"),
                         options=options)
    kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server(KvStoreServicer(store, mover), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    server.start()
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, port, store


def _size(text: str) -> int:
    """Bytes with an optional binary suffix: 4096, 64Mi, 1Gi."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def parse_args(argv: list[str] | None = None) -> KvStoreConfig:
    p = argparse.ArgumentParser(prog="graphmesh-kvstore", description="Stores committed KV blocks by token prefix.")
    p.add_argument("--listen", default="127.0.0.1:50060", help="HOST:PORT; port 0 picks a free port")
    p.add_argument("--capacity-bytes", type=_size, default=1 << 30, help="memory tier size (e.g. 4Gi)")
    p.add_argument("--dir", type=Path, help="disk tier directory; blocks there survive restarts")
    p.add_argument("--disk-capacity-bytes", type=_size, default=0, help="disk tier size; 0 is unbounded")
    p.add_argument("--block-tokens", type=int, default=16, help="the block size accepted; 0 accepts any")
    p.add_argument("--max-put-bytes", type=_size, default=DEFAULT_MAX_PUT_BYTES, help="largest PutBlocks")
    p.add_argument("--max-message-bytes", type=_size, default=64 << 20, help="largest gRPC message")
    p.add_argument("--executor-timeout", type=float, default=120.0, help="seconds for a seed or copy without deadline")
    p.add_argument("--workers", type=int, default=16, help="gRPC handler threads")
    a = p.parse_args(argv)
    return KvStoreConfig(listen=a.listen, capacity_bytes=a.capacity_bytes, directory=a.dir,
                         disk_capacity_bytes=a.disk_capacity_bytes, block_tokens=a.block_tokens,
                         max_put_bytes=a.max_put_bytes, max_message_bytes=a.max_message_bytes,
                         executor_timeout_s=a.executor_timeout, workers=a.workers)


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logs.configure("kvstore")
    started = time.monotonic()
    server, port, store = build_server(config)
    host = config.listen.rsplit(":", 1)[0]
    s = store.stats()
    log.info("serving", extra={"listen": f"{host}:{port}", "capacity_bytes": config.capacity_bytes,
                               "dir": str(config.directory or ""), "disk_capacity_bytes": config.disk_capacity_bytes,
                               "block_tokens": config.block_tokens, "blocks": s.blocks, "disk_bytes": s.disk_bytes,
                               "startup_ms": round((time.monotonic() - started) * 1e3, 1)})
    print(f"graphmesh-kvstore listening on {host}:{port}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping", extra={"grace_s": 5})
    server.stop(grace=5).wait()


if __name__ == "__main__":
    main()
