"""The torch backend's CPU kernels (backends/cpu_kernels.c) against torch's own matmul and attention (MKL), on a
SmolLM2 stage in-process: the time of one decode step of N rows, one core.

Two runtimes hold the same stage in one process, one built with the kernels and one with GRAPHMESH_CPU_KERNELS=0
(torch's matmul and attention, the weights in the layout MKL prefers), and their steps alternate, so load from
other processes hits both alike. Each step's rows are N sessions after a 40-token prompt; both must produce the
same tokens. Prints a table and writes bench/results/cpu_kernels.json.

    .venv/bin/python bench/bench_cpu_kernels.py [--rows 1,4,8,16,32] [--steps 14] [--layers 0,30]
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

from bench.common import machine, median, progress, write_results
from graphmesh import plan as dag
from graphmesh_executor.backends import cpu_kernels
from graphmesh_executor.stage import Boundary, StageRuntime, StageSpec, StepRow

PROMPT = list(range(100, 140))


def use_kernels(on: bool) -> None:
    """Whether the backend finds the kernels: set before each engine's step (and before its weights are laid out)."""
    os.environ["GRAPHMESH_CPU_KERNELS"] = "1" if on else "0"
    cpu_kernels.library.cache_clear()


def runtime(kernels: bool, layers: tuple[int, int]) -> StageRuntime:
    """A stage whose weights were laid out with the kernels on or off (the choice is made as they are set)."""
    use_kernels(kernels)
    rt = StageRuntime("torch", kv_cache_bytes=128 << 20, pusher=lambda *a: a[-1](None), standby_weights=False)
    first, last = layers[0] == 0, layers[1] == 30
    # the stage as one rank of a pipeline over the whole model: its boundaries come from and go to nobody
    ranges = [r for r in ((0, layers[0]), layers, (layers[1], 30)) if r[0] < r[1]]
    rank = ranges.index(layers)
    rt.install(1, rank, len(ranges), StageSpec("smollm2-135m", layers[0], layers[1], first, last),
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
    a = p.parse_args(argv)
    load = os.getloadavg()
    torch.set_num_threads(1)
    layers = tuple(int(x) for x in a.layers.split(","))
    assert len(layers) == 2
    progress("== loading the stage twice (kernels on, off)")
    engines = {"kernels": runtime(True, layers), "torch": runtime(False, layers)}
    use_kernels(True)
    assert cpu_kernels.library() is not None, "the kernels do not build here: nothing to compare"
    step_ids = itertools.count(1)
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in a.rows.split(",")]:
        times: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {name: [] for name in engines}
        for name, rt in engines.items():
            use_kernels(name == "kernels")
            step = next(step_ids)
            if layers[0] != 0:
                rt.accept_boundary(1, boundary(rt, step, np.random.default_rng(0).standard_normal(
                    (n * len(PROMPT), 576), np.float32)))
            rt.execute_step(1, step, [StepRow(f"{name}-{n}-{i}", 1, 0, 0, PROMPT) for i in range(n)], False, 60.0)
        for k in range(a.steps + 3):
            for name, rt in engines.items():
                use_kernels(name == "kernels")
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
        rows.append({"rows": n, "kernels_ms": ms["kernels"], "torch_ms": ms["torch"], "speedup": ms["torch"] / ms["kernels"],
                     "same_tokens": tokens["kernels"] == tokens["torch"]})
        progress(f"{n:3d} rows  kernels {ms['kernels']:7.1f} ms  torch {ms['torch']:7.1f} ms")
    print(f"\nSmolLM2 layers {layers[0]}-{layers[1]}, f32, one decode step of N rows, one core (median of {a.steps}, "
          f"interleaved; load average at start {load[0]:.2f}):")
    print("rows  kernels ms  torch (MKL) ms  speedup  same tokens")
    print("----  ----------  --------------  -------  -----------")
    for r in rows:
        print(f"{r['rows']:4d}  {r['kernels_ms']:10.1f}  {r['torch_ms']:14.1f}  {r['speedup']:6.2f}x  {r['same_tokens']}")
    write_results("cpu_kernels.json", {"benchmark": "cpu_kernels", "machine": machine(load), "model": "smollm2-135m",
                                       "weights": "f32", "layers": list(layers), "threads": 1, "steps": a.steps,
                                       "rows": rows})


if __name__ == "__main__":
    main()
