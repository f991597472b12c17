"""Executor overhead against bare grpcio: round trip of a tiny graph, and tensor transfer in and out; and two trait
methods that must do what they say, each against the call they replace, through the same executor.

Both servers run as separate processes on loopback, started by this script: a numpy executor and a
bare grpcio echo server (generic handlers on raw bytes, no protobuf work) with the same message
limits and the same 1 MiB chunking. Then a torch executor (one thread):
- active extent: SmolLM2's 30 layers over a prompt chunk of 17 tokens in the 32-row bucket the stage would
  pad it to, run with the extent (17, 32) against the same run without it (goal <= 0.65x: the real rows' cost);
- with --cuda, on cuda:0: 8 CommitNoWait then one SyncPending against 8 Runs of a graph of one [n, n] matmul,
  for a few n (goal >= 1.5x where the GPU time of a run is about its round trip: overlap can hide no more).
Prints a table and writes bench/results/executor.json.

    .venv/bin/python bench/bench_executor.py [--sizes 1,16,256] [--runs 5] [--rtt-runs 500] [--cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import (
    MIB,
    args_or_bare_server,
    free_address,
    interleaved_medians,
    machine,
    progress,
    spawn,
    write_results,
)
from graphmesh import ExecutorClient, GraphBuilder, RemoteExecutable, models, tensors
from graphmesh.bundled import resolve_model
from graphmesh.channels import MESSAGE_OPTIONS
from graphmesh.checkpoints import open_checkpoint
from graphmesh.errors import NotFound
from graphmesh.v1 import executor_pb2, tensor_pb2
from graphmesh_executor.server import tune_malloc

GOAL = 1.3
EXTENT_GOAL, COMMIT_GOAL = 0.65, 1.5


# -- the bare echo server ---------------------------------------------------------------------------------
def _echo_upload(chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    return sum(len(c) for c in chunks).to_bytes(8, "little")


def _echo_download(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    total = int.from_bytes(request, "little")
    data = bytes(total)
    for offset in range(0, total, tensors.CHUNK_BYTES):
        yield data[offset:offset + tensors.CHUNK_BYTES]


ECHO: dict[str, grpc.RpcMethodHandler[Any, Any]] = {  # the bare server's methods (args_or_bare_server)
    "Unary": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
    "Upload": grpc.stream_unary_rpc_method_handler(_echo_upload),
    "Download": grpc.unary_stream_rpc_method_handler(_echo_download),
}


# -- the measurements -------------------------------------------------------------------------------------
def round_trip(client: ExecutorClient, echo: grpc.Channel, runs: int) -> dict[str, float]:
    g = GraphBuilder("tiny")
    g.output(g.add(g.input("x", (1, 8)), 1.0))
    exe = client.compile(g.build())
    x = {"x": np.ones((1, 8), np.float32)}
    request = executor_pb2.RunRequest(executable_id=exe.id, inputs=[tensor_pb2.NamedTensor(
        name="x", tensor=tensors.to_proto(x["x"]))])
    payload = request.SerializeToString()  # the echo moves the same bytes a Run request does
    unary: grpc.UnaryUnaryMultiCallable[bytes, bytes] = echo.unary_unary("/bench.Echo/Unary")
    progress(f"round trip: {runs} runs each, Run request of {len(payload)} bytes")
    ours, bare = interleaved_medians([lambda: exe.run(x), lambda: unary(payload, timeout=30)], runs, warmup=50)
    exe.release()
    return {"graphmesh_run_us": ours * 1e6, "bare_echo_us": bare * 1e6, "ratio": ours / bare}


def transfer(client: ExecutorClient, echo: grpc.Channel, size_mib: int, runs: int) -> list[dict[str, Any]]:
    n = size_mib * MIB // 4
    g = GraphBuilder(f"transfer_{size_mib}")
    g.input("h", (n,))
    g.output(g.param("p", (n,)))  # the output is the param itself: no compute, only transfer
    exe = client.compile(g.build())
    data = np.random.default_rng(size_mib).standard_normal(n).astype(np.float32)
    raw = data.tobytes()
    upload: grpc.StreamUnaryMultiCallable[bytes, bytes] = echo.stream_unary("/bench.Echo/Upload")
    download: grpc.UnaryStreamMultiCallable[bytes, bytes] = echo.unary_stream("/bench.Echo/Download")

    def echo_in() -> None:
        upload((raw[o:o + tensors.CHUNK_BYTES] for o in range(0, len(raw), tensors.CHUNK_BYTES)), timeout=600)

    def echo_out() -> None:
        buf = np.empty(len(raw), np.uint8)  # not bytearray: its zeroed pages cost ~0.7 ms/MiB in faults when filled
        offset = 0
        for chunk in download(len(raw).to_bytes(8, "little"), timeout=600):
            buf[offset:offset + len(chunk)] = np.frombuffer(chunk, np.uint8)
            offset += len(chunk)

    def run_out() -> None:
        out = exe.run({})[0]
        assert out.nbytes == len(raw)

    exe.bind_handle("h", data)
    rows = []
    for op, fn, bare_fn in (("SetParams in", lambda: exe.set_param("p", data), echo_in),
                            ("Run output out", run_out, echo_out),
                            ("ReadHandle out", lambda: exe.read_handle("h"), echo_out)):
        ours, bare = interleaved_medians([fn, bare_fn], runs)
        row = {"size_mib": size_mib, "op": op, "mib_per_s": size_mib / ours, "bare_echo_mib_per_s": size_mib / bare,
               "ratio": ours / bare}
        progress(f"  {size_mib:>4} MiB {op:<15} {row['mib_per_s']:8.0f} MiB/s   bare {row['bare_echo_mib_per_s']:8.0f}"
                 f" MiB/s   x{row['ratio']:.2f}")
        rows.append(row)
    exe.release()
    return rows


def active_extent(runs: int) -> dict[str, Any] | None:
    """SmolLM2, every layer, a paged prefill graph of 32 rows holding a 17-token chunk, on a torch executor; None
    where the bundled model is not installed (a GPU machine that runs --cuda alone)."""
    try:
        gguf = resolve_model("smollm2-135m")
    except NotFound as e:
        progress(f"active extent: skipped ({e})")
        return None
    config = open_checkpoint(gguf).config
    assert config is not None
    address = free_address()
    process = spawn([sys.executable, "-m", "graphmesh_executor.server", "--listen", address, "--backend", "torch",
                     "--threads", "1", "--model-root", str(gguf.parent)], address)
    try:
        with ExecutorClient(address, timeout=600) as client:
            layout = models.PagedLayout(seqs=1, blocks=2, block_size=16, pool_blocks=4)
            exe = client.compile(models.build_stage(config, range(config.n_layers), seq_len=32, cache_len=0, first=True,
                                                    last=True, sample=True, paged=layout))
            exe.load_params(gguf.name)
            for i in range(config.n_layers):
                for kind in "kv":
                    exe.bind_handle(f"past_{kind}_{i}", np.zeros((layout.pool_rows, config.kv_dim), np.float32))
            n, pad = 17, np.zeros(15, np.int64)
            inputs = {"input_ids": np.r_[np.arange(100, 100 + n), pad], "positions": np.r_[np.arange(n), pad],
                      "slots": np.r_[np.arange(n) + 16, pad], "token_seq": np.zeros(32, np.int64),
                      "block_table": np.array([[1, 2]]), "last_index": np.array([n - 1]),
                      "temperature": np.zeros(1, np.float32), "top_k": np.zeros(1, np.int64),
                      "top_p": np.ones(1, np.float32), "seed": np.zeros(1, np.int64)}
            whole, cut = exe.run(inputs, typed=True)[0], exe.run(inputs, typed=True, extent=(n, 32))[0]
            assert np.array_equal(whole, cut), (whole, cut)  # the same token either way
            progress(f"active extent: {runs} runs each of 17 rows in a 32-row bucket, SmolLM2 30 layers, torch, 1 thread")
            full_s, cut_s = interleaved_medians([lambda: exe.run(inputs, [0]),
                                                 lambda: exe.run(inputs, [0], extent=(n, 32))], runs)
            exe.release()
    finally:
        process.terminate()
        process.wait(timeout=10)
    return {"rows": n, "bucket": 32, "full_ms": full_s * 1e3, "extent_ms": cut_s * 1e3, "ratio": cut_s / full_s,
            "goal": EXTENT_GOAL}


def _matmul_runs(exe: RemoteExecutable, commit: bool) -> Callable[[], None]:
    """8 Runs of `exe`, or 8 CommitNoWait and a SyncPending, each sending the scalar s."""
    s = {"s": np.ones(1, np.float32)}

    call: Callable[[dict[str, np.ndarray]], object] = exe.commit_no_wait if commit else exe.run

    def calls() -> None:
        for _ in range(8):
            call(s)
        if commit:
            assert exe.sync_pending() == 8
    return calls


def commit_no_wait(runs: int) -> list[dict[str, Any]]:
    """8 CommitNoWait + SyncPending against 8 Runs on a torch executor on cuda:0, y = sum((x * s) @ w), x [n, n]
    bound as a handle so each call sends a scalar."""
    address = free_address()
    process = spawn([sys.executable, "-m", "graphmesh_executor.server", "--listen", address, "--backend", "torch",
                     "--device", "cuda:0"], address)
    rows = []
    try:
        with ExecutorClient(address, timeout=600) as client:
            for n in (1024, 2048, 3072, 4096, 8192):
                g = GraphBuilder(f"matmul_{n}")
                x, w = g.input("x", (n, n)), g.param("w", (n, n))
                g.output(g.sum(g.matmul(g.mul(x, g.input("s", (1,))), w)))
                exe = client.compile(g.build())
                exe.set_param("w", np.full((n, n), 1.0 / n, np.float32))
                exe.bind_handle("x", np.ones((n, n), np.float32), resident=True)
                run_s, commit_s = interleaved_medians([_matmul_runs(exe, False), _matmul_runs(exe, True)], runs,
                                                      warmup=3)
                rows.append({"n": n, "runs_ms": run_s * 1e3, "commits_ms": commit_s * 1e3, "speedup": run_s / commit_s,
                             "goal": COMMIT_GOAL})
                progress(f"  n={n}: 8 Runs {run_s * 1e3:.2f} ms, 8 CommitNoWait + SyncPending {commit_s * 1e3:.2f} ms, "
                         f"x{run_s / commit_s:.2f}")
                exe.release()
    finally:
        process.terminate()
        process.wait(timeout=10)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,16,256", help="transfer sizes in MiB")
    p.add_argument("--runs", type=int, default=5, help="runs per transfer measurement (median)")
    p.add_argument("--rtt-runs", type=int, default=500, help="runs of the round trip (median)")
    p.add_argument("--cuda", action="store_true", help="also CommitNoWait against Run on a torch executor on cuda:0")
    a = args_or_bare_server(p, argv, "bench.Echo", ECHO)
    tune_malloc()
    load = os.getloadavg()  # other processes on a small machine move these numbers: recorded with them
    executor_address, echo_address = free_address(), free_address()
    progress(f"starting executor at {executor_address} and bare echo at {echo_address}; load average {load}")
    processes = [spawn([sys.executable, "-m", "graphmesh_executor.server", "--listen", executor_address, "--backend",
                        "numpy"], executor_address),
                 spawn([sys.executable, __file__, "--bare-server", echo_address], echo_address)]
    try:
        with ExecutorClient(executor_address, timeout=600) as client, grpc.insecure_channel(echo_address,
                                                                                          MESSAGE_OPTIONS) as echo:
            assert client.capabilities().backend == executor_pb2.BACKEND_NUMPY
            rtt = round_trip(client, echo, a.rtt_runs)
            progress(f"  Run {rtt['graphmesh_run_us']:.0f} us   bare echo {rtt['bare_echo_us']:.0f} us   "
                     f"x{rtt['ratio']:.2f}")
            rows = []
            for size in (int(s) for s in a.sizes.split(",")):
                progress(f"transfer {size} MiB: {a.runs} runs each")
                rows += transfer(client, echo, size, a.runs)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)

    extent = active_extent(a.runs)
    commits = commit_no_wait(a.runs) if a.cuda else []

    print(f"\nround trip of a tiny graph (median of {a.rtt_runs}):")
    print(f"  graphmesh Run {rtt['graphmesh_run_us']:7.0f} us | bare grpcio echo {rtt['bare_echo_us']:7.0f} us | "
          f"x{rtt['ratio']:.2f} (goal <= {GOAL})")
    print(f"\ntransfer (median of {a.runs}; MiB/s; ratio = our time / bare echo time, goal <= {GOAL}):")
    print(f"  {'size':>8}  {'op':<15} {'graphmesh':>10} {'bare echo':>10} {'ratio':>6}")
    for r in rows:
        print(f"  {r['size_mib']:>4} MiB  {r['op']:<15} {r['mib_per_s']:>10.0f} {r['bare_echo_mib_per_s']:>10.0f} "
              f"{r['ratio']:>6.2f}")
    if extent is not None:
        print(f"\nactive extent (median of {a.runs}): 17 of 32 rows {extent['extent_ms']:.1f} ms | whole bucket "
              f"{extent['full_ms']:.1f} ms | x{extent['ratio']:.2f} (goal <= {EXTENT_GOAL})")
    for r in commits:
        print(f"CommitNoWait x8 + SyncPending, [{r['n']}, {r['n']}] matmul on cuda:0: {r['commits_ms']:.2f} ms | 8 Runs "
              f"{r['runs_ms']:.2f} ms | x{r['speedup']:.2f} (goal >= {COMMIT_GOAL})")
    write_results("executor.json", {
        "machine": machine(load), "chunk_bytes": tensors.CHUNK_BYTES, "goal_ratio": GOAL,
        "round_trip": {"runs": a.rtt_runs, **rtt}, "transfer": {"runs": a.runs, "rows": rows},
        "active_extent": extent and {"runs": a.runs, **extent}, "commit_no_wait": {"runs": a.runs, "rows": commits}})


if __name__ == "__main__":
    main()
