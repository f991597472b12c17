"""Prefix caching on the 2-executor SmolLM2 mesh: time to first token of a 1000-token prompt whose first 900
tokens are in the KV store, against the same-sized prompt cold, in one run.

Each round draws a fresh 900-token prefix (seeded random token ids, so nothing from an earlier round can hit)
and two 100-token suffixes. The cold request (prefix + suffix A) finds nothing stored and computes all 1000
tokens; its committed KV is written behind to the store, and once the store holds those blocks (its stats) the
warm request (prefix + suffix B) seeds the 896 tokens of whole 16-token blocks it shares on both stages and
computes only the rest. GenerateResponse.prefill_computed_tokens confirms what each request computed. A first
round, not counted, compiles the graphs of both shapes. Prints a table and writes bench/results/prefix.json.

    .venv/bin/python bench/bench_prefix.py [--rounds 5] [--prefix 900] [--suffix 100]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import MIB, machine, median, progress, table, write_results
from graphmesh import security
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.coordinator_client import Chunk, CoordinatorClient
from graphmesh.kvstore_client import KvStoreClient
from graphmesh.launcher import LocalMesh

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
    """Waits until the store holds `blocks` blocks; returns the seconds waited (the write-behind's lag)."""
    started = time.perf_counter()
    while store.stats().blocks < blocks:
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError(f"the write-behind did not reach {blocks} blocks within {timeout_s:.0f} s")
        time.sleep(0.02)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="cold/warm pairs measured (median)")
    p.add_argument("--prefix", type=int, default=900, help="tokens shared by the cold and the warm prompt")
    p.add_argument("--suffix", type=int, default=100, help="tokens after the shared prefix")
    a = p.parse_args(argv)
    load = os.getloadavg()
    config = open_checkpoint(resolve_model(MODEL)).config
    assert config is not None
    rng = np.random.default_rng(0)
    prompt_tokens = a.prefix + a.suffix
    stored = a.prefix // BLOCK * BLOCK  # whole blocks of the shared prefix
    progress(f"{EXECUTORS}-executor mesh with the KV store; prompts of {prompt_tokens} tokens, {a.prefix} shared "
             f"({stored} in whole blocks); {a.rounds} rounds after one of warm-up; load average {load}")
    cold: list[Request] = []
    warm: list[Request] = []
    lags: list[float] = []
    t0 = time.perf_counter()
    with LocalMesh(EXECUTORS, "torch", MODEL, kvstore=True) as mesh, \
            CoordinatorClient(mesh.coordinator_address) as client, \
            KvStoreClient(mesh.kvstore_address, metadata=security.mesh_metadata(mesh.mesh_token)) as store:
        progress(f"mesh ready in {time.perf_counter() - t0:.0f} s (logs in {mesh.log_dir})")
        for r in range(a.rounds + 1):
            # token ids above the special tokens; fresh each round, so an earlier round cannot hit
            prefix, suffix_a, suffix_b = (rng.integers(1000, config.vocab_size, n).tolist()
                                          for n in (a.prefix, a.suffix, a.suffix))
            blocks = store.stats().blocks
            c = first_token(client, prefix + suffix_a)
            lag = wait_for_blocks(store, blocks + EXECUTORS * (prompt_tokens // BLOCK))
            w = first_token(client, prefix + suffix_b)
            label = "warm-up" if r == 0 else f"round {r}/{a.rounds}"
            progress(f"{label:<12} cold TTFT {c.ttft_ms:7.0f} ms ({c.computed} computed)   warm TTFT {w.ttft_ms:6.0f} ms "
                     f"({w.computed} computed)   x{c.ttft_ms / w.ttft_ms:.1f}   write-behind lag {lag * 1e3:.0f} ms")
            if r:
                cold.append(c)
                warm.append(w)
                lags.append(lag)
        stats = store.stats()

    cold_ms, warm_ms = median([c.ttft_ms for c in cold]), median([w.ttft_ms for w in warm])
    speedup = cold_ms / warm_ms
    rows: list[list[Any]] = [
        ["cold (nothing stored)", median([c.ttft_ms for c in cold]), median([c.server_ttft_ms for c in cold]),
         median([float(c.computed) for c in cold]), 1.0],
        [f"warm ({a.prefix} tokens stored)", warm_ms, median([w.server_ttft_ms for w in warm]),
         median([float(w.computed) for w in warm]), speedup]]
    print(f"\nTTFT of a {prompt_tokens}-token prompt on the {EXECUTORS}-executor SmolLM2 mesh (torch, f32), median of "
          f"{a.rounds} rounds; load average at start {load[0]:.2f} on {os.cpu_count()} cores:")
    print(table(["request", "TTFT ms (client)", "TTFT ms (coordinator)", "prefill tokens computed", "speed-up"], rows))
    print(f"\ngoal: warm >= {GOAL_SPEEDUP:.0f}x faster than cold: {speedup:.1f}x, "
          f"{'met' if speedup >= GOAL_SPEEDUP else 'MISSED'}")
    # what one warm request seeds: K and V rows of every layer (f32) for the stored tokens, over both stages
    seeded_bytes = stored * config.n_layers * 2 * config.kv_dim * 4
    seed_ms = seeded_bytes / stats.seed_bytes_per_s * 1e3 if stats.seed_bytes_per_s else float("nan")
    print(f"KV store: {stats.blocks} blocks, {stats.memory_bytes / MIB:.0f} MiB in memory, hit ratio {stats.hit_ratio:.2f}, "
          f"seed throughput {stats.seed_bytes_per_s / MIB:.0f} MiB/s; write-behind lag after a cold request "
          f"{median(lags) * 1e3:.0f} ms (median)")
    print(f"a warm request seeds {seeded_bytes / MIB:.1f} MiB: about {seed_ms:.0f} ms of its TTFT at the store's mean seed "
          f"throughput; the rest is the {median([float(w.computed) for w in warm]):.0f}-token prefill (attending to "
          f"{prompt_tokens} rows), the lookups and the protocol")
    write_results("prefix.json", {
        "machine": machine(load, note="a 2-core machine shared with other helpers' work: the load average is part "
                           "of the result"),
        "model": MODEL, "backend": "torch", "weights": "f32", "executors": EXECUTORS, "block_tokens": BLOCK,
        "prompt_tokens": prompt_tokens, "shared_prefix_tokens": a.prefix, "stored_prefix_tokens": stored,
        "rounds": a.rounds, "goal_speedup": GOAL_SPEEDUP,
        "cold_ttft_ms": cold_ms, "warm_ttft_ms": warm_ms, "speedup": speedup, "goal_met": speedup >= GOAL_SPEEDUP,
        "cold_computed_tokens": [c.computed for c in cold], "warm_computed_tokens": [w.computed for w in warm],
        "runs": {"cold": [vars(c) for c in cold], "warm": [vars(w) for w in warm]},
        "write_behind_lag_ms": [lag * 1e3 for lag in lags],
        "warm_seeded_bytes": seeded_bytes, "warm_seed_ms_estimate": seed_ms,
        "kvstore": {"blocks": stats.blocks, "memory_bytes": stats.memory_bytes, "hit_ratio": stats.hit_ratio,
                    "seed_bytes_per_s": stats.seed_bytes_per_s, "evictions": stats.evictions}})


if __name__ == "__main__":
    main(sys.argv[1:])
