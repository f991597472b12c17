"""Serving under load: N concurrent streams against graphmesh meshes of 1, 2 and 3 torch executors and against
vLLM's CPU build (the peer, in a venv of its own under build/peers/, see bench/peers.py), SmolLM2-135M-Instruct
f32 on both. Per run: aggregate tokens/s (every generated token over the wall time from the requests leaving to
the last token arriving), time to first token p50/p99 and inter-token latency p50/p99 over all the streams.

Every engine gets the same prompt as token ids (the chat-templated question, as in bench_mesh.py), so both see
the same number of prompt tokens (checked: vLLM echoes the ids it got, the coordinator reports them), greedy,
`max_tokens` tokens each with end-of-sequence ignored so every stream generates them all. Nothing reuses a
prompt's KV between streams: the meshes run without a KV store, vLLM without prefix caching, so each stream pays
its prefill. Both are f32 and greedy, so their tokens should agree: each engine's are checked against vLLM's
(same_tokens_as_peer). Inter-token latency is the gap between streamed chunks, as vLLM's own serving benchmark measures
it (a chunk is one token on both engines at these settings; tokens per chunk are recorded to show it).

Threads: each mesh's executors split the cores between them as LocalMesh does (2 cores: 2, 1+1, and 1+1+1,
LocalMesh's floor of one thread an executor); vLLM binds its OpenMP threads to every core, its best setting on a
machine of its own (--vllm-bind tries another: its API server and engine-core processes need CPU time too, and
on a loaded machine a team of 2 spinning threads waits on whichever one another process holds). Every engine is up for
the whole run and the runs interleave (each repeat goes through every concurrency on every engine), so load from
other processes hits all alike; the table shows medians over the repeats. The load average at the start and
the end is recorded: on a shared small machine it is part of the result.

    .venv/bin/python bench/bench_serving.py [--repeats 3] [--concurrency 1,4,8,16,32] [--meshes 1,2,3]
        [--tokens 64] [--no-peer | --peer-only] [--vllm-bind 0-1] [--quick]

--quick: 1 repeat, concurrency 1 and 4, 16 tokens, for a smoke test of the harness (not figures).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import machine, median, progress, table, write_results
from bench.peers import VLLM, VllmServer, ensure_hf_model
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from graphmesh.tokenizer import Tokenizer

MODEL = "smollm2-135m"
QUESTION = "Explain in one paragraph why the sky is blue."  # bench_mesh.py's: the two benchmarks' prompts match
PEER = "vLLM"
CONCURRENCY = "1,4,8,16,32"
QUICK_CONCURRENCY = "1,4"
QUICK_TOKENS = 16
SCALING = (16, 1)  # the speedup reported: aggregate tokens/s of 16 streams over 1 stream
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Stream:
    """One request: when it left, when each chunk arrived (perf_counter seconds), the tokens in each."""

    started: float
    arrivals: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = -1  # as the engine saw them; -1: it did not say

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.started

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.arrivals)]


# A stream of `tokens` tokens for `prompt` (token ids), blocking until its last token.
Target = Callable[[list[int], int], Stream]


# -- the clients ----------------------------------------------------------------------------------------------
def _sse_events(reply: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent-events stream, up to its `[DONE]`."""
    for raw in reply:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def vllm_target(server: VllmServer) -> Target:
    host, port = server.address.rsplit(":", 1)
    model = str(server.model)  # vLLM names the served model after the path it was given

    def generate(prompt: list[int], tokens: int) -> Stream:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
                           "ignore_eos": True, "stream": True, "return_token_ids": True,
                           "stream_options": {"include_usage": True}}).encode()
        # a connection per stream, as N independent clients would have: one shared connection would serialize them
        connection = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
        try:
            stream = Stream(time.perf_counter())
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            reply = connection.getresponse()
            if reply.status != 200:
                raise RuntimeError(f"vLLM answered {reply.status}: {reply.read()[:500]!r}")
            for event in _sse_events(reply):
                now = time.perf_counter()
                for choice in event.get("choices") or []:
                    if choice.get("prompt_token_ids"):  # the first chunk echoes the prompt
                        stream.prompt_tokens = len(choice["prompt_token_ids"])
                    ids = choice.get("token_ids") or []
                    if ids:  # a closing chunk with only the finish reason carries no token
                        stream.arrivals.append(now)
                        stream.chunk_tokens.append(len(ids))
                        stream.token_ids += ids
                usage = event.get("usage")
                if usage and stream.prompt_tokens < 0:
                    stream.prompt_tokens = int(usage["prompt_tokens"])
        finally:
            connection.close()
        return stream

    return generate


def mesh_target(mesh: LocalMesh) -> Target:
    # one client for every stream: a gRPC channel multiplexes concurrent calls, as one frontend's would
    client = CoordinatorClient(mesh.coordinator_address, timeout=REQUEST_TIMEOUT_S)

    def generate(prompt: list[int], tokens: int) -> Stream:
        stream = Stream(time.perf_counter())
        for chunk in client.generate(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=True, temperature=0.0):
            if chunk.prompt_token_ids:
                stream.prompt_tokens = len(chunk.prompt_token_ids)
            if chunk.token_ids:
                stream.arrivals.append(time.perf_counter())
                stream.chunk_tokens.append(len(chunk.token_ids))
                stream.token_ids += chunk.token_ids
        return stream

    return generate


# -- one run --------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@dataclass
class Load:
    """One run of `streams` concurrent streams; latencies in ms."""

    streams: int
    tokens_per_s: float
    wall_s: float
    tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tokens_per_chunk: float
    prompt_tokens: list[int]  # distinct prompt lengths the engine reported
    first_stream_tokens: list[int]  # token ids of one stream, to compare the engines' outputs


def run_load(target: Target, prompt: list[int], streams: int, tokens: int) -> Load:
    """`streams` requests released together by a barrier, each on a thread of its own."""
    barrier = threading.Barrier(streams + 1)

    def one(_: int) -> Stream:
        barrier.wait()
        return target(prompt, tokens)

    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(one, i) for i in range(streams)]
        barrier.wait()
        started = time.perf_counter()
        runs = [f.result() for f in futures]
    for r in runs:
        if r.tokens != tokens:  # ignore_eos not honoured, or a stream cut short: its numbers would mislead
            raise RuntimeError(f"a stream generated {r.tokens} tokens, not {tokens}")
    wall = max(r.arrivals[-1] for r in runs) - started
    total = sum(r.tokens for r in runs)
    ttft = [r.ttft_s * 1e3 for r in runs]
    gaps = [g * 1e3 for r in runs for g in r.gaps_s]
    return Load(streams, total / wall, wall, total, percentile(ttft, 50), percentile(ttft, 99),
                percentile(gaps, 50), percentile(gaps, 99), total / sum(len(r.arrivals) for r in runs),
                sorted({r.prompt_tokens for r in runs}), runs[0].token_ids)


# -- the benchmark ----------------------------------------------------------------------------------------------
def mesh_name(n: int, decode_steps: int = 1) -> str:
    runs = f", runs of {decode_steps}" if decode_steps > 1 else ""
    return f"graphmesh, {n} executor{'s' if n > 1 else ''}{runs}"


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each (engine, concurrency), interleaved; median (default 3)")
    p.add_argument("--concurrency", default=None, help=f"concurrent stream counts (default {CONCURRENCY})")
    p.add_argument("--meshes", default="1,2,3", help="executor counts of the graphmesh meshes")
    p.add_argument("--decode-steps", default="1", help="the meshes' --decode-steps (the coordinator's longest decode "
                   "run); several values: a mesh of each size for each")
    p.add_argument("--tokens", type=int, default=None, help="tokens generated per stream (default 64)")
    p.add_argument("--quick", action="store_true", help=f"smoke test: 1 repeat, concurrency {QUICK_CONCURRENCY}, "
                   f"{QUICK_TOKENS} tokens (flags given explicitly still win)")
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--no-peer", action="store_true", help="graphmesh only: no vLLM venv, no vLLM server")
    peer.add_argument("--peer-only", action="store_true", help="vLLM only: no mesh")
    p.add_argument("--vllm-bind", default="", help="cores vLLM's OpenMP threads are bound to, as "
                   "VLLM_CPU_OMP_THREADS_BIND takes them (default: every core, e.g. 0-1)")
    p.add_argument("--output", default=None, help="results file under bench/results/ (default serving.json; "
                   "--quick: serving-quick.json, so that a smoke test never stands in for the figures)")
    a = p.parse_args(argv)
    repeats = a.repeats or (1 if a.quick else 3)
    concurrency = ints(a.concurrency or (QUICK_CONCURRENCY if a.quick else CONCURRENCY))
    tokens = a.tokens or (QUICK_TOKENS if a.quick else 64)
    sizes = [] if a.peer_only else ints(a.meshes)
    if not sizes and a.no_peer:
        p.error("nothing to measure: no meshes and no peer")
    load = os.getloadavg()
    cpus = os.cpu_count() or 1

    path = resolve_model(MODEL)
    tokenizer = Tokenizer.from_checkpoint(open_checkpoint(path))
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))
    progress(f"SmolLM2 {path.name}; prompt of {len(prompt)} tokens, {tokens} tokens per stream, concurrency "
             f"{concurrency}, {repeats} repeat(s); {cpus} cores; load average {load}")

    targets: dict[str, Target] = {}
    threads: dict[str, str] = {}
    meshes: list[LocalMesh] = []
    server: VllmServer | None = None
    loads: dict[str, dict[int, list[Load]]] = {}
    try:
        if not a.no_peer:
            # the model directory is made here, with the product venv's transformers, which reads the GGUF
            bind = a.vllm_bind or f"0-{cpus - 1}"
            server = VllmServer(ensure_hf_model(path), threads_bind=bind,
                                extra_args=["--no-enable-prefix-caching"]).start()
            targets[PEER], threads[PEER] = vllm_target(server), f"bound to {bind}"
        for n, d in itertools.product(sizes, ints(a.decode_steps)):
            t0 = time.perf_counter()
            meshes.append(LocalMesh(n, "torch", MODEL, kvstore=False,
                                    extra_coordinator_args=("--decode-steps", str(d))).start())
            targets[mesh_name(n, d)] = mesh_target(meshes[-1])
            threads[mesh_name(n, d)] = "+".join([str(max(1, cpus // n))] * n)  # LocalMesh's split of the cores
            progress(f"{mesh_name(n, d)} ready in {time.perf_counter() - t0:.0f} s (logs in {meshes[-1].log_dir})")

        for name, target in targets.items():
            # every batch shape the runs will use is compiled or traced once before any run counts
            for k in concurrency:
                progress(f"warm-up: {name}, {k} stream(s)")
                run_load(target, prompt, k, tokens)
        loads = {name: {k: [] for k in concurrency} for name in targets}
        for r in range(repeats):
            for k in concurrency:
                for name, target in targets.items():
                    result = run_load(target, prompt, k, tokens)
                    loads[name][k].append(result)
                    progress(f"repeat {r + 1}/{repeats}  {k:>2} streams  {name:<24} {result.tokens_per_s:7.1f} tok/s  "
                             f"TTFT p50 {result.ttft_p50_ms:7.1f} ms  ITL p50 {result.itl_p50_ms:6.1f} ms  "
                             f"(load {os.getloadavg()[0]:.2f})")
    finally:
        for mesh in meshes:
            mesh.stop()
        if server is not None:
            server.stop()

    report(a, prompt, tokens, repeats, concurrency, cpus, load, threads, loads)


def report(a: argparse.Namespace, prompt: list[int], tokens: int, repeats: int, concurrency: list[int], cpus: int,
           load: tuple[float, float, float], threads: dict[str, str], loads: dict[str, dict[int, list[Load]]]) -> None:
    metrics = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_chunk")
    medians = {name: {k: {m: median([getattr(run, m) for run in runs]) for m in metrics} for k, runs in by_k.items()}
               for name, by_k in loads.items()}
    peer = medians.get(PEER)
    reference = loads[PEER][concurrency[0]][0].first_stream_tokens if PEER in loads else None

    rows: list[list[Any]] = []
    for k in concurrency:
        for name in loads:
            m = medians[name][k]
            ratio = m["tokens_per_s"] / peer[k]["tokens_per_s"] if peer and name != PEER else float("nan")
            rows.append([k, name, threads[name], m["tokens_per_s"], ratio, m["ttft_p50_ms"], m["ttft_p99_ms"],
                         m["itl_p50_ms"], m["itl_p99_ms"]])
    print(f"\nSmolLM2-135M-Instruct f32, prompt {len(prompt)} tokens, {tokens} generated per stream, greedy, EOS "
          f"ignored (median of {repeats} interleaved repeat(s); load average at start {load[0]:.2f}, now "
          f"{os.getloadavg()[0]:.2f}, on {cpus} cores):")
    print(table(["streams", "engine", "threads", "tok/s", f"x {PEER}", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                 "ITL p99 ms"], rows))

    many, one = SCALING
    if many not in concurrency or one not in concurrency:  # a narrower matrix: its widest over its narrowest
        many, one = max(concurrency), min(concurrency)
    scaling = {name: medians[name][many]["tokens_per_s"] / medians[name][one]["tokens_per_s"] for name in loads}
    print(f"\naggregate tok/s of {many} streams over {one}:")
    for name, value in scaling.items():
        print(f"  {name:<24} {value:.2f}")

    engines: dict[str, Any] = {}
    for name, by_k in loads.items():
        prompt_seen = sorted({n for runs in by_k.values() for run in runs for n in run.prompt_tokens})
        same = None if reference is None else all(
            run.first_stream_tokens == reference for runs in by_k.values() for run in runs)
        engines[name] = {
            "threads": threads[name], "prompt_tokens_seen": prompt_seen,
            "same_tokens_as_peer": same,
            "concurrency": {str(k): {**medians[name][k],
                                     "tokens_per_s_vs_peer": (medians[name][k]["tokens_per_s"] /
                                                              peer[k]["tokens_per_s"]) if peer and name != PEER
                                     else None,
                                     "runs": [{key: v for key, v in asdict(run).items() if key != "first_stream_tokens"}
                                              for run in runs]}
                            for k, runs in by_k.items()},
            f"speedup_{many}_vs_{one}_streams": scaling[name]}
        if prompt_seen not in ([len(prompt)], [-1]):
            progress(f"WARNING: {name} saw prompts of {prompt_seen} tokens, not {len(prompt)}")
    write_results(a.output or ("serving-quick.json" if a.quick else "serving.json"), {
        "machine": machine(load, note="a 2-core machine shared with other work: the load average is part of the "
                           "result" if cpus <= 2 else ""),
        "model": MODEL, "weights": "f32", "question": QUESTION, "prompt_tokens": len(prompt),
        "tokens_per_stream": tokens, "repeats": repeats, "quick": a.quick, "concurrency": concurrency,
        "peer": {"name": PEER, "package": VLLM, "prefix_caching": False} if PEER in loads else None,
        "graphmesh": {"backend": "torch", "kvstore": False},
        "itl": "gap between streamed chunks", "scaling": {"streams": many, "over": one},
        "engines": engines})


if __name__ == "__main__":
    main(sys.argv[1:])
