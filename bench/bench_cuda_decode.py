"""A decode step of the 1.1B mesh's two stages, in-process on one GPU: the torch backend's Triton kernels
(backends/cuda_kernels.py) against torch's own ops (GRAPHMESH_CUDA_KERNELS=0), in the same run.

For each batch size it reports the median wall time of one decode step through both stages (captured CUDA graphs,
as the mesh runs them; host work included), and, for one step run eagerly under torch.profiler, the kernels launched
and the sum of their GPU times. On a GPU a decode step is bound by its kernel count, not its arithmetic: these are the
figures that a fused kernel moves. bench_gpu_mesh.py measures the whole mesh under concurrent streams.

    python bench/bench_cuda_decode.py --rows 1,16,32      # needs a CUDA device
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.bench_gpu import TINYLLAMA, make_model
from bench.common import RESULTS_DIR, machine, median, progress, table

PROMPT = 32


def measure(path: Path, rows: list[int], steps: int) -> list[dict[str, Any]]:
    """This process's figures, with the kernels as GRAPHMESH_CUDA_KERNELS set them."""
    import torch

    from graphmesh_executor.backends.torch_backend import TorchExecutable
    from graphmesh_executor.stage_types import StepRow
    from tests.stage_pipeline import two_stages

    step_ids = itertools.count(1)
    runtimes = two_stages(path, "torch", 11, 22, device="cuda:0", hidden=2048, kv_cache_bytes=4 << 30, dtype="bf16")

    def step(batch: list[StepRow]) -> list[int]:
        sid = next(step_ids)
        runtimes[0].execute_step(1, sid, batch, False, 60.0)
        return list(runtimes[1].execute_step(1, sid, batch, False, 60.0).tokens)

    out = []
    for n in rows:
        sessions = [f"r{n}-{i}" for i in range(n)]
        tokens = step([StepRow(s, 1, 0, 0, [(7 * i + j) % 31000 + 1 for j in range(PROMPT)])
                       for i, s in enumerate(sessions)])
        times = []
        for epoch in range(2, steps + 2):
            batch = [StepRow(s, epoch, epoch - 1, PROMPT + epoch - 2, [t]) for s, t in zip(sessions, tokens)]
            torch.cuda.synchronize()
            start = time.perf_counter()
            tokens = step(batch)
            times.append((time.perf_counter() - start) * 1e3)
        # One more step eagerly, every kernel launched on its own, to count them and sum their GPU times.
        TorchExecutable.cuda_graphs = False
        epoch = steps + 2
        batch = [StepRow(s, epoch, epoch - 1, PROMPT + epoch - 2, [t]) for s, t in zip(sessions, tokens)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(batch)
            torch.cuda.synchronize()
        TorchExecutable.cuda_graphs = True
        kernels = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
        out.append({"rows": n, "step_ms": median(times[steps // 2:]), "kernels": len(kernels),
                    "kernel_ms": sum(e.device_time for e in kernels) / 1e3})
        progress(f"rows {n}: {out[-1]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,32", help="batch sizes (decode rows a step)")
    p.add_argument("--steps", type=int, default=40, help="decode steps a batch size (the second half is timed)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "cuda_decode.json")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # internal: this process measures into this file
    a = p.parse_args()
    rows = [int(n) for n in a.rows.split(",")]
    if a.measure:
        Path(a.measure).write_text(json.dumps(measure(Path(os.environ["BENCH_MODEL"]), rows, a.steps)))
        return
    results: dict[str, list[dict[str, Any]]] = {}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        progress("making the random 1.1B Llama (TinyLlama shape, bf16)")
        make_model(TINYLLAMA, "cpu", Path(tmp) / "model")
        for name, flag in (("triton", "1"), ("torch ops", "0")):
            progress(f"measuring with {name} (GRAPHMESH_CUDA_KERNELS={flag})")
            into = Path(tmp) / f"{flag}.json"
            env = {**os.environ, "GRAPHMESH_CUDA_KERNELS": flag, "BENCH_MODEL": str(Path(tmp) / "model")}
            subprocess.run([sys.executable, __file__, "--rows", a.rows, "--steps", str(a.steps), "--measure", str(into)],
                           env=env, check=True)
            results[name] = json.loads(into.read_text())
    lines = []
    for fused, plain in zip(results["triton"], results["torch ops"]):
        lines.append([fused["rows"], f"{fused['step_ms']:.2f}", f"{plain['step_ms']:.2f}",
                      f"{plain['step_ms'] / fused['step_ms']:.2f}x", f"{fused['kernels']} / {plain['kernels']}",
                      f"{fused['kernel_ms']:.2f} / {plain['kernel_ms']:.2f}"])
    print(table(["rows", "step ms (triton)", "step ms (torch ops)", "speedup", "kernels", "kernel GPU ms"], lines))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"benchmark": "cuda_decode", "machine": machine(load),
                                 "model": "random Llama, TinyLlama-1.1B shape", "dtype": "bf16",
                                 "stages": "2 in-process, layers 0-11 and 11-22", "prompt_tokens": PROMPT,
                                 "results": results}, indent=1))
    progress(f"wrote {a.out}")


if __name__ == "__main__":
    main()
