"""Serving under load: N concurrent streams against graphmesh meshes of 1, 2 and 3 torch executors and against
the peers, each in a venv of its own under build/peers/ (see bench/peers.py): vLLM's CPU build (SmolLM2-135M-
Instruct f32, dequantized from the bundled GGUF) and, with --peers vllm,llamacpp, llama.cpp (llama-cpp-python's
server, built from source for this CPU, serving the GGUF as stored: Q4_1). The meshes run packed weights, the
coordinator's default, unless --weights says otherwise (f32, packed, packed-bf16; several: a mesh of each size for
each, named by it). Per
run: aggregate tokens/s (every generated token over the wall time from the requests leaving to the last token
arriving), time to first token p50/p99 and inter-token latency p50/p99 over all the streams.

Every engine gets the same prompt (the chat-templated question, as in bench_mesh.py), greedy, `max_tokens`
tokens each with end-of-sequence ignored so every stream generates them all. vLLM and the meshes get it as token
ids and report the prompt they saw (vLLM echoes the ids, the coordinator reports them). llama.cpp's server takes
prompts as text only, so it gets the prompt's text, checked once to tokenize back to the very same ids
(/extras/tokenize); it has no ignore_eos either, so its requests ban every end-of-generation token through
logit_bias (-1e30), and every stream must end by length; it streams text, not ids, so its token ids are its
text encoded again with the GGUF's tokenizer (same_text_as_peer compares the text itself). Nothing reuses a
prompt's KV between streams on the meshes (no KV store) or on vLLM (no prefix caching), so each stream pays its
prefill, unless --prefix-reuse runs each as its defaults do (the meshes with a KV store, as graphmesh up starts
them; vLLM with prefix caching); llama.cpp's server runs one request at a time and always reuses the previous
request's KV for a shared prefix (no switch for either: recorded, not worked around; see LlamaCppServer). The f32
meshes and vLLM are both f32 and greedy, so their tokens should agree: each engine's are checked against vLLM's
(same_tokens_as_peer; a mismatch of an f32 mesh is warned about), and against llama.cpp's when it ran
(same_tokens_as_llamacpp); the packed meshes and llama.cpp run 4-bit weights with other arithmetic and may differ,
which is recorded.
Inter-token latency is the gap between streamed chunks, as vLLM's own serving benchmark measures it (a chunk is
one token on every engine at these settings; tokens per chunk are recorded to show it).

Threads: each mesh's executors split the cores between them as LocalMesh does (2 cores: 2, 1+1, and 1+1+1,
LocalMesh's floor of one thread an executor); vLLM binds its OpenMP threads to every core, its best setting on a
machine of its own (--vllm-bind tries another: its API server and engine-core processes need CPU time too, and
on a loaded machine a team of 2 spinning threads waits on whichever one another process holds); llama.cpp runs
its OpenMP team on every core too (--llamacpp-threads tries fewer), and is as exposed. Every engine is up for
the whole run and the runs interleave (each repeat goes through every concurrency on every engine), so load from
other processes hits all alike; the table shows medians over the repeats. The load average at the start and
the end is recorded: on a shared small machine it is part of the result.

    .venv/bin/python bench/bench_serving.py [--repeats 3] [--concurrency 1,4,8,16,32] [--meshes 1,2,3]
        [--weights f32[,packed,packed-bf16]] [--tokens 64] [--peers vllm[,llamacpp]] [--no-peer | --peer-only]
        [--vllm-bind 0-1] [--llamacpp-threads 2] [--prefix-reuse] [--quick]

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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import machine, median, progress, table, write_results
from bench.peers import LLAMACPP, PEER_NAMES, VLLM, LlamaCppServer, VllmServer, ensure_hf_model, llamacpp_recipe
from graphmesh import models
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from graphmesh.tokenizer import Tokenizer

MODEL = "smollm2-135m"
QUESTION = "Explain in one paragraph why the sky is blue."  # bench_mesh.py's: the two benchmarks' prompts match
PEER = "vLLM"  # the reference: ratios and token checks are against it
LLAMA = "llama.cpp"
WEIGHTS = tuple(models.WEIGHTS)  # the coordinator's --weights
EOG_BIAS = -1e30  # llama.cpp adds it to the banned tokens' logits: -inf in effect, and valid JSON
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
    finish_reason: str = ""

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    def arrived(self, at: float, token_ids: Sequence[int]) -> None:
        """A chunk of these tokens arrived at `at` (perf_counter seconds)."""
        self.arrivals.append(at)
        self.chunk_tokens.append(len(token_ids))
        self.token_ids += token_ids

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


def _completion_events(address: str, body: bytes, engine: str) -> Iterator[tuple[float, dict[str, Any]]]:
    """POSTs a streamed /v1/completions request and yields each event with the time it arrived. A connection per
    stream, as N independent clients would have: one shared connection would serialize them."""
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"{engine} answered {reply.status}: {reply.read()[:500]!r}")
        for event in _sse_events(reply):
            yield time.perf_counter(), event
    finally:
        connection.close()


def vllm_target(server: VllmServer) -> Target:
    model = str(server.model)  # vLLM names the served model after the path it was given

    def generate(prompt: list[int], tokens: int) -> Stream:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
                           "ignore_eos": True, "stream": True, "return_token_ids": True,
                           "stream_options": {"include_usage": True}}).encode()
        stream = Stream(time.perf_counter())
        for now, event in _completion_events(server.address, body, "vLLM"):
            for choice in event.get("choices") or []:
                if choice.get("prompt_token_ids"):  # the first chunk echoes the prompt
                    stream.prompt_tokens = len(choice["prompt_token_ids"])
                ids = choice.get("token_ids") or []
                if ids:  # a closing chunk with only the finish reason carries no token
                    stream.arrived(now, ids)
            usage = event.get("usage")
            if usage and stream.prompt_tokens < 0:
                stream.prompt_tokens = int(usage["prompt_tokens"])
        return stream

    return generate


def llamacpp_target(server: LlamaCppServer, prompt_text: str, prompt_ids: list[int],
                    encode: Callable[[str], list[int]]) -> Target:
    """llama-cpp-python's /v1/completions: the prompt as text (its request type takes no token ids), checked
    here to tokenize to `prompt_ids`; greedy (temperature 0; its default repeat_penalty of 1.1 would bend greedy, so
    1.0); its end-of-generation tokens banned through logit_bias, the one way its API has to make a stream run
    to max_tokens (its min_tokens bans the GGUF's EOS alone, and SmolLM2 has two such tokens). Unlike vLLM's
    ignore_eos, which lets the model emit EOS and goes on, a banned token is never emitted: where greedy would
    pick one, the tokens diverge from there (recorded by the token checks, not hidden). Chunks carry text:
    each non-empty one is a token (the server holds a token back only while it ends inside a UTF-8 character),
    and the token ids are the whole text encoded again (`encode`, the GGUF's tokenizer)."""
    seen = server.tokenize(prompt_text)
    if seen != prompt_ids:
        raise RuntimeError(f"llama.cpp tokenizes the prompt's text to {len(seen)} ids, not the {len(prompt_ids)} "
                           f"the other engines get: {seen[:12]}... vs {prompt_ids[:12]}...")
    bias = {str(t): EOG_BIAS for t in server.eog_ids}

    def generate(prompt: list[int], tokens: int) -> Stream:
        if prompt != prompt_ids:
            raise ValueError("the llama.cpp target was made for another prompt")
        body = json.dumps({"prompt": prompt_text, "max_tokens": tokens, "temperature": 0.0, "repeat_penalty": 1.0,
                           "logit_bias": bias, "stream": True}).encode()
        text: list[str] = []
        stream = Stream(time.perf_counter(), prompt_tokens=len(seen))
        for now, event in _completion_events(server.address, body, "llama.cpp"):
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    stream.arrivals.append(now)
                    stream.chunk_tokens.append(1)
                    text.append(choice["text"])
                stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
        if stream.finish_reason != "length":
            raise RuntimeError(f"a llama.cpp stream ended by {stream.finish_reason or 'nothing'!r} after "
                               f"{stream.tokens} tokens, not by length: the end-of-generation ban did not hold")
        stream.token_ids = encode("".join(text))
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
                stream.arrived(time.perf_counter(), chunk.token_ids)
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
def mesh_name(n: int, decode_steps: int = 1, weights: str = "f32", pinned: bool = True) -> str:
    runs = f", runs of {decode_steps}" if decode_steps > 1 else ""
    return (f"graphmesh, {n} executor{'s' if n > 1 else ''}{runs}{'' if weights == 'f32' else f', {weights}'}"
            f"{'' if pinned or n == 1 else ', unpinned'}")


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def names(text: str, allowed: tuple[str, ...], what: str, p: argparse.ArgumentParser) -> list[str]:
    values = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if unknown := [v for v in values if v not in allowed]:
        p.error(f"unknown {what} {unknown}: choose from {', '.join(allowed)}")
    return values


def llamacpp_n_ctx(streams: int, prompt: int, tokens: int) -> int:
    """Room for every concurrent stream's prompt and tokens at once, rounded up to llama.cpp's 256-cell pad."""
    return -(-streams * (prompt + tokens) // 256) * 256


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each (engine, concurrency), interleaved; median (default 3)")
    p.add_argument("--concurrency", default=None, help=f"concurrent stream counts (default {CONCURRENCY})")
    p.add_argument("--meshes", default="1,2,3", help="executor counts of the graphmesh meshes")
    p.add_argument("--decode-steps", default="1", help="the meshes' --decode-steps (the coordinator's longest decode "
                   "run); several values: a mesh of each size for each")
    p.add_argument("--coordinator-args", default="", help="more flags for the meshes' coordinators, e.g. "
                   "'--steps-in-flight 3'")
    p.add_argument("--prefix-reuse", action="store_true", help="every engine reuses a prompt's KV as its defaults do: "
                   "the meshes with a KV store (as graphmesh up starts them), vLLM with prefix caching; llama.cpp "
                   "always does")
    p.add_argument("--tokens", type=int, default=None, help="tokens generated per stream (default 64)")
    p.add_argument("--quick", action="store_true", help=f"smoke test: 1 repeat, concurrency {QUICK_CONCURRENCY}, "
                   f"{QUICK_TOKENS} tokens (flags given explicitly still win)")
    p.add_argument("--pin", default="on", help="on, off or on,off: whether the executors of a mesh run on cores of "
                   "their own (LocalMesh.pin_cores, the default); both: each mesh of several executors both ways")
    p.add_argument("--weights", default="packed", help=f"the meshes' weight formats, a comma list of "
                   f"{', '.join(WEIGHTS)} (default packed, the coordinator's); several: a mesh of each size for each")
    p.add_argument("--peers", default=None, help=f"the peers, a comma list of {', '.join(PEER_NAMES)} "
                   "(default vllm); ratios and token checks are against vLLM, and against llama.cpp when it runs")
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--no-peer", action="store_true", help="graphmesh only: no peer venv, no peer server")
    peer.add_argument("--peer-only", action="store_true", help="the peers only: no mesh")
    p.add_argument("--vllm-bind", default="", help="cores vLLM's OpenMP threads are bound to, as "
                   "VLLM_CPU_OMP_THREADS_BIND takes them (default: every core, e.g. 0-1)")
    p.add_argument("--llamacpp-threads", type=int, default=0, help="llama.cpp's --n_threads and --n_threads_batch "
                   "(default: every core; on a loaded machine its OpenMP team waits on whichever thread another "
                   "process holds, as vLLM's does)")
    p.add_argument("--output", default=None, help="results file under bench/results/ (default serving.json; "
                   "--quick: serving-quick.json, so that a smoke test never stands in for the figures)")
    a = p.parse_args(argv)
    repeats = a.repeats or (1 if a.quick else 3)
    concurrency = ints(a.concurrency or (QUICK_CONCURRENCY if a.quick else CONCURRENCY))
    tokens = a.tokens or (QUICK_TOKENS if a.quick else 64)
    sizes = [] if a.peer_only else ints(a.meshes)
    weights = names(a.weights, WEIGHTS, "weight format(s)", p)
    pins = [v == "on" for v in names(a.pin, ("on", "off"), "--pin value(s)", p)]
    if a.no_peer and a.peers is not None:
        p.error("--no-peer and --peers contradict each other")
    peers = [] if a.no_peer else names(a.peers or "vllm", PEER_NAMES, "peer(s)", p)
    if not sizes and not peers:
        p.error("nothing to measure: no meshes and no peer")
    if not weights:
        p.error("no weight format for the meshes")
    load = os.getloadavg()
    cpus = os.cpu_count() or 1

    path = resolve_model(MODEL)
    tokenizer = Tokenizer.from_checkpoint(open_checkpoint(path))
    prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    prompt = tokenizer.encode(prompt_text)
    progress(f"SmolLM2 {path.name}; prompt of {len(prompt)} tokens, {tokens} tokens per stream, concurrency "
             f"{concurrency}, {repeats} repeat(s); {cpus} cores; load average {load}")

    targets: dict[str, Target] = {}
    threads: dict[str, str] = {}
    engine_weights: dict[str, str] = {}
    meshes: list[LocalMesh] = []
    server: VllmServer | None = None
    llama: LlamaCppServer | None = None
    loads: dict[str, dict[int, list[Load]]] = {}
    try:
        if "vllm" in peers:
            # the model directory is made here, with the product venv's transformers, which reads the GGUF
            bind = a.vllm_bind or f"0-{cpus - 1}"
            server = VllmServer(ensure_hf_model(path), threads_bind=bind,
                                extra_args=[] if a.prefix_reuse else ["--no-enable-prefix-caching"]).start()
            targets[PEER], threads[PEER], engine_weights[PEER] = vllm_target(server), f"bound to {bind}", "f32"
        if "llamacpp" in peers:
            llama = LlamaCppServer(path, n_threads=a.llamacpp_threads or cpus,
                                   n_ctx=llamacpp_n_ctx(max(concurrency), len(prompt), tokens)).start()
            targets[LLAMA] = llamacpp_target(llama, prompt_text, prompt, tokenizer.encode)
            threads[LLAMA], engine_weights[LLAMA] = f"{llama.threads}", "Q4_1 (GGUF)"
        for n, d, w, pin in itertools.product(sizes, ints(a.decode_steps), weights, pins):
            if n == 1 and not pin and True in pins:
                continue  # one executor has every core either way
            t0 = time.perf_counter()
            name = mesh_name(n, d, w, pin)
            meshes.append(LocalMesh(n, "torch", MODEL, weights=w, kvstore=a.prefix_reuse, pin_cores=pin,
                                    extra_coordinator_args=("--decode-steps", str(d),
                                                            *a.coordinator_args.split())).start())
            targets[name], engine_weights[name] = mesh_target(meshes[-1]), w
            threads[name] = "+".join([str(max(1, cpus // n))] * n)  # LocalMesh's split of the cores
            progress(f"{name} ready in {time.perf_counter() - t0:.0f} s (logs in {meshes[-1].log_dir})")

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
                    progress(f"repeat {r + 1}/{repeats}  {k:>2} streams  {name:<32} {result.tokens_per_s:7.1f} tok/s  "
                             f"TTFT p50 {result.ttft_p50_ms:7.1f} ms  ITL p50 {result.itl_p50_ms:6.1f} ms  "
                             f"(load {os.getloadavg()[0]:.2f})")
    finally:
        for mesh in meshes:
            mesh.stop()
        if server is not None:
            server.stop()
        if llama is not None:
            llama.stop()

    report(a, prompt, tokens, repeats, concurrency, cpus, load, threads, engine_weights, loads, tokenizer.decode,
           llama)


def report(a: argparse.Namespace, prompt: list[int], tokens: int, repeats: int, concurrency: list[int], cpus: int,
           load: tuple[float, float, float], threads: dict[str, str], weights: dict[str, str],
           loads: dict[str, dict[int, list[Load]]], decode: Callable[[list[int]], str],
           llama: LlamaCppServer | None) -> None:
    metrics = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_chunk")
    medians = {name: {k: {m: median([getattr(run, m) for run in runs]) for m in metrics} for k, runs in by_k.items()}
               for name, by_k in loads.items()}
    # the ratio columns: against vLLM as before, and against llama.cpp when it ran
    against = [peer for peer in (PEER, LLAMA) if peer in loads] or [PEER]

    def ratio(name: str, k: int, peer: str) -> float:
        if peer not in medians or name == peer:
            return float("nan")
        return medians[name][k]["tokens_per_s"] / medians[peer][k]["tokens_per_s"]

    rows: list[list[Any]] = []
    for k in concurrency:
        for name in loads:
            m = medians[name][k]
            rows.append([k, name, weights[name], threads[name], m["tokens_per_s"],
                         *[ratio(name, k, peer) for peer in against], m["ttft_p50_ms"], m["ttft_p99_ms"],
                         m["itl_p50_ms"], m["itl_p99_ms"]])
    print(f"\nSmolLM2-135M-Instruct, prompt {len(prompt)} tokens, {tokens} generated per stream, greedy, EOS "
          f"ignored (median of {repeats} interleaved repeat(s); load average at start {load[0]:.2f}, now "
          f"{os.getloadavg()[0]:.2f}, on {cpus} cores):")
    print(table(["streams", "engine", "weights", "threads", "tok/s", *[f"x {peer}" for peer in against],
                 "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"], rows))

    many, one = SCALING
    if many not in concurrency or one not in concurrency:  # a narrower matrix: its widest over its narrowest
        many, one = max(concurrency), min(concurrency)
    scaling = {name: medians[name][many]["tokens_per_s"] / medians[name][one]["tokens_per_s"] for name in loads}
    print(f"\naggregate tok/s of {many} streams over {one}:")
    for name, value in scaling.items():
        print(f"  {name:<32} {value:.2f}")

    # token checks: one stream of each run against the first run's of each peer
    references = {peer: loads[peer][concurrency[0]][0].first_stream_tokens for peer in (PEER, LLAMA) if peer in loads}

    def same_tokens(by_k: dict[int, list[Load]], peer: str) -> bool | None:
        if peer not in references:
            return None
        return all(run.first_stream_tokens == references[peer] for runs in by_k.values() for run in runs)

    def same_text(by_k: dict[int, list[Load]], peer: str) -> bool | None:
        if peer not in references:
            return None
        text = decode(references[peer])
        return all(decode(run.first_stream_tokens) == text for runs in by_k.values() for run in runs)

    checks = {name: {"same_tokens_as_peer": same_tokens(by_k, PEER), "same_text_as_peer": same_text(by_k, PEER),
                     **({"same_tokens_as_llamacpp": same_tokens(by_k, LLAMA)} if LLAMA in references else {})}
              for name, by_k in loads.items()}
    if references:
        print(f"\nsame tokens as {' / '.join(references)} (every run's first stream):")
        for name, check in checks.items():
            verdicts = [check["same_tokens_as_peer"]] if PEER in references else []
            verdicts += [check["same_tokens_as_llamacpp"]] if LLAMA in references else []
            print(f"  {name:<32} {' / '.join('yes' if v else 'no' for v in verdicts)}")

    engines: dict[str, Any] = {}
    for name, by_k in loads.items():
        prompt_seen = sorted({n for runs in by_k.values() for run in runs for n in run.prompt_tokens})
        engines[name] = {
            "threads": threads[name], "weights": weights[name], "prompt_tokens_seen": prompt_seen, **checks[name],
            "first_stream_text": decode(by_k[concurrency[0]][0].first_stream_tokens),
            "concurrency": {str(k): {**medians[name][k],
                                     "tokens_per_s_vs_peer": None if PEER not in medians or name == PEER
                                     else ratio(name, k, PEER),
                                     **({"tokens_per_s_vs_llamacpp": None if name == LLAMA else ratio(name, k, LLAMA)}
                                        if LLAMA in medians else {}),
                                     "runs": [{key: v for key, v in asdict(run).items() if key != "first_stream_tokens"}
                                              for run in runs]}
                            for k, runs in by_k.items()},
            f"speedup_{many}_vs_{one}_streams": scaling[name]}
        if prompt_seen not in ([len(prompt)], [-1]):
            progress(f"WARNING: {name} saw prompts of {prompt_seen} tokens, not {len(prompt)}")
        if weights[name] == "f32" and name != PEER and checks[name]["same_tokens_as_peer"] is False:
            progress(f"WARNING: {name} runs f32 weights but its tokens differ from vLLM's (f32 too, greedy)")
    peers: dict[str, Any] = {}
    if PEER in loads:
        peers[PEER] = {"package": VLLM, "weights": "f32, dequantized from the GGUF", "prefix_caching": a.prefix_reuse,
                       "prompt": "token ids", "ignore_eos": True}
    if LLAMA in loads and llama is not None:
        peers[LLAMA] = {
            "package": LLAMACPP, "cmake_args": llamacpp_recipe()["CMAKE_ARGS"],
            "cpu_flags_used": llamacpp_recipe()["cpu_flags_used"], "weights": "Q4_1, the GGUF as stored",
            "n_threads": llama.threads, "n_ctx": llama.n_ctx, "interrupt_requests": False, "logits_all": False,
            "requests": "one at a time: the server's lock around its one context; concurrent streams queue",
            "prefix_reuse": "always: the previous request's KV for a shared prefix (no switch)",
            "prompt": "text, checked to tokenize to the same ids", "token_ids": "the streamed text encoded again",
            "ignore_eos": f"not in its API: logit_bias {EOG_BIAS:g} on its end-of-generation tokens {llama.eog_ids}"}
    write_results(a.output or ("serving-quick.json" if a.quick else "serving.json"), {
        "machine": machine(load, note="a 2-core machine shared with other work: the load average is part of the "
                           "result" if cpus <= 2 else ""),
        "model": MODEL, "weights": sorted({weights[name] for name in loads if name not in (PEER, LLAMA)}),
        "question": QUESTION, "prompt_tokens": len(prompt),
        "tokens_per_stream": tokens, "repeats": repeats, "quick": a.quick, "concurrency": concurrency,
        "peer": {"name": PEER, "package": VLLM, "prefix_caching": a.prefix_reuse} if PEER in loads else None,
        "peers": peers,
        "graphmesh": {"backend": "torch", "kvstore": a.prefix_reuse},
        "itl": "gap between streamed chunks", "scaling": {"streams": many, "over": one},
        "engines": engines})


if __name__ == "__main__":
    main(sys.argv[1:])
