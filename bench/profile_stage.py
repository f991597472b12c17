"""Where a stage's step time goes: one StageRuntime holding a whole random-weight Llama in-process (the executor's
own code, no gRPC), a prefill step of B prompts and decode steps of N rows, each timed on the host, with the engine
thread's Python profile (cProfile over the engine's tasks) and the GPU's busy time (CUDA events around the step).

A step's wall time minus its GPU time is what the host adds; the profile says where. Prints the tables and writes
bench/results/profile_stage.json (or --out).

    python bench/profile_stage.py --shape tinyllama --prefill 64x32 --decode 1,32,128,256 --decode-steps 8
    python bench/profile_stage.py --shape small --device cpu --decode 1,8      # a dry run
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import itertools
import json
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.bench_gpu import make_model
from bench.bench_gpu_mesh import SHAPES
from bench.common import RESULTS_DIR, machine, median, progress, table
from graphmesh_executor.engine import Engine
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_types import StageSpec, StepRow

_ids = itertools.count(1)


class Profiled:
    """cProfile over every task the engine thread runs while on (cProfile sees only the thread it runs in)."""

    def __init__(self) -> None:
        self.profile: cProfile.Profile | None = None
        submit = Engine.submit
        outer = self

        def profiled_submit(engine: Engine, name: str, task: Callable[[], Any]) -> Any:
            def wrapped() -> Any:  # runs on the engine thread: the profile sees the task's calls there
                prof = outer.profile
                if prof is None:
                    return task()
                prof.enable()
                try:
                    return task()
                finally:
                    prof.disable()
            return submit(engine, name, wrapped)
        setattr(Engine, "submit", profiled_submit)  # noqa: B010 (every engine's tasks, from now on)

    def top(self, n: int = 25) -> str:
        assert self.profile is not None
        out = io.StringIO()
        pstats.Stats(self.profile, stream=out).sort_stats("tottime").print_stats(n)
        return out.getvalue()


def step(rt: StageRuntime, rows: list[StepRow], decode_steps: int, device: str) -> tuple[float, float, Any]:
    """Wall seconds of one step, the GPU's busy seconds within it (events around it), and its result."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
    t0 = time.perf_counter()
    out = rt.execute_step(1, next(_ids), rows, False, 120.0, decode_steps=decode_steps)
    if cuda:
        end.record()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return wall, (start.elapsed_time(end) / 1e3 if cuda else float("nan")), out


def traced(run: Callable[[], Any], path: Path, iterations: int) -> tuple[Any, dict[str, float]]:
    """Runs `run` under torch's profiler, writes its chrome trace to `path`, and sums the GPU's kernels in it: their
    time, the span from the first kernel's start to the last one's end, and the idle time between them (the gaps the
    host leaves), each a token of the run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = run()
        torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in json.loads(path.read_text())["traceEvents"]
                     if e.get("cat") == "kernel" and "dur" in e)
    if not kernels:
        return out, {"kernels": 0}
    busy, end, gaps = 0.0, kernels[0][0], []
    for start, stop in kernels:
        if start > end:
            gaps.append(start - end)
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - kernels[0][0]
    big = sorted(gaps)[-5:]
    return out, {"kernels": len(kernels), "kernel_ms_per_token": busy / 1e3 / iterations,
                 "span_ms_per_token": span / 1e3 / iterations, "idle_ms_per_token": (span - busy) / 1e3 / iterations,
                 "largest_gaps_ms": [g / 1e3 for g in big]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tinyllama", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--prefill", default="64x32", help="sessions x prompt tokens of the prefill step")
    p.add_argument("--decode", default="1,32,128,256", help="rows of the decode steps")
    p.add_argument("--decode-steps", type=int, default=8, help="tokens a decode run makes per row")
    p.add_argument("--steps", type=int, default=6, help="timed steps per row count")
    p.add_argument("--kv-cache-bytes", type=int, default=8 << 30)
    p.add_argument("--trace", default="", help="also trace one more decode run of each level with torch's profiler "
                   "into this directory (chrome traces) and report the GPU's kernel time and idle gaps within it")
    p.add_argument("--out", default=str(RESULTS_DIR / "profile_stage.json"))
    a = p.parse_args()
    load = os.getloadavg()
    shape = SHAPES[a.shape]
    sessions, prompt_len = (int(x) for x in a.prefill.split("x"))
    levels = [int(x) for x in a.decode.split(",")]
    rng = np.random.default_rng(0)
    prof = Profiled()
    result: dict[str, Any] = {"benchmark": "profile_stage", "machine": machine(load), "shape": a.shape,
                              "device": a.device, "dtype": a.dtype, "decode_steps": a.decode_steps}
    with tempfile.TemporaryDirectory() as tmp:
        make_model(shape, "cuda" if a.device.startswith("cuda") else "cpu", Path(tmp))
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        rt = StageRuntime("torch", a.device, kv_cache_bytes=a.kv_cache_bytes, standby_weights=False)
        t0 = time.perf_counter()
        rt.install(1, 0, 1, StageSpec(tmp, 0, shape["num_hidden_layers"], True, True, dtype=a.dtype))
        progress(f"== installed in {time.perf_counter() - t0:.1f} s")
        n_sessions = max(max(levels), sessions)
        prompts = [rng.integers(3, shape["vocab_size"], prompt_len).tolist() for _ in range(n_sessions + sessions)]
        last: dict[int, int] = {}  # each session's last token, epoch and position: levels run different sessions
        epochs: dict[int, int] = {}
        pos: dict[int, int] = {}

        def prefill(ids: list[int], tag: str) -> tuple[float, float]:
            rows = [StepRow(f"s{i}", 1, 0, 0, prompts[i]) for i in ids]
            wall, gpu, out = step(rt, rows, 1, a.device)
            for i, tok in zip(ids, out.tokens):
                last[i], epochs[i], pos[i] = tok, 2, prompt_len
            progress(f"   prefill {tag}: {len(ids)} x {prompt_len} tokens, {wall * 1e3:.1f} ms (GPU {gpu * 1e3:.1f})")
            return wall, gpu

        # prefill every session in steps of `sessions` (the first compiles), the last one profiled
        prefill_rows = []
        for start in range(0, n_sessions, sessions):
            ids = list(range(start, min(n_sessions, start + sessions)))
            if start + sessions >= n_sessions:
                prof.profile = cProfile.Profile()
            prefill_rows.append(prefill(ids, f"{start}-{ids[-1]}"))
        result["prefill"] = {"sessions": sessions, "prompt_tokens": prompt_len,
                             "wall_ms": [w * 1e3 for w, _ in prefill_rows], "gpu_ms": [g * 1e3 for _, g in prefill_rows],
                             "profile": prof.top()}
        print(f"\nprefill steps of {sessions} x {prompt_len} tokens: wall ms {[round(w * 1e3, 1) for w, _ in prefill_rows]}, "
              f"GPU ms {[round(g * 1e3, 1) for _, g in prefill_rows]}\nengine thread, the last prefill step:\n{prof.top(20)}")
        prof.profile = None
        if a.trace and a.device.startswith("cuda"):  # one more prefill step, of sessions the decode levels never use
            rows = [StepRow(f"s{i}", 1, 0, 0, prompts[i]) for i in range(n_sessions, n_sessions + sessions)]
            result["prefill"]["trace"] = traced(functools.partial(step, rt, rows, 1, a.device),
                                                Path(a.trace) / "prefill.json", 1)[1]
            progress(f"   traced prefill: {result['prefill']['trace']}")
        def decode(n: int) -> tuple[float, float, Any]:
            """step() of a decode run of sessions 0..n-1, each from its last token; their state moves on by its tokens."""
            rows = [StepRow(f"s{i}", epochs[i], epochs[i] - 1, pos[i], [last[i]]) for i in range(n)]
            wall, gpu, out = step(rt, rows, a.decode_steps, a.device)
            for i in range(n):
                made = out.run_tokens[i] if out.run_tokens else [out.tokens[i]]
                last[i], epochs[i], pos[i] = made[-1], epochs[i] + 1, pos[i] + len(made)
            return wall, gpu, out

        rows_out = []
        for n in levels:
            walls, gpus = [], []
            for k in range(a.steps + 2):  # two untimed steps first: a new batch size compiles and captures
                if k == 2:
                    prof.profile = cProfile.Profile()
                wall, gpu, _ = decode(n)
                if k >= 2:
                    walls.append(wall)
                    gpus.append(gpu)
            top = prof.top(25)
            prof.profile = None
            timed_gpu = gpus[0] == gpus[0]  # NaN off CUDA
            row = {"rows": n, "decode_steps": a.decode_steps, "wall_ms_per_token": median(walls) * 1e3 / a.decode_steps,
                   "gpu_ms_per_token": median(gpus) * 1e3 / a.decode_steps if timed_gpu else float("nan"),
                   "tok_s": n * a.decode_steps / median(walls), "profile": top}
            row["host_share"] = 1 - row["gpu_ms_per_token"] / row["wall_ms_per_token"] if timed_gpu else float("nan")
            if a.trace and timed_gpu:
                row["trace"] = traced(functools.partial(decode, n), Path(a.trace) / f"decode_{n}.json",
                                      a.decode_steps)[1]
                progress(f"   traced: {row['trace']}")
            rows_out.append(row)
            progress(f"   decode {n} rows: {row['wall_ms_per_token']:.2f} ms a token (GPU {row['gpu_ms_per_token']:.2f}), "
                     f"{row['tok_s']:.0f} tok/s")
            print(f"\nengine thread, decode runs of {n} rows ({a.decode_steps} tokens each):\n{top}")
        result["decode"] = rows_out
    print(table(["rows", "wall ms/token", "GPU ms/token", "host share", "tok/s"],
                [[r["rows"], r["wall_ms_per_token"], r["gpu_ms_per_token"], r["host_share"], r["tok_s"]] for r in rows_out]))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    progress(f"== wrote {a.out}")


if __name__ == "__main__":
    main()
