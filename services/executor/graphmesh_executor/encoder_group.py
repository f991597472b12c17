"""An encoder group of the plan on the rank that owns it: the model's encoder (graphmesh.models.encoder), compiled
per power-of-two bucket of rows, its weights read from the checkpoint once. Runs on the engine thread only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from graphmesh.graph import parse
from graphmesh.models.config import EncoderConfig
from graphmesh.models.encoder import build_encoder
from graphmesh_executor.backends import compile_graph
from graphmesh_executor.executable import Executable
from graphmesh_executor.weights import load_params

MIN_ROWS = 16  # the smallest bucket: one executable serves every small image


class EncoderGroup:
    def __init__(self, config: EncoderConfig, weights: Path, backend: str, device: str, dtype: str) -> None:
        self.config, self.weights = config, weights
        self.backend, self.device, self.dtype = backend, device, dtype
        self._executables: dict[int, Executable[Any]] = {}

    def _executable(self, rows: int) -> Executable[Any]:
        exe = self._executables.get(rows)
        if exe is None:
            exe = compile_graph(parse(build_encoder(self.config, rows, self.dtype)), self.backend, self.device)
            holder = next(iter(self._executables.values()), None)
            if holder is None:
                load_params(exe, self.weights, {})
                exe.finalize_params()
            else:
                exe.copy_params_from(holder)
            self._executables[rows] = exe
        return exe

    def run(self, features: np.ndarray) -> np.ndarray:
        """features f32 [n, input_dim] -> f32 [n, hidden]. Rows are independent: the padding of the bucket only
        costs its compute, and is dropped."""
        n = features.shape[0]
        rows = MIN_ROWS
        while rows < n:
            rows *= 2
        padded = np.zeros((rows, self.config.input_dim), np.float32)
        padded[:n] = features
        out = self._executable(rows).run({"features": padded}, read_indices=[0], typed=True)[0]
        return np.ascontiguousarray(out[:n], dtype=np.float32)
