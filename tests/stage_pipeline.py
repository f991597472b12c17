"""Two stage runtimes in one process, the first's boundaries handed straight to the second: a pipeline without
executors, links or a coordinator, for the tests (and a benchmark) that drive StageRuntime steps by hand."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphmesh import plan as dag
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_types import Boundary, StageSpec


def two_stages(path: Path, backend: str, split: int, n_layers: int, *, device: str = "cpu", hidden: int = 64,
               kv_cache_bytes: int, **spec: Any) -> list[StageRuntime]:
    """Layers [0, split) and [split, n_layers) of the model at `path` on `backend`/`device`, installed as incarnation
    1 of a plan whose ranks are addressed "0" and "1"; `spec`: the rest of both StageSpecs (dtype, ...)."""
    runtimes: list[StageRuntime] = []

    def push(address: str, incarnation: int, boundary: Boundary, timeout_s: float,
             delivered: Callable[[Exception | None], None]) -> None:
        runtimes[int(address)].accept_boundary(incarnation, boundary)
        delivered(None)

    runtimes = [StageRuntime(backend, device, pusher=push, kv_cache_bytes=kv_cache_bytes) for _ in range(2)]
    plan = dag.pipeline([(0, split), (split, n_layers)], ["0", "1"], hidden)
    runtimes[0].install(1, 0, 2, StageSpec(str(path), 0, split, True, False, **spec), plan)
    runtimes[1].install(1, 1, 2, StageSpec(str(path), split, n_layers, False, True, **spec), plan)
    return runtimes
