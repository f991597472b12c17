"""Serving on a GPU through the real mesh: a random-weight Llama of TinyLlama-1.1B's shape, bf16, over 2 torch
executors on one CUDA device and a coordinator, driven by concurrent CoordinatorClient streams (ignore_eos).

Per concurrency: aggregate tokens/s, TTFT and inter-token latency (p50/p99; the gap between streamed chunks, each
chunk the tokens that were ready together), and the recoveries the mesh went through meanwhile (the incarnation
must not move: concurrency must never look like a failure). Each stream's greedy tokens are compared with the same
prompt decoded alone (bf16 batched GEMMs may round differently from a batch of one, so this is reported, not
asserted). Writes bench/results/gpu_mesh.json (or --out).

--transports links,grpc runs the whole table once per way boundaries travel between the executors, one mesh
after the other in the same run: over boundary links (the default) and over PushBoundary calls (executors
started with --boundary-link-port off), the peer the links are measured against.

--mps off,on runs it again with NVIDIA's Multi-Process Service (a daemon the benchmark starts and stops): without
it the two executors' CUDA contexts take the GPU in turns; with it their kernels run side by side.

    python bench/bench_gpu_mesh.py                                # on a machine with a GPU
    python bench/bench_gpu_mesh.py --small --device cpu --concurrency 1,4   # a dry run on a tiny model
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.bench_gpu import SMALL, TINYLLAMA, make_model
from bench.common import RESULTS_DIR, machine, median, progress, table
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh


def stream(address: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    with CoordinatorClient(address) as client:
        t0 = time.perf_counter()
        stamps, ids = [], []
        for chunk in client.generate(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=True):
            stamps.append(time.perf_counter())
            ids += list(chunk.token_ids)
    # the gaps between chunks, as vLLM's serving benchmark measures them: tokens that came together are one chunk
    return {"ttft": stamps[0] - t0, "gaps": np.diff(stamps).tolist(), "ids": ids, "start": t0, "end": stamps[-1],
            "chunks": len(stamps)}


def run_level(address: str, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    barrier = threading.Barrier(len(prompts))

    def one(prompt: list[int]) -> dict[str, Any]:
        barrier.wait()
        return stream(address, prompt, tokens)
    with ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(one, prompts))
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    gaps = [g for r in runs for g in r["gaps"]]
    ttfts = [r["ttft"] for r in runs]
    return {"tok_s": sum(len(r["ids"]) for r in runs) / wall, "ttft_p50_ms": 1e3 * float(np.percentile(ttfts, 50)),
            "ttft_p99_ms": 1e3 * float(np.percentile(ttfts, 99)),
            "itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)) if gaps else 0.0,
            "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)) if gaps else 0.0, "ids": [r["ids"] for r in runs],
            "tokens_per_chunk": sum(len(r["ids"]) for r in runs) / sum(r["chunks"] for r in runs)}


def run_mesh(a: argparse.Namespace, model: str, transport: str, levels: list[int],
             prompts: list[list[int]], label: str) -> dict[str, Any]:
    """Every concurrency level through one mesh whose executors pass boundaries over `transport`."""
    link_args = [] if transport == "links" else ["--boundary-link-port", "off"]
    mesh = LocalMesh(a.executors, "torch", model, kvstore=False, startup_timeout_s=600,
                     extra_executor_args=["--device", a.device, "--kv-cache-bytes", a.kv_cache_bytes, *link_args],
                     extra_coordinator_args=["--dtype", a.dtype, "--max-step-tokens", "2048",
                                             "--steps-in-flight", str(a.steps_in_flight),
                                             "--decode-steps", str(a.decode_steps)])
    with mesh:
        address = mesh.coordinator_address
        with CoordinatorClient(address) as client:
            before = client.status().incarnation
        # As long as the measured streams: the KV block-table buckets (1, 2, 4 ... blocks per sequence) grow with
        # the sessions, and each new one compiles and captures on the step that first needs it.
        progress(f"== {label}: warm-up (compiles and captures every batch and block-table bucket once)")
        for n in levels:
            run_level(address, prompts[:n], a.tokens)
        solo = [stream(address, prompts[i], a.tokens)["ids"] for i in range(min(4, max(levels)))]
        rows: list[dict[str, Any]] = []
        for n in levels:
            reps = []
            for r in range(a.repeats):
                progress(f"== {label}: {n} streams, repeat {r + 1}/{a.repeats}")
                reps.append(run_level(address, prompts[:n], a.tokens))
            same = sum(ids == solo[i] for rep in reps for i, ids in enumerate(rep["ids"][:len(solo)]))
            rows.append({"streams": n, **{k: median([x[k] for x in reps]) for k in
                                          ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                           "tokens_per_chunk")},
                         "same_as_solo": f"{same}/{sum(min(n, len(solo)) for _ in reps)}"})
        with CoordinatorClient(address) as client:
            after = client.status().incarnation
    one = float(rows[0]["tok_s"]) if rows and rows[0]["streams"] == 1 else 0.0
    for row in rows:
        row["vs_one_stream"] = float(row["tok_s"]) / one if one else 0.0
    return {"recoveries": after - before, "rows": rows}


@contextlib.contextmanager
def mps_daemon(on: bool) -> Iterator[None]:
    """NVIDIA's Multi-Process Service for the processes started inside (they find it through the environment)."""
    if not on:
        yield
        return
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise SystemExit("--mps on needs nvidia-cuda-mps-control on PATH")
    with tempfile.TemporaryDirectory(prefix="mps-") as where:
        env = {"CUDA_MPS_PIPE_DIRECTORY": f"{where}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{where}/log"}
        for d in env.values():
            os.makedirs(d)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        subprocess.run([control, "-d"], check=True)
        try:
            yield
        finally:
            subprocess.run([control], input=b"quit\n", check=False)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--small", action="store_true", help="a tiny model (dry run)")
    p.add_argument("--concurrency", default="1,4,8,16,32,64")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--executors", type=int, default=2)
    p.add_argument("--kv-cache-bytes", default="8Gi")
    p.add_argument("--dtype", default="bf16", help="stage dtype; f32 shows batched == solo tokens without bf16 rounding")
    p.add_argument("--steps-in-flight", type=int, default=0, help="the coordinator's --steps-in-flight (0: one per stage)")
    p.add_argument("--decode-steps", type=int, default=0,
                   help="the coordinator's --decode-steps (longest decode run; 0: its default for the devices)")
    p.add_argument("--transports", default="links",
                   help="comma-separated: links (boundary links, the default) and/or grpc (PushBoundary calls)")
    p.add_argument("--mps", default="off", help="comma-separated: off and/or on (NVIDIA MPS for the executors)")
    p.add_argument("--out", default=str(RESULTS_DIR / "gpu_mesh.json"))
    a = p.parse_args()
    levels = [int(x) for x in a.concurrency.split(",")]
    load = os.getloadavg()
    shape = SMALL if a.small else TINYLLAMA
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, shape["vocab_size"], a.prompt_tokens).tolist() for _ in range(max(levels))]
    transports = a.transports.split(",")
    if not set(transports) <= {"links", "grpc"}:
        raise SystemExit(f"--transports takes links and/or grpc, not {a.transports!r}")
    mps = a.mps.split(",")
    if not set(mps) <= {"off", "on"}:
        raise SystemExit(f"--mps takes off and/or on, not {a.mps!r}")
    by_transport: dict[str, dict[str, Any]] = {}  # by transport, "+mps" where MPS ran
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"== writing a random {('tiny' if a.small else '1.1B')} Llama (bf16) to {tmp}")
        make_model(shape, "cpu", Path(tmp))
        for setting in mps:
            with mps_daemon(setting == "on"):
                for transport in transports:
                    name = transport + ("+mps" if setting == "on" else "")
                    by_transport[name] = run_mesh(a, tmp, transport, levels, prompts, name)
    cols = ["streams", "tok_s", "vs_one_stream", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "tokens_per_chunk", "same_as_solo"]
    for name, run in by_transport.items():
        print(f"boundaries over {name.replace('+mps', ' (MPS on)')}:")
        print(table(cols, [[row[c] for c in cols] for row in run["rows"]]))
        print(f"recoveries during the run: {run['recoveries']}")
    first = next(iter(by_transport.values()))
    result = {"benchmark": "gpu_mesh", "machine": machine(load), "model": "random Llama, TinyLlama-1.1B shape" if not
              a.small else "tiny", "dtype": a.dtype, "executors": a.executors, "device": a.device,
              "tokens_per_stream": a.tokens, "prompt_tokens": a.prompt_tokens, "repeats": a.repeats,
              "steps_in_flight": a.steps_in_flight or a.executors, "decode_steps": a.decode_steps,
              "transport": transports[0], "mps": mps[0] == "on", "recoveries": first["recoveries"], "rows": first["rows"],
              "transports": by_transport,
              "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA", "NCCL", "GRAPHMESH"))}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    progress(f"== wrote {a.out}")


if __name__ == "__main__":
    main()
