"""What every benchmark shares: progress on stderr, free ports, spawning servers, interleaved medians, machine
info (cores, load average, git commit) recorded with the numbers, tables, and the JSON results file."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import numpy as np
from google.rpc import status_pb2

from graphmesh.channels import MESSAGE_OPTIONS
from graphmesh.launcher import LocalMesh
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc
from graphmesh_executor.server import tune_malloc
from graphmesh_server.serving import cpu_flags

MIB = 1 << 20
GIB = 1 << 30
RESULTS_DIR = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def spawn(args: list[str], address: str) -> subprocess.Popen[bytes]:
    """Starts a server process and waits until its port answers."""
    process = subprocess.Popen(args, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
    return process


def args_or_bare_server(p: argparse.ArgumentParser, argv: list[str] | None, service: str,
                        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]) -> argparse.Namespace:
    """The benchmark's arguments; or, in the process it spawns as its baseline (`--bare-server ADDRESS`), a bare
    grpcio server of `handlers` (generic, on raw bytes, no protobuf work) as /`service`/..., until it is ended."""
    p.add_argument("--bare-server", metavar="ADDRESS", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not a.bare_server:
        return a
    tune_malloc()  # the same process tuning as the executor, so the comparison is of code, not allocators
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=MESSAGE_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, handlers)])
    server.add_insecure_port(a.bare_server)
    server.start()
    server.wait_for_termination()
    sys.exit(0)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def interleaved_medians(fns: Sequence[Callable[[], Any]], runs: int, warmup: int = 1) -> list[float]:
    """Median seconds of each function, measured round-robin so that load from other processes hits all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(runs):
        for fn, out in zip(fns, times):
            started = time.perf_counter()
            fn()
            out.append(time.perf_counter() - started)
    return [median(t) for t in times]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mesh_processes(mesh: LocalMesh) -> dict[str, subprocess.Popen[bytes]]:
    """A local mesh's coordinator, its front end when it has one, and each executor (executor-0, ...), by name."""
    assert mesh.coordinator_process is not None
    front = {"frontend": mesh.frontend_process} if mesh.frontend_process is not None else {}
    return {"coordinator": mesh.coordinator_process, **front,
            **{f"executor-{i}": p for i, p in enumerate(mesh.executor_processes)}}


def cpu_by_process(mesh: LocalMesh) -> dict[str, float]:
    """The CPU seconds so far (user + system) of each of a local mesh's processes (mesh_processes)."""
    return {name: cpu_seconds(p.pid) for name, p in mesh_processes(mesh).items()}


class GpuBusy:
    """The share of time GPU 0 ran a kernel while the block runs: nvidia-smi's utilization.gpu, asked for every 100 ms
    (the driver updates it about every 200 ms), averaged; NaN without nvidia-smi or a sample."""

    def __init__(self) -> None:
        self.share = float("nan")
        self._smi: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> GpuBusy:
        smi = shutil.which("nvidia-smi")
        if smi:
            self._smi = subprocess.Popen([smi, "--id=0", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._smi is None:
            return
        self._smi.terminate()
        out, _ = self._smi.communicate()
        samples = [float(line) for line in out.decode().split() if line.replace(".", "", 1).isdigit()]
        if samples:
            self.share = sum(samples) / len(samples) / 100


def py_spy(pid: int, path: str | Path, *flags: str) -> subprocess.Popen[bytes]:
    """py-spy sampling process `pid` into `path` (collapsed stacks) until interrupted (SIGINT: it writes them and
    exits); the one on PATH (a GPU machine's carried wheel), else the venv's."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--format", "raw", *flags, "-o", str(path)],
                            stdout=subprocess.DEVNULL)


def metrics(port: int) -> dict[tuple[str, str], float]:
    """A service's /metrics samples by (name, the value of its `kind` label or "")."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, s.labels.get("kind", "")): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def git_commit() -> str:
    """HEAD, with "+dirty" when the working tree differs from it (the numbers may then belong to no commit)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.strip() + ("+dirty" if dirty.strip() else "")


def git_tree(repo: Path = REPO) -> str:
    """The hash git gives the working tree's files (tracked, and untracked ones it does not ignore: what a GPU call
    carries), whatever HEAD says: `git rev-parse COMMIT^{tree}` names the same for the commit holding these files.
    A copy whose git metadata is stale (the lent GPU machine's) reports a HEAD the numbers do not belong to."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}  # the checkout's own index untouched
            for args in (["read-tree", "HEAD"], ["add", "-A"]):
                subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, check=True)
            return subprocess.run(["git", "write-tree"], cwd=repo, env=env, capture_output=True, text=True,
                                  check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    """lscpu's model name: the figures of one host kind do not carry over to another."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def machine(load_at_start: tuple[float, float, float], **extra: Any) -> dict[str, Any]:
    """Where and under what load the numbers were taken: other processes on a small machine move them."""
    return {"cpus": os.cpu_count(), "cpu": cpu_model(), "cpu_flags": sorted(cpu_flags()),
            "platform": platform.platform(), "python": platform.python_version(),
            "grpcio": grpc.__version__, "git_commit": git_commit(), "git_tree": git_tree(),
            "load_average_at_start": list(load_at_start),
            "load_average_at_end": list(os.getloadavg()), **extra}


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table: strings left-aligned, numbers right-aligned, floats with the digits they need."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "-" if v != v else f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], int | float) for row in rows) for i in range(len(headers))]
    lines = ["  ".join(h.rjust(w) if n else h.ljust(w) for h, w, n in zip(headers, widths, numeric))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(r, widths, numeric)) for r in cells]
    return "\n".join(lines)


def write_results(name: str, payload: dict[str, Any]) -> Path:
    path = RESULTS_DIR / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
    return path


def stream_record(t0: float, stamps: list[float], sizes: list[int], ids: list[int]) -> dict[str, Any]:
    """A stream that began at t0 and got chunks of `sizes` tokens at `stamps`: its TTFT and the gaps between chunks,
    as vLLM's serving benchmark measures them (tokens that came together are one chunk)."""
    return {"ttft": stamps[0] - t0 if stamps else float("nan"), "gaps": np.diff(stamps).tolist(), "ids": ids,
            "start": t0, "end": stamps[-1] if stamps else t0, "chunks": len(stamps), "stamps": stamps, "sizes": sizes}


STREAMS_PER_CHANNEL = 64  # under HTTP/2's usual limit of 100 concurrent streams on one connection


async def generate_multiplexed(address: str, requests: Sequence[coordinator_pb2.GenerateRequest]) -> list[dict[str, Any]]:
    """generate_streams' records, the calls made over one GenerateStreams stream (as a front end makes its clients'):
    a call's chunks are its responses, stamped when the message that carried them came."""
    t0 = time.perf_counter()
    stamps: list[list[float]] = [[] for _ in requests]
    sizes: list[list[int]] = [[] for _ in requests]
    ids: list[list[int]] = [[] for _ in requests]
    async with grpc.aio.insecure_channel(address, options=MESSAGE_OPTIONS) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        calls = [coordinator_pb2.GenerateStreamsRequest(id=i, generate=r) for i, r in enumerate(requests)]
        async for message in stub.GenerateStreams(iter(calls), timeout=600.0):
            now = time.perf_counter()
            for event in message.events:
                if event.HasField("response"):
                    stamps[event.id].append(now)
                    sizes[event.id].append(len(event.response.token_ids))
                    ids[event.id] += event.response.token_ids
                elif event.status:  # not OK
                    raise RuntimeError(f"call {event.id} ended: {status_pb2.Status.FromString(event.status)}")
    return [stream_record(t0, s, n, i) for s, n, i in zip(stamps, sizes, ids)]


async def generate_streams(address: str, requests: Sequence[coordinator_pb2.GenerateRequest]) -> list[dict[str, Any]]:
    """Every request's Generate stream at once, from one event loop over a channel per 64 streams (as vLLM's serving
    benchmark drives a server: one asyncio process; a thread and a channel per stream cost the client's GIL more
    than the server's work at hundreds of streams). Per stream: its tokens, and when each chunk came and how many
    tokens it held."""
    channels = [grpc.aio.insecure_channel(address, options=MESSAGE_OPTIONS)
                for _ in range(-(-len(requests) // STREAMS_PER_CHANNEL))]
    stubs = [coordinator_pb2_grpc.CoordinatorServiceStub(c) for c in channels]

    async def one(i: int, request: coordinator_pb2.GenerateRequest) -> dict[str, Any]:
        t0 = time.perf_counter()
        stamps: list[float] = []
        sizes: list[int] = []
        ids: list[int] = []
        async for chunk in stubs[i % len(stubs)].Generate(request, timeout=600.0):
            stamps.append(time.perf_counter())
            sizes.append(len(chunk.token_ids))
            ids += chunk.token_ids
        return stream_record(t0, stamps, sizes, ids)
    try:
        for c in channels:
            await c.channel_ready()
        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))
    finally:
        for c in channels:
            await c.close()
