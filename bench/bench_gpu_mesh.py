"""Serving on a GPU through the real mesh against one compiled process on the same GPU: a random-weight model of a
real shape (`--shape tinyllama`: TinyLlama-1.1B, `llama8b`: Llama-3-8B; `moe`: a Qwen3-MoE of Qwen3-30B-A3B's widths,
12 layers of 32 experts, top 4, 2.65B parameters; `small` and `moe-small` for a dry run), bf16, over 1 and 2 torch
executors on one CUDA device and a coordinator, driven by concurrent Generate streams (ignore_eos) from one
asyncio client over shared channels (`--client threads`: a thread and a CoordinatorClient per stream, as before).

The peer (bench/gpu_peer.py, run first in a process of its own) is gpt-fast style: the same checkpoint, plain model
code, a static KV cache per batch size, SDPA, the decode step compiled with torch.compile(mode="reduce-overhead");
its figure is steady decode tok/s at each concurrency. The mesh's is all tokens over the wall time of the level
(tok_s, x_peer: TTFT and the ramp included), and beside it its steady decode (decode_tok_s, decode_x_peer: the
tokens that arrived while every stream of the level was decoding, over that span), the peer's kind of figure.

Per mesh and concurrency: aggregate tokens/s and its ratio to the peer, TTFT and inter-token latency (p50/p99; the
gap between streamed chunks, each chunk the tokens that were ready together), and the recoveries the mesh went
through meanwhile (the incarnation must not move: concurrency must never look like a failure). Each stream's
greedy tokens are compared with the same prompt decoded alone (bf16 batched GEMMs may round differently from a
batch of one, so this is reported, not asserted; `--dtype f32` makes them comparable).

`--workload poisson` adds a serving run per mesh: `--requests` requests arriving as a Poisson process at `--rate`
a second, prompts of 64 to 2,048 tokens and outputs of 32 to 512 drawn uniformly (seeded); it reports TTFT and ITL
p50/p99, tokens/s and goodput (the tokens of requests whose TTFT was within 2 s and whose ITL p99 within 200 ms,
per second).

--transports links,grpc runs the whole table once per way boundaries travel between the executors (boundary links,
the default, or PushBoundary calls). --mps off,on runs it again with NVIDIA's Multi-Process Service.

--gpus N puts one executor on each GPU (graphmesh.launcher.gpu_env: its GPU first in CUDA_VISIBLE_DEVICES): a mesh of
n executors runs on GPUs 0..n-1, so boundaries cross GPUs (CUDA IPC between them where the link chooses it,
graphmesh_executor/transport.py). Without it every executor shares --device. --shape llama70b (Llama-3-70B, bf16,
~141 GB) fits no single GPU: run it with --gpus 2 or 4 and --no-peer (the compiled peer holds the model on one GPU).

The random checkpoint is written tensor by tensor, in row pieces of at most --write-piece-bytes, straight into
safetensors shards of --shard-bytes (the header first: offsets follow from the shapes): the host never holds more
than one piece, whatever the shape. --write-only DIR writes it and prints the peak RSS growth against the piece and
the largest shard, the check that the writer streams.

--measure-boundary times a 32k-token prefill's boundary (f32 [32768, hidden], what a stage pushes) from this process
to an executor on the next GPU (GPU 1 with --gpus 2 or more, else the same one), over each transport the pair can
take (TCP frames, and CUDA IPC where the executors' handshake chooses it): median seconds and GB/s.

    python bench/bench_gpu_mesh.py --shape tinyllama --executors 1,2 --concurrency 1,32,128,256
    python bench/bench_gpu_mesh.py --shape llama8b --gpus 2 --executors 1,2 --concurrency 1,32,128,256
    python bench/bench_gpu_mesh.py --shape llama70b --gpus 4 --executors 2,4 --concurrency 1,32,128 --no-peer
    python bench/bench_gpu_mesh.py --shape moe --executors 1,2 --concurrency 1,32,128,256   # MoE: grouped experts
    python bench/bench_gpu_mesh.py --shape llama8b --gpus 2 --measure-boundary   # the boundary alone
    python bench/bench_gpu_mesh.py --shape small --device cpu --concurrency 1,4 --no-peer   # a dry run on the CPU
    python bench/bench_gpu_mesh.py --shape medium --write-only /tmp/ckpt --shard-bytes 256Mi   # the writer alone
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.bench_gpu import SMALL, TINYLLAMA
from bench.common import (
    RESULTS_DIR,
    GpuBusy,
    cpu_by_process,
    generate_multiplexed,
    generate_streams,
    machine,
    median,
    mesh_processes,
    metrics,
    progress,
    py_spy,
    stream_record,
    table,
)
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh, free_port, gpu_env, wait_healthy
from graphmesh.v1 import coordinator_pb2
from graphmesh_server.serving import byte_size


def stream(address: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    with CoordinatorClient(address) as client:
        t0 = time.perf_counter()
        stamps, sizes, ids = [], [], []
        for chunk in client.generate(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=True):
            stamps.append(time.perf_counter())
            sizes.append(len(chunk.token_ids))
            ids += list(chunk.token_ids)
    return stream_record(t0, stamps, sizes, ids)


def run_level(address: str, prompts: list[list[int]], tokens: int, client: str = "aio") -> dict[str, Any]:
    """One level's streams, all at once: from one asyncio loop (client "aio"), all over one GenerateStreams stream
    ("multiplexed": what a front end in a process of its own would send, the coordinator spared a gRPC stream and
    message per call), or a thread and a CoordinatorClient each ("threads", the benchmark's client before
    2026-12-06)."""
    if client in ("aio", "multiplexed"):
        run = generate_multiplexed if client == "multiplexed" else generate_streams
        runs = asyncio.run(run(address, [
            coordinator_pb2.GenerateRequest(prompt_token_ids=p, max_tokens=tokens, ignore_eos=True) for p in prompts]))
    else:
        barrier = threading.Barrier(len(prompts))

        def one(prompt: list[int]) -> dict[str, Any]:
            barrier.wait()
            return stream(address, prompt, tokens)
        with ThreadPoolExecutor(len(prompts)) as pool:
            runs = list(pool.map(one, prompts))
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    gaps = [g for r in runs for g in r["gaps"]]
    ttfts = [r["ttft"] for r in runs]
    return {"wall_s": wall, "tok_s": sum(len(r["ids"]) for r in runs) / wall, "decode_tok_s": steady_decode(runs),
            "ttft_p50_ms": 1e3 * float(np.percentile(ttfts, 50)),
            "ttft_p99_ms": 1e3 * float(np.percentile(ttfts, 99)),
            "itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)) if gaps else 0.0,
            "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)) if gaps else 0.0, "ids": [r["ids"] for r in runs],
            "tokens_per_chunk": sum(len(r["ids"]) for r in runs) / sum(r["chunks"] for r in runs)}


STEP_KINDS = ("prompt", "decode_run", "decode", "verify")  # the coordinator's graphmesh_steps_by_kind


def scrape(mesh: LocalMesh) -> dict[str, dict[tuple[str, str], float]]:
    return {name: metrics(port) for name, port in mesh.metrics_ports.items()}


def where_time_went(before: dict[str, dict[tuple[str, str], float]], after: dict[str, dict[tuple[str, str], float]],
                    wall: float) -> dict[str, Any]:
    """A level's steps by kind (how many, their rows, the coordinator's seconds from sending each to its reply), the
    executors' compiles of shapes met for the first time (a step waits for each), and the wall time outside steps
    (arrivals, the coordinator's turn between steps: no step in flight; steps of several micro-batches overlap)."""
    def delta(service: str, name: str, kind: str = "") -> float:
        return after[service].get((name, kind), 0.0) - before[service].get((name, kind), 0.0)
    out: dict[str, Any] = {kind: {"steps": delta("coordinator", "graphmesh_steps_by_kind_total", kind),
                                  "rows": delta("coordinator", "graphmesh_step_rows_total", kind),
                                  "s": delta("coordinator", "graphmesh_step_seconds_total", kind)} for kind in STEP_KINDS}
    executors = [name for name in after if name.startswith("executor")]
    out["compiles"] = sum(delta(e, "graphmesh_stage_compiles_total") for e in executors)
    out["compile_s"] = sum(delta(e, "graphmesh_stage_compile_seconds_total") for e in executors)
    out["wall_s"] = wall
    out["outside_steps_s"] = wall - delta("coordinator", "graphmesh_steps_busy_seconds_total")
    return out


def measured(mesh: LocalMesh, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run()`'s record (with its "wall_s") and, under "where", where its time went: steps by kind, compiles, how
    busy each process was (one core busy in the coordinator is its GIL's limit) and the GPU (GpuBusy)."""
    counted, cpu = scrape(mesh), cpu_by_process(mesh)
    with GpuBusy() as gpu:
        record = run()
    wall = record["wall_s"]
    record["where"] = where_time_went(counted, scrape(mesh), wall)
    record["where"]["cores"] = {k: (v - cpu[k]) / wall for k, v in cpu_by_process(mesh).items()}
    record["where"]["gpu_busy"] = gpu.share
    return record


def _share(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def steady_decode(runs: list[dict[str, Any]]) -> float:
    """Tokens a second while every stream of the level decodes: those that arrived after the last stream's first
    token and until the first stream's last, over that span (the peer's figure is of this kind: decode with the
    whole batch, prefill left out). NaN where the streams never all decoded at once."""
    begin, end = max(r["stamps"][0] for r in runs), min(r["stamps"][-1] for r in runs)
    if end <= begin:
        return float("nan")
    arrived = sum(n for r in runs for t, n in zip(r["stamps"], r["sizes"]) if begin < t <= end)
    return arrived / (end - begin)


LLAMA8B: dict[str, Any] = {"vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
                           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                           "rope_theta": 500000.0}
LLAMA70B: dict[str, Any] = {"vocab_size": 128256, "hidden_size": 8192, "num_hidden_layers": 80,
                            "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                            "rope_theta": 500000.0}
MEDIUM: dict[str, Any] = {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                          "num_key_value_heads": 4, "intermediate_size": 4096}  # ~0.6 GB: the writer's CPU check
# Qwen3-MoE rather than Mixtral: it is the MoE family people run now (Qwen3-30B-A3B), graphmesh and transformers both
# serve it, and its many small experts (top-k of dozens, not 2 of 8) are what stresses a grouped expert product; it
# also has q/k norms. Qwen3-30B-A3B's widths (hidden 2048, 32 heads of 128 over 4 kv heads, experts of 768, its
# vocabulary) with 12 layers of 32 experts, top 4 renormalised: 2.65B parameters (5.3 GB bf16), ~0.8B read a token.
QWEN3_MOE: dict[str, Any] = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                             "num_hidden_layers": 12, "num_attention_heads": 32, "num_key_value_heads": 4,
                             "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
                             "num_experts": 32, "num_experts_per_tok": 4, "norm_topk_prob": True,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
MOE_SMALL: dict[str, Any] = {**QWEN3_MOE, "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                             "intermediate_size": 128, "moe_intermediate_size": 48, "num_experts": 8,
                             "num_experts_per_tok": 2}  # the MoE shape's dry run, and tests/test_gpu_peer.py's
SHAPES = {"small": SMALL, "medium": MEDIUM, "tinyllama": TINYLLAMA, "llama8b": LLAMA8B, "llama70b": LLAMA70B,
          "moe": QWEN3_MOE, "moe-small": MOE_SMALL}


def hf_config(shape: dict[str, Any]) -> Any:
    """The transformers config of a shape: its model_type names the family (a Llama where it names none)."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    family = shape.get("model_type", "llama")
    fields = {k: v for k, v in shape.items() if k != "model_type"}
    common = {"max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
              "dtype": "bfloat16"}
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**{"rms_norm_eps": 1e-6, **common, **fields})
    if family == "llama":
        return LlamaConfig(**{"rms_norm_eps": 1e-5, **common, **fields})
    raise SystemExit(f"no random-checkpoint writer for model_type {family!r}")


def hf_tensors(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of `config`'s model as transformers saves it (a Qwen3-MoE's experts one by one), in file order."""
    h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or h // heads
    qwen3_moe = config.model_type == "qwen3_moe"
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (heads * hd, h)),
                (p + "self_attn.k_proj.weight", (kv * hd, h)), (p + "self_attn.v_proj.weight", (kv * hd, h)),
                (p + "self_attn.o_proj.weight", (h, heads * hd))]
        if qwen3_moe:
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        out.append((p + "post_attention_layernorm.weight", (h,)))
        sparse = qwen3_moe and i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0
        inter = config.moe_intermediate_size if sparse else config.intermediate_size
        mlps = [f"{p}mlp.experts.{e}." for e in range(config.num_experts)] if sparse else [p + "mlp."]
        if sparse:
            out.append((p + "mlp.gate.weight", (config.num_experts, h)))
        for m in mlps:
            out += [(m + "gate_proj.weight", (inter, h)), (m + "up_proj.weight", (inter, h)),
                    (m + "down_proj.weight", (h, inter))]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (config.vocab_size, h))]


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def write_random_model(shape: dict[str, Any], device: str, path: Path, shard_bytes: int = 4 << 30,
                       piece_bytes: int = 256 << 20) -> dict[str, Any]:
    """A random bf16 model of `shape` (hf_config: a Llama or a Qwen3-MoE) as a Hugging Face directory (config,
    generation config, safetensors shards and their index), written a row piece at a time: each shard's header comes
    first (every offset follows from the shapes), then each tensor's rows, generated on `device` (N(0, the config's
    initializer_range, 0.02 by default) as transformers initializes, norms 1) in pieces of at most `piece_bytes`.
    Returns the shards, the largest shard and the peak RSS growth (bytes)."""
    import torch
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    config = hf_config(shape)
    config.save_pretrained(path)
    # random weights: decode a fixed number of tokens, never an end of sequence
    generation: Any = GenerationConfig
    generation(bos_token_id=1, eos_token_id=None, pad_token_id=0).save_pretrained(path)
    tensors = hf_tensors(config)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors:
        n = 2 * int(np.prod(dims))
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += n
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    base, peak = _rss(), 0
    generator = torch.Generator(device=device)
    for index, (shard, file) in enumerate(zip(shards, files)):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dims in shard:
            n = 2 * int(np.prod(dims))
            header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + n]}
            offset += n
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        with open(path / file, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for t, (_, dims) in enumerate(shard):
                row = 2 * int(np.prod(dims[1:]))
                rows = max(1, piece_bytes // row) if len(dims) > 1 else 1
                for r0 in range(0, dims[0] if len(dims) > 1 else 1, rows):
                    if len(dims) == 1:  # a norm's weight
                        piece = torch.ones(dims, dtype=torch.bfloat16)
                    else:
                        generator.manual_seed(hash((index, t, r0)) & 0x7FFFFFFF)
                        piece = torch.randn((min(rows, dims[0] - r0), *dims[1:]), generator=generator,
                                            dtype=torch.bfloat16, device=device).mul_(config.initializer_range).cpu()
                    f.write(piece.view(torch.uint8).numpy().data)
                    peak = max(peak, _rss() - base)
                    del piece
        progress(f"   shard {index + 1}/{len(shards)}: {offset / 2**30:.2f} GiB")
    weight_map = {name: file for shard, file in zip(shards, files) for name, _ in shard}
    total = sum(2 * int(np.prod(dims)) for _, dims in tensors)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=1))
    largest = max(sum(2 * int(np.prod(d)) for _, d in shard) for shard in shards)
    return {"bytes": total, "shards": len(shards), "largest_shard_bytes": largest, "piece_bytes": piece_bytes,
            "peak_rss_growth_bytes": peak}
GOOD_TTFT_S, GOOD_ITL_P99_S = 2.0, 0.2  # a request counts toward goodput within both


def run_peer(a: argparse.Namespace, model: str, levels: list[int]) -> dict[int, dict[str, Any]]:
    """The compiled single process's steady decode tok/s per batch size, in a process of its own."""
    cmd = [sys.executable, str(Path(__file__).with_name("gpu_peer.py")), model, "--batches", ",".join(map(str, levels)),
           "--prompt-tokens", str(a.prompt_tokens), "--tokens", str(a.tokens), "--dtype", a.dtype,
           "--device", a.device]
    progress("== the compiled single process (gpu_peer.py), " + ", ".join(map(str, levels)) + " sequences")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {int(r["batch"]): r for r in rows}


def poisson(address: str, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """A serving run: Poisson arrivals, prompt and output lengths drawn uniformly (seeded), as vLLM's serving
    benchmark drives a server."""
    rng = np.random.default_rng(1)
    gaps = rng.exponential(1.0 / a.rate, a.requests)
    reqs = [(rng.integers(3, vocab, int(rng.integers(64, 2049))).tolist(), int(rng.integers(32, 513)))
            for _ in range(a.requests)]
    t0 = time.perf_counter()

    def one(i: int) -> dict[str, Any]:
        delay = t0 + float(gaps[: i + 1].sum()) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return stream(address, *reqs[i])
    with ThreadPoolExecutor(a.requests) as pool:
        runs = list(pool.map(one, range(a.requests)))
    wall = max(r["end"] for r in runs) - t0
    ttfts = [r["ttft"] for r in runs]
    gaps_all = [g for r in runs for g in r["gaps"]]
    good = [r for r in runs if r["ttft"] <= GOOD_TTFT_S and (not r["gaps"] or np.percentile(r["gaps"], 99) <= GOOD_ITL_P99_S)]
    return {"requests": a.requests, "rate": a.rate, "wall_s": wall, "tok_s": sum(len(r["ids"]) for r in runs) / wall,
            "prompt_tok_s": sum(len(p) for p, _ in reqs) / wall,
            "goodput_tok_s": sum(len(r["ids"]) for r in good) / wall, "good_requests": len(good),
            "ttft_p50_ms": 1e3 * float(np.percentile(ttfts, 50)), "ttft_p99_ms": 1e3 * float(np.percentile(ttfts, 99)),
            "itl_p50_ms": 1e3 * float(np.percentile(gaps_all, 50)) if gaps_all else 0.0,
            "itl_p99_ms": 1e3 * float(np.percentile(gaps_all, 99)) if gaps_all else 0.0}


def run_mesh(a: argparse.Namespace, model: str, executors: int, transport: str, levels: list[int],
             prompts: list[list[int]], label: str, vocab: int) -> dict[str, Any]:
    """Every concurrency level through one mesh whose executors pass boundaries over `transport`."""
    link_args = [] if transport == "links" else ["--boundary-link-port", "off"]
    # With --gpus the launcher pins each executor to its GPU (cuda:0 in its own order). A prefill chunk's boundary
    # of 2,048 tokens is 64 MiB at the 70B shape's width, f32: over the 64 MiB default frame limit.
    device_args = [] if a.gpus else ["--device", a.device]
    mesh = LocalMesh(executors, "torch", model, kvstore=False, startup_timeout_s=900, metrics=True, frontend=a.frontend,
                     gpus=list(range(executors)) if a.gpus else (),
                     extra_executor_args=[*device_args, "--kv-cache-bytes", a.kv_cache_bytes,
                                          "--max-message-bytes", "1Gi", *link_args],
                     extra_coordinator_args=["--dtype", a.dtype,
                                             "--steps-in-flight", str(a.steps_in_flight),
                                             "--decode-steps", str(a.decode_steps),
                                             "--max-step-tokens", str(a.max_step_tokens)])
    with mesh:
        address = mesh.client_address
        with CoordinatorClient(address) as client:
            before = client.status().incarnation
        # As long as the measured streams: the executors met every run shape at load; this pass warms the rest
        # (the clients' channels, the coordinator's first use of each step size, the allocators).
        progress(f"== {label}: warm-up (one pass of every level)")
        for n in levels:
            run_level(address, prompts[:n], a.tokens, a.client)
        solo = [stream(address, prompts[i], a.tokens)["ids"] for i in range(min(4, max(levels)))]
        rows: list[dict[str, Any]] = []
        for n in levels:
            reps = []
            for r in range(a.repeats):
                progress(f"== {label}: {n} streams, repeat {r + 1}/{a.repeats}")
                reps.append(measured(mesh, functools.partial(run_level, address, prompts[:n], a.tokens, a.client)))
            same = sum(ids == solo[i] for rep in reps for i, ids in enumerate(rep["ids"][:len(solo)]))
            rows.append({"streams": n, **{k: median([x[k] for x in reps]) for k in
                                          ("tok_s", "decode_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                           "tokens_per_chunk")},
                         "same_as_solo": f"{same}/{sum(min(n, len(solo)) for _ in reps)}",
                         "where": [rep["where"] for rep in reps]})
        profiles = profile_level(mesh, a, prompts[:max(levels)], label) if a.py_spy else {}
        served = None
        if a.workload == "poisson":
            progress(f"== {label}: Poisson arrivals, {a.requests} requests at {a.rate}/s")
            served = measured(mesh, lambda: poisson(address, a, vocab))
        with CoordinatorClient(address) as client:
            after = client.status().incarnation
    one = float(rows[0]["tok_s"]) if rows and rows[0]["streams"] == 1 else 0.0
    for row in rows:
        row["vs_one_stream"] = float(row["tok_s"]) / one if one else 0.0
    return {"recoveries": after - before, "rows": rows, "poisson": served, "profiles": profiles}


def profile_level(mesh: LocalMesh, a: argparse.Namespace, prompts: list[list[int]], label: str) -> dict[str, Any]:
    """py-spy on every process of the mesh (each thread while it runs: collapsed stacks) through --py-spy more passes
    of the largest level; each process's stacks go beside --out, and what its busiest threads did comes back."""
    processes = mesh_processes(mesh)
    stem = Path(a.out).with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)  # before the results file is written: py-spy writes there first
    files = {name: Path(f"{stem}_{label.split(',')[0].replace(' ', '')}_{name}.txt") for name in processes}
    spies = [py_spy(p.pid, files[name], "--threads", "--nonblocking", "--rate", str(SPY_RATE))
             for name, p in processes.items()]
    time.sleep(1.0)  # py-spy attaches
    progress(f"== {label}: py-spy on {len(spies)} processes, {a.py_spy} passes of {len(prompts)} streams")
    t0 = time.perf_counter()
    try:
        for _ in range(a.py_spy):
            run_level(mesh.client_address, prompts, a.tokens, a.client)
    finally:
        seconds = time.perf_counter() - t0
        for p in spies:
            p.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
        for p in spies:
            p.wait(60)
    return {name: busiest_threads(path, seconds * SPY_RATE) for name, path in files.items() if path.exists()}


SPY_RATE = 250  # py-spy's samples a second


def busiest_threads(path: Path, ticks: float, threads: int = 4, frames: int = 6) -> list[dict[str, Any]]:
    """From py-spy's collapsed stacks (`thread (tid): name;frame;...;frame count`, a sample wherever a thread ran):
    the threads that ran most, each one's share of the `ticks` samples the run lasted, and its commonest leaf frames
    with their shares of its samples."""
    by_thread: dict[str, dict[str, int]] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread, *rest = stack.split(";")
        leaf = rest[-1] if rest else "(no frame)"
        leaves = by_thread.setdefault(thread.partition(": ")[2] or thread, {})
        leaves[leaf] = leaves.get(leaf, 0) + int(count)
    ranked = sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values()))
    return [{"thread": name, "samples": sum(leaves.values()), "busy": round(sum(leaves.values()) / ticks, 3),
             "leaves": [(leaf, round(n / sum(leaves.values()), 3)) for leaf, n in
                        sorted(leaves.items(), key=lambda kv: -kv[1])[:frames]]} for name, leaves in ranked[:threads]]


def measure_boundary(a: argparse.Namespace, shape: dict[str, Any]) -> list[dict[str, Any]]:
    """Boundaries of each of --boundary-tokens tokens, f32 [tokens, hidden], pushed from this process (on GPU 0, or
    --device) to an executor on the next GPU (or the same one), once per transport the pair can take, every size
    over the GPU path when it is one (DEVICE_MIN_BYTES aside); seconds from the push to the receiver's answer, which
    it sends once it has read every byte. The executor holds no stage, so it answers NOT_INSTALLED after reading the
    bundle: that answer is the expected one."""
    import torch

    from graphmesh import plan as dag
    from graphmesh_executor import transport
    from graphmesh_executor.stage_servicer import BoundaryPusher
    from graphmesh_executor.stage_types import Boundary

    on_gpu = a.device.startswith("cuda") or bool(a.gpus)
    sender_device = "cuda:0" if a.gpus else a.device
    transport.DEVICE_MIN_BYTES = 0  # each size through the transport the pair chose, the smallest too
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((int(n), shape["hidden_size"]), np.float32) for n in a.boundary_tokens.split(",")]
    rows: list[dict[str, Any]] = []
    for forced in (["tcp", "auto"] if on_gpu else ["tcp"]):
        address = f"127.0.0.1:{free_port()}"
        env = {**os.environ, transport.ENV: forced, **(gpu_env([0, 1], 1) if a.gpus >= 2 else {})}
        device = "cuda:0" if a.gpus else a.device
        log = Path(tempfile.mkdtemp(prefix="boundary-")) / "executor.log"
        with open(log, "wb") as out:
            receiver = subprocess.Popen([sys.executable, "-m", "graphmesh_executor.server", "--listen", address,
                                         "--backend", "torch", "--device", device, "--max-message-bytes", "2047Mi"],
                                        stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(address, receiver, 300.0, "the receiving executor", log=log)
            pusher = BoundaryPusher(device=sender_device)
            step = 0
            for value in values:
                times, answers = [], set()
                for i in range(a.boundary_repeats + 1):  # the first opens the link or maps a slot: not counted
                    step += 1
                    boundary = Boundary(step, values={dag.ACTIVATION: value})
                    done: Future[Exception | None] = Future()
                    began = time.perf_counter()
                    pusher(address, 1, boundary, 120.0, done.set_result)
                    error = done.result(timeout=300)
                    if i:
                        times.append(time.perf_counter() - began)
                    answers.add(getattr(error, "reason", repr(error)))
                if answers != {"NOT_INSTALLED"}:
                    raise RuntimeError(f"the receiving executor answered {answers}, not NOT_INSTALLED: see {log}")
                choice = pusher.transports[address]
                seconds = median(times)
                rows.append({"transport": transport.NAMES[choice.transport], "reason": choice.reason,
                             "tokens": value.shape[0], "bytes": value.nbytes, "seconds": seconds,
                             "gb_s": value.nbytes / seconds / 1e9, "sender": sender_device,
                             "receiver_gpu": 1 if a.gpus >= 2 else 0 if on_gpu else None})
                progress(f"   {rows[-1]['transport']}, {value.nbytes / 2**20:.1f} MiB: {seconds * 1e3:.2f} ms, "
                         f"{rows[-1]['gb_s']:.2f} GB/s ({choice.reason})")
        finally:
            receiver.terminate()
            receiver.wait(timeout=30)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


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
    p.add_argument("--shape", default="tinyllama", choices=sorted(SHAPES), help="the random model's shape")
    p.add_argument("--concurrency", default="1,32,128,256")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--executors", default="1,2", help="comma-separated executor counts, one mesh each")
    p.add_argument("--kv-cache-bytes", default="8Gi")
    p.add_argument("--dtype", default="bf16", help="stage dtype; f32 shows batched == solo tokens without bf16 rounding")
    p.add_argument("--steps-in-flight", type=int, default=0, help="the coordinator's --steps-in-flight (0: its default)")
    p.add_argument("--decode-steps", type=int, default=0,
                   help="the coordinator's --decode-steps (longest decode run; 0: its default for the devices)")
    p.add_argument("--max-step-tokens", type=int, default=0,
                   help="the coordinator's --max-step-tokens (a step's token budget; 0: its default for the devices)")
    p.add_argument("--transports", default="links",
                   help="comma-separated: links (boundary links, the default) and/or grpc (PushBoundary calls)")
    p.add_argument("--mps", default="off", help="comma-separated: off and/or on (NVIDIA MPS for the executors)")
    p.add_argument("--client", default="aio", choices=["aio", "multiplexed", "threads"],
                   help="the streams' client: one asyncio loop over shared channels, all of them over one "
                        "GenerateStreams stream, or a thread and channel each")
    p.add_argument("--frontend", action="store_true",
                   help="the streams call a graphmesh-frontend, which relays them to the coordinator over one stream")
    p.add_argument("--no-peer", action="store_true", help="the meshes only (the peer needs CUDA)")
    p.add_argument("--peer-from", default="", help="an earlier results file whose peer rows to reuse (the peer is "
                   "not run again: a 10-minute call holds the peer or a mesh or two, not all); the JSON records the "
                   "file, since its peer ran in another call, perhaps on another machine")
    p.add_argument("--workload", default="levels", choices=["levels", "poisson"],
                   help="poisson: a serving run with Poisson arrivals after the levels, per mesh")
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals a second")
    p.add_argument("--requests", type=int, default=64, help="requests of the Poisson run")
    p.add_argument("--gpus", type=int, default=0, help="one executor per GPU: a mesh of n executors on GPUs 0..n-1 "
                   "(default 0: every executor on --device)")
    p.add_argument("--shard-bytes", type=byte_size, default=4 << 30, help="safetensors shard size of the random model")
    p.add_argument("--write-piece-bytes", type=byte_size, default=256 << 20,
                   help="the most the writer holds in host memory at once")
    p.add_argument("--write-only", default="", help="write the random checkpoint to this directory and stop")
    p.add_argument("--measure-boundary", action="store_true",
                   help="time boundaries between two GPUs (or on the device) by transport and size, and stop")
    p.add_argument("--boundary-tokens", default="32768",
                   help="--measure-boundary's sizes in f32 rows of the shape's width (default: a 32k-token prefill)")
    p.add_argument("--boundary-repeats", type=int, default=5)
    p.add_argument("--py-spy", type=int, default=0, metavar="PASSES",
                   help="after the levels, py-spy every process of each mesh through this many passes of the largest "
                        "level (collapsed stacks beside --out; the busiest threads' frames printed)")
    p.add_argument("--out", default=str(RESULTS_DIR / "gpu_mesh.json"))
    a = p.parse_args()
    shape = SHAPES[a.shape]
    writer_device = "cuda:0" if a.gpus else (a.device if a.device.startswith("cuda") else "cpu")
    if a.write_only:
        progress(f"== writing a random {a.shape} model (bf16) to {a.write_only}")
        stats = write_random_model(shape, writer_device, Path(a.write_only), a.shard_bytes, a.write_piece_bytes)
        print(json.dumps(stats))
        print(f"peak RSS growth {stats['peak_rss_growth_bytes'] / 2**20:.0f} MiB while writing "
              f"{stats['bytes'] / 2**30:.2f} GiB in {stats['shards']} shards (largest "
              f"{stats['largest_shard_bytes'] / 2**20:.0f} MiB, pieces of {a.write_piece_bytes / 2**20:.0f} MiB)")
        return
    if a.measure_boundary:
        progress(f"== boundaries of {a.boundary_tokens} tokens, {a.shape} width")
        boundary = measure_boundary(a, shape)
        out = Path(a.out if a.out != str(RESULTS_DIR / "gpu_mesh.json") else RESULTS_DIR / "gpu_boundary.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"benchmark": "gpu_boundary", "machine": machine(os.getloadavg()), "shape": a.shape,
                                   "gpus": a.gpus, "boundary": boundary}, indent=1) + "\n")
        progress(f"== wrote {out}")
        return
    levels = [int(x) for x in a.concurrency.split(",")]
    counts = [int(x) for x in a.executors.split(",")]
    if a.gpus and max(counts) > a.gpus:
        raise SystemExit(f"--gpus {a.gpus}: one executor per GPU, so no mesh of {max(counts)} executors")
    load = os.getloadavg()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, shape["vocab_size"], a.prompt_tokens).tolist() for _ in range(max(levels))]
    transports = a.transports.split(",")
    if not set(transports) <= {"links", "grpc"}:
        raise SystemExit(f"--transports takes links and/or grpc, not {a.transports!r}")
    mps = a.mps.split(",")
    if not set(mps) <= {"off", "on"}:
        raise SystemExit(f"--mps takes off and/or on, not {a.mps!r}")
    runs: dict[str, dict[str, Any]] = {}  # by mesh: executors, transport, "+mps" where MPS ran
    peer: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"== writing a random {a.shape} model (bf16) to {tmp}")
        write_random_model(shape, writer_device, Path(tmp), a.shard_bytes, a.write_piece_bytes)
        import torch  # the writer's copy on the GPU goes before the peer and the meshes take it

        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        if a.peer_from:
            peer = {int(r["batch"]): r for r in json.loads(Path(a.peer_from).read_text())["peer"]["rows"]}
        elif not a.no_peer:
            peer = run_peer(a, tmp, levels)
        for setting in mps:
            with mps_daemon(setting == "on"):
                for n in counts:
                    for transport in transports:
                        name = f"{n} executor{'s' if n > 1 else ''}, {transport}" + (", MPS" if setting == "on" else "")
                        runs[name] = run_mesh(a, tmp, n, transport, levels, prompts, name, shape["vocab_size"])
    for run in runs.values():
        for row in run["rows"]:
            row["peer_tok_s"] = peer[row["streams"]]["tok_s"] if row["streams"] in peer else float("nan")
            row["x_peer"] = row["tok_s"] / row["peer_tok_s"]  # NaN where the peer did not run at this level
            row["decode_x_peer"] = row["decode_tok_s"] / row["peer_tok_s"]
    cols = ["streams", "tok_s", "peer_tok_s", "x_peer", "decode_tok_s", "decode_x_peer", "vs_one_stream", "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_chunk", "same_as_solo"]
    for name, run in runs.items():
        print(f"\n{a.shape}, {a.dtype}, {name}; recoveries during the run: {run['recoveries']}")
        print(table(cols, [[row[c] for c in cols] for row in run["rows"]]))
        print("where the time went (last repeat; ms of the coordinator's steps by kind, steps, mean rows):")
        wheres = [(row["streams"], row["where"][-1]) for row in run["rows"]]
        if run["poisson"]:
            wheres.append(("Poisson", run["poisson"]["where"]))
        print(table(["streams", "wall", "prompt", "decode_run", "decode", "outside steps", "compiles", "GPU busy",
                     "cores busy: " + " / ".join(wheres[0][1]["cores"]) if wheres else ""], [
            [streams, f"{1e3 * w['wall_s']:.0f}",
             *(f"{1e3 * w[k]['s']:.0f} ({w[k]['steps']:.0f}, {w[k]['rows'] / max(w[k]['steps'], 1):.0f})"
               for k in ("prompt", "decode_run", "decode")),
             f"{1e3 * w['outside_steps_s']:.0f}", f"{w['compiles']:.0f} ({1e3 * w['compile_s']:.0f} ms)",
             _share(w.get("gpu_busy", math.nan)), " / ".join(f"{v:.2f}" for v in w["cores"].values())]
            for streams, w in wheres]))
        for process, busiest in run["profiles"].items():
            print(f"py-spy, {process}: the busiest threads and their commonest frames (share of the thread's samples)")
            for t in busiest:
                print(f"  {t['thread']} (running {t['busy']:.0%} of the time): " +
                      "; ".join(f"{leaf} {share:.0%}" for leaf, share in t["leaves"]))
        if run["poisson"]:
            print("Poisson serving run: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in run["poisson"].items() if k != "where"))
    result = {"benchmark": "gpu_mesh", "machine": machine(load), "shape": a.shape,
              "model": f"random {shape.get('model_type', 'llama')}, {a.shape} shape",
              "dtype": a.dtype, "device": a.device, "gpus": a.gpus, "tokens_per_stream": a.tokens,
              "prompt_tokens": a.prompt_tokens,
              "repeats": a.repeats, "decode_steps": a.decode_steps, "client": a.client, "frontend": a.frontend,
              "max_step_tokens": a.max_step_tokens,
              "peer": {"kind": "gpu_peer.py: torch.compile(mode='reduce-overhead'), static KV cache, SDPA",
                       "rows": list(peer.values()), "from": a.peer_from or "this run"}, "meshes": runs,
              "recoveries": sum(r["recoveries"] for r in runs.values()),
              "env": {k: v for k, v in os.environ.items() if k.startswith(("CUDA", "NCCL", "GRAPHMESH"))}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    progress(f"== wrote {a.out}")


if __name__ == "__main__":
    main()
