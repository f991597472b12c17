"""SmolLM2-135M on one executor, every backend and weight mode, against transformers `generate` on the same weights.

For each configuration (backend x weights x transport) a worker process measures, in rounds that alternate
with transformers (so load from other processes hits both alike): greedy decode tokens/s (median step time
of a session after a short chat prompt) and the prefill time of a 512-token prompt. Transports: in-process
(StageRuntime install + execute_step, the code path the mesh runs) and gRPC (an executor process driven through
StageService.Install / ExecuteStep, one single-row step per token with the commit folded in, as the coordinator
runs a session alone). Both hold the session's KV in a paged pool of --kv-cache-bytes (the numpy backend copies
its pool on every step, so a pool far bigger than the run needs only slows it down). transformers loads the same
GGUF with dtype float32; both sides run with the same torch.set_num_threads (--threads; OMP_NUM_THREADS for
numpy's and mlx's BLAS).

Weight modes: f32 (dequantized; must give transformers' tokens), packed (GGUF blocks kept packed, f32
activations: the same dequantized values) and packed-bf16 (bf16 activations into the packed layers:
torch's int4 kernel; torch only), with their agreement with f32.

    .venv/bin/python bench/bench_backends.py [--threads 1] [--runs 3] [--tokens 32] [--backends numpy,torch,mlx]
        [--kv-cache-bytes 64Mi]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import free_address, machine, median, progress, table, write_results
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_types import StageSpec, StepRow
from graphmesh_server.serving import byte_size

MODEL = "smollm2-135m"
GOAL = 1.5
MODES = ("f32", "packed", "packed-bf16")  # StageSpec.weights
TEXT = ("The history of astronomy is the story of people looking up and trying to make sense of what they saw. "
        "Early observers tracked the motions of the Sun, the Moon and the planets, built calendars around them, "
        "and argued for centuries about whether the Earth or the Sun sat at the centre of everything. ")


# -- the engines ------------------------------------------------------------------------------------------------
class InProcess:
    def __init__(self, backend: str, mode: str, kv_cache_bytes: int) -> None:
        self.runtime = StageRuntime(backend, kv_cache_bytes=kv_cache_bytes)
        self.runtime.install(1, 0, 1, StageSpec(MODEL, 0, 30, True, True, weights=mode))
        self.sessions = 0
        self.step_ids = itertools.count(1)

    def generate(self, prompt: list[int], tokens: int, logits: bool = False) -> tuple[list[int], list[float], Any]:
        """Greedy tokens, the seconds of each decode step, and the prompt's last logits when asked."""
        self.sessions += 1
        session = f"s{self.sessions}"
        began = time.perf_counter()
        first = self.runtime.execute_step(1, next(self.step_ids), [StepRow(session, 1, 0, 0, prompt)], logits, 60.0)
        times = [time.perf_counter() - began]
        first_logits = first.logits[0] if first.logits is not None else None
        out = [int(np.argmax(first_logits)) if first_logits is not None else first.tokens[0]]
        start = len(prompt)
        for epoch in range(2, tokens + 1):
            began = time.perf_counter()
            row = StepRow(session, epoch, epoch - 1, start, [out[-1]])
            out.append(self.runtime.execute_step(1, next(self.step_ids), [row], False, 60.0).tokens[0])
            times.append(time.perf_counter() - began)
            start += 1
        self.runtime.release(1, session)
        return out, times, first_logits

    def close(self) -> None:
        pass


class OverGrpc:
    def __init__(self, backend: str, mode: str, threads: int, kv_cache_bytes: int) -> None:
        import grpc

        from graphmesh.launcher import wait_healthy
        from graphmesh.v1 import stage_pb2, stage_pb2_grpc

        self.pb = stage_pb2
        self.address = free_address()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.process = subprocess.Popen([sys.executable, "-m", "graphmesh_executor.server", "--listen", self.address,
                                         "--backend", backend, "--threads", str(threads),
                                         "--kv-cache-bytes", str(kv_cache_bytes)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(self.address, self.process, 120.0, f"{backend} executor")
        self.channel = grpc.insecure_channel(self.address)
        self.stub = stage_pb2_grpc.StageServiceStub(self.channel)
        spec = stage_pb2.StageSpec(model=MODEL, layer_start=0, layer_end=30, first=True, last=True,
                                   weights=mode)
        self.stub.Install(stage_pb2.InstallRequest(incarnation=1, rank=0, world_size=1, stage=spec), timeout=300)
        self.sessions = 0
        self.step_ids = itertools.count(1)

    def generate(self, prompt: list[int], tokens: int, logits: bool = False) -> tuple[list[int], list[float], Any]:
        from graphmesh import tensors

        pb = self.pb
        self.sessions += 1
        session = f"s{self.sessions}"
        out: list[int] = []
        times: list[float] = []
        first_logits = None
        pending, start = list(prompt), 0
        for epoch in range(1, tokens + 1):
            kind = pb.OUTPUT_KIND_LOGITS if logits and epoch == 1 else pb.OUTPUT_KIND_TOKEN
            row = pb.StepRow(session_id=session, epoch=epoch, commit_epoch=epoch - 1, start_position=start,
                             token_ids=pending)
            request = pb.ExecuteStepRequest(
                incarnation=1, step_id=next(self.step_ids), rows=[row], output=kind, boundary_timeout_ms=30_000)
            began = time.perf_counter()
            reply = self.stub.ExecuteStep(request, timeout=120)
            times.append(time.perf_counter() - began)
            if kind == pb.OUTPUT_KIND_LOGITS:
                first_logits = tensors.from_proto(reply.logits).reshape(-1)  # [1, vocab]: the step's one row
                out.append(int(np.argmax(first_logits)))
            else:
                out.append(int(reply.rows[0].token))
            start, pending = start + len(pending), [out[-1]]
        self.stub.ReleaseSession(pb.ReleaseSessionRequest(header=pb.FencingHeader(incarnation=1, session_id=session)),
                                 timeout=30)
        return out, times, first_logits

    def close(self) -> None:
        self.channel.close()
        self.process.terminate()
        self.process.wait(timeout=30)


class Transformers:
    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from graphmesh.bundled import resolve_model

        path = resolve_model(MODEL)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)

    def generate(self, prompt: list[int], tokens: int) -> tuple[list[int], float]:
        """Greedy tokens and the seconds per decoded token: (t(N) - t(1)) / (N - 1)."""
        ids = self.torch.tensor([prompt])
        seconds = []
        for n in (1, tokens):
            began = time.perf_counter()
            with self.torch.inference_mode():
                # eos_token_id=None, not min_new_tokens: the latter masks EOS and changes the greedy tokens
                out = self.model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            seconds.append(time.perf_counter() - began)
        return out[0, len(prompt):].tolist(), (seconds[1] - seconds[0]) / (tokens - 1)

    def prefill(self, prompt: list[int]) -> tuple[float, np.ndarray]:
        began = time.perf_counter()
        with self.torch.inference_mode():
            logits = self.model(self.torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]  # as generate does
        return time.perf_counter() - began, logits.numpy()


# -- one configuration, in its own process ------------------------------------------------------------------------
def prompts() -> tuple[list[int], list[int]]:
    """A chat prompt for decoding, and a 512-token text for prefill."""
    from graphmesh.bundled import resolve_model
    from graphmesh.checkpoints import open_checkpoint
    from graphmesh.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(open_checkpoint(resolve_model(MODEL)))
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    long = tok.encode(TEXT * 12)
    assert len(long) >= 512
    return chat, long[:512]


def worker(backend: str, mode: str, transport: str, threads: int, runs: int, tokens: int,
           kv_cache_bytes: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    chat, long = prompts()
    hf = Transformers()
    began = time.perf_counter()
    engine: InProcess | OverGrpc = InProcess(backend, mode, kv_cache_bytes) if transport == "in-process" else \
        OverGrpc(backend, mode, threads, kv_cache_bytes)
    install_s = time.perf_counter() - began
    engine.generate(chat, 4)  # warm-up: compiles the prefill and decode shapes
    hf.generate(chat, 4)
    ours_step, ours_prefill, hf_step, hf_prefill = [], [], [], []
    for r in range(runs):
        tokens_ours, times, _ = engine.generate(chat, tokens)
        ours_step.append(median(times[1:]))
        hf_tokens, seconds = hf.generate(chat, tokens)
        hf_step.append(seconds)
        _, prefill_times, logits = engine.generate(long, 1, logits=True)
        ours_prefill.append(prefill_times[0])
        seconds, hf_logits = hf.prefill(long)
        hf_prefill.append(seconds)
        progress(f"  {backend}/{mode}/{transport} round {r + 1}: ours {1 / ours_step[-1]:.1f} tok/s, prefill "
                 f"{ours_prefill[-1] * 1e3:.0f} ms; transformers {1 / hf_step[-1]:.1f} tok/s, prefill "
                 f"{hf_prefill[-1] * 1e3:.0f} ms")
    engine.close()
    return {"backend": backend, "weights": mode, "transport": transport, "threads": threads, "install_s": install_s,
            "kv_cache_bytes": kv_cache_bytes,
            "decode_tokens_per_s": 1 / median(ours_step), "decode_ms_per_token": median(ours_step) * 1e3,
            "prefill_512_ms": median(ours_prefill) * 1e3,
            "transformers_decode_tokens_per_s": 1 / median(hf_step), "transformers_prefill_512_ms": median(hf_prefill) * 1e3,
            "decode_speedup": median(hf_step) / median(ours_step), "prefill_speedup": median(hf_prefill) / median(ours_prefill),
            "tokens": tokens_ours, "transformers_tokens": hf_tokens,
            "identical_leading_tokens_vs_transformers": same_prefix(tokens_ours, hf_tokens),
            "prefill_512_max_abs_logit_diff_vs_transformers": float(np.abs(logits - hf_logits).max()),
            "prefill_512_logits": logits.astype(np.float32).tolist(),
            "runs": runs, "rounds": {"ours_step_ms": [t * 1e3 for t in ours_step], "hf_step_ms": [t * 1e3 for t in hf_step]}}


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- the benchmark ------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads on both sides (and OMP_NUM_THREADS)")
    p.add_argument("--runs", type=int, default=3, help="rounds per configuration (medians)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per decode run")
    p.add_argument("--backends", default="numpy,torch,mlx")
    p.add_argument("--modes", default="f32,packed,packed-bf16")
    p.add_argument("--transports", default="in-process,grpc")
    p.add_argument("--kv-cache-bytes", default="64Mi", help="the stage's KV pool (64Mi: ~1400 tokens of SmolLM2)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # backend:mode:transport, run in a child process
    p.add_argument("--out", default="backends.json")
    a = p.parse_args()
    if a.worker:
        backend, mode, transport = a.worker.split(":")
        print(json.dumps(worker(backend, mode, transport, a.threads, a.runs, a.tokens, byte_size(a.kv_cache_bytes))))
        return
    load = os.getloadavg()
    configs = [(b, m, t) for b in a.backends.split(",") for m in a.modes.split(",") for t in a.transports.split(",")
               if m in MODES and not (m == "packed-bf16" and b != "torch")]
    results = []
    for backend, mode, transport in configs:
        progress(f"{backend} / {mode} / {transport} (threads {a.threads})")
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        if backend == "mlx":
            from graphmesh_executor.backends.mlx_backend import launch_env

            env |= {**launch_env(), "GRAPHMESH_BLAS_PRELOADED": "1"}
        child = subprocess.run([sys.executable, __file__, "--worker", f"{backend}:{mode}:{transport}", "--threads",
                                str(a.threads), "--runs", str(a.runs), "--tokens", str(a.tokens),
                                "--kv-cache-bytes", a.kv_cache_bytes], env=env,
                               stdout=subprocess.PIPE, text=True)
        if child.returncode:
            progress(f"  failed with status {child.returncode}")
            continue
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    reference = {(r["backend"], r["transport"]): r for r in results if r["weights"] == "f32"}
    for r in results:
        f32 = reference.get((r["backend"], r["transport"])) or next((x for x in results if x["weights"] == "f32"), None)
        if f32 is not None and r["weights"] != "f32":
            r["identical_leading_tokens_vs_f32"] = same_prefix(r["tokens"], f32["tokens"])
            r["prefill_512_max_abs_logit_diff_vs_f32"] = float(np.abs(np.array(r["prefill_512_logits"]) -
                                                                      np.array(f32["prefill_512_logits"])).max())
    for r in results:
        del r["prefill_512_logits"]
    rows = [[r["backend"], r["weights"], r["transport"], r["decode_tokens_per_s"], r["transformers_decode_tokens_per_s"],
             r["decode_speedup"], r["prefill_512_ms"], r["transformers_prefill_512_ms"],
             f"{r['identical_leading_tokens_vs_transformers']}/{a.tokens}",
             f"{r.get('identical_leading_tokens_vs_f32', '-')}"] for r in results]
    print(table(["backend", "weights", "transport", "tok/s", "hf tok/s", "x hf", "prefill ms", "hf prefill ms",
                 "same as hf", "same as f32"], rows))
    best = max((r["decode_speedup"] for r in results if r["backend"] == "torch"), default=float("nan"))
    print(f"\nbest torch decode speedup over transformers: {best:.2f}x (goal {GOAL}x); threads {a.threads} on both sides")
    write_results(a.out, {"model": MODEL, "threads_both_sides": a.threads, "runs": a.runs, "tokens": a.tokens,
                          "kv_cache_bytes": byte_size(a.kv_cache_bytes),
                          "goal_torch_decode_speedup": GOAL, "best_torch_decode_speedup": best,
                          "machine": machine(load), "results": results})


if __name__ == "__main__":
    main()
