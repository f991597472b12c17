"""A stage's weights: the checkpoint of its layers read and compiled on install (reused while the stage is
unchanged), the encoder when the plan gives this rank one, and the standby weights (the rest of the model read in the
background) that let a re-plan hand this rank new layers without reading the checkpoint again."""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

import numpy as np

from graphmesh import models
from graphmesh.bundled import BUNDLED, resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.errors import InvalidArgument
from graphmesh.models.config import ModelConfig
from graphmesh.models.moe import read_param
from graphmesh_executor.encoder_group import EncoderGroup
from graphmesh_executor.kv_pool import KvPool
from graphmesh_executor.stage_inputs import RunInputs
from graphmesh_executor.stage_types import StageSpec
from graphmesh_executor.weights import resolve_under_root
from graphmesh_server.serving import available_memory_bytes

log = logging.getLogger("graphmesh.executor.stage")

DEFAULT_KV_CACHE_BYTES = 512 << 20  # the CPU pool's cap when --kv-cache-bytes is not given
NUMPY_KV_CACHE_BYTES = 16 << 20
WARM_SHAPES = 4  # executables a re-plan compiles up front: the old stage's most recently used shapes


class StageWeights(RunInputs):
    """Loading a stage (engine thread): set by StageRuntime.__init__, read by the protocol through StageState."""

    model_root: str | None
    kv_cache_bytes: int
    model_identity: str
    param_bytes: int
    standby_weights: bool | None
    standby_ready: threading.Event
    _weights_path: Path | None
    _encoder: EncoderGroup | None
    _loaded_key: StageSpec | None

    def _load(self, spec: StageSpec) -> None:
        path = self._model_path(spec.model)
        same_model = path == self._weights_path
        if not same_model:  # another model: its params may have the same names, never the same values
            self._standby, self._weights_path = {}, path
            self.standby_ready.clear()
        ckpt = open_checkpoint(path)
        if ckpt.config is None:
            raise InvalidArgument(f"{path} has no model config", "NO_MODEL_CONFIG")
        config = ckpt.config
        if not 0 <= spec.layer_start < spec.layer_end <= config.n_layers:
            raise InvalidArgument(f"layers [{spec.layer_start}, {spec.layer_end}) outside the model's "
                                  f"{config.n_layers} layers", "BAD_LAYER_RANGE")
        if spec.weights not in models.WEIGHTS:
            raise InvalidArgument(f"weights must be one of {', '.join(models.WEIGHTS)}, got {spec.weights!r}",
                                  "BAD_WEIGHTS")
        dtype = spec.dtype or ("bf16" if self.device.startswith("cuda") else "f32")
        if dtype not in ("f32", "bf16", "f16"):
            raise InvalidArgument(f"dtype must be 'f32', 'bf16' or 'f16', got {dtype!r}", "BAD_DTYPE")
        self.config, self.spec, self.dtype = config, spec, dtype
        self._packed_schemes = ckpt.packed_schemes()
        # "packed" (the default) keeps a GGUF's quantized blocks packed where the family's stages consume them; a
        # checkpoint with none, or another family (GPT-2), is read as f32 then, so the default serves every model.
        self._packed = spec.weights != "f32" and bool(self._packed_schemes) and \
            models.quantizable(config)
        recent = list(self._executables)[-WARM_SHAPES:]  # most recently used last
        self._executables.clear()
        block = spec.kv_block_tokens or 16
        layers = spec.layer_end - spec.layer_start
        row_bytes = 2 * layers * config.kv_dim * (4 if dtype == "f32" else 2)  # K and V of every layer, per token
        budget = self.kv_cache_bytes or default_kv_cache_bytes(self.device, self.backend)
        pool = KvPool(max(2, budget // (row_bytes * block)), block)
        previous, self._holder, self.pool, self._pools = self._holder, None, pool, {}
        holder = self._compile(1, 1, 1, True, True, weights=path, reuse=previous if same_model else None)
        self._holder, self._wide_tables = holder, holder.reads_own_blocks()
        self._pools = dict(zip(self._pool_names(), holder.zeros_like_inputs(self._pool_names())))
        # What KV keys are rooted in: the checkpoint and how this stage computes with it, since rows computed in
        # bf16 or from packed weights differ from f32 ones for the same tokens, and a shared store must never hand
        # one to the other (a wrong hit changes tokens).
        self.model_identity = f"{ckpt.identity()}|weights={spec.weights}|dtype={dtype}"
        self.param_bytes = sum(int(np.prod(t.shape)) * (1 if t.dtype == "u8" else 4) for t in holder.graph.params.values())
        self._loaded_key = spec
        # A re-plan (recovery) compiles the shapes the old stage ran most recently now, on every rank at once:
        # left to the restore's first steps they would be compiled one rank after another, on its critical path.
        for key in recent:
            self._executable(*key)
        if not recent and self._wide_tables:  # a first load where captures pay: every shape a step may take
            self._warm_up()
        log.info("stage loaded", extra={"layers": f"{spec.layer_start}-{spec.layer_end}", "dtype": dtype,
                                        "kv_pool_blocks": pool.lendable, "kv_block_tokens": block,
                                        "warmed_shapes": len(self._executables)})
        if not self._packed and not self.standby_ready.is_set() and self._wants_standby(config):
            threading.Thread(target=self._read_standby, args=(path, config, set(holder.graph.params)), daemon=True,
                             name="standby-weights").start()

    def _load_encoder(self, spec: StageSpec, owned: bool) -> None:
        """Holds the model's encoder when this rank owns the plan's encoder group (engine thread)."""
        if not owned:
            self._encoder = None
            return
        assert self.config is not None
        if self.config.encoder is None:
            raise InvalidArgument(f"the plan gives this rank an encoder group; {spec.model} has no encoder",
                                  "BAD_PLAN")
        path = self._model_path(spec.model)
        if self._encoder is None or self._encoder.weights != path or self._encoder.dtype != self.dtype:
            self._encoder = EncoderGroup(self.config.encoder, path, self.backend, self.device, self.dtype)

    def preload(self, model: str) -> None:
        """Reads the whole of `model`'s weights now, as standby weights (f32), so the first Install of any layer
        range reads no checkpoint: what an executor that joins a live mesh does before it registers, since the
        roster it joins waits for its Install."""
        path = self._model_path(model)
        config = open_checkpoint(path).config
        if config is None:
            raise InvalidArgument(f"{path} has no model config", "NO_MODEL_CONFIG")
        t0 = time.perf_counter()

        def read() -> None:  # on the engine, as an Install is: the two never touch the weights at once
            self._standby, self._weights_path = {}, path
            self.standby_ready.clear()
            self._read_standby(path, config, set())

        self.engine.run("stage.preload", read)
        log.info("model preloaded", extra={"model": model, "ms": round((time.perf_counter() - t0) * 1e3, 1)})

    def _wants_standby(self, config: ModelConfig) -> bool:
        if self.standby_weights is not None:
            return self.standby_weights
        every = models.stage_params(config, range(0, config.n_layers), first=True, last=True)
        model_bytes = 4 * sum(math.prod(t.shape) for t in every.values())
        available = available_memory_bytes()
        return available is not None and model_bytes <= available // 4

    def _read_standby(self, path: Path, config: ModelConfig, held: set[str]) -> None:
        ckpt = open_checkpoint(path)
        every = models.stage_params(config, range(0, config.n_layers), first=True, last=True)
        standby = self._standby
        available = set(ckpt.names())
        for name, t in every.items():
            if self._standby is not standby:
                return  # another model was installed meanwhile
            if name not in held and name not in standby:
                standby[name] = read_param(ckpt, name, t.dtype, available)  # MoE experts: stacked
        if self._standby is standby:
            self.standby_ready.set()
        log.info("standby weights read", extra={"params": len(self._standby)})

    def _model_path(self, model: str) -> Path:
        """A bundled name, or a path confined to --model-root when the executor has one."""
        if model in BUNDLED or self.model_root is None:
            return resolve_model(model)
        return resolve_under_root(Path(self.model_root), model)


def default_kv_cache_bytes(device: str, backend: str = "torch") -> int:
    """The KV pool's size when --kv-cache-bytes is not given: a quarter of the free device memory on CUDA (after
    the weights), else a tenth of the available host memory up to DEFAULT_KV_CACHE_BYTES (NUMPY_KV_CACHE_BYTES for
    the numpy reference, whose functional kv_scatter copies the pool on every step)."""
    if backend == "numpy":
        return NUMPY_KV_CACHE_BYTES
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free // 4)
    available = available_memory_bytes()
    return DEFAULT_KV_CACHE_BYTES if available is None else min(DEFAULT_KV_CACHE_BYTES, available // 10)
