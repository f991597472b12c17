"""The torch backend's CUDA kernels for decode, in Triton: one launch where torch's ops take several.

On a GPU a decode step of a few dozen rows is not bound by its arithmetic but by its kernel count: a stage
iteration of the 1.1B mesh (11 layers, 16 rows) was ~300 small kernels and ~1.1 ms of GPU time on an H200, where
its weights alone read in ~0.12 ms. So the ops a layer repeats get one kernel each:

- rope ("half" style over the whole head): torch's form is a product, a roll and an addcmul; a layer's q and k
  rotate in one launch (TorchExecutable fuses the two nodes);
- a layer's two KV writes (k and v rows into their pools at the same slots): one launch, not two index_copy_;
- paged decode attention (one query row per sequence): torch's form gathers every sequence's blocks for keys and
  for values, then runs SDPA with an additive mask. Here each (sequence, kv head) walks its own blocks through the
  block table, up to its own position, with an online softmax: no gathered copy, no mask, no padded keys;
- a residual add and the RMS norm that reads it (TorchExecutable fuses the two nodes), the norm alone with the same
  bits, and silu(gate) * up;
- products x @ W.T of f32 rows, and MoE's grouped product (each row times its expert's weight) in every dtype.
  cuBLAS picks its kernel by the row count, so a row's f32 sums changed with the rows beside it and a batched
  stream drifted from its solo tokens. Here one tile shape serves every row count and each output is summed over
  k in one order: a row's bits are the same alone or among 255 others. The grouped product sorts rows by expert
  and finds each tile's expert on the device: no host read, so a captured graph serves any routing.

They compute in float32 and round once at the end, except where an op alone would round an intermediate that
another op reads (the residual sum, silu's output): that is rounded as the op rounds it. They run under a captured
CUDA graph like any other kernel: their launch parameters (shapes, strides) are those of the captured run. Without
triton or a C compiler for it, or with GRAPHMESH_CUDA_KERNELS=0, callers use torch's ops (the reference they are
tested against on the GPU).
"""

import functools
import logging
import os
import shutil

import torch

from graphmesh_executor.backends.torch_tensors import TORCH_DTYPES

log = logging.getLogger("graphmesh.executor.cuda_kernels")

Tensor = torch.Tensor

# Only where a kernel can run (a GPU, or Triton's interpreter in tests/triton_interpreted.py): a CPU executor
# skips Triton's import and its native modules. Every caller checks usable() first.
try:
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        import triton
        import triton.language as tl
    else:
        triton = None
except ImportError:
    triton = None


@functools.cache
def _enabled() -> bool:
    """Whether the kernels may run here, logged once: triton importable, not turned off, and a C compiler for
    Triton to build its launchers with at first use (found as Triton finds it: $CC, else gcc or clang)."""
    if os.environ.get("GRAPHMESH_CUDA_KERNELS", "1") == "0":
        log.info("CUDA kernels off (GRAPHMESH_CUDA_KERNELS=0): torch's ops run instead")
        return False
    if triton is None:
        log.warning("triton is not installed: the CUDA decode path runs torch's ops, with ~2x the kernels a step")
        return False
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        log.warning("no C compiler for Triton ($CC, gcc or clang): the CUDA decode path runs torch's ops")
        return False
    return True


def usable(*xs: Tensor) -> bool:
    """Whether these tensors take the Triton kernels: on a CUDA device, where they may run (see _enabled). With no
    tensors: whether the kernels may run at all (TorchExecutable asks before fusing pairs of nodes for them)."""
    return all(x.is_cuda for x in xs) and _enabled()


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


if triton is not None:
    # Triton reads a kernel's annotations itself: only its constexprs carry one.
    @triton.jit  # type: ignore[untyped-decorator]
    def _rotate_half(x_ptr, out_ptr, heads, cos, sin, s, sx_s, sx_h, so_s, so_h, D: tl.constexpr,  # type: ignore[no-untyped-def]
                     BH: tl.constexpr):
        """Row s of x [S, heads, D] rotated: x * cos + roll(x, D/2) * sin, cos and sin [1, D] float32."""
        h = tl.arange(0, BH)[:, None]
        d = tl.arange(0, D)[None, :]
        live = h < heads
        at = x_ptr + s * sx_s + h * sx_h
        x = tl.load(at + d, mask=live, other=0.0).to(tl.float32)
        rolled = tl.load(at + (d + D // 2) % D, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + s * so_s + h * so_h + d, (x * cos + rolled * sin).to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit  # type: ignore[untyped-decorator]
    def _rope_half_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, sx_s, sx_h, so_s, so_h, sc_s,  # type: ignore[no-untyped-def]
                          D: tl.constexpr, BH: tl.constexpr):
        s = tl.program_id(0)
        d = tl.arange(0, D)[None, :]
        _rotate_half(x_ptr, out_ptr, heads, tl.load(cos_ptr + s * sc_s + d), tl.load(sin_ptr + s * sc_s + d), s,
                     sx_s, sx_h, so_s, so_h, D, BH)

    @triton.jit  # type: ignore[untyped-decorator]
    def _rope_half_pair_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, xo_ptr, yo_ptr, x_heads, y_heads,  # type: ignore[no-untyped-def]
                               sx_s, sx_h, sy_s, sy_h, sxo_s, sxo_h, syo_s, syo_h, sc_s, D: tl.constexpr, BH: tl.constexpr):
        s = tl.program_id(0)
        d = tl.arange(0, D)[None, :]
        cos = tl.load(cos_ptr + s * sc_s + d)
        sin = tl.load(sin_ptr + s * sc_s + d)
        if tl.program_id(1) == 0:
            _rotate_half(x_ptr, xo_ptr, x_heads, cos, sin, s, sx_s, sx_h, sxo_s, sxo_h, D, BH)
        else:
            _rotate_half(y_ptr, yo_ptr, y_heads, cos, sin, s, sy_s, sy_h, syo_s, syo_h, D, BH)

    @triton.jit  # type: ignore[untyped-decorator]
    def _scatter_pair_kernel(k_ptr, v_ptr, k_rows_ptr, v_rows_ptr, slots_ptr, n, sk, sv, skr, svr,  # type: ignore[no-untyped-def]
                             BN: tl.constexpr):
        r = tl.program_id(0)
        slot = tl.load(slots_ptr + r).to(tl.int64)
        i = tl.arange(0, BN)
        live = i < n
        k = tl.load(k_rows_ptr + r * skr + i, mask=live, other=0.0)
        v = tl.load(v_rows_ptr + r * svr + i, mask=live, other=0.0)
        tl.store(k_ptr + slot * sk + i, k.to(k_ptr.dtype.element_ty), mask=live)
        tl.store(v_ptr + slot * sv + i, v.to(v_ptr.dtype.element_ty), mask=live)

    @triton.jit  # type: ignore[untyped-decorator]
    def _tanh(x):  # type: ignore[no-untyped-def]
        # tanh from e^(-2|x|), which never overflows; libdevice's tanh has moved between Triton releases
        t = tl.exp(-2.0 * tl.abs(x))
        y = (1.0 - t) / (1.0 + t)
        return tl.where(x < 0, -y, y)

    @triton.jit  # type: ignore[untyped-decorator]
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, out_ptr, scale,  # type: ignore[no-untyped-def]
                             window, softcap, sq_t, sq_h, sk_row, sk_h, st_t, so_t, so_h,
                             BLOCK: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr,
                             BN: tl.constexpr, HALF: tl.constexpr, CAP: tl.constexpr):
        t = tl.program_id(0)
        kv = tl.program_id(1)
        g = tl.arange(0, BG)
        d = tl.arange(0, D)
        heads = kv * G + g
        q = tl.load(q_ptr + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=(g < G)[:, None], other=0.0)
        keys = tl.load(pos_ptr + t).to(tl.int32) + 1  # the row's own position and every one before it
        first = tl.maximum(keys - tl.where(window > 0, window, keys), 0)  # a sliding window's first key (else 0)
        best = tl.full([BG], float("-inf"), tl.float32)
        total = tl.zeros([BG], tl.float32)
        acc = tl.zeros([BG, D], tl.float32)
        for start in range(first, keys, BN):
            n = start + tl.arange(0, BN)
            live = n < keys
            block = tl.load(table_ptr + t * st_t + n // BLOCK, mask=live, other=0).to(tl.int64)
            rows = (block * BLOCK + n % BLOCK)[:, None] * sk_row + kv * sk_h + d[None, :]
            k = tl.load(k_ptr + rows, mask=live[:, None], other=0.0)
            v = tl.load(v_ptr + rows, mask=live[:, None], other=0.0)
            if HALF:  # tensor cores, float32 sums, as SDPA's kernels do
                scores = tl.dot(q, tl.trans(k))
            else:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # no tf32: f32 stays f32
            scores = scores * scale
            if CAP:  # Gemma 2's soft-cap of the scaled scores
                scores = softcap * _tanh(scores / softcap)
            scores = tl.where(live[None, :], scores, float("-inf"))
            top = tl.maximum(best, tl.max(scores, 1))
            p = tl.exp(scores - top[:, None])
            shrink = tl.exp(best - top)
            total = total * shrink + tl.sum(p, 1)
            if HALF:
                acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * shrink[:, None] + tl.dot(p, v, input_precision="ieee")
            best = top
        out = acc / total[:, None]
        tl.store(out_ptr + t * so_t + heads[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(g < G)[:, None])

    @triton.jit  # type: ignore[untyped-decorator]
    def _rms_norm_kernel(a_ptr, b_ptr, w_ptr, sum_ptr, out_ptr, n, sa, sb, ss, so, eps,  # type: ignore[no-untyped-def]
                         ADD: tl.constexpr, BN: tl.constexpr):
        r = tl.program_id(0)
        i = tl.arange(0, BN)
        live = i < n
        x = tl.load(a_ptr + r * sa + i, mask=live, other=0.0)
        if ADD:
            total = (x.to(tl.float32) + tl.load(b_ptr + r * sb + i, mask=live, other=0.0).to(tl.float32))
            x = total.to(sum_ptr.dtype.element_ty)  # the residual as the add alone rounds it, and the norm reads that
            tl.store(sum_ptr + r * ss + i, x, mask=live)
        x = x.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + i, mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * so + i, (x * scale * w).to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit  # type: ignore[untyped-decorator]
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, sg, su, so, BN: tl.constexpr):  # type: ignore[no-untyped-def]
        r = tl.program_id(0)
        i = tl.program_id(1) * BN + tl.arange(0, BN)
        live = i < n
        g = tl.load(g_ptr + r * sg + i, mask=live, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r * su + i, mask=live, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as silu alone rounds
        tl.store(out_ptr + r * so + i, (silu * u).to(out_ptr.dtype.element_ty), mask=live)


    @triton.jit(do_not_specialize=["m"])  # type: ignore[untyped-decorator]
    def _product_kernel(x_ptr, w_ptr, out_ptr, m, n, k, sx, sw_e, sw_n, sw_k, so,  # type: ignore[no-untyped-def]
                        src_ptr, expert_ptr, first_ptr, end_ptr,
                        GROUPED: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):
        """A [BM, BN] tile of out = x @ W.T, W [n, k] (strides sw_n, sw_k). GROUPED: tile rows are positions
        first .. end of the rows sorted by expert (src_ptr: each position's row of x and out), all of one expert
        (W = w[expert], stride sw_e); expert -1 marks a tile no expert needed. Every row runs the same k loop."""
        tile = tl.program_id(0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        if GROUPED:
            expert = tl.load(expert_ptr + tile)
            at = tl.load(first_ptr + tile) + tl.arange(0, BM)
            live = at < tl.where(expert >= 0, tl.load(end_ptr + tile), 0)
            rows = tl.load(src_ptr + at, mask=live, other=0).to(tl.int64)
            w_ptr += tl.maximum(expert, 0).to(tl.int64) * sw_e
            depth = tl.where(expert >= 0, k, 0)  # an idle tile skips the loop
        else:
            rows = (tile * BM + tl.arange(0, BM)).to(tl.int64)
            live = rows < m
            depth = k
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, depth, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + rows[:, None] * sx + ks[None, :], mask=live[:, None] & (ks[None, :] < k), other=0.0)
            b = tl.load(w_ptr + cols[None, :].to(tl.int64) * sw_n + ks[:, None] * sw_k,
                        mask=(ks[:, None] < k) & (cols[None, :] < n), other=0.0)
            if IEEE:  # f32 as f32: no TF32 rounding of the operands
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        tl.store(out_ptr + rows[:, None] * so + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & (cols[None, :] < n))


# One tile shape for every row count (the invariance): 16 rows is tl.dot's least; f32 takes Triton's FMA loop.
_TILE = {torch.float32: (16, 64, 32), torch.bfloat16: (16, 64, 64), torch.float16: (16, 64, 64)}


def product_usable(x: Tensor, w: Tensor) -> bool:
    """x [M, K] and a weight [N, K] (or [E, K, N] experts) of one dtype the tiles serve."""
    return usable(x, w) and x.dim() == 2 and w.dim() in (2, 3) and x.dtype == w.dtype and x.dtype in _TILE


def products_serve(dtype: str) -> bool:
    """Whether the products may run for rows of this graph dtype ("f32", "bf16", ...): a graph whose grouped
    product they serve reads nothing back and may run static (cuda_graphs)."""
    return usable() and TORCH_DTYPES.get(dtype) in _TILE


def matmul_xwt(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T for x [M, K], w [N, K] (any strides): each row's sums in one order whatever M."""
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = _TILE[x.dtype]
    if m:
        _product_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x, w, out, m, n, k, x.stride(0), 0, w.stride(0), w.stride(1), out.stride(0), x, x, x, x,
            GROUPED=False, IEEE=x.dtype == torch.float32, BM=bm, BN=bn, BK=bk)
    return out


def expert_tiles(ids: Tensor, experts: int, tile: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The grouped product's schedule, on the device and of a size fixed by the row count: (src, expert, first,
    end). src [M]: the rows in expert order (stable); then per tile of up to `tile` sorted rows of one expert,
    its expert (-1: a spare tile), its first sorted position and its expert's end. There are M / tile + experts
    tiles, enough for any routing."""
    flat = ids.reshape(-1).long()
    src = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.long, device=ids.device).index_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts, 0)
    tiles = (counts + tile - 1) // tile
    tile_ends = torch.cumsum(tiles, 0)
    t = torch.arange(-(-flat.numel() // tile) + experts, device=ids.device)
    expert = torch.searchsorted(tile_ends, t, right=True)
    spare = expert >= experts
    e = expert.clamp(max=experts - 1)
    first = ends[e] - counts[e] + (t - (tile_ends[e] - tiles[e])) * tile
    return src, torch.where(spare, -1, e), first, ends[e]


def grouped_matmul(x: Tensor, w: Tensor, ids: Tensor) -> Tensor:
    """out[r] = x[r] @ w[ids[r]] for x [M, K], experts w [E, K, N], ids [M]: one launch, no host read."""
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    experts, _, n = w.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = _TILE[x.dtype]
    if m:
        src, expert, first, end = expert_tiles(ids, experts, bm)
        _product_kernel[(expert.numel(), triton.cdiv(n, bn))](
            x, w, out, m, n, k, x.stride(0), w.stride(0), w.stride(2), w.stride(1), out.stride(0), src, expert,
            first, end, GROUPED=True, IEEE=x.dtype == torch.float32, BM=bm, BN=bn, BK=bk)
    return out


def rows_usable(*xs: Tensor) -> bool:
    """2-d tensors of one float dtype and shape with contiguous rows, for rms_norm, add_rms_norm and silu_mul."""
    return (usable(*xs) and all(x.dim() == 2 and x.shape == xs[0].shape and x.dtype == xs[0].dtype and x.stride(1) == 1
                                for x in xs) and xs[0].dtype in (torch.float32, torch.bfloat16, torch.float16))


def add_rms_norm(a: Tensor, b: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(a + b, rms_norm(a + b) * weight) over rows [S, H] in one pass: a layer's residual add and the norm that
    reads it. The sum is rounded to the rows' dtype first, so both are what the two ops give apart."""
    rows, n = a.shape
    total = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    out = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    if rows:
        _rms_norm_kernel[(rows,)](a, b, weight, total, out, n, a.stride(0), b.stride(0), total.stride(0),
                                  out.stride(0), eps, ADD=True, BN=triton.next_power_of_2(n))
    return total, out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """rms_norm(x) * weight over rows [S, H]: add_rms_norm's norm, bit for bit. A stage that begins at a layer's
    norm runs it alone where a stage holding the layer before fuses it with the add, so a session re-planned over
    other stages (a recovery) keeps its tokens only if the two agree; torch's norm sums in another order."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x, x, weight, x, out, n, x.stride(0), x.stride(0), x.stride(0), out.stride(0), eps,
                                  ADD=False, BN=triton.next_power_of_2(n))
    return out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up over rows [S, I] (the SwiGLU of a Llama MLP) in one pass; silu rounded as it is alone."""
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0),
                                                        BN=block)
    return out


def rope_half_usable(x: Tensor) -> bool:
    """x [S, H, D] rotated over its whole head: D a power of two, the last axis contiguous, x in a dtype the kernel
    computes in (its f32 arithmetic would round an f64 x)."""
    return (usable(x) and x.dim() == 3 and _pow2(x.shape[2]) and x.stride(2) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + roll(x, D/2) * sin over x [S, H, D] with cos, sin [S, 1, D] float32 (sin signed, see
    torch_ops.half_table): a new [S, H, D] tensor in x's dtype."""
    s, h, d = x.shape
    out = torch.empty((s, h, d), dtype=x.dtype, device=x.device)
    cos, sin = cos.reshape(s, d).contiguous(), sin.reshape(s, d).contiguous()
    if s:
        _rope_half_kernel[(s,)](x, cos, sin, out, h, x.stride(0), x.stride(1), out.stride(0), out.stride(1), d,
                                D=d, BH=triton.next_power_of_2(h))
    return out


def rope_half_pair(x: Tensor, y: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """rope_half of x [S, Hx, D] and of y [S, Hy, D] at the same positions (a layer's q and k) in one launch."""
    s, hx, d = x.shape
    hy = y.shape[1]
    xo = torch.empty((s, hx, d), dtype=x.dtype, device=x.device)
    yo = torch.empty((s, hy, d), dtype=y.dtype, device=y.device)
    cos, sin = cos.reshape(s, d).contiguous(), sin.reshape(s, d).contiguous()
    if s:
        _rope_half_pair_kernel[(s, 2)](x, y, cos, sin, xo, yo, hx, hy, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                                       xo.stride(0), xo.stride(1), yo.stride(0), yo.stride(1), d, D=d,
                                       BH=triton.next_power_of_2(max(hx, hy)))
    return xo, yo


def scatter_pair_usable(k_pool: Tensor, v_pool: Tensor, k_rows: Tensor, v_rows: Tensor) -> bool:
    """Pools [slots, W] and rows [S, W] (any float dtypes), each with contiguous rows."""
    return (usable(k_pool, v_pool, k_rows, v_rows)
            and all(t.dim() == 2 and t.shape[1] == k_pool.shape[1] and t.stride(1) == 1 and t.is_floating_point()
                    for t in (k_pool, v_pool, k_rows, v_rows)) and k_rows.shape[0] == v_rows.shape[0])


def scatter_pair(k_pool: Tensor, v_pool: Tensor, k_rows: Tensor, v_rows: Tensor, slots: Tensor) -> None:
    """k_pool[slots] = k_rows and v_pool[slots] = v_rows, in place, in one launch (a layer's two KV writes)."""
    rows, n = k_rows.shape
    if rows:
        _scatter_pair_kernel[(rows,)](k_pool, v_pool, k_rows, v_rows, slots, n, k_pool.stride(0), v_pool.stride(0),
                                      k_rows.stride(0), v_rows.stride(0), BN=triton.next_power_of_2(n))


def paged_decode_usable(q: Tensor, k_pool: Tensor, v_pool: Tensor) -> bool:
    """q [T, Hq, D] and pools [rows, Hkv, D] of one float dtype, D a power of two >= 16, last axes contiguous."""
    return (usable(q, k_pool, v_pool) and _pow2(q.shape[2]) and q.dtype == k_pool.dtype == v_pool.dtype
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and q.stride(2) == k_pool.stride(2) == v_pool.stride(2) == 1 and k_pool.stride() == v_pool.stride())


def paged_serves(head_dim: int, dtype: str) -> bool:
    """Whether paged attention of this head size and graph dtype ("f32", "bf16", ...) takes the row kernel below
    where it may run: each row over its own blocks, whatever the table's width."""
    return usable() and _pow2(head_dim) and TORCH_DTYPES.get(dtype) in (torch.float32, torch.bfloat16, torch.float16)


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, pos: Tensor, block: int,
                           scale: float, window: int = 0, softcap: float = 0.0) -> Tensor:
    """Attention of one query row per sequence over its own blocks: q [T, Hq, D]; k_pool, v_pool [rows, Hkv, D]
    (block b's keys are rows b*block ..); table [T, blocks] the pool blocks of each row's sequence; pos [T] each
    row's position (it sees keys 0..pos, the last `window` of them where window > 0); scores soft-capped where
    softcap > 0. Returns [T, Hq, D] in q's dtype."""
    t, hq, d = q.shape
    hkv = k_pool.shape[1]
    group = hq // hkv
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if t:
        table = table if table.stride(1) == 1 else table.contiguous()
        _paged_decode_kernel[(t, hkv)](
            q, k_pool, v_pool, table, pos, out, scale, window, softcap or 1.0, q.stride(0), q.stride(1),
            k_pool.stride(0), k_pool.stride(1), table.stride(0), out.stride(0), out.stride(1), BLOCK=block, G=group,
            BG=max(16, triton.next_power_of_2(group)), D=d, BN=64, HALF=q.dtype != torch.float32, CAP=softcap > 0)
    return out
