"""Prompt steps of shapes a stage meets for the first time, against the same shapes again: one StageRuntime holding
a whole random-weight Llama in-process (the executor's own code, no gRPC), each step timed on the host and on the GPU
(CUDA events), and the last chunk of a split prompt traced with torch's profiler (its kernels, by GPU time).

A serving load brings prompts of every length, so nearly every prompt run has a (queries, keys) shape the warm-up at
load did not meet: a kernel that prepares itself per shape pays that on a step the clients wait for. Prints a line per
step and the traced kernels; writes nothing.

    python bench/probe_prompt_shapes.py --shape tinyllama
    python bench/probe_prompt_shapes.py --shape small --device cpu      # a dry run
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.bench_gpu import make_model
from bench.bench_gpu_mesh import SHAPES
from bench.profile_stage import step
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_types import StageSpec, StepRow


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tinyllama", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    shape, cuda = SHAPES[a.shape], a.device.startswith("cuda")
    rng = np.random.default_rng(0)
    ids = itertools.count()

    def prompt(n: int) -> list[int]:
        return rng.integers(3, shape["vocab_size"], n).tolist()

    with tempfile.TemporaryDirectory() as tmp:
        make_model(shape, "cuda" if cuda else "cpu", Path(tmp))
        rt = StageRuntime("torch", a.device, kv_cache_bytes=8 << 30, standby_weights=False)
        rt.install(1, 0, 1, StageSpec(tmp, 0, shape["num_hidden_layers"], True, True, dtype="bf16" if cuda else "f32"))

        def timed(tag: str, rows: list[StepRow]) -> None:
            wall, gpu, _ = step(rt, rows, 1, a.device)
            print(f"{tag}: wall {wall * 1e3:.1f} ms, GPU {gpu * 1e3:.1f} ms", flush=True)

        for k in range(3):
            timed(f"one prompt of 2,048 tokens, #{k + 1}", [StepRow(f"a{next(ids)}", 1, 0, 0, prompt(2048))])
        for k in range(3):  # the second chunk's run starts at position 1,024: queries 1,024, keys 2,048
            session, tokens = f"c{next(ids)}", prompt(2048)
            timed(f"chunk 1 of 2 (1,024 tokens from 0), #{k + 1}", [StepRow(session, 1, 0, 0, tokens[:1024])])
            timed(f"chunk 2 of 2 (1,024 tokens from 1,024), #{k + 1}", [StepRow(session, 2, 1, 1024, tokens[1024:])])
        for k in range(3):
            rows = [StepRow(f"m{next(ids)}", 1, 0, 0, prompt(1536))]
            rows += [StepRow(f"e{next(ids)}", 1, 0, 0, prompt(1)) for _ in range(64)]
            timed(f"a prompt of 1,536 tokens and 64 of one, #{k + 1}", rows)
        if cuda:
            from torch.profiler import ProfilerActivity, profile

            session, tokens = f"c{next(ids)}", prompt(2048)
            timed("chunk 1 of 2, traced below: chunk 2", [StepRow(session, 1, 0, 0, tokens[:1024])])
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                timed("chunk 2 of 2, traced", [StepRow(session, 2, 1, 1024, tokens[1024:])])
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
