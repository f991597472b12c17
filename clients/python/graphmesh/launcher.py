"""Starts a mesh on loopback as real processes: executors, then the coordinator (and the kvstore when
installed). Used by `graphmesh up`, `graphmesh generate` without --coordinator, `make demo`, tests and
benchmarks."""

from __future__ import annotations

import importlib.util
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from graphmesh import channels, security

if TYPE_CHECKING:  # a type only: importing the SDK never imports graphmesh_server (only a proxied mesh does, below)
    from graphmesh_server.faults import TcpProxy

EXECUTOR_START_S = 120.0  # an executor imports its backend and may load a model's weights before it serves


def _ephemeral_ports() -> range:
    try:
        low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


_handed_out: set[int] = set()
_port_lock = threading.Lock()


def free_port() -> int:
    """A loopback port that is free now and that nothing else will take before its user binds it. It comes from
    below the kernel's ephemeral range: a port out of that range (bind to 0) can be taken between our check and
    the child's bind by any socket bound to 0 or by an outgoing connection, as a proxy or a boundary link of the
    same mesh does, and the child then exits on EADDRINUSE. The same process never hands a port out twice."""
    ephemeral = _ephemeral_ports()
    candidates = range(10000, ephemeral.start) if ephemeral.start > 11000 else range(ephemeral.stop, 65536)
    with _port_lock:
        for _ in range(1000):
            port = random.choice(candidates)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {candidates.start}-{candidates.stop - 1}")


def gpu_env(gpus: Sequence[int], rank: int) -> dict[str, str]:
    """The environment that pins executor `rank` to GPU gpus[rank]: CUDA_VISIBLE_DEVICES lists its GPU first, so it
    computes on cuda:0, then the mesh's other GPUs, which it never allocates on but whose memory a CUDA IPC boundary
    link must be able to map (graphmesh_executor/transport.py); a process that sees one GPU cannot."""
    own = gpus[rank]
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in [own, *(g for g in gpus if g != own)])}


def parse_gpus(text: str) -> list[int]:
    """`--gpus`: a count ("2": GPUs 0 and 1) or comma-separated GPU ids ("0,1"; "3," is GPU 3 alone)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts if p) or not any(parts):
        raise ValueError(f"--gpus takes a count (2) or GPU ids (0,1), not {text!r}")
    if len(parts) == 1:
        if int(parts[0]) == 0:
            raise ValueError("--gpus 0 starts no executor: give a count of at least 1, or ids such as 0,")
        return list(range(int(parts[0])))
    ids = [int(p) for p in parts if p]
    if len(set(ids)) != len(ids):
        raise ValueError(f"--gpus names a GPU twice: {text!r}")
    return ids


def fastest_backend() -> str:
    """The backend an executor serves with unless told (here, and graphmesh-executor's --backend default): torch
    (CPU or CUDA) where installed, else mlx, else numpy, the reference."""
    for name in ("torch", "mlx"):
        if importlib.util.find_spec(name) is not None:
            return name
    return "numpy"


def _log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def wait_healthy(address: str, process: subprocess.Popen[bytes] | None, timeout_s: float, what: str,
                 credentials: grpc.ChannelCredentials | None = None, service: str = "", log: Path | None = None) -> None:
    """The one health wait: until grpc.health.v1 at `address` says SERVING for `service` ("" is the whole
    server; a standby coordinator serves "liveness" alone). Raises RuntimeError when `process` exits first and
    TimeoutError after `timeout_s`, with the tail of the process's `log` so that a failed start says why."""
    try:
        _wait_healthy(address, process, timeout_s, what, credentials, service)
    except (RuntimeError, TimeoutError) as e:
        if log is None:
            raise
        raise type(e)(f"{e}; the tail of {log}:\n{_log_tail(log)}") from None


def _wait_healthy(address: str, process: subprocess.Popen[bytes] | None, timeout_s: float, what: str,
                  credentials: grpc.ChannelCredentials | None, service: str) -> None:
    deadline = time.monotonic() + timeout_s
    with channels.open_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{what} exited with status {process.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} at {address} did not become healthy within {timeout_s:.0f} s")
            time.sleep(0.1)


class Startable:
    """A set of processes started by start() (or `with`) and ended by stop(): a start that fails part-way stops
    what it had started before the error goes on, so nothing outlives a failed start."""

    def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


@dataclass
class LocalMesh(Startable):
    executors: int = 2
    backend: str | Sequence[str] = ""
    model: str = "smollm2-135m"
    split: Sequence[int] = ()
    weights: str = "packed"
    log_dir: str = ""
    state_dir: str = ""
    extra_coordinator_args: Sequence[str] = ()
    startup_timeout_s: float = 300.0
    coordinator_listen: str = ""
    http_listen: str = ""  # HOST:PORT of the OpenAI HTTP API (the front end's when there is one); "": off
    # clients call a graphmesh-frontend (frontend_address, and the HTTP API), which relays to the coordinator
    frontend: bool = False
    kvstore: bool = True  # start a KV store (when graphmesh-kvstore is installed) and write KV behind to it
    fault_injection: bool = False  # executors accept StageService.InjectFault
    proxied: bool = False  # the coordinator and the boundary pushes reach executors through fault proxies
    standby_weights: bool | None = None  # executors hold the whole model (None: their default, where it fits)
    gpus: Sequence[int] = ()  # one executor per GPU id, in rank order (gpu_env); empty: executors' own --device
    pin_cores: bool = True  # CPU executors sharing this host each run on cores of their own (_core_shares)
    # TLS for every service (PEM files): each serves with tls_cert and presents it to the others; with tls_ca
    # every hop is mutual TLS. The certificate must name 127.0.0.1.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_roots: str = ""  # without tls_ca: the CA every process trusts for servers (GRPC_DEFAULT_SSL_ROOTS_FILE_PATH)
    auth_token_file: str = ""  # clients of the coordinator must send this bearer token
    # Identifies mesh members to each other (--mesh-token-file on every service); empty: start() makes a random
    # one. Tests and tools that call StageService or KvStoreService themselves send it (security.mesh_metadata).
    mesh_token: str = ""
    mesh_token_file: str = field(default="", init=False)  # written by start(), removed by stop()
    metrics: bool = False  # every service serves Prometheus /metrics on a free port (metrics_ports)
    env: dict[str, str] = field(default_factory=dict)  # added to every service's environment (OTEL_* ...)
    extra_executor_args: Sequence[str] = ()
    # One more executor, of its own, for the draft model of --speculative draft:MODEL (passed to the coordinator as
    # --draft-executor; the speculative flag itself goes in extra_coordinator_args)
    draft_executor: bool = False
    draft_address: str = ""
    draft_process: subprocess.Popen[bytes] | None = None
    extra_kvstore_args: Sequence[str] = ()
    metrics_ports: dict[str, int] = field(default_factory=dict)  # "coordinator", "kvstore", "executor-<rank>"
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    executor_processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    executor_addresses: list[str] = field(default_factory=list)  # as the coordinator sees them
    proxies: list[TcpProxy] = field(default_factory=list)
    coordinator_process: subprocess.Popen[bytes] | None = None
    coordinator_address: str = ""
    frontend_address: str = ""
    frontend_process: subprocess.Popen[bytes] | None = None
    kvstore_address: str = ""
    _coordinator_args: list[str] = field(default_factory=list)
    _draft_args: list[str] = field(default_factory=list)

    def backends(self) -> list[str]:
        if isinstance(self.backend, str):
            return [self.backend or fastest_backend()] * (len(self.gpus) or self.executors)
        return list(self.backend)

    def _core_shares(self, cores: list[int], executors: int, each: int) -> list[list[int]]:
        """The `each` cores of every executor (--cpus) when several CPU executors share this host and each can have
        its own: pinned, a stage's threads stay where its data is warm instead of following the hand-offs between the
        stages (bench/RESULTS.md, CPU serving). Empty: leave them to the OS."""
        extra = list(self.extra_executor_args)
        device = extra[extra.index("--device") + 1] if "--device" in extra[:-1] else "cpu"
        if not self.pin_cores or self.gpus or device != "cpu" or "--cpus" in extra or not 1 < executors <= len(cores):
            return []
        return [cores[rank * each:(rank + 1) * each] for rank in range(executors)]

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="graphmesh-logs-"))
        self.log_dir = str(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        out = open(log_dir / f"{name}.log", "ab")
        if self.metrics:
            self.metrics_ports[name] = free_port()
            args = [*args, "--metrics-port", str(self.metrics_ports[name])]
        process = subprocess.Popen([sys.executable, "-m", *args, *self._security_args(name)], stdout=out,
                                   stderr=subprocess.STDOUT, env={**os.environ, **self._env(name), **(env or {})})
        self.processes.append(process)
        return process

    def log(self, name: str) -> Path:
        """Where the process `name` ("coordinator", "kvstore", "executor-<rank>") writes its output."""
        return Path(self.log_dir) / f"{name}.log"

    def _env(self, name: str) -> dict[str, str]:
        env = dict(self.env)
        if self.tls_roots:
            env["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = self.tls_roots
        if env.get("OTEL_TRACES_EXPORTER", "none") != "none":  # tell the processes of one service apart in traces
            env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(filter(None, (env.get("OTEL_RESOURCE_ATTRIBUTES"),
                                                                     f"service.instance.id={name}")))
        return env

    def _security_args(self, name: str) -> list[str]:
        args = []
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if path:
                args += [flag, path]
        if self.mesh_token_file:
            args += ["--mesh-token-file", self.mesh_token_file]
        if name in ("coordinator", "frontend") and self.auth_token_file:
            args += ["--auth-token-file", self.auth_token_file]
        if name == "frontend" and self.auth_token_file:  # its clients' token is the coordinator's too
            args += ["--coordinator-token-file", self.auth_token_file]
        extra = {"kvstore": self.extra_kvstore_args, "coordinator": self.extra_coordinator_args}
        return args + list(extra.get(name, self.extra_executor_args if name.startswith("executor") else ()))

    def credentials(self) -> grpc.ChannelCredentials | None:
        """What a client of this mesh needs to reach it: its CA, and its certificate when the mesh wants one."""
        if not self.tls_cert:
            return None
        if not self.tls_ca:
            return security.credentials(self.tls_roots)
        return security.credentials(self.tls_ca, self.tls_cert, self.tls_key)

    def _write_mesh_token(self) -> None:
        self.mesh_token = self.mesh_token or secrets.token_urlsafe(32)
        path = Path(tempfile.mkdtemp(prefix="graphmesh-secrets-")) / "mesh-token"  # the directory is 0700
        path.write_text(self.mesh_token + "\n")
        path.chmod(0o600)
        self.mesh_token_file = str(path)

    def _start(self) -> None:
        backends = self.backends()
        if self.gpus and (len(backends) != len(self.gpus) or set(backends) != {"torch"}):
            raise ValueError(f"one executor per GPU: {len(self.gpus)} GPUs {list(self.gpus)} need {len(self.gpus)} "
                             f"torch executors, not {backends}")
        self._write_mesh_token()
        if self.kvstore and importlib.util.find_spec("graphmesh_kvstore") is not None:
            self.kvstore_address = f"127.0.0.1:{free_port()}"
            store = self._spawn("kvstore", ["graphmesh_kvstore.server", "--listen", self.kvstore_address])
        # Every process starts at once and each waits for what it needs (the coordinator for its executors): a
        # start costs the slowest process's import, not the sum of them all.
        backends = self.backends()
        # executors sharing a machine must not oversubscribe the cores this process may use (a cpuset, taskset)
        cores = sorted(os.sched_getaffinity(0))
        threads = max(1, len(cores) // len(backends))
        shares = self._core_shares(cores, len(backends), threads)
        spawned = []
        for rank, backend in enumerate(backends):
            address = f"127.0.0.1:{free_port()}"
            env = {"OMP_NUM_THREADS": str(threads)}
            args = ["graphmesh_executor.server", "--listen", address, "--backend", backend, "--threads", str(threads)]
            args += ["--cpus", ",".join(map(str, shares[rank]))] if shares else []
            args += ["--enable-fault-injection"] if self.fault_injection else []
            args += [] if self.standby_weights is None else ["--standby-weights", "on" if self.standby_weights else "off"]
            if self.gpus:
                env.update(gpu_env(self.gpus, rank))
                args += ["--device", "cuda:0"]
            if self.proxied:  # the previous rank's boundary link goes through the same proxy as its gRPC calls
                # fault proxies are test tooling of graphmesh-server, installed wherever the services this spawns are
                from graphmesh_server.faults import TcpProxy

                proxy = TcpProxy(address)
                link = f"127.0.0.1:{free_port()}"
                args += ["--boundary-link-port", link.rsplit(":", 1)[1], "--boundary-link-advertise", proxy.forward(link)]
            process = self._spawn(f"executor-{rank}", args, env)
            spawned.append((address, process, rank))
            self.executor_processes.append(process)
            if self.proxied:
                self.proxies.append(proxy)
                address = proxy.address
            self.executor_addresses.append(address)
        if self.draft_executor:
            self.draft_address = f"127.0.0.1:{free_port()}"
            self._draft_args = ["graphmesh_executor.server", "--listen", self.draft_address, "--backend", backends[-1],
                                "--threads", str(threads), *(["--enable-fault-injection"] if self.fault_injection else [])]
            self._spawn_draft_executor()
        if self.kvstore_address:  # the coordinator hands the store's address to its executors once it is up
            wait_healthy(self.kvstore_address, store, 60.0, "kvstore", self.credentials(), log=self.log("kvstore"))
        self.coordinator_address = self.coordinator_listen or f"127.0.0.1:{free_port()}"
        args = ["graphmesh_coordinator.server", "--listen", self.coordinator_address, "--executors",
                ",".join(self.executor_addresses), "--model", self.model, "--weights", self.weights,
                "--state-dir", self.state_dir or tempfile.mkdtemp(prefix="graphmesh-state-"),
                "--startup-timeout", str(EXECUTOR_START_S)]
        if self.split:
            args += ["--split", ",".join(str(n) for n in self.split)]
        if self.kvstore_address:
            args += ["--kvstore", self.kvstore_address]
        if self.http_listen and not self.frontend:
            args += ["--http-listen", self.http_listen]
        if self.draft_address:
            args += ["--draft-executor", self.draft_address]
        self._coordinator_args = args
        self.coordinator_process = self._spawn("coordinator", self._coordinator_args)
        if self.frontend:
            self.frontend_address = f"127.0.0.1:{free_port()}"
            http = ["--http-listen", self.http_listen] if self.http_listen else []
            self.frontend_process = self._spawn("frontend", ["graphmesh_coordinator.frontend", "--listen",
                                                             self.frontend_address, "--coordinator",
                                                             self.coordinator_address, "--model", self.model, *http])
        for address, process, rank in spawned:
            wait_healthy(address, process, EXECUTOR_START_S, f"executor {rank}", self.credentials(),
                         log=self.log(f"executor-{rank}"))
        if self.draft_executor:
            self._wait_draft_executor()
        self._wait_coordinator()
        if self.frontend:  # serving once the coordinator it relays to is
            wait_healthy(self.frontend_address, self.frontend_process, self.startup_timeout_s, "front end",
                         self.credentials(), log=self.log("frontend"))

    @property
    def client_address(self) -> str:
        """Where clients call CoordinatorService: the front end when the mesh has one, else the coordinator."""
        return self.frontend_address or self.coordinator_address

    @property
    def http_url(self) -> str:
        """The OpenAI API's base URL (what an OpenAI client takes as base_url); "" when it is off."""
        if not self.http_listen:
            return ""
        host, _, port = self.http_listen.rpartition(":")
        scheme = "https" if self.tls_cert else "http"
        return f"{scheme}://{'127.0.0.1' if host in ('', '0.0.0.0') else host}:{port}/v1"

    def start_draft_executor(self) -> None:
        """(Re)starts the draft model's executor on the same address."""
        self._spawn_draft_executor()
        self._wait_draft_executor()

    def _spawn_draft_executor(self) -> None:
        threads = self._draft_args[self._draft_args.index("--threads") + 1]
        self.draft_process = self._spawn("executor-draft", self._draft_args, {"OMP_NUM_THREADS": threads})

    def _wait_draft_executor(self) -> None:
        wait_healthy(self.draft_address, self.draft_process, EXECUTOR_START_S, "the draft executor",
                     self.credentials(), log=self.log("executor-draft"))

    def start_coordinator(self) -> None:
        """(Re)starts the coordinator on the same address and state dir."""
        self.coordinator_process = self._spawn("coordinator", self._coordinator_args)
        self._wait_coordinator()

    def _wait_coordinator(self) -> None:
        wait_healthy(self.coordinator_address, self.coordinator_process, self.startup_timeout_s, "coordinator",
                     self.credentials(), log=self.log("coordinator"))

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        for proxy in self.proxies:
            proxy.close()
        if self.mesh_token_file:
            shutil.rmtree(Path(self.mesh_token_file).parent, ignore_errors=True)
            self.mesh_token_file = ""
