"""Long prompt runs of a CUDA step through FlashInfer's paged prefill, where `flashinfer-python` is installed.

A run longer than the row kernel takes (torch_attention.ROW_KERNEL_RUN) otherwise gathers its sequence's blocks and
makes a flash call of its own. FlashInfer's BatchPrefillWithPagedKVCacheWrapper reads the pool through the block
table, every long run of the step in one launch: 2-5x faster a layer on an H100, its plan (host work, once a step)
aside (bench_attention_kernels.py, bench/RESULTS.md). It compiles its kernels with the machine's nvcc at first use,
which the stage's warm-up meets at load; where that fails (no nvcc), or with GRAPHMESH_FLASHINFER=0, the flash
calls serve, as they do for f32 (FlashInfer has no f32 kernels), soft-capped or windowed attention.

FlashInfer plans a step's work split by the step's runs, so a long run's bits may depend on the other long runs of
its step: bf16 and f16 only, which promise no batch invariance anyway (their products are cuBLAS's).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from graphmesh_executor.backends.torch_tensors import Run, Tensor, memo

log = logging.getLogger("graphmesh.executor.flashinfer")

ENV = "GRAPHMESH_FLASHINFER"  # "0": never
HEAD_SIZES = (64, 128, 256)  # those its prefill kernels are built for
# Its float workspace for split-KV partials: the 128 MB its docs suggest was too little for a 2,048-token step of 32
# heads in bench_attention_kernels' plans.
WORKSPACE_BYTES = 256 << 20


@dataclass
class _Device:
    wrapper: Any
    planned: object | None = None  # the step layout whose plan the wrapper holds


_devices: dict[int, _Device] = {}
_failed = False  # FlashInfer failed once in this process (its JIT, most likely): the flash calls serve from then on
calls = 0  # runs attended here, for tests


@functools.cache
def _module() -> Any:
    try:
        import flashinfer
    except Exception:  # not installed, or it does not import on this machine
        return None
    return flashinfer


def _usable(q: Tensor, k_pool: Tensor, v_pool: Tensor, a: dict[str, Any]) -> bool:
    """Whether the step's long runs may go through FlashInfer: CUDA, a half dtype, a head size it is built for, plain
    causal attention over contiguous pools, and FlashInfer present and not failed here."""
    return (not _failed and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and k_pool.dtype == v_pool.dtype == q.dtype and q.shape[2] in HEAD_SIZES and not a["softcap"]
            and not a["window"] and k_pool.is_contiguous() and v_pool.is_contiguous()
            and os.environ.get(ENV, "1") != "0" and _module() is not None)


def _device(index: int) -> _Device:
    held = _devices.get(index)
    if held is None:
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
        held = _devices[index] = _Device(_module().BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD"))
    return held


@dataclass(frozen=True, eq=False)
class _Layout:
    rows: Tensor  # the long runs' rows of the step, in order
    qo_indptr: Tensor
    kv_indptr: Tensor
    kv_indices: Tensor
    last_page_len: Tensor


def _layout(table: Tensor, long: list[Run], block: int, device: torch.device) -> _Layout:
    blocks = [-(-keys // block) for _, _, _, keys, _ in long]
    rows = torch.cat([torch.arange(start, end) for _, start, end, _, _ in long])
    qo = torch.tensor([0] + [end - start for _, start, end, _, _ in long]).cumsum(0)
    kv = torch.tensor([0, *blocks]).cumsum(0)
    indices = torch.cat([table[seq, :n] for (seq, _, _, _, _), n in zip(long, blocks)]).to(torch.int32)
    last = torch.tensor([(keys - 1) % block + 1 for _, _, _, keys, _ in long], dtype=torch.int32)
    return _Layout(rows.to(device), qo.to(device, torch.int32), kv.to(device, torch.int32), indices, last.to(device))


def attend(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, token_seq: Tensor, long: list[Run],
           a: dict[str, Any], out: Tensor) -> bool:
    """Writes the long runs' rows of `out` (each run's queries over its sequence's keys up to its own position);
    False, nothing written, where FlashInfer may not serve them (_usable) or failed (then, and from then on, the
    caller's flash calls serve)."""
    global _failed, calls
    if not _usable(q, k_pool, v_pool, a):
        return False
    block, (hkv, d), hq = a["block_size"], k_pool.shape[1:], q.shape[1]
    scale = a["scale"] or d**-0.5
    layout: _Layout = memo(token_seq, ("flashinfer-layout", id(table)),
                           lambda: _layout(table, long, block, q.device))
    held = _device(q.device.index or 0)
    try:
        if held.planned is not layout:  # once a step (a step's layers share its layout), again if steps interleave
            held.planned = None
            if not calls:
                log.info("FlashInfer prefill: first plan (its kernels compile now when they are not cached)")
            held.wrapper.plan(layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.last_page_len, hq, hkv,
                              d, block, causal=True, sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_pool.dtype)
            held.planned = layout
        attended = held.wrapper.run(q.index_select(0, layout.rows),
                                    (k_pool.view(-1, block, hkv, d), v_pool.view(-1, block, hkv, d)))
    except Exception as e:
        _failed = True
        log.warning("FlashInfer prefill failed; long prompt runs take the flash calls from now on",
                    extra={"error": f"{type(e).__name__}: {e}"[:500]})
        return False
    out.index_copy_(0, layout.rows, attended.to(out.dtype))
    calls += len(long)
    return True
