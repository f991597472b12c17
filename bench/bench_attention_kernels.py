"""Paged attention on one GPU, the kernels side by side in the same run: the torch backend's Triton row kernel (what
the mesh runs), torch's SDPA (over gathered blocks for decode, a flash call per sequence for prompts), and FlashInfer
(`flashinfer-python`: paged decode and paged prefill over a block table, the kernels vLLM and SGLang use), over the
same pool, block table and queries.

Decode: B rows of one query each, every row's keys in its own pool blocks (the mesh's layout: a pool [rows, Hkv, D],
block b its rows b*16..); each kernel is captured in a CUDA graph of LAYERS calls, as a decode iteration replays them,
and the figure is the GPU time of one call. Prefill: the prompt steps of a serving load (chunks of prompts from
position 0 or after a prefix, some with decodes beside them), run eagerly as the mesh runs a prompt step, host work
included; the figure is the wall time of one layer's call once the step's layout is made (the mesh makes it once a
step, not once a layer). Every output is checked against float64 attention over the same keys.

FlashInfer compiles its kernels on first use with the machine's nvcc (minutes per configuration); its plan() is
host work once a step, reported apart. Where it is not installed its columns are empty and the run says so.

    python bench/bench_attention_kernels.py --shape tinyllama,llama8b   # needs a CUDA device
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import RESULTS_DIR, interleaved_medians, machine, median, progress, table

SHAPES = {"tinyllama": (32, 4, 64), "llama8b": (32, 8, 128)}  # query heads, kv heads, head size
BLOCK = 16  # StageSpec.kv_block_tokens: the mesh's block on every device
LAYERS = 22  # calls a captured graph holds: one decode iteration of the 1.1B model
# Prompt steps (rows of one sequence at consecutive positions; the step budget is 2,048 tokens): (queries, prefix).
PREFILLS: dict[str, list[tuple[int, int]]] = {
    "8 prompts of 256": [(256, 0)] * 8,
    "1 prompt of 2048": [(2048, 0)],
    "chunk of 1024 after 1024": [(1024, 1024)],
    "4 prompts of 384 + 64 decodes": [(384, 0)] * 4 + [(1, 200)] * 64,
    "16 prompts of 32 + 128 decodes": [(32, 0)] * 16 + [(1, 100)] * 128,
}


def _flashinfer() -> Any:
    try:
        import flashinfer
    except Exception as e:  # not installed, or its import failed on this machine
        progress(f"flashinfer not usable here: {type(e).__name__}: {e}")
        return None
    return flashinfer


class Case:
    """Sequences in one pool: each its own random blocks, its queries the last `queries` of its `keys` positions."""

    def __init__(self, torch: Any, shape: tuple[int, int, int], runs: list[tuple[int, int]], dtype: Any,
                 seed: int) -> None:
        hq, hkv, d = shape
        gen = torch.Generator().manual_seed(seed)
        self.torch, self.hq, self.hkv, self.d, self.dtype = torch, hq, hkv, d, dtype
        self.runs = runs
        self.keys = [q + p for q, p in runs]
        blocks = [-(-k // BLOCK) for k in self.keys]
        width = max(blocks)
        total = sum(blocks) + 8
        order = torch.randperm(total, generator=gen)
        self.table = torch.zeros(len(runs), width, dtype=torch.int32)
        self.indices, at = [], 0
        for i, n in enumerate(blocks):
            self.table[i, :n] = order[at:at + n]
            self.indices.append(order[at:at + n])
            at += n
        dev = "cuda"
        self.k_pool = (torch.randn(total * BLOCK, hkv, d, generator=gen) * 0.5).to(dev, dtype)
        self.v_pool = torch.randn(total * BLOCK, hkv, d, generator=gen).to(dev, dtype)
        tokens = sum(q for q, _ in runs)
        self.q = torch.randn(tokens, hq, d, generator=gen).to(dev, dtype)
        self.token_seq = torch.tensor([i for i, (q, _) in enumerate(runs) for _ in range(q)], dtype=torch.int32)
        self.pos = torch.tensor([p + j for q, p in runs for j in range(q)], dtype=torch.int32)
        self.table_dev = self.table.to(dev)
        self.scale = d ** -0.5

    def reference(self) -> Any:
        """float64 attention of every query over its sequence's keys up to its own position."""
        torch, out, at = self.torch, [], 0
        for i, (q, p) in enumerate(self.runs):
            ids = self.indices[i].to("cuda").long()
            rows = (ids[:, None] * BLOCK + torch.arange(BLOCK, device="cuda")).reshape(-1)[:q + p]
            k = self.k_pool[rows].double().repeat_interleave(self.hq // self.hkv, 1)  # [K, Hq, D]
            v = self.v_pool[rows].double().repeat_interleave(self.hq // self.hkv, 1)
            qs = self.q[at:at + q].double()  # [q, Hq, D]
            scores = torch.einsum("qhd,khd->hqk", qs, k) * self.scale
            seen = torch.arange(q + p, device="cuda")[None, :] <= (p + torch.arange(q, device="cuda"))[:, None]
            scores = scores.masked_fill(~seen[None], -math.inf)
            out.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v))
            at += q
        return torch.cat(out)

    def flashinfer_layout(self) -> tuple[Any, Any, Any, Any]:
        """FlashInfer's paged-KV description of the same table: (qo_indptr, kv_indptr, kv_indices, last_page_len)."""
        torch = self.torch
        counts = [len(ix) for ix in self.indices]
        kv_indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        qo_indptr = torch.tensor([0, *torch.tensor([q for q, _ in self.runs]).cumsum(0).tolist()], dtype=torch.int32)
        last = torch.tensor([(k - 1) % BLOCK + 1 for k in self.keys], dtype=torch.int32)
        indices = torch.cat(self.indices).to(torch.int32).to("cuda")
        return qo_indptr, kv_indptr, indices, last


def _graph_us(torch: Any, call: Callable[[], Any], replays: int = 20) -> float:
    """GPU microseconds of one `call`, from a CUDA graph of LAYERS calls replayed (launches as the mesh makes them)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            call()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * LAYERS))
    return median(times)


def _wall_us(torch: Any, call: Callable[[], Any], repeats: int = 15) -> float:
    """Wall microseconds of one eager `call`, host work and the GPU's together."""
    return interleaved_medians([lambda: (call(), torch.cuda.synchronize())], repeats)[0] * 1e6


def _error(out: Any, ref: Any) -> float:
    return float((out.double() - ref).abs().max())


def decode_rows(torch: Any, fi: Any, shape: tuple[int, int, int], rows: int, context: int, dtype: Any
                ) -> dict[str, Any]:
    """One decode layer of `rows` rows at `context` keys each, by every kernel."""
    import torch.nn.functional as F

    from graphmesh_executor.backends import cuda_kernels
    case = Case(torch, shape, [(1, context - 1)] * rows, dtype, seed=rows * 7919 + context)
    hq, hkv, d = shape
    pos = case.pos.to("cuda")
    ref = case.reference()
    row: dict[str, Any] = {"rows": rows, "context": context}

    def triton() -> Any:
        return cuda_kernels.paged_decode_attention(case.q, case.k_pool, case.v_pool, case.table_dev, pos, BLOCK,
                                                   case.scale)

    blocks = case.table.shape[1]
    keys = blocks * BLOCK
    ids = case.table_dev[:, :blocks].reshape(-1).long()
    hide = torch.arange(keys, device="cuda")[None, :] > pos[:, None]
    bias = torch.zeros(hide.shape, dtype=dtype, device="cuda").masked_fill_(hide, -math.inf)[:, None, None]

    def sdpa() -> Any:  # the torch backend's decode path without the row kernel: blocks gathered, one fused call
        k = case.k_pool.view(-1, BLOCK, hkv, d).index_select(0, ids).view(rows, keys, hkv, d)
        v = case.v_pool.view(-1, BLOCK, hkv, d).index_select(0, ids).view(rows, keys, hkv, d)
        o = F.scaled_dot_product_attention(case.q.reshape(rows, hkv, hq // hkv, d), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=bias, scale=case.scale)
        return o.reshape(rows, hq, d)

    kernels: dict[str, Callable[[], Any]] = {"triton": triton, "sdpa": sdpa}
    if fi is not None:
        _, kv_indptr, indices, last = case.flashinfer_layout()
        k4, v4 = case.k_pool.view(-1, BLOCK, hkv, d), case.v_pool.view(-1, BLOCK, hkv, d)
        for cores in (False, True):
            workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=cores,
                paged_kv_indptr_buffer=kv_indptr.to("cuda"), paged_kv_indices_buffer=indices.clone(),
                paged_kv_last_page_len_buffer=last.to("cuda"))

            def plan(w: Any = wrapper) -> None:
                w.plan(kv_indptr, indices, last, hq, hkv, d, BLOCK, q_data_type=dtype, kv_data_type=dtype,
                       sm_scale=case.scale)
            t0 = time.perf_counter()
            plan()
            row[f"flashinfer{'_tc' if cores else ''}_first_plan_s"] = time.perf_counter() - t0  # JIT on first use
            row[f"flashinfer{'_tc' if cores else ''}_plan_us"] = _wall_us(torch, plan)
            kernels["flashinfer_tc" if cores else "flashinfer"] = (
                lambda w=wrapper: w.run(case.q, (k4, v4)))  # type: ignore[misc]
    for name, call in kernels.items():
        try:
            row[f"{name}_err"] = _error(call(), ref)
            row[f"{name}_us"] = _graph_us(torch, call)
        except Exception as e:  # one kernel's failure is a figure of its own, not the end of the run
            row[f"{name}_failed"] = f"{type(e).__name__}: {e}"[:300]
            progress(f"  {name} failed: {row[f'{name}_failed']}")
    return row


def prefill_step(torch: Any, fi: Any, shape: tuple[int, int, int], name: str, runs: list[tuple[int, int]],
                 dtype: Any) -> dict[str, Any]:
    """One prompt step's layer by every path: the mesh's op, the row kernel for every row, SDPA per sequence,
    FlashInfer's paged prefill."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from graphmesh_executor.backends import cuda_kernels, torch_attention
    from graphmesh_executor.executable import RngOptions, RunContext
    case = Case(torch, shape, runs, dtype, seed=len(name))
    hq, hkv, d = shape
    ref = case.reference()
    token_seq, pos = case.token_seq.to("cuda"), case.pos.to("cuda")
    ctx = RunContext(RngOptions())
    attrs = {"block_size": BLOCK, "scale": case.scale, "window": 0, "softcap": 0.0, "decode": False}
    row: dict[str, Any] = {"step": name, "tokens": int(case.q.shape[0]), "sequences": len(runs)}

    def mesh() -> Any:  # the op as a prompt step runs it (its layout memoised on the step's tensors, as in a step)
        return torch_attention.paged_attention(ctx, [case.q, case.k_pool, case.v_pool, case.table_dev, token_seq,
                                                     pos], attrs)

    row_table = case.table_dev.index_select(0, token_seq.long())

    def rows() -> Any:  # every row a query of the row kernel (what runs of up to ROW_KERNEL_RUN rows take)
        return cuda_kernels.paged_decode_attention(case.q, case.k_pool, case.v_pool, row_table, pos, BLOCK,
                                                   case.scale)

    gathered = []
    at = 0
    for i, (q, p) in enumerate(runs):
        ids = case.indices[i].to("cuda").long()
        gathered.append((at, q, p, ids))
        at += q

    def sdpa() -> Any:  # a flash call per sequence over its gathered blocks (what longer runs take)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return torch.cat([one(*g) for g in gathered])  # no cuDNN, as the mesh's prompt runs

    def one(start: int, q: int, p: int, ids: Any) -> Any:
        k = case.k_pool.view(-1, BLOCK, hkv, d).index_select(0, ids).reshape(-1, hkv, d)[:q + p]
        v = case.v_pool.view(-1, BLOCK, hkv, d).index_select(0, ids).reshape(-1, hkv, d)[:q + p]
        qs = case.q[start:start + q]
        if p == 0 and q > 1:
            o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, scale=case.scale,
                                               enable_gqa=True)
        else:  # a masked call takes no grouped heads (the memory-efficient kernel), so they are repeated
            seen = torch.arange(q + p, device="cuda")[None, :] <= (p + torch.arange(q, device="cuda"))[:, None]
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1)[None], k.repeat_interleave(hq // hkv, 1).transpose(0, 1)[None],
                v.repeat_interleave(hq // hkv, 1).transpose(0, 1)[None], attn_mask=seen, scale=case.scale)
        return o[0].transpose(0, 1)

    kernels: dict[str, Callable[[], Any]] = {"mesh": mesh, "row_kernel": rows, "sdpa": sdpa}
    if fi is not None:
        qo_indptr, kv_indptr, indices, last = case.flashinfer_layout()
        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

        def plan() -> None:
            wrapper.plan(qo_indptr.to("cuda"), kv_indptr.to("cuda"), indices, last.to("cuda"), hq, hkv, d, BLOCK,
                         causal=True, sm_scale=case.scale, q_data_type=dtype, kv_data_type=dtype)
        t0 = time.perf_counter()
        plan()
        row["flashinfer_first_plan_s"] = time.perf_counter() - t0
        row["flashinfer_plan_us"] = _wall_us(torch, plan)
        k4, v4 = case.k_pool.view(-1, BLOCK, hkv, d), case.v_pool.view(-1, BLOCK, hkv, d)
        kernels["flashinfer"] = lambda: wrapper.run(case.q, (k4, v4))
    for kname, call in kernels.items():
        try:
            row[f"{kname}_err"] = _error(call(), ref)
            row[f"{kname}_us"] = _wall_us(torch, call)
        except Exception as e:
            row[f"{kname}_failed"] = f"{type(e).__name__}: {e}"[:300]
            progress(f"  {kname} failed: {row[f'{kname}_failed']}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tinyllama,llama8b", help="comma-separated: " + ", ".join(SHAPES))
    p.add_argument("--rows", default="1,32,128,256", help="decode rows")
    p.add_argument("--contexts", default="160,1024,4096", help="keys of each decode row")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16"])
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--out", default=str(RESULTS_DIR / "attention_kernels.json"))
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_attention_kernels needs a CUDA device")
    load = os.getloadavg()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    fi = _flashinfer()
    result: dict[str, Any] = {
        "benchmark": "attention_kernels", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "flashinfer": getattr(fi, "__version__", None), "dtype": a.dtype, "block": BLOCK, "layers_a_graph": LAYERS,
        "decode": {}, "prefill": {}}
    for shape_name in a.shape.split(","):
        shape = SHAPES[shape_name]
        decode = []
        for context in [int(c) for c in a.contexts.split(",")]:
            for rows in [int(r) for r in a.rows.split(",")]:
                progress(f"== {shape_name} decode: {rows} rows of {context} keys")
                decode.append(decode_rows(torch, fi, shape, rows, context, dtype))
        result["decode"][shape_name] = decode
        _write(a.out, result, load)
        _print(f"{shape_name} {shape}: one decode layer, GPU us (a graph of {LAYERS} calls), max |err| vs f64",
               ["rows", "context"], ["triton", "sdpa", "flashinfer", "flashinfer_tc"], decode)
        if a.no_prefill:
            continue
        prefill = []
        for name, runs in PREFILLS.items():
            progress(f"== {shape_name} prefill: {name}")
            prefill.append(prefill_step(torch, fi, shape, name, runs, dtype))
        result["prefill"][shape_name] = prefill
        _print(f"{shape_name}: one prompt step's layer, wall us (eager, host work included), max |err| vs f64",
               ["step", "tokens"], ["mesh", "row_kernel", "sdpa", "flashinfer"], prefill)
        _write(a.out, result, load)  # after each shape: a call that runs out of time keeps what it measured


def _print(title: str, keys: list[str], names: list[str], rows: list[dict[str, Any]]) -> None:
    """A table of `rows`: their keys, each kernel's microseconds, FlashInfer's plan, the first kernel's and
    FlashInfer's largest error."""
    nan = float("nan")
    print(f"\n{title}")
    print(table([*keys, *[f"{n} us" for n in names], "fi plan us", f"{names[0]} err", "fi err"],
                [[*[r[k] for k in keys], *[r.get(f"{n}_us", nan) for n in names], r.get("flashinfer_plan_us", nan),
                  r.get(f"{names[0]}_err", nan), r.get("flashinfer_err", nan)] for r in rows]))


def _write(out: str, result: dict[str, Any], load: tuple[float, float, float]) -> None:
    result["machine"] = machine(load)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    progress(f"== wrote {out}")


if __name__ == "__main__":
    main()
