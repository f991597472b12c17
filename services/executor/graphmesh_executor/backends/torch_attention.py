"""The torch backend's attention and KV ops: attention over a cache, the KV writes (in place where the executable
donated the pool), and paged attention over a block table, on CPU or CUDA.

Decode rows (one query per sequence) take one kernel over the pool (cpu_kernels, or the Triton row kernel on CUDA):
no gathered copy of a sequence's blocks. Prompt chunks mixed with decodes take, on CUDA, the same row kernel for
every run of up to ROW_KERNEL_RUN rows, so a row's bits depend on its own run alone; longer runs and CPU prompts take
a flash kernel per sequence (their bits their run's alone too), or on CUDA in bf16 and f16, where flashinfer-python
is installed, FlashInfer's paged prefill, every long run of the step in one launch (flashinfer_prefill.py).

Why decode keeps the row kernel and not FlashInfer's (measured beside it over one pool, bench_attention_kernels.py):
over short contexts it is faster at every row count, from 32 rows over long ones about even, and FlashInfer needs a
host plan every step; FlashInfer is faster for a few rows over thousands of keys, where it splits a row's keys
across the GPU and the row kernel runs a program per row and kv head.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphmesh.errors import OutOfRange
from graphmesh_executor.backends import cpu_kernels, cuda_kernels, flashinfer_prefill
from graphmesh_executor.backends.torch_tensors import (
    HALF,
    MEMO,
    Run,
    Tensor,
    check_indices,
    memo,
    span,
    static_run,
    upcast,
)
from graphmesh_executor.executable import RunContext

# A tensor attribute: the kv_write cache the executable hands over for an in-place write (TorchExecutable's donations).
# It lives exactly as long as the tensor.
DONATED = "_graphmesh_donated"


def _visible(pos: Tensor, keys: int, window: int) -> Tensor:
    """[*pos.shape, keys]: whether a query at `pos` sees each key: up to its position, and within `window` (0: none)."""
    j = torch.arange(keys, device=pos.device)
    seen = j <= pos[..., None]
    return seen & (j > pos[..., None] - window) if window else seen


def _explicit_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, scale: float, softcap: float
                        ) -> Tensor:
    """q [S, Hq, D], k and v [K, Hkv, D], visible [S, K] (None: every key) -> [S, Hq, D], the scores written out:
    SDPA has no soft-cap (Gemma 2)."""
    s, hq, d = q.shape
    hkv = k.shape[1]
    qg = upcast(q).reshape(s, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, S, D]
    scores = torch.matmul(qg, upcast(k).permute(1, 2, 0)[:, None]) * scale  # [Hkv, G, S, K]
    scores = scores.float() if scores.dtype in HALF else scores
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    vh = upcast(v).transpose(0, 1)[:, None]  # [Hkv, 1, K, D]
    out = torch.matmul(torch.softmax(scores, -1).to(vh.dtype), vh)  # [Hkv, G, S, D]
    return out.permute(2, 0, 1, 3).reshape(s, hq, d).to(q.dtype)


def attention(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    q, k, v = xs[:3]  # [S, H, D]
    window, softcap = a["window"], a["softcap"]
    mask = None
    causal = False  # the mask is exactly SDPA's lower triangle: its flash kernel, not a masked one (~1.5x on CPU)
    hide = None  # decode: keys past the query's position (or before its window), on the device
    if a["causal"] and q.shape[0] and static_run(ctx):
        # No host read of the positions: every cache row is read and rows past each query's position are
        # masked, so one captured graph serves every position.
        pos, keys = xs[3], k.shape[0]
        visible: Tensor = memo(pos, ("static-mask", keys, window), lambda: _visible(pos, keys, window))
        mask, hide = visible, memo(pos, ("static-hide", keys, window), lambda: ~visible[0])
        # Rows past every query are padding that may hold anything (NaN included): a zero weight times NaN is
        # NaN, so they are zeroed, not only masked.
        pad = memo(pos, ("static-pad", keys), lambda: (torch.arange(keys, device=q.device) > pos.max())[:, None, None])
        k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
    elif a["causal"] and q.shape[0]:
        pos = xs[3]
        lo, hi = span(pos)
        keys = min(k.shape[0], hi + 1)  # rows past every query's position are padding: never read them
        k, v = k[:keys], v[:keys]
        if window and hi - window + 1 > 0:  # some query's window starts past key 0
            mask = memo(pos, ("mask", keys, window), lambda: _visible(pos, keys, window))
            hide = ~mask[0] if q.shape[0] == 1 else None
        elif lo + 1 < keys:  # some query sees fewer keys than remain (prefill); a decode step needs no mask
            causal = lo == 0 and keys == q.shape[0] and memo(pos, "iota", lambda: bool(
                torch.equal(pos, torch.arange(keys, dtype=pos.dtype, device=pos.device))))
            if not causal:
                mask = memo(pos, ("mask", keys), lambda: torch.arange(keys, device=q.device)[None, :] <= pos[:, None])
    scale = a["scale"] or q.shape[2] ** -0.5
    if q.shape[0] == 1:
        # Decode: two small matmuls per kv head group; SDPA's dispatch costs more than the math here
        # (measured 1.65 ms vs 0.12 ms on CPU for 32 heads over 400 keys). One query needs no causal mask.
        hq, d = q.shape[1:]
        hkv = k.shape[1]
        qg, kh, vh = upcast(q).reshape(hkv, hq // hkv, d), upcast(k).permute(1, 2, 0), upcast(v).transpose(0, 1)
        scores = torch.matmul(qg, kh) * scale  # [Hkv, G, keys]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if hide is not None:
            scores.masked_fill_(hide, -math.inf)
        p = torch.softmax(scores.float() if scores.dtype in HALF else scores, -1).to(vh.dtype)
        return torch.matmul(p, vh).reshape(1, hq, d).to(q.dtype)  # [Hkv, G, D] -> [1, Hq, D]
    if softcap:
        if causal:
            mask = memo(xs[3], ("mask", k.shape[0]), lambda: _visible(xs[3], k.shape[0], 0))
        return _explicit_attention(q, k, v, mask, scale, softcap)
    # A batch axis of 1: torch's CPU flash kernel takes 4-d inputs only (3-d ones fall back to the math path, 3-4x slower).
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=causal, scale=a["scale"] or None,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def kv_write(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    cache, rows, pos = xs
    if static_run(ctx):
        # The executable checked the row range on the host, and writes its donated caches in place.
        idx = pos.reshape(-1)[:1]
        if rows.shape[0] > 1:
            idx = idx + torch.arange(rows.shape[0], device=pos.device)
        cache.__dict__.pop(DONATED, None)
        cache.__dict__.pop(MEMO, None)
        return cache.index_copy_(0, idx, rows)
    start: int = memo(pos, "start", lambda: int(pos.reshape(-1)[0]))
    if start < 0 or start + rows.shape[0] > cache.shape[0]:
        raise OutOfRange(f"kv_write of rows [{start}, {start + rows.shape[0]}) into a cache of "
                         f"{cache.shape[0]} rows", "ROW_OUT_OF_RANGE")
    # Functional unless the executable donated the cache: a handle replaced by this very output after the run.
    out = cache if cache.__dict__.pop(DONATED, False) else cache.clone()
    out[start : start + rows.shape[0]] = rows
    out.__dict__.pop(MEMO, None)  # written in place: nothing derived from it before still holds
    return out


def _writable(ctx: RunContext, pool: Tensor) -> Tensor:
    """The pool a kv_scatter writes: in place when the executable donated it (the handle this output replaces) or
    the run is static; a pool is the whole KV of every session on the stage, far too big to copy per layer per step."""
    out = pool if pool.__dict__.pop(DONATED, False) or static_run(ctx) else pool.clone()
    out.__dict__.pop(MEMO, None)  # written in place: nothing derived from it before still holds
    return out


def kv_scatter(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    pool, rows, slots = xs
    check_indices(ctx, slots, pool.shape[0], "kv_scatter slot")
    out = _writable(ctx, pool)
    # Every layer scatters to the same slots: their index form is made once a run (a kernel on CUDA).
    index = memo(slots, "index", lambda: slots.reshape(-1).long())
    return out.index_copy_(0, index, rows if rows.dtype == out.dtype else rows.to(out.dtype))


def kv_scatter_pair(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """Two kv_scatters to the same slots (TorchExecutable._fusions: a layer's v pool, then its k pool): one launch
    where the Triton kernel serves both, else each alone."""
    v_pool, v_rows, slots, k_pool, k_rows = xs
    if not cuda_kernels.scatter_pair_usable(k_pool, v_pool, k_rows, v_rows):
        return kv_scatter(ctx, [v_pool, v_rows, slots], a), kv_scatter(ctx, [k_pool, k_rows, slots], a)
    check_indices(ctx, slots, min(k_pool.shape[0], v_pool.shape[0]), "kv_scatter slot")
    k_out, v_out = _writable(ctx, k_pool), _writable(ctx, v_pool)
    cuda_kernels.scatter_pair(k_out, v_out, k_rows, v_rows, slots)
    return v_out, k_out


def _paged_rows(table: Tensor, blocks: int) -> Tensor:
    """Pool block ids of the first `blocks` blocks of every sequence, flattened [B * blocks]; once a run."""
    return memo(table, ("paged-rows", blocks), lambda: table[:, :blocks].reshape(-1).long())  # type: ignore[no-any-return]


def paged_attention(ctx: RunContext, xs: list[Tensor], a: dict[str, Any]) -> Tensor:
    q, k_pool, v_pool, table, token_seq, pos = xs
    block, (t, hq, d), hkv = a["block_size"], q.shape, k_pool.shape[1]
    scale, window, softcap = a["scale"] or d**-0.5, a["window"], a["softcap"]
    check_indices(ctx, table, k_pool.shape[0] // block, "block_table block")
    check_indices(ctx, token_seq, table.shape[0], "token_seq sequence")
    check_indices(ctx, pos, table.shape[1] * block, "q_positions position")
    if a["decode"] and not static_run(ctx) and cpu_kernels.attention_usable(q, k_pool, v_pool):
        return cpu_kernels.paged_decode_attention(q, k_pool, v_pool, table, pos, block, scale, window,
                                                  softcap)  # in place, no copies
    k_blocks, v_blocks = k_pool.view(-1, block, hkv, d), v_pool.view(-1, block, hkv, d)
    if a["decode"] and cuda_kernels.paged_decode_usable(q, k_pool, v_pool):
        return cuda_kernels.paged_decode_attention(q, k_pool, v_pool, table, pos, block, scale, window,
                                                   softcap)  # one kernel, no copies
    if a["decode"]:
        # One query per sequence: gather every sequence's blocks (whole-block copies) and run one batched
        # attention with keys past each query masked. Static runs read every block of the table (no host read).
        blocks = table.shape[1] if static_run(ctx) else -(-(span(pos)[1] + 1) // block)
        ids = _paged_rows(table, blocks)
        keys = blocks * block
        k = k_blocks.index_select(0, ids).view(t, keys, hkv, d)
        v = v_blocks.index_select(0, ids).view(t, keys, hkv, d)
        if q.is_cuda and not softcap:
            # One fused attention kernel where the products below take ~10 (a decode step's GPU time is mostly
            # kernel count): each kv head's group of query heads is that head's query axis, so no kv head is
            # repeated; every (sequence, kv head) is its own problem, whatever the other rows of the batch.
            bias = memo(pos, ("paged-bias", keys, q.dtype, window),
                         lambda: _hiding_bias(pos, keys, q.dtype, window)[:, None, None])
            attended = F.scaled_dot_product_attention(q.reshape(t, hkv, hq // hkv, d), k.transpose(1, 2),
                                                      v.transpose(1, 2), attn_mask=bias, scale=scale)
            return attended.reshape(t, hq, d)
        hidden = memo(pos, ("paged-hide", keys, window), lambda: ~_visible(pos, keys, window))
        scores = torch.matmul(q.reshape(t, hkv, hq // hkv, d), k.permute(0, 2, 3, 1)) * scale  # [T, Hkv, G, keys]
        scores = scores.float() if scores.dtype in HALF else scores
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(hidden[:, None, None, :], -math.inf)
        p = torch.softmax(scores, -1).to(v.dtype)
        return torch.matmul(p, v.permute(0, 2, 1, 3)).reshape(t, hq, d).to(q.dtype)
    # Chunks of prompts (and decodes) mixed: each sequence's queries are one contiguous run of rows.
    if static_run(ctx) and cuda_kernels.paged_decode_usable(q, k_pool, v_pool):
        # Every run fits the row kernel (cuda_graphs checked rows_fit on the host inputs): each row of the bucket is
        # a query of it, as _rows_attention gives a short run's rows, with no host read (a captured graph).
        row_table = memo(token_seq, ("static-row-table", id(table)), lambda: table.index_select(0, token_seq.long()))
        return cuda_kernels.paged_decode_attention(q, k_pool, v_pool, row_table, pos, block, scale, window, softcap)
    runs = _prompt_runs(token_seq, pos)
    if q.is_cuda and cuda_kernels.paged_decode_usable(q, k_pool, v_pool):
        return _rows_attention(q, k_pool, v_pool, table, token_seq, pos, runs, a)
    return torch.cat([_run_attention(q, k_pool, v_pool, table, pos, r, a) for r in runs])


def _run_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, pos: Tensor, run: Run,
                   a: dict[str, Any]) -> Tensor:
    """One sequence's run of query rows over its blocks: a causal kernel when the run is the sequence from 0."""
    seq, start, end, keys, from_zero = run
    block, (hkv, d) = a["block_size"], k_pool.shape[1:]
    scale, window, softcap = a["scale"] or d**-0.5, a["window"], a["softcap"]
    ids = table[seq, :-(-keys // block)].long()
    k = k_pool.view(-1, block, hkv, d).index_select(0, ids).reshape(-1, hkv, d)[:keys]
    v = v_pool.view(-1, block, hkv, d).index_select(0, ids).reshape(-1, hkv, d)[:keys]
    qs, ps = q[start:end], pos[start:end]
    causal = from_zero and end - start > 1 and not (window and keys > window)
    mask = None if causal or (from_zero and not window) else _visible(ps, keys, window)
    if softcap:
        return _explicit_attention(qs, k, v, _visible(ps, keys, window) if causal else mask, scale, softcap)
    gqa = q.shape[1] != hkv
    if q.is_cuda and mask is not None and gqa:  # the memory-efficient kernel takes a mask but not grouped heads
        k, v, gqa = k.repeat_interleave(q.shape[1] // hkv, 1), v.repeat_interleave(q.shape[1] // hkv, 1), False
    # A batch axis of 1: torch's CPU flash kernel takes 4-d inputs only.
    with _no_cudnn() if q.is_cuda else contextlib.nullcontext():
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _no_cudnn() -> contextlib.AbstractContextManager[None]:
    """SDPA's kernels but cuDNN's, which builds a graph for every new (queries, keys) shape the first time it meets it
    (0.2-0.7 s on an H100): a prompt run has its own shape, nearly every one new under a serving load."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


# Runs of at most this many query rows take the row kernel on CUDA (each row over its own keys, as a decode row);
# longer ones a flash kernel of their own, which reads each key once per tile of queries instead of once per row.
# 512 made a serving load's prompt steps slower (chunks after long prefixes; bench/RESULTS.md).
ROW_KERNEL_RUN = 256


def _rows_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, token_seq: Tensor, pos: Tensor,
                    runs: list[Run], a: dict[str, Any]) -> Tensor:
    """A mixed step on CUDA (decodes and prompt chunks of any lengths): every row of a short run is a query of the
    paged row kernel over its sequence's table row, all in one launch, whatever the batch; each long run is one
    flash call. A row's path depends on its own run alone, so a row's bits do not depend on the other rows."""
    def layout() -> tuple[Tensor, Tensor | None, list[Run]]:
        long = [r for r in runs if r[2] - r[1] > ROW_KERNEL_RUN]
        rows = None
        if long:
            rows = torch.tensor([i for r in runs if r[2] - r[1] <= ROW_KERNEL_RUN for i in range(r[1], r[2])],
                                dtype=torch.long, device=q.device)
        seqs = token_seq.long() if rows is None else token_seq.index_select(0, rows).long()
        return table.index_select(0, seqs), rows, long
    row_table, rows, long = memo(token_seq, ("row-table", id(pos), id(table)), layout)
    kernel = {"block": a["block_size"], "scale": a["scale"] or q.shape[2] ** -0.5, "window": a["window"],
              "softcap": a["softcap"]}
    if rows is None:
        return cuda_kernels.paged_decode_attention(q, k_pool, v_pool, row_table, pos, **kernel)
    out = torch.empty_like(q)
    if rows.numel():
        out.index_copy_(0, rows, cuda_kernels.paged_decode_attention(q.index_select(0, rows), k_pool, v_pool,
                                                                      row_table, pos.index_select(0, rows), **kernel))
    if not flashinfer_prefill.attend(q, k_pool, v_pool, table, token_seq, long, a, out):
        for r in long:
            out[r[1]:r[2]] = _run_attention(q, k_pool, v_pool, table, pos, r, a)
    return out


def _hiding_bias(pos: Tensor, keys: int, dtype: torch.dtype, window: int = 0) -> Tensor:
    """[*pos.shape, keys]: 0 where a query at `pos` sees the key, -inf past it (and before its window). SDPA's fused
    CUDA kernels take it additive, in q's dtype, made once a run: a boolean mask is converted inside every layer's
    call."""
    hide = ~_visible(pos, keys, window)
    return torch.zeros(hide.shape, dtype=dtype, device=pos.device).masked_fill_(hide, -math.inf)


def rows_fit(token_seq: np.ndarray, pos: np.ndarray) -> bool:
    """Whether every run of a step's rows (_prompt_runs) has at most ROW_KERNEL_RUN rows: then each row takes the row
    kernel, and a static run may give it every row with no host read (cuda_graphs' check, on the host inputs)."""
    if not token_seq.size:
        return True
    starts = np.flatnonzero(np.concatenate([[True], (token_seq[1:] != token_seq[:-1]) | (pos[1:] != pos[:-1] + 1)]))
    return int(np.diff(np.append(starts, token_seq.size)).max()) <= ROW_KERNEL_RUN


def _prompt_runs(token_seq: Tensor, pos: Tensor) -> list[Run]:
    """The runs of adjacent rows of one sequence at consecutive positions (a bucket's padding rows, all at position
    0, are each a run of their own); once a run, not once a layer (a host read: a sync on CUDA)."""
    def split() -> list[Run]:
        seqs, positions = token_seq.tolist(), pos.tolist()
        runs: list[Run] = []
        start = 0
        while start < len(seqs):
            end = start + 1
            while end < len(seqs) and seqs[end] == seqs[start] and positions[end] == positions[end - 1] + 1:
                end += 1
            keys = max(positions[start:end]) + 1
            from_zero = positions[start] == 0 and positions[end - 1] == end - start - 1 and keys == end - start
            runs.append((seqs[start], start, end, keys, from_zero))
            start = end
        return runs
    return memo(token_seq, ("prompt-runs", id(pos)), split)  # type: ignore[no-any-return]
