"""The GPU issue's acceptance run: in f32 on CUDA, each of N concurrent streams is token-identical to its solo run,
greedy and seeded-sampled alike, with 1 and with 2 executors on the device, and again when one executor of 2 is
killed (kill -9) in the middle of the batched run. CI has no GPU; this runs on the lent one and its JSON is
committed under bench/results/.

    python bench/gpu_acceptance.py --shape tinyllama --streams 128 --tokens 32
    python bench/gpu_acceptance.py --shape small --device cpu --streams 8 --tokens 8   # a dry run on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.bench_gpu import SMALL, TINYLLAMA, make_model
from bench.common import RESULTS_DIR, machine, progress
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from graphmesh_server import faults

SHAPES = {"small": SMALL, "tinyllama": TINYLLAMA}


def generate(address: str, prompt: list[int], tokens: int, seed: int, started: threading.Event | None = None
             ) -> list[int]:
    """Even seeds decode greedily, odd ones sample at temperature 0.8 with that seed."""
    ids: list[int] = []
    with CoordinatorClient(address) as client:
        for chunk in client.generate(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=True,
                                     temperature=0.8 if seed % 2 else 0.0, seed=seed):
            ids += list(chunk.token_ids)
            if started is not None:
                started.set()
    return ids


def batched(address: str, prompts: list[list[int]], tokens: int, fault: Any = None) -> list[list[int]]:
    """Every prompt at once; `fault` runs once the first tokens have arrived, while the others still decode."""
    started = threading.Event()
    with ThreadPoolExecutor(len(prompts)) as pool:
        runs = [pool.submit(generate, address, p, tokens, i, started) for i, p in enumerate(prompts)]
        if fault is not None:
            started.wait(600)
            time.sleep(0.05)
            fault()
        return [r.result() for r in runs]


def incarnation(address: str) -> int:
    with CoordinatorClient(address) as client:
        return int(client.status().incarnation)


def differing(got: list[list[int]], solo: list[list[int]]) -> list[dict[str, int]]:
    """The streams whose tokens are not their solo run's: index (odd: sampled) and the first position that differs."""
    return [{"stream": i, "first_difference": next((j for j, (x, y) in enumerate(zip(g, s)) if x != y),
                                                  min(len(g), len(s)))}
            for i, (g, s) in enumerate(zip(got, solo)) if g != s]


def check(a: argparse.Namespace, model: str, executors: int, prompts: list[list[int]]) -> dict[str, Any]:
    mesh = LocalMesh(executors, "torch", model, kvstore=False, startup_timeout_s=900,
                     extra_executor_args=["--device", a.device, "--kv-cache-bytes", a.kv_cache_bytes],
                     extra_coordinator_args=["--dtype", "f32", "--steps-in-flight", str(a.steps_in_flight)])
    with mesh:
        address = mesh.coordinator_address
        progress(f"== {executors} executor(s): warm-up")
        batched(address, prompts, a.tokens)
        progress(f"== {executors} executor(s): {len(prompts)} solo runs")
        solo = [generate(address, p, a.tokens, i) for i, p in enumerate(prompts)]
        progress(f"== {executors} executor(s): {len(prompts)} streams at once")
        together = batched(address, prompts, a.tokens)
        result: dict[str, Any] = {"executors": executors, "streams": len(prompts),
                                  "identical": sum(x == y for x, y in zip(together, solo)),
                                  "differing": differing(together, solo)}
        if executors > 1:
            progress(f"== {executors} executors: {len(prompts)} streams at once, kill -9 of executor 1 meanwhile")
            before = incarnation(address)
            killed = batched(address, prompts, a.tokens, lambda: faults.kill9(mesh.executor_processes[1]))
            result["identical_after_kill"] = sum(x == y for x, y in zip(killed, solo))
            result["differing_after_kill"] = differing(killed, solo)
            result["recoveries_during_kill_run"] = incarnation(address) - before
    progress(f"   {result}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tinyllama", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--executors", default="1,2")
    p.add_argument("--kv-cache-bytes", default="8Gi")
    p.add_argument("--steps-in-flight", type=int, default=0, help="the coordinator's --steps-in-flight (0: its default)")
    p.add_argument("--out", default=str(RESULTS_DIR / "gpu_acceptance.json"))
    a = p.parse_args()
    load = os.getloadavg()
    shape = SHAPES[a.shape]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, shape["vocab_size"], a.prompt_tokens).tolist() for _ in range(a.streams)]
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"== writing a random {a.shape} Llama to {tmp}")
        make_model(shape, a.device if a.device.startswith("cuda") else "cpu", Path(tmp))
        rows = [check(a, tmp, int(n), prompts) for n in a.executors.split(",")]
    for row in rows:
        print(f"{row['executors']} executor(s): {row['identical']}/{row['streams']} streams identical to solo"
              + (f"; after kill -9: {row['identical_after_kill']}/{row['streams']}, "
                 f"{row['recoveries_during_kill_run']} recoveries" if "identical_after_kill" in row else ""))
    out = {"benchmark": "gpu_acceptance", "machine": machine(load), "shape": a.shape, "dtype": "f32", "device": a.device,
           "tokens_per_stream": a.tokens, "prompt_tokens": a.prompt_tokens, "rows": rows,
           "sampling": "even streams greedy, odd ones temperature 0.8 seeded by their index"}
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    progress(f"== wrote {a.out}")


if __name__ == "__main__":
    main()
