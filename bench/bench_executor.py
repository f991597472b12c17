"""Executor overhead against bare grpcio: round trip of a tiny graph, and tensor transfer in and out.

Both servers run as separate processes on loopback, started by this script: a numpy executor and a
bare grpcio echo server (generic handlers on raw bytes, no protobuf work) with the same message
limits and the same 1 MiB chunking. Prints a table and writes bench/results/executor.json.

    .venv/bin/python bench/bench_executor.py [--sizes 1,16,256] [--runs 5] [--rtt-runs 500]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import MIB, OPTIONS, free_address, interleaved_medians, machine, progress, spawn, write_results
from graphmesh import ExecutorClient, GraphBuilder, tensors
from graphmesh.v1 import executor_pb2, tensor_pb2
from graphmesh_executor.server import tune_malloc

GOAL = 1.3


# -- the bare echo server ---------------------------------------------------------------------------------
def _echo_upload(chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    return sum(len(c) for c in chunks).to_bytes(8, "little")


def _echo_download(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    total = int.from_bytes(request, "little")
    data = bytes(total)
    for offset in range(0, total, tensors.CHUNK_BYTES):
        yield data[offset:offset + tensors.CHUNK_BYTES]


def serve_echo(address: str) -> None:
    tune_malloc()  # the same process tuning as the executor, so the ratio compares code, not allocators
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Upload": grpc.stream_unary_rpc_method_handler(_echo_upload),
        "Download": grpc.unary_stream_rpc_method_handler(_echo_download),
    })])
    server.add_insecure_port(address)
    server.start()
    server.wait_for_termination()


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,16,256", help="transfer sizes in MiB")
    p.add_argument("--runs", type=int, default=5, help="runs per transfer measurement (median)")
    p.add_argument("--rtt-runs", type=int, default=500, help="runs of the round trip (median)")
    p.add_argument("--echo-server", metavar="ADDRESS", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.echo_server:
        serve_echo(a.echo_server)
        return
    tune_malloc()
    load = os.getloadavg()  # other processes on a small machine move these numbers: recorded with them
    executor_address, echo_address = free_address(), free_address()
    progress(f"starting executor at {executor_address} and bare echo at {echo_address}; load average {load}")
    processes = [spawn([sys.executable, "-m", "graphmesh_executor.server", "--listen", executor_address, "--backend",
                        "numpy"], executor_address),
                 spawn([sys.executable, __file__, "--echo-server", echo_address], echo_address)]
    try:
        with ExecutorClient(executor_address, timeout=600) as client, grpc.insecure_channel(echo_address,
                                                                                          OPTIONS) as echo:
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

    print(f"\nround trip of a tiny graph (median of {a.rtt_runs}):")
    print(f"  graphmesh Run {rtt['graphmesh_run_us']:7.0f} us | bare grpcio echo {rtt['bare_echo_us']:7.0f} us | "
          f"x{rtt['ratio']:.2f} (goal <= {GOAL})")
    print(f"\ntransfer (median of {a.runs}; MiB/s; ratio = our time / bare echo time, goal <= {GOAL}):")
    print(f"  {'size':>8}  {'op':<15} {'graphmesh':>10} {'bare echo':>10} {'ratio':>6}")
    for r in rows:
        print(f"  {r['size_mib']:>4} MiB  {r['op']:<15} {r['mib_per_s']:>10.0f} {r['bare_echo_mib_per_s']:>10.0f} "
              f"{r['ratio']:>6.2f}")
    write_results("executor.json", {
        "machine": machine(load), "chunk_bytes": tensors.CHUNK_BYTES, "goal_ratio": GOAL,
        "round_trip": {"runs": a.rtt_runs, **rtt}, "transfer": {"runs": a.runs, "rows": rows}})


if __name__ == "__main__":
    main()
