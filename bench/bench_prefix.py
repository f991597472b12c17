"""Prefix caching on the 2-executor SmolLM2 mesh: time to first token of a 1000-token prompt whose first 900
tokens are in the KV store, against the same-sized prompt cold, in one run.

Each round draws a fresh 900-token prefix (seeded random token ids, so nothing from an earlier round can hit)
and two 100-token suffixes. The cold request (prefix + suffix A) finds nothing stored and computes all 1000
tokens; its committed KV is written behind to the store, and once the store holds those blocks (its stats) the
warm request (prefix + suffix B) seeds the 896 tokens of whole 16-token blocks it shares on both stages and
computes only the rest. GenerateResponse.prefill_computed_tokens confirms what each request computed. A first
round, not counted, compiles the graphs of both shapes. Two store tiers, each on a fresh mesh in the same run: the
kvstore's memory, and Redis (a redis-server/valkey-server started here; the kvstore's memory tier cut to 1 MiB,
so the warm request's blocks come from Redis). Goal (issue 14): warm through Redis >= 5x faster than cold.
Prints a table and writes bench/results/prefix.json.

    .venv/bin/python bench/bench_prefix.py [--rounds 5] [--prefix 900] [--suffix 100] [--tiers memory,redis]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import MIB, machine, median, progress, table, write_results
from graphmesh import security
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.coordinator_client import Chunk, CoordinatorClient
from graphmesh.kvstore_client import KvStoreClient
from graphmesh.launcher import LocalMesh, free_port

MODEL = "smollm2-135m"
EXECUTORS = 2
BLOCK = 16  # the mesh's KV block size (kvkeys.DEFAULT_BLOCK_TOKENS)
GOAL_SPEEDUP = 5.0


@dataclass
class Request:
    ttft_ms: float  # at the client: request sent -> first token received
    server_ttft_ms: float  # the coordinator's own count (GenerateResponse.ttft_ms)
    computed: int  # prefill_computed_tokens


def first_token(client: CoordinatorClient, prompt: list[int]) -> Request:
    """Two tokens, so that the prefill's epoch is committed (folded into the second) and written behind."""
    started = time.perf_counter()
    ttft = 0.0
    chunks: list[Chunk] = []
    for chunk in client.generate(prompt_token_ids=prompt, max_tokens=2, ignore_eos=True):
        if not chunks:
            ttft = (time.perf_counter() - started) * 1e3
        chunks.append(chunk)
    return Request(ttft, chunks[0].ttft_ms, chunks[0].prefill_computed_tokens)


def wait_for_blocks(store: KvStoreClient, blocks: int, timeout_s: float = 120.0) -> float:
    """Waits until the store's local tiers hold `blocks` blocks; returns the seconds waited (the write-behind's lag)."""
    started = time.perf_counter()
    while store.stats().blocks < blocks:
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"the write-behind did not reach {blocks} blocks within {timeout_s:.0f} s")
        time.sleep(0.02)
    return time.perf_counter() - started


def wait_for_entries(server: redis.Redis, entries: int, timeout_s: float = 120.0) -> float:
    """Waits until the shared tier holds `entries` entries (one per layer and block); returns the seconds waited."""
    started = time.perf_counter()
    while int(server.dbsize()) < entries:
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"the write-behind did not reach {entries} Redis entries within {timeout_s:.0f} s")
        time.sleep(0.02)
    return time.perf_counter() - started


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[tuple[str, redis.Redis]]:
    """valkey-server or redis-server (`make redis-server` installs one) on a free loopback port, no persistence."""
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench_prefix: --tiers redis needs valkey-server or redis-server (`make redis-server`)")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru", "--dir", str(directory)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"bench_prefix: {binary} did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", client
    finally:
        process.terminate()
        process.wait(timeout=10)


@dataclass
class Tier:
    cold: list[Request] = field(default_factory=list)
    warm: list[Request] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    stats: Any = None


def measure(tier: str, a: argparse.Namespace, vocab: int) -> Tier:
    """Rounds of a cold then a warm request on a fresh mesh whose store serves hits from `tier`: its memory, or
    Redis behind a memory tier of 1 MiB (about 40 of a prompt's 1,860 per-layer entries), so nearly every
    block a warm request seeds is fetched from Redis."""
    rng = np.random.default_rng(0)
    result = Tier()
    prompt_tokens = a.prefix + a.suffix
    with contextlib.ExitStack() as stack:
        shared: redis.Redis | None = None
        extra: list[str] = []
        if tier == "redis":
            url, shared = stack.enter_context(redis_server(Path(stack.enter_context(tempfile.TemporaryDirectory()))))
            extra = ["--redis-url", url, "--capacity-bytes", "1Mi"]
        t0 = time.perf_counter()
        mesh = stack.enter_context(LocalMesh(EXECUTORS, "torch", MODEL, kvstore=True, extra_kvstore_args=extra))
        client = stack.enter_context(CoordinatorClient(mesh.coordinator_address))
        store = stack.enter_context(KvStoreClient(mesh.kvstore_address, metadata=security.mesh_metadata(mesh.mesh_token)))
        progress(f"{tier}: mesh ready in {time.perf_counter() - t0:.0f} s (logs in {mesh.log_dir})")
        for r in range(a.rounds + 1):
            # token ids above the special tokens; fresh each round, so an earlier round cannot hit
            prefix, suffix_a, suffix_b = (rng.integers(1000, vocab, n).tolist() for n in (a.prefix, a.suffix, a.suffix))
            before = store.stats().blocks if shared is None else int(shared.dbsize())
            c = first_token(client, prefix + suffix_a)
            if shared is None:
                lag = wait_for_blocks(store, before + EXECUTORS * (prompt_tokens // BLOCK))
            else:
                lag = wait_for_entries(shared, before + a.layers * (prompt_tokens // BLOCK))
            w = first_token(client, prefix + suffix_b)
            label = "warm-up" if r == 0 else f"round {r}/{a.rounds}"
            progress(f"{tier:<6} {label:<12} cold TTFT {c.ttft_ms:7.0f} ms ({c.computed} computed)   warm TTFT "
                     f"{w.ttft_ms:6.0f} ms ({w.computed} computed)   x{c.ttft_ms / w.ttft_ms:.1f}   write-behind lag "
                     f"{lag * 1e3:.0f} ms")
            if r:
                result.cold.append(c)
                result.warm.append(w)
                result.lags.append(lag)
        result.stats = store.stats()
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="cold/warm pairs measured (median)")
    p.add_argument("--prefix", type=int, default=900, help="tokens shared by the cold and the warm prompt")
    p.add_argument("--suffix", type=int, default=100, help="tokens after the shared prefix")
    p.add_argument("--tiers", default="memory,redis", help="where warm hits come from: memory, redis (each a fresh mesh)")
    a = p.parse_args(argv)
    load = os.getloadavg()
    config = open_checkpoint(resolve_model(MODEL)).config
    assert config is not None
    a.layers = config.n_layers
    prompt_tokens = a.prefix + a.suffix
    stored = a.prefix // BLOCK * BLOCK  # whole blocks of the shared prefix
    tiers = [t for t in a.tiers.split(",") if t]
    if not set(tiers) <= {"memory", "redis"}:
        raise SystemExit(f"bench_prefix: --tiers takes memory and/or redis, got {a.tiers!r}")
    progress(f"{EXECUTORS}-executor mesh with the KV store ({', '.join(tiers)}); prompts of {prompt_tokens} tokens, "
             f"{a.prefix} shared ({stored} in whole blocks); {a.rounds} rounds after one of warm-up; load average {load}")
    results = {tier: measure(tier, a, config.vocab_size) for tier in tiers}

    rows: list[list[Any]] = []
    out: dict[str, Any] = {}
    # what one warm request seeds: K and V rows of every layer (f32) for the stored tokens, over both stages
    seeded_bytes = stored * config.n_layers * 2 * config.kv_dim * 4
    for tier, t in results.items():
        cold_ms, warm_ms = median([c.ttft_ms for c in t.cold]), median([w.ttft_ms for w in t.warm])
        speedup = cold_ms / warm_ms
        rows += [[tier, "cold (nothing stored)", cold_ms, median([c.server_ttft_ms for c in t.cold]),
                  median([float(c.computed) for c in t.cold]), 1.0, ""],
                 [tier, f"warm ({a.prefix} tokens stored)", warm_ms, median([w.server_ttft_ms for w in t.warm]),
                  median([float(w.computed) for w in t.warm]), speedup,
                  f"{'met' if speedup >= GOAL_SPEEDUP else 'MISSED'}"]]
        st = t.stats
        out[tier] = {
            "cold_ttft_ms": cold_ms, "warm_ttft_ms": warm_ms, "speedup": speedup, "goal_met": speedup >= GOAL_SPEEDUP,
            "cold_computed_tokens": [c.computed for c in t.cold], "warm_computed_tokens": [w.computed for w in t.warm],
            "runs": {"cold": [vars(c) for c in t.cold], "warm": [vars(w) for w in t.warm]},
            "write_behind_lag_ms": [lag * 1e3 for lag in t.lags],
            "kvstore": {"blocks": st.blocks, "memory_bytes": st.memory_bytes, "hit_ratio": st.hit_ratio,
                        "seed_bytes_per_s": st.seed_bytes_per_s, "evictions": st.evictions,
                        "shared_hit_blocks": st.shared_hit_blocks, "shared_errors": st.shared_errors}}
    print(f"\nTTFT of a {prompt_tokens}-token prompt on the {EXECUTORS}-executor SmolLM2 mesh (torch, f32), median of "
          f"{a.rounds} rounds; load average at start {load[0]:.2f} on {os.cpu_count()} cores:")
    print(table(["store tier", "request", "TTFT ms (client)", "TTFT ms (coordinator)", "prefill tokens computed",
                 "speed-up", f"goal >= {GOAL_SPEEDUP:.0f}x"], rows))
    for tier, t in results.items():
        st = t.stats
        print(f"{tier}: {st.blocks} blocks in the local tiers ({st.memory_bytes / MIB:.0f} MiB), {st.shared_hit_blocks} "
              f"entries served from Redis, hit ratio {st.hit_ratio:.2f}, seed throughput {st.seed_bytes_per_s / MIB:.0f} "
              f"MiB/s, write-behind lag after a cold request {median(t.lags) * 1e3:.0f} ms (median); a warm request "
              f"seeds {seeded_bytes / MIB:.1f} MiB")
    write_results("prefix.json", {
        "machine": machine(load, note="the load average is part of the result"),
        "model": MODEL, "backend": "torch", "weights": "f32", "executors": EXECUTORS, "block_tokens": BLOCK,
        "prompt_tokens": prompt_tokens, "shared_prefix_tokens": a.prefix, "stored_prefix_tokens": stored,
        "rounds": a.rounds, "goal_speedup": GOAL_SPEEDUP, "warm_seeded_bytes": seeded_bytes, "tiers": out})


if __name__ == "__main__":
    main(sys.argv[1:])
