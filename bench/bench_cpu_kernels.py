"""The torch backend's CPU kernels (backends/cpu_kernels.c), each build this host runs (AVX-512, AVX2), against
torch's own matmul and attention (MKL), on a SmolLM2 stage in-process: the time of one decode step of N rows, one
core.

One runtime per engine holds the same stage in one process: the kernels of each build (GRAPHMESH_CPU_ISA) and
torch's ops (GRAPHMESH_CPU_KERNELS=0, the weights in the layout MKL prefers). Their steps alternate, so load from
other processes hits all alike. Each step's rows are N sessions after a 40-token prompt; all must produce the
same tokens. `--weights packed` keeps the GGUF's Q4_1 blocks (torch then multiplies by their dequantized copy).
Prints a table and writes bench/results/cpu_kernels[-packed].json.

    .venv/bin/python bench/bench_cpu_kernels.py [--rows 1,4,8,16,32] [--steps 14] [--layers 0,30] [--weights packed]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import machine, median, progress, table, write_results
from graphmesh import plan as dag
from graphmesh_executor.backends import cpu_kernels
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_types import Boundary, StageSpec, StepRow
from graphmesh_server.serving import cpu_flags

PROMPT = list(range(100, 140))


def use(engine: str) -> None:
    """Which kernels the backend finds: set before each engine's step (and before its weights are laid out)."""
    os.environ["GRAPHMESH_CPU_KERNELS"] = "0" if engine == "torch" else "1"
    cpu_kernels.select(engine if engine != "torch" else "avx2")
    cpu_kernels._library.cache_clear()


def runtime(engine: str, layers: tuple[int, int], weights: str) -> StageRuntime:
    """A stage whose weights were laid out for `engine` (the choice is made as they are set)."""
    use(engine)
    rt = StageRuntime("torch", kv_cache_bytes=128 << 20, pusher=lambda *a: a[-1](None), standby_weights=False)
    first, last = layers[0] == 0, layers[1] == 30
    # the stage as one rank of a pipeline over the whole model: its boundaries come from and go to nobody
    ranges = [r for r in ((0, layers[0]), layers, (layers[1], 30)) if r[0] < r[1]]
    rank = ranges.index(layers)
    rt.install(1, rank, len(ranges), StageSpec("smollm2-135m", layers[0], layers[1], first, last, weights=weights),
               dag.pipeline(ranges, [str(i) for i in range(len(ranges))], 576))
    return rt


def boundary(rt: StageRuntime, step: int, hidden: np.ndarray) -> Boundary:
    """The activation a previous rank would push to `rt` for `step`."""
    assert rt.plan is not None and rt.group is not None
    route = rt.plan.routes_into(rt.group.id)[0]
    return Boundary(step, 0, route.id, {dag.ACTIVATION: hidden}, route.schema.identity)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,8,16,32", help="decode rows (sessions) per step")
    p.add_argument("--steps", type=int, default=14, help="timed steps per row count and engine (3 more warm up)")
    p.add_argument("--layers", default="0,30", help="the stage's layer range")
    p.add_argument("--weights", default="f32", choices=["f32", "packed"])
    p.add_argument("--output", help="file name under bench/results/ (default cpu_kernels[-WEIGHTS].json)")
    a = p.parse_args(argv)
    load = os.getloadavg()
    torch.set_num_threads(1)
    layers = tuple(int(x) for x in a.layers.split(","))
    assert len(layers) == 2
    builds = [b for b in ("avx512", "avx2") if cpu_kernels._ISA_CPU[b] <= cpu_flags()]
    assert builds, "the kernels do not run here: nothing to compare"
    names = [*builds, "torch"]
    progress(f"== loading the stage {len(names)} times ({', '.join(names)}), {a.weights} weights")
    engines = {name: runtime(name, layers, a.weights) for name in names}
    step_ids = itertools.count(1)
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in a.rows.split(",")]:
        times: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {name: [] for name in engines}
        for name, rt in engines.items():
            use(name)
            step = next(step_ids)
            if layers[0] != 0:
                rt.accept_boundary(1, boundary(rt, step, np.random.default_rng(0).standard_normal(
                    (n * len(PROMPT), 576), np.float32)))
            rt.execute_step(1, step, [StepRow(f"{name}-{n}-{i}", 1, 0, 0, PROMPT) for i in range(n)], False, 60.0)
        for k in range(a.steps + 3):
            for name, rt in engines.items():
                use(name)
                step = next(step_ids)
                if layers[0] != 0:
                    rt.accept_boundary(1, boundary(rt, step, np.random.default_rng(k).standard_normal((n, 576),
                                                                                               np.float32)))
                t0 = time.perf_counter()
                out = rt.execute_step(1, step, [StepRow(f"{name}-{n}-{i}", k + 2, k + 1, len(PROMPT) + k, [7 + k])
                                                for i in range(n)], False, 60.0)
                if k >= 3:
                    times[name].append(time.perf_counter() - t0)
                tokens[name].append(out.tokens)
        for name, rt in engines.items():
            for i in range(n):
                rt.release(1, f"{name}-{n}-{i}")
        ms = {name: median(t) * 1e3 for name, t in times.items()}
        rows.append({"rows": n, **{f"{name}_ms": ms[name] for name in names},
                     **{f"{b}_x_torch": ms["torch"] / ms[b] for b in builds},
                     "same_tokens": all(tokens[name] == tokens[builds[0]] for name in names)})
        progress(f"{n:3d} rows  " + "  ".join(f"{name} {ms[name]:7.1f} ms" for name in names))
    print(f"\nSmolLM2 layers {layers[0]}-{layers[1]}, {a.weights} weights, one decode step of N rows, one core (median "
          f"of {a.steps}, interleaved; load average at start {load[0]:.2f}):")
    print(table(["rows", *[f"{name} ms" for name in names], *[f"{b} x torch" for b in builds], "same tokens"],
                [[r["rows"], *[r[f"{name}_ms"] for name in names], *[r[f"{b}_x_torch"] for b in builds],
                  str(r["same_tokens"])] for r in rows]))
    write_results(a.output or ("cpu_kernels.json" if a.weights == "f32" else f"cpu_kernels-{a.weights}.json"),
                  {"benchmark": "cpu_kernels", "machine": machine(load), "model": "smollm2-135m", "weights": a.weights,
                   "layers": list(layers), "threads": 1, "steps": a.steps, "builds": builds, "rows": rows})


if __name__ == "__main__":
    main()
