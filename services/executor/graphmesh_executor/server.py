"""The executor process: `graphmesh-executor --listen HOST:PORT --backend numpy|torch|mlx ...`.

build_server() is the one place that creates the gRPC server and adds its
services: StageService (the pipeline protocol the coordinator drives, with the
stage's own executables), ExecutorService (the ExecutableGraph trait over its
own registry: conformance tests and SDK clients; it does not see the stage's),
health and reflection.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from graphmesh import channels
from graphmesh.launcher import fastest_backend
from graphmesh.v1 import executor_pb2, executor_pb2_grpc, stage_pb2
from graphmesh_executor import affinity
from graphmesh_executor.backends import NAMES
from graphmesh_executor.fencing import AuthorityState
from graphmesh_executor.kv_push import KvPusher
from graphmesh_executor.kv_writer import KvWriteBehind
from graphmesh_executor.registry import ExecutableRegistry
from graphmesh_executor.servicer import ExecutorServicer
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_servicer import BoundaryPusher, add_stage_service, listen_for_links
from graphmesh_server import bootstrap, etcd, logs, telemetry
from graphmesh_server.bootstrap import ServerSecurity
from graphmesh_server.etcd import EtcdClient
from graphmesh_server.membership import Registration
from graphmesh_server.serving import byte_size, fits_in_memory, memory_bytes, run_until_signalled, starting

log = logging.getLogger("graphmesh.executor")

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"].full_name
STAGE_SERVICE_NAME = stage_pb2.DESCRIPTOR.services_by_name["StageService"].full_name
# A bigger stream than the machine can hold is refused up front rather than killing the executor half-way.
DEFAULT_MAX_PARAM_BYTES = fits_in_memory(64 << 30)
STANDBY_WEIGHTS = {"auto": None, "on": True, "off": False}  # --standby-weights -> ExecutorConfig.standby_weights


@dataclass(frozen=True)
class ExecutorConfig:
    listen: str = "127.0.0.1:0"
    backend: str = "numpy"
    device: str = "cpu"
    model_root: Path | None = None
    threads: int | None = None  # compute threads of the backend; None keeps the library default
    cpus: frozenset[int] = frozenset()  # the cores its threads run on (affinity.pin); empty: wherever the OS puts them
    max_message_bytes: int = channels.MAX_MESSAGE_BYTES
    max_param_bytes: int = DEFAULT_MAX_PARAM_BYTES
    workers: int = 64  # calls served at once; stage waiters hold one each (the coordinator bounds them)
    enable_fault_injection: bool = False  # StageService.InjectFault, for tests and benchmarks only
    # Read the whole model in the background, so a re-plan after a peer is lost reads no checkpoint. None: on when
    # the model's f32 weights take at most a quarter of the available memory.
    standby_weights: bool | None = None
    kv_cache_bytes: int = 0  # the paged KV pool of the stage; 0 sizes it from free memory
    metrics_port: int = 0  # Prometheus /metrics; 0: off
    security: ServerSecurity = field(default_factory=ServerSecurity)
    etcd: tuple[str, ...] = ()  # etcd client URLs: register as a member of cluster_name there; empty: static meshes
    cluster_name: str = "graphmesh"
    advertise: str = ""  # the address the coordinator and the other executors reach this one at; "": listen
    registration_ttl_s: int = 2  # the registration's lease: how long a dead executor stays registered
    drain_timeout_s: float = 30.0  # on SIGTERM, how long to wait for the coordinator to re-plan without this one
    preload_model: str = ""  # read this model's whole weights before registering (a join then reads no checkpoint)
    # The boundary link listener's port (0: a free one; None: no listener, previous ranks push over gRPC), and the
    # HOST:PORT previous ranks reach it at ("": the host they reach the gRPC port at, this port)
    boundary_link_port: int | None = 0
    boundary_link_advertise: str = ""


def tune_malloc() -> None:
    """Keeps freed buffers in the heap (glibc only): every 1 MiB chunk otherwise lands in fresh mmap pages
    whose faults cost ~0.7 ms per MiB on a VM, more than copying the chunk itself."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest allowed value; bigger blocks still use mmap
    libc.mallopt(m_trim_threshold, 1 << 30)


def _set_threads(backend: str, threads: int) -> None:
    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
    else:
        # numpy's and mlx's BLAS read OMP_NUM_THREADS / OPENBLAS_NUM_THREADS when they load, before argv is parsed
        log.warning("--threads applies to the torch backend; set OMP_NUM_THREADS for the others",
                    extra={"backend": backend, "threads": threads})


def build_server(config: ExecutorConfig) -> tuple[grpc.Server, int, StageRuntime]:
    """Creates, binds and starts the server; health turns SERVING once it accepts calls."""
    if config.threads:
        _set_threads(config.backend, config.threads)
    registry = ExecutableRegistry(config.backend, config.device)
    options = channels.message_options(config.max_message_bytes)
    server = config.security.server(config.workers, options, telemetry.server_interceptors(config.metrics_port > 0),
                                    "executor-rpc")
    executor_pb2_grpc.add_ExecutorServiceServicer_to_server(
        ExecutorServicer(registry, model_root=config.model_root, max_message_bytes=config.max_message_bytes,
                         max_param_bytes=config.max_param_bytes), server)
    block_writer = KvWriteBehind(tls=config.security.tls)
    runtime = StageRuntime(config.backend, config.device, str(config.model_root) if config.model_root else None,
                           pusher=(pusher := BoundaryPusher(config.security.tls, config.device)), block_writer=block_writer,
                           faults_enabled=config.enable_fault_injection, standby_weights=config.standby_weights,
                           kv_cache_bytes=config.kv_cache_bytes, device_links=pusher.on_device, queue=pusher.queue)
    stage = add_stage_service(server, runtime, KvPusher(config.security.tls, config.max_message_bytes))
    stage.pusher = pusher  # Status reports its transport per next rank
    link = None
    if config.boundary_link_port is not None and config.security.tls is None:  # links are plain TCP
        link = listen_for_links(stage, config.listen.rsplit(":", 1)[0], config.boundary_link_port,
                                config.max_message_bytes, config.boundary_link_advertise)
        log.info("boundary link listener", extra={"port": link.port, "advertised": link.address})
    port, _ = config.security.start(server, config.listen, (SERVICE_NAME, STAGE_SERVICE_NAME))
    if config.metrics_port:
        authority = runtime.authority
        telemetry.expose(
            ("graphmesh_incarnation", "gauge", "The incarnation this executor obeys (0: not installed)",
             lambda: authority.incarnation),
            ("graphmesh_poisoned", "gauge", "1 while the current incarnation is poisoned or terminal",
             lambda: authority.state in (AuthorityState.POISONED, AuthorityState.TERMINAL)),
            ("graphmesh_poisonings", "counter", "Incarnations poisoned on this executor", lambda: authority.poisonings),
            ("graphmesh_stage_sessions", "gauge", "Sessions holding KV on this executor", lambda: len(runtime.sessions())),
            ("graphmesh_stage_compiles", "counter", "Executables compiled for a step's shape on first use (the step "
             "waits)", lambda: runtime.compiles),
            ("graphmesh_stage_compile_seconds", "counter", "Seconds those compiles took", lambda: runtime.compile_seconds),
            ("graphmesh_kv_pool_blocks", "gauge", "KV blocks this stage lends to sessions", lambda: runtime.pool.lendable),
            ("graphmesh_kv_pool_free_blocks", "gauge", "KV blocks free in the pool", lambda: runtime.pool.free),
            ("graphmesh_kv_write_behind_blocks", "counter", "KV blocks written behind to the kvstore",
             lambda: block_writer.written_blocks),
            ("graphmesh_kv_write_behind_failures", "counter", "Failed write-behind puts", lambda: block_writer.failures),
            ("graphmesh_kv_write_behind_dropped", "counter", "Write-behinds dropped on a full queue",
             lambda: block_writer.dropped),
            ("graphmesh_boundary_link_pushes", "counter", "Boundary bundles taken over boundary links (PushBoundary "
             "calls count in graphmesh_rpc_server_seconds)", lambda: link.pushes if link is not None else 0),
            ("graphmesh_boundary_links", "gauge", "Boundary links open to this executor",
             lambda: link.links if link is not None else 0))
    return server, port, runtime


def parse_args(argv: list[str] | None = None) -> ExecutorConfig:
    p = argparse.ArgumentParser(prog="graphmesh-executor", description="Serves compiled graphs over gRPC.")
    p.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT; port 0 picks a free port")
    p.add_argument("--backend", choices=NAMES, default=None,
                   help="default: the fastest installed (torch, else mlx, else numpy: the reference)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--model-root", type=Path, help="directory LoadParams may read checkpoints from")
    p.add_argument("--threads", type=int, help="compute threads of the backend")
    p.add_argument("--cpus", default="", help="cores this executor's threads run on, e.g. 0-3 or 0,2 (default: any; "
                                              "graphmesh up gives executors that share a host cores of their own)")
    p.add_argument("--max-message-bytes", type=byte_size, default=channels.MAX_MESSAGE_BYTES,
                   help="largest gRPC message (e.g. 64Mi)")
    p.add_argument("--max-param-bytes", type=byte_size, default=DEFAULT_MAX_PARAM_BYTES,
                   help="largest SetParams/BindHandle stream (default: 64Gi or half the memory, whichever is less)")
    p.add_argument("--workers", type=int, default=64, help="calls served at once (--max-concurrent-rpcs overrides)")
    p.add_argument("--enable-fault-injection", action="store_true", help="accept StageService.InjectFault (tests)")
    p.add_argument("--standby-weights", choices=["auto", "on", "off"], default="auto",
                   help="hold the whole model's weights so a re-plan after losing a peer reads no checkpoint "
                        "(auto: when they take at most a quarter of the available memory)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 is off")
    p.add_argument("--kv-cache-bytes", type=byte_size, default=0,
                   help="size of the stage's paged KV pool (e.g. 2Gi); 0: from free memory")
    etcd.add_arguments(p, "register as an executor of --cluster-name there, so the leading coordinator plans over it "
                          "(default: none; the coordinator's --executors names it)")
    p.add_argument("--advertise", default="", help="HOST:PORT the coordinator and the other executors reach this "
                                                   "executor at (default: --listen; required when it listens on "
                                                   "0.0.0.0)")
    p.add_argument("--registration-ttl", type=int, default=2,
                   help="seconds a registration outlives its executor's last renewal (a dead executor's lease)")
    p.add_argument("--preload-model", default="",
                   help="bundled model name or checkpoint path whose whole weights are read at start, before the "
                        "executor registers (--etcd): the leader then installs it on a live mesh without a "
                        "checkpoint read (f32 weights)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="with --etcd, seconds SIGTERM waits for the coordinator to re-plan without this executor "
                        "before it stops serving")
    p.add_argument("--boundary-link-port", default="0",
                   help="port of the boundary link listener, the data plane previous ranks push activations over "
                        "(0: a free port; 'off': none, they push over gRPC; a TLS mesh never opens one)")
    p.add_argument("--boundary-link-advertise", default="",
                   help="HOST:PORT previous ranks reach the boundary link at (default: the host they reach this "
                        "executor at, the listener's port)")
    bootstrap.add_arguments(p, executor_service=True)
    a = p.parse_args(argv)
    if a.boundary_link_port != "off" and not a.boundary_link_port.isdigit():
        p.error(f"--boundary-link-port takes a port or 'off', not {a.boundary_link_port!r}")
    try:
        cpus = affinity.parse(a.cpus) if a.cpus else frozenset()
    except ValueError as e:
        p.error(f"--cpus takes cores like 0-3 or 0,2: {e}")
    allowed = os.sched_getaffinity(0)
    if cpus - allowed:
        p.error(f"--cpus {a.cpus}: cores {sorted(cpus - allowed)} are not this process's to use (it may use "
                f"{sorted(allowed)})")
    return ExecutorConfig(listen=a.listen, backend=a.backend or fastest_backend(), device=a.device, model_root=a.model_root,
                          threads=a.threads, cpus=cpus, max_message_bytes=a.max_message_bytes,
                          max_param_bytes=a.max_param_bytes,
                          workers=a.workers, enable_fault_injection=a.enable_fault_injection,
                          standby_weights=STANDBY_WEIGHTS[a.standby_weights], metrics_port=a.metrics_port,
                          kv_cache_bytes=a.kv_cache_bytes, security=bootstrap.from_args(a),
                          etcd=tuple(a.etcd), cluster_name=a.cluster_name,
                          advertise=a.advertise, registration_ttl_s=a.registration_ttl,
                          drain_timeout_s=a.drain_timeout, preload_model=a.preload_model,
                          boundary_link_port=None if a.boundary_link_port == "off" else int(a.boundary_link_port),
                          boundary_link_advertise=a.boundary_link_advertise)


def _preload_blas(backend: str) -> None:
    """mlx-cpu ships a reference BLAS; a tuned one must be preloaded before the process starts, so the
    executor re-executes itself once with it (whoever launched it: CLI, tests, Kubernetes)."""
    if backend != "mlx" or "GRAPHMESH_BLAS_PRELOADED" in os.environ:
        return
    from graphmesh_executor.backends.mlx_backend import launch_env

    env = launch_env()
    if env and "LD_PRELOAD" not in os.environ:
        os.execve(sys.executable, [sys.executable, "-m", "graphmesh_executor.server", *sys.argv[1:]],
                  {**os.environ, **env, "GRAPHMESH_BLAS_PRELOADED": "1"})


def main(argv: list[str] | None = None) -> None:
    with starting("graphmesh-executor"):
        config = parse_args(argv)
        if argv is None:
            _preload_blas(config.backend)
        if config.cpus:  # before any thread starts: each inherits the cores of the thread that starts it
            affinity.pin(config.cpus)
        logs.configure("executor")
        telemetry.setup("graphmesh-executor")
        telemetry.serve_metrics(config.metrics_port)
        tune_malloc()
        started = time.monotonic()
        server, port, runtime = build_server(config)
        if config.preload_model:
            runtime.preload(config.preload_model)
    host = config.listen.rsplit(":", 1)[0]
    log.info("serving", extra={"listen": f"{host}:{port}", "backend": config.backend, "device": config.device,
                               "model_root": str(config.model_root or ""), "max_message_bytes": config.max_message_bytes,
                               "startup_ms": round((time.monotonic() - started) * 1e3, 1)})
    print(f"graphmesh-executor listening on {host}:{port}", file=sys.stderr, flush=True)
    if not config.etcd:
        run_until_signalled(server, grace_s=5.0)
        return
    registration = Registration(EtcdClient(config.etcd), config.cluster_name, advertised_address(config, host, port),
                                {"backend": config.backend, "device": config.device, "memory_bytes": memory_bytes()},
                                config.registration_ttl_s)
    registration.start()
    run_until_signalled(server, grace_s=5.0, drain=lambda: leave(registration, runtime, config.drain_timeout_s))


def advertised_address(config: ExecutorConfig, host: str, port: int) -> str:
    """What this executor registers as its address: --advertise, else the host of --listen with the port it bound."""
    if config.advertise:
        return config.advertise
    if host in ("", "0.0.0.0", "[::]"):
        raise SystemExit("graphmesh-executor: --etcd with --listen on every interface needs --advertise HOST:PORT "
                         "(the address the coordinator reaches this executor at)")
    return f"{host}:{port}"


def leave(registration: Registration, runtime: StageRuntime, timeout_s: float) -> None:
    """Leaves the mesh without failing anyone: deregisters, then keeps serving until the coordinator has fenced
    the roster this executor is part of (it re-plans without it, restoring its sessions on the others), or
    `timeout_s` passes."""
    authority = runtime.authority
    held = authority.incarnation if authority.state == AuthorityState.ACTIVE else 0
    registration.close()
    log.info("leaving the mesh", extra={"incarnation": held, "drain_timeout_s": timeout_s})
    deadline = time.monotonic() + timeout_s
    while held and authority.state == AuthorityState.ACTIVE and authority.incarnation == held:
        if time.monotonic() > deadline:
            log.warning("the coordinator did not re-plan without this executor in time; stopping anyway",
                        extra={"incarnation": held, "drain_timeout_s": timeout_s})
            return
        time.sleep(0.05)
    log.info("left the mesh", extra={"incarnation": held})


if __name__ == "__main__":
    main()
