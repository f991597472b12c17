"""The coordinator's CPU seconds per 1,000 generated tokens at 1, 64 and 256 concurrent streams (issue 37 item 4).

A proxy, on a CPU host, for "the coordinator is never the bottleneck at 256 streams" on a GPU: the mesh is one
torch executor serving a tiny random Llama with a byte-level tokenizer (tests/model_fixtures.py: the executor's
compute is cheap, and the coordinator detokenizes every token as for a real model), and the coordinator schedules
with the GPU defaults unless told otherwise (256 rows a step, 2,048 step tokens, decode runs of 32: what a step of
256 rows takes on a GPU), so that its steps are shaped as on the H100 at 256 streams. N streams of M tokens each go
through the real gRPC Generate stream at once (or, with --multiplexed, all over one GenerateStreams stream, as a
front end sends them; with --frontend, through a graphmesh-frontend, whose CPU is read too; with --http, as
streamed /v1/completions of the OpenAI API, a client thread each: the front end's with both; with --kserve, as KServe
ModelStreamInfer text requests, a stream each, tritonclient's way: the front end's with --frontend), and the coordinator's
user + system CPU time (/proc/PID/stat) is read before and after: CPU time, not wall time, so other load on a
shared machine hardly moves it. A warm-up burst first takes the one-off costs (first
use of each batch shape, imports) out of the figures. Prints a table; writes bench/results/coordinator_cpu.json
(or NAME) with --write.

    .venv/bin/python bench/bench_coordinator_cpu.py [--streams 1,64,256] [--tokens 128] [--rounds 1]
        [--coordinator-args "--max-step-seqs 64"] [--multiplexed | --frontend] [--http | --kserve] [--py-spy FILE]
        [--write [NAME]]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` and `tests` importable

from bench.bench_openai import http_target
from bench.common import (
    cpu_by_process,
    generate_multiplexed,
    generate_streams,
    machine,
    median,
    metrics,
    progress,
    py_spy,
    table,
    write_results,
)
from graphmesh.kserve import grpc_service_pb2 as kserve_pb2
from graphmesh.kserve import grpc_service_pb2_grpc as kserve_grpc
from graphmesh.launcher import LocalMesh, free_port
from graphmesh.v1 import coordinator_pb2
from tests.model_fixtures import VOCAB, make_tiny_llama, write_tiny_tokenizer

GPU_SCHEDULE = "--max-step-seqs 256 --max-step-tokens 2048 --decode-steps 32"  # the CUDA defaults' at 256 rows
PROMPT_TOKENS = 8


def prompt(i: int) -> list[int]:
    """A distinct prompt per stream: no two share a KV prefix."""
    return [(3 + 7 * i + 13 * j) % (VOCAB - 3) + 3 for j in range(PROMPT_TOKENS)]


async def burst(address: str, streams: int, tokens: int, multiplexed: bool = False) -> int:
    """Runs `streams` Generate calls at once, each a stream of its own or all over one GenerateStreams stream;
    returns the tokens they received (each must get all of its)."""
    run = generate_multiplexed if multiplexed else generate_streams
    runs = await run(address, [coordinator_pb2.GenerateRequest(
        prompt_token_ids=prompt(i), max_tokens=tokens, ignore_eos=True) for i in range(streams)])
    got = [len(r["ids"]) for r in runs]
    if any(n != tokens for n in got):
        raise RuntimeError(f"streams ended short: {sorted(set(got))} tokens of {tokens}")
    return sum(got)


def http_burst(base_url: str, model: str, streams: int, tokens: int) -> int:
    """The same burst as streamed /v1/completions, a client thread and connection each."""
    generate = http_target(base_url, model=model)
    with ThreadPoolExecutor(streams) as pool:
        got = list(pool.map(lambda i: generate(prompt(i), tokens).tokens, range(streams)))
    if any(n != tokens for n in got):
        raise RuntimeError(f"streams ended short: {sorted(set(got))} tokens of {tokens}")
    return sum(got)


async def kserve_burst(address: str, model: str, streams: int, tokens: int) -> int:
    """The same burst as KServe ModelStreamInfer text requests (raw prompts, a stream each); every one must end for
    its length, so each generated `tokens` tokens."""
    async def one(stub: Any, i: int) -> str:
        request = kserve_pb2.ModelInferRequest(model_name=model, inputs=[kserve_pb2.ModelInferRequest.InferInputTensor(
            name="text_input", datatype="BYTES", shape=[1], contents=kserve_pb2.InferTensorContents(
                bytes_contents=[f"stream {i}:".encode()]))], parameters={
            "max_tokens": kserve_pb2.InferParameter(int64_param=tokens),
            "ignore_eos": kserve_pb2.InferParameter(bool_param=True), "raw": kserve_pb2.InferParameter(bool_param=True)})
        finish = ""
        async for response in stub.ModelStreamInfer(iter([request]), timeout=600):
            if response.error_message:
                raise RuntimeError(response.error_message)
            if "finish_reason" in response.infer_response.parameters:
                finish = response.infer_response.parameters["finish_reason"].string_param
        return finish

    async with grpc.aio.insecure_channel(address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        finishes = await asyncio.gather(*(one(stub, i) for i in range(streams)))
    if set(finishes) != {"length"}:
        raise RuntimeError(f"streams ended short: {sorted(set(finishes))}")
    return streams * tokens


def steps(metrics_port: int) -> float:
    """The coordinator's graphmesh_steps counter."""
    return metrics(metrics_port)[("graphmesh_steps_total", "")]


def measure(mesh: LocalMesh, streams: int, tokens: int, multiplexed: bool = False, model: str = "",
            kserve: bool = False) -> dict[str, Any]:
    """One burst; over the OpenAI API, or KServe with `kserve`, when `model` (the name it serves) is given."""
    port = mesh.metrics_ports["coordinator"]
    cpu0, steps0, t0 = cpu_by_process(mesh), steps(port), time.perf_counter()
    if kserve:
        got = asyncio.run(kserve_burst(mesh.client_address, model, streams, tokens))
    elif model:
        got = http_burst(mesh.http_url, model, streams, tokens)
    else:
        got = asyncio.run(burst(mesh.client_address, streams, tokens, multiplexed))
    wall = time.perf_counter() - t0
    used = {k: v - cpu0[k] for k, v in cpu_by_process(mesh).items()}
    cpu, front_cpu, n_steps = used["coordinator"], used.get("frontend", 0.0), steps(port) - steps0
    # cores: how busy the coordinator was (1.0 is one core, where the GIL caps a process's Python); wall time
    # itself depends on the machine's other load and is only recorded
    return {"streams": streams, "tokens": got, "steps": n_steps, "cpu_s": cpu, "wall_s": wall, "cores": cpu / wall,
            "cpu_ms_per_token": cpu * 1e3 / got, "cpu_ms_per_step": cpu * 1e3 / n_steps if n_steps else float("nan"),
            "frontend_cpu_ms_per_token": front_cpu * 1e3 / got}


def profile(mesh: LocalMesh, path: str) -> subprocess.Popen[bytes]:
    """py-spy sampling the coordinator's thread that holds the GIL (collapsed stacks) until interrupted."""
    assert mesh.coordinator_process is not None
    return py_spy(mesh.coordinator_process.pid, path, "--gil", "--rate", "100")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="1,64,256", help="concurrent streams per level, comma-separated")
    p.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    p.add_argument("--rounds", type=int, default=1, help="bursts per level (the table shows medians)")
    p.add_argument("--coordinator-args", default=GPU_SCHEDULE,
                   help=f"extra coordinator flags (default: the GPU schedule, {GPU_SCHEDULE!r}; '' for the CPU one)")
    p.add_argument("--py-spy", default="", metavar="FILE",
                   help="also profile the coordinator with py-spy during the largest level (collapsed stacks)")
    p.add_argument("--multiplexed", action="store_true",
                   help="each level's calls over one GenerateStreams stream (a front end's), not a stream each")
    p.add_argument("--frontend", action="store_true",
                   help="the streams call a graphmesh-frontend, which relays them to the coordinator over one stream")
    p.add_argument("--http", action="store_true",
                   help="the streams are streamed /v1/completions of the OpenAI API (the front end's with --frontend)")
    p.add_argument("--kserve", action="store_true",
                   help="the streams are KServe ModelStreamInfer text requests (the front end's with --frontend)")
    p.add_argument("--write", default="", nargs="?", const="coordinator_cpu.json", metavar="NAME",
                   help="write bench/results/NAME (default coordinator_cpu.json)")
    a = p.parse_args()
    levels = [int(n) for n in a.streams.split(",")]
    load = os.getloadavg()
    # with a tokenizer: the coordinator detokenizes every token, as it does for any real model
    model = write_tiny_tokenizer(make_tiny_llama(Path(tempfile.mkdtemp(prefix="graphmesh-bench-")) / "llama"))
    rows: list[dict[str, Any]] = []
    if a.http and a.kserve:
        p.error("--http and --kserve are two ways of sending the streams: choose one")
    served = str(model) if a.http or a.kserve else ""
    with LocalMesh(1, "torch", str(model), kvstore=False, metrics=True, frontend=a.frontend,
                   http_listen=f"127.0.0.1:{free_port()}" if a.http else "",
                   extra_coordinator_args=shlex.split(a.coordinator_args)) as mesh:
        progress("warm-up")
        measure(mesh, max(levels), 4, a.multiplexed, served, a.kserve)
        for streams in levels:
            spy = profile(mesh, a.py_spy) if a.py_spy and streams == max(levels) else None
            runs = [measure(mesh, streams, a.tokens, a.multiplexed, served, a.kserve) for _ in range(a.rounds)]
            if spy is not None:
                spy.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
                spy.wait()
            row = {k: median([r[k] for r in runs]) for k in ("tokens", "steps", "cpu_s", "cores", "cpu_ms_per_token",
                                                             "cpu_ms_per_step", "frontend_cpu_ms_per_token")}
            rows.append({"streams": streams, **row, "rounds": runs})
            progress(f"  {streams} streams: {row['cpu_ms_per_token']:.3f} CPU-ms/token")
    print(table(["streams", "tokens", "steps", "coordinator CPU s", "cores busy", "CPU-ms / 1k tokens",
                 "CPU-ms / step", "front end CPU-ms / 1k tokens"],
                [[r["streams"], int(r["tokens"]), int(r["steps"]), r["cpu_s"], r["cores"], r["cpu_ms_per_token"] * 1e3,
                  r["cpu_ms_per_step"], r["frontend_cpu_ms_per_token"] * 1e3] for r in rows]))
    if a.write:
        write_results(a.write, {"machine": machine(load), "tokens_per_stream": a.tokens, "multiplexed": a.multiplexed,
                                "frontend": a.frontend, "http": a.http, "kserve": a.kserve,
                                "coordinator_args": a.coordinator_args, "levels": rows})


if __name__ == "__main__":
    main()
