"""The torch backend's CPU kernels on x86-64 (cpu_kernels.c, compiled at first use): x @ w.T for f32 rows, with w
f32 or packed GGUF blocks, and paged attention of one query row per sequence.

A decode step multiplies a handful of rows (one per session) by every weight of its layers. That is the cost
of a step on CPU, and MKL's small-M product reads the weights at half the speed of its one-row product. Both
products here read their weight in panels made once per weight (f32: fpanels; GGUF: panels) and serve any number
of rows, prompt chunks too (bench_cpu_kernels.py measures whole decode steps against torch's ops).
Like tinygrad's CPU backend, the C source ships with the package and is built by the system's C compiler into a
per-user cache; without a compiler or the instructions, callers use torch.

The build is chosen per host (isa()): AVX-512 (f, bw, vl, dq) where the CPU has it, else AVX2 + FMA + F16C;
GRAPHMESH_CPU_ISA=avx2 pins the AVX2 build on any host (tests run both where both run). The two builds give the
same bits for every kernel: a product's output is one FMA chain over k in order whatever the vector width, and
attention and the norms keep their 8-lane sums in both.

    python -m graphmesh_executor.backends.cpu_kernels   # builds it now (an image build), prints where or why not
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from graphmesh.ops import QUANT_BLOCKS, q8_rows
from graphmesh_executor import affinity
from graphmesh_executor.backends.torch_tensors import memo
from graphmesh_server.serving import cpu_flags, user_dir

log = logging.getLogger("graphmesh.executor.cpu_kernels")

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_ISA_FLAGS = {  # what each build may use; the C source picks its vectors by __AVX512F__
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}
_ISA_CPU = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}}
_FLAGS = ["-O3", "-shared", "-fPIC"]
_LIBS = ["-lm", "-pthread"]
_PANELS = "_graphmesh_panels"  # a packed tensor's panel form, in its __dict__ (by panel width)
_Q8_PANELS = "_graphmesh_q8panels"  # its panel form for int8 activations (activations="q8")
_FPANELS = "_graphmesh_fpanels"  # an f32 weight's panel form, in its __dict__ (by panel width)
HELPED_ROWS = 2  # products of this many rows at most split their columns with the helper thread (cpu_kernels.c)
_MIN_SHARE = 384  # output columns a thread takes at least: fewer cost more in the handoff than they save


_chosen: str | None = None  # the build of this process, once asked (isa() runs at every product)


def isa() -> str:
    """The build this host runs: GRAPHMESH_CPU_ISA if set (avx2 or avx512), else the widest the CPU has."""
    global _chosen
    if _chosen is None:
        _chosen = os.environ.get("GRAPHMESH_CPU_ISA") or ("avx512" if _ISA_CPU["avx512"] <= cpu_flags() else "avx2")
    return _chosen


def select(build: str | None) -> None:
    """Pins the build this process runs from now on (tests and benchmarks run each); None: isa()'s choice."""
    global _chosen
    _chosen = build


def _cache_dir() -> Path:
    """GRAPHMESH_KERNEL_CACHE (an image builds the kernel there, see docker/executor.Dockerfile), else the user's
    cache directory."""
    if os.environ.get("GRAPHMESH_KERNEL_CACHE"):
        return Path(os.environ["GRAPHMESH_KERNEL_CACHE"])
    return user_dir("XDG_CACHE_HOME", ".cache") / "graphmesh" / "kernels"


def library() -> ctypes.CDLL | None:
    """The compiled kernels of this host's build (isa()), or None where they cannot run here (logged once with the
    reason)."""
    return _library(isa())


def compiled(build: str, compiler: str | None) -> Path | None:
    """The shared library of `build` (a key of _ISA_FLAGS), compiled now unless the cache has it; None where it
    is not cached and there is no compiler. Compiling needs no CPU that runs it: an image builds every build (and
    drops its compiler), and the executor loads the one its host runs."""
    flags = _FLAGS + _ISA_FLAGS[build]
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags + _LIBS).encode()).hexdigest()[:16]
    path = _cache_dir() / f"cpu_kernels-{build}-{digest}.so"
    if not path.exists():
        if compiler is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        # Built beside its final name and renamed: executors starting together never load a half-written file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, str(_SOURCE), "-o", tmp, *_LIBS], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        log.info("cpu kernels compiled", extra={"path": str(path), "compiler": compiler, "isa": build})
    return path


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def _library(build: str) -> ctypes.CDLL | None:
    why = ""
    compiler = _compiler()
    if os.environ.get("GRAPHMESH_CPU_KERNELS", "1") == "0":
        why = "off (GRAPHMESH_CPU_KERNELS=0)"
    elif platform.machine().lower() not in ("x86_64", "amd64"):
        why = f"not an x86-64 CPU ({platform.machine()})"
    elif build not in _ISA_FLAGS:
        why = f"GRAPHMESH_CPU_ISA={build!r} is not one of {', '.join(_ISA_FLAGS)}"
    elif not _ISA_CPU[build] <= cpu_flags():
        why = f"the CPU lacks {', '.join(sorted(_ISA_CPU[build] - cpu_flags()))} for the {build} build"
    if why:
        log.info("cpu kernels unavailable: torch serves every matmul and attention", extra={"reason": why})
        return None
    try:
        path = compiled(build, compiler)
        if path is None:
            log.info("cpu kernels unavailable: torch serves every matmul and attention",
                     extra={"reason": "no C compiler (cc) on PATH and no build in the cache"})
            return None
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = e.stderr.decode(errors="replace")[-500:] if isinstance(e, subprocess.CalledProcessError) else str(e)
        log.warning("cpu kernels failed to build or load: torch serves every matmul and attention",
                    extra={"error": detail})
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.panel_width.argtypes = []
    lib.panel_width.restype = i
    lib.repack_f32.argtypes = [i, i, p, p]
    lib.repack_f32.restype = None
    lib.gemm_fpanels.argtypes = [i, i, p, i, p, p, i, i, i]
    lib.gemm_fpanels.restype = None
    lib.panel_block_bytes.argtypes = [i]
    lib.panel_block_bytes.restype = ctypes.c_size_t
    lib.repack_blocks.argtypes = [i, i, i, p, p]
    lib.repack_blocks.restype = None
    lib.gemm_qpanels.argtypes = [i, i, p, i, p, i, p, i, i, i]
    lib.gemm_qpanels.restype = None
    lib.start_helper.argtypes = []
    lib.start_helper.restype = i
    lib.helper_rest.argtypes = []
    lib.helper_rest.restype = None
    lib.helper_chunks.argtypes = []
    lib.helper_chunks.restype = ctypes.c_longlong
    lib.gemm_fpanels_shared.argtypes = [i, i, p, i, p, p, i, i]
    lib.gemm_fpanels_shared.restype = None
    lib.gemm_qpanels_shared.argtypes = [i, i, p, i, p, i, p, i, i]
    lib.gemm_qpanels_shared.restype = None
    lib.q8_panel_block_bytes.argtypes = [i]
    lib.q8_panel_block_bytes.restype = ctypes.c_size_t
    lib.repack_q8.argtypes = [i, i, i, p, p]
    lib.repack_q8.restype = None
    lib.quantize_rows_q8.argtypes = [i, i, p, i, p, p, p]
    lib.quantize_rows_q8.restype = None
    lib.gemm_q8panels.argtypes = [i, i, p, p, p, p, i, p, i, i, i]
    lib.gemm_q8panels.restype = None
    lib.gemm_q8panels_shared.argtypes = [i, i, p, i, p, i, p, i, i]
    lib.gemm_q8panels_shared.restype = i
    lib.q8_use_vnni.argtypes = [i]
    lib.q8_use_vnni.restype = None
    lib.q8_vnni.argtypes = []
    lib.q8_vnni.restype = i
    lib.paged_decode_attention.argtypes = [i, i, i, i, i, i, p, p, p, p, p, ctypes.c_float, i, ctypes.c_float, p, p, p]
    lib.paged_decode_attention.restype = None
    lib.rms_norm.argtypes = [i, i, p, p, ctypes.c_float, p]
    lib.rms_norm.restype = None
    lib.rope_half.argtypes = [i, i, i, p, i, p, p, p]
    lib.rope_half.restype = None
    lib.rope_half_pair.argtypes = [i, i, i, i, p, i, p, i, p, p, p, p]
    lib.rope_half_pair.restype = None
    lib.add_rms_norm.argtypes = [i, i, p, p, p, ctypes.c_float, p, p]
    lib.add_rms_norm.restype = None
    lib.argmax_rows.argtypes = [i, i, p, p]
    lib.argmax_rows.restype = None
    return lib


def panel() -> int:
    """Weight rows of a panel in this host's build: a thread's share of a product is whole panels."""
    lib = library()
    assert lib is not None
    return _panel_width(lib)


@functools.cache
def _panel_width(lib: ctypes.CDLL) -> int:
    return int(lib.panel_width())


@functools.cache
def _helper(lib: ctypes.CDLL) -> bool:
    """Whether cpu_kernels.c's helper thread runs here (gemm_*_shared; _helped says for which products): where this
    process may run on a second core, even when held to one compute thread or pinned to one core (affinity.py;
    GRAPHMESH_CPU_HELPER=0: never)."""
    if os.environ.get("GRAPHMESH_CPU_HELPER", "1") == "0" or len(affinity.unpinned()) < 2:
        return False
    with affinity.borrowing_threads():  # pinned (--cpus), it borrows a core the other stages leave idle
        return bool(lib.start_helper() == 0)


def rest_helper() -> None:
    """A run is over: the helper thread, if it runs, sleeps now rather than spin on (cpu_kernels.c's helper_rest)
    on a core that another stage's run may want next."""
    lib = library()
    if lib is not None and _helper.cache_info().currsize and _helper(lib):
        lib.helper_rest()


def _helped(lib: ctypes.CDLL, m: int, light: bool) -> bool:
    """Whether a product of m rows shares its columns with the helper thread: one or two rows (a lone stream's
    decode), or any rows of a light step (few sessions: a verified chunk, a lone prompt), when torch's own threads
    would not split it anyway."""
    return (m <= HELPED_ROWS or (light and torch.get_num_threads() == 1)) and _helper(lib)


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="cpu-kernels")


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether matmul_xwt computes x @ w.T here: f32 rows on the host, w [n, k] row-major f32."""
    return (x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype == torch.float32 and x.is_cpu and w.is_cpu
            and x.shape[1] == w.shape[1] and w.is_contiguous() and library() is not None)


def has_fpanels(w: torch.Tensor) -> bool:
    """Whether `w` carries its panel form (fpanels) for this host's build: a weight laid out for matmul_xwt, not an
    activation."""
    return library() is not None and f"{_FPANELS}{panel()}" in w.__dict__


def fpanels(w: torch.Tensor) -> torch.Tensor:
    """An f32 weight [n, k] laid out again in panels of panel() rows, [ceil(n / P)][k][P] (cpu_kernels.c's
    repack_f32), the form gemm_fpanels reads. Made once per tensor and kept with it (weights are never written in
    place): TorchExecutable makes it when a weight is set, so that no request waits for it."""
    width = panel()
    made: torch.Tensor | None = w.__dict__.get(f"{_FPANELS}{width}")
    if made is None:
        lib = library()
        assert lib is not None
        n, k = w.shape
        made = torch.empty(-(-n // width) * k * width, dtype=torch.float32)
        lib.repack_f32(n, k, w.contiguous().data_ptr(), made.data_ptr())
        w.__dict__[f"{_FPANELS}{width}"] = made
    return made


def matmul_xwt(x: torch.Tensor, w: torch.Tensor, light: bool = False) -> torch.Tensor:
    """x @ w.T (x [m, k], w [n, k] contiguous, f32), read from w's panels (fpanels), split over torch's intra-op
    threads, or shared with the helper thread (_helped). Every output element is one FMA chain over k in order,
    whatever m, the row's place, the split and the build are (cpu_kernels.c): a session's numbers never depend on the
    other rows of its step."""
    lib = library()
    assert lib is not None
    x = x.contiguous()
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    args = (m, k, x.data_ptr(), k, fpanels(w).data_ptr(), out.data_ptr(), n)
    if _helped(lib, m, light):
        lib.gemm_fpanels_shared(*args, n)
    else:
        _run_shares(_shares(n, panel()), lambda i, a, b: lib.gemm_fpanels(*args, a, b))
    return out


def _shares(n: int, tile: int) -> tuple[tuple[int, int], ...]:
    """A product's n output columns split over torch's intra-op threads: shares of whole weight tiles of `tile`
    rows, as many as have enough work."""
    return _split(n, tile, torch.get_num_threads())


@functools.cache  # a decode step asks ~120 times for a handful of splits: Python per call is a step's overhead
def _split(n: int, tile: int, threads: int) -> tuple[tuple[int, int], ...]:
    threads = min(threads, max(1, n // _MIN_SHARE))
    share = -(-n // threads // tile) * tile
    return tuple((a, min(n, a + share)) for a in range(0, n, share))


def _run_shares(shares: tuple[tuple[int, int], ...], run: Callable[[int, int, int], object]) -> None:
    """run(i, a, b) for every share [a, b), at once: ctypes releases the GIL for a call, and this thread takes
    the first."""
    if len(shares) == 1:
        run(0, *shares[0])
        return
    rest = [_pool(len(shares) - 1).submit(run, i, a, b) for i, (a, b) in enumerate(shares) if i]
    run(0, *shares[0])
    for f in rest:
        f.result()


PACKED_SCHEMES = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "q4_k": 3, "q6_k": 4}  # cpu_kernels.c's scheme numbers


def packs(scheme: str, k: int) -> bool:
    """Whether the kernels multiply rows of k values by a weight of `scheme`: one they read, k whole blocks (32
    values, a K-quant's 256)."""
    return scheme in PACKED_SCHEMES and k % QUANT_BLOCKS[scheme][0] == 0


def packed_usable(x: torch.Tensor, packed: torch.Tensor, scheme: str) -> bool:
    """Whether matmul_xwt_packed computes x @ w.T here: f32 rows of x on the host (any number: a decode's or a
    prompt chunk's), w packed GGUF blocks."""
    return (x.dim() == 2 and x.dtype == torch.float32 and x.is_cpu
            and packed.is_cpu and packed.dtype == torch.uint8 and packed.is_contiguous()
            and packs(scheme, x.shape[1]) and library() is not None)


def panels(packed: torch.Tensor, scheme: str, n: int, k: int, activations: str = "f32") -> torch.Tensor:
    """GGUF blocks [n, k/B * block bytes] (B values a block: 32, a K-quant's 256) laid out again in panels of
    panel() rows, the form the product reads: gemm_qpanels' (cpu_kernels.c's repack_blocks), or with int8
    activations gemm_q8panels' (repack_q8); about the same bytes, give or take the last panel's padding (a q4_k
    super-block's 6-bit scales and mins take a byte each). Made once per tensor and kept with it (weights are never
    written in place)."""
    width = panel()
    q8 = q8_rows(scheme, activations)
    key = f"{_Q8_PANELS if q8 else _PANELS}{width}"
    made: torch.Tensor | None = packed.__dict__.get(key)
    if made is None:
        lib = library()
        assert lib is not None
        blocks = k // QUANT_BLOCKS[scheme][0]
        block_bytes = lib.q8_panel_block_bytes if q8 else lib.panel_block_bytes
        repack = lib.repack_q8 if q8 else lib.repack_blocks
        made = torch.empty(-(-n // width) * blocks * block_bytes(PACKED_SCHEMES[scheme]), dtype=torch.uint8)
        repack(PACKED_SCHEMES[scheme], n, k, packed.contiguous().data_ptr(), made.data_ptr())
        packed.__dict__[key] = made
    return made


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """f32 rows [m, k] as gemm_q8panels reads them (cpu_kernels.c's quantize_rows_q8): int8 codes [m, k], per block
    of 32 its scale d [m, k/32] and sum(codes) [m, k/32]."""
    lib = library()
    assert lib is not None
    x = x.contiguous()
    m, k = x.shape
    codes = torch.empty(m, k, dtype=torch.int8)
    scales = torch.empty(m, k // 32, dtype=torch.float32)
    sums = torch.empty(m, k // 32, dtype=torch.int32)
    lib.quantize_rows_q8(m, k, x.data_ptr(), k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr())
    return codes, scales, sums


def matmul_xwt_packed(x: torch.Tensor, packed: torch.Tensor, scheme: str, n: int, light: bool = False,
                      activations: str = "f32") -> torch.Tensor:
    """x @ w.T for w [n, k] held as GGUF blocks (packed [n, k/B * block bytes]), read in panels (panels()).
    activations="f32": w's values are exactly gguf's dequantization, and each output is one FMA chain over k in
    order, whatever the row count, the thread split and the build: the bits of matmul_xwt over the dequantized
    weight. activations="q8" (q4_0, q4_1, q8_0 blocks): x's rows are quantized to int8 blocks first and each
    block's dot product is exact in integers (llama.cpp's arithmetic), again with bits independent of the row
    count, the split and the build."""
    lib = library()
    assert lib is not None
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    w = panels(packed, scheme, n, k, activations).data_ptr()
    if q8_rows(scheme, activations):
        if _helped(lib, m, light):  # quantized in the same call
            if lib.gemm_q8panels_shared(m, k, x.data_ptr(), k, w, PACKED_SCHEMES[scheme], out.data_ptr(), n, n) < 0:
                raise MemoryError(f"no memory to quantize {m} rows of {k} for a product")
            return out
        codes, scales, sums = quantize_rows(x)
        q8 = (m, k, codes.data_ptr(), scales.data_ptr(), sums.data_ptr(), w, PACKED_SCHEMES[scheme], out.data_ptr(), n)
        _run_shares(_shares(n, panel()), lambda i, a, b: lib.gemm_q8panels(*q8, a, b))
        return out
    args = (m, k, x.data_ptr(), k, w, PACKED_SCHEMES[scheme], out.data_ptr(), n)
    if _helped(lib, m, light):
        lib.gemm_qpanels_shared(*args, n)
    else:
        _run_shares(_shares(n, panel()), lambda i, a, b: lib.gemm_qpanels(*args, a, b))
    return out


def attention_usable(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether paged_decode_attention serves this decode: f32 on the host, pools [slots, kv heads, head dim]."""
    return (q.dtype == k_pool.dtype == v_pool.dtype == torch.float32 and q.is_cpu
            and k_pool.is_cpu and v_pool.is_cpu and k_pool.dim() == v_pool.dim() == 3
            and k_pool.is_contiguous() and v_pool.is_contiguous() and q.shape[1] % k_pool.shape[1] == 0
            and library() is not None)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                           pos: torch.Tensor, block: int, scale: float, window: int = 0, softcap: float = 0.0,
                           ) -> torch.Tensor:
    """Row s of q [t, hq, d] attends to keys 0..pos[s] of sequence s (its last `window` of them where window > 0),
    whose blocks are table[s] (pool block ids), its scores soft-capped where softcap > 0.
    The caller has checked every table entry and position against the pools' bounds."""
    lib = library()
    assert lib is not None
    (t, hq, d), hkv, keys = q.shape, k_pool.shape[1], table.shape[1] * block
    # Every layer of a run reads the same table and positions, and its scratch is free again when it returns:
    # made once a run.
    scores, rows = memo(pos, ("attention-scratch", hq, keys), lambda: (
        torch.empty(hq * (keys + 8), dtype=torch.float32),  # a row per head, padded to whole vectors
        torch.empty(2 * keys, dtype=torch.int64)))  # a key's K and V row addresses
    q, table, pos = q.contiguous(), _int64(table), _int64(pos)
    out = torch.empty(t, hq, d, dtype=torch.float32)
    lib.paged_decode_attention(t, hq, hkv, d, block, table.shape[1], q.data_ptr(), k_pool.data_ptr(),
                               v_pool.data_ptr(), table.data_ptr(), pos.data_ptr(), scale, window, softcap,
                               out.data_ptr(), scores.data_ptr(), rows.data_ptr())
    return out


def _int64(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int64, converted once a run (memo) where it is not already."""
    if t.dtype == torch.int64 and t.is_contiguous():
        return t
    return memo(t, "i64", lambda: t.contiguous().long())  # type: ignore[no-any-return]


def _host_f32(*tensors: torch.Tensor) -> bool:
    for t in tensors:  # a loop, not all() over a generator: called ~120 times a decode step
        if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMS norm of x's rows (last axis) scaled by w, or None where the kernel does not serve it (then torch does)."""
    lib = library()
    if lib is None or not _host_f32(x, w) or w.dim() != 1 or x.shape[-1] != w.shape[0]:
        return None
    out = torch.empty_like(x)
    lib.rms_norm(x.numel() // w.shape[0], w.shape[0], x.data_ptr(), w.data_ptr(), eps, out.data_ptr())
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float,
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + y, rms_norm(x + y) scaled by w) in one call, the bits of the two apart (torch's add and rms_norm above);
    None where the kernel does not serve them."""
    lib = library()
    if lib is None or not _host_f32(x, y, w) or x.shape != y.shape or w.dim() != 1 or x.shape[-1] != w.shape[0]:
        return None
    total, out = torch.empty_like(x), torch.empty_like(x)
    lib.add_rms_norm(x.numel() // w.shape[0], w.shape[0], x.data_ptr(), y.data_ptr(), w.data_ptr(), eps,
                     total.data_ptr(), out.data_ptr())
    return total, out


def _rotatable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether rope_half's kernel reads x [rows, heads, d] at cos's positions: f32 on the host, each row's heads
    contiguous (rows may be apart: q of a joined q, k, v product)."""
    if x.dim() != 3 or x.dtype != torch.float32 or not x.is_cpu:
        return False
    (rows, heads, d), (row, head, step) = x.shape, x.stride()  # read once: this runs twice a layer
    return d % 2 == 0 and step == 1 and head == d and row >= heads * d and cos.shape == (rows, 1, d)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x * cos + roll(x, d / 2, -1) * sin for x [rows, heads, d] and cos, sin [rows, 1, d], bit for bit torch's
    three kernels; None where the kernel does not serve it."""
    lib = library()
    if lib is None or not _host_f32(cos, sin) or cos.shape != sin.shape or not _rotatable(x, cos):
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.rope_half(x.shape[0], x.shape[1], x.shape[2], x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                  out.data_ptr())
    return out


def rope_half_pair(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """rope_half of x and of y (a layer's k and q) at the same positions in one call; None where the kernel does
    not serve both."""
    lib = library()
    # both rotatable at cos's positions: the same rows and head size
    if lib is None or not _host_f32(cos, sin) or cos.shape != sin.shape or not _rotatable(x, cos) \
            or not _rotatable(y, cos):
        return None
    out_x, out_y = torch.empty(x.shape, dtype=torch.float32), torch.empty(y.shape, dtype=torch.float32)
    lib.rope_half_pair(x.shape[0], x.shape[1], y.shape[1], x.shape[2], x.data_ptr(), x.stride(0), y.data_ptr(),
                       y.stride(0), cos.data_ptr(), sin.data_ptr(), out_x.data_ptr(), out_y.data_ptr())
    return out_x, out_y


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(x, dim=-1) for f32 rows x [rows, n] on the host (the first maximum, or the first NaN), or None
    where the kernel does not serve it."""
    lib = library()
    if lib is None or x.dim() != 2 or not _host_f32(x) or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(x.shape[0], x.shape[1], x.data_ptr(), out.data_ptr())
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    cc = _compiler()
    if platform.machine().lower() in ("x86_64", "amd64") and cc is not None:
        for each in _ISA_FLAGS:  # every build, for whichever host the image lands on
            print(f"cpu kernels, {each} build: {compiled(each, cc)}")
    print(f"cpu kernels on this host: {library() or 'unavailable (see the log line above)'}")
