"""What the torch backend's modules share about tensors: the dtypes by graphmesh's names, values derived from a
tensor kept on it, and the host-side index checks every kernel of a run makes (or, in a static run, its executable
made before it)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from graphmesh.errors import OutOfRange
from graphmesh_executor.executable import RunContext

Tensor = torch.Tensor
TORCH_DTYPES: dict[str, torch.dtype] = {
    "f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
    "i64": torch.int64, "i32": torch.int32, "u8": torch.uint8, "bool": torch.bool,
}
# Values derived from a tensor that every layer reads (the positions: rope tables, masks), each computed once
# and kept in its __dict__ under this name. They live exactly as long as the tensor, which is never written in place.
MEMO = "_graphmesh_memo"
HALF = (torch.float16, torch.bfloat16)  # computed in f32 where a CPU op would round each step (upcast)
# A run of a prompt step's rows: (sequence, first row, end row, keys, its rows are positions 0.. in order)
Run = tuple[int, int, int, int, bool]


def upcast(x: Tensor) -> Tensor:
    return x.float() if x.dtype in HALF and x.device.type == "cpu" else x


def memo(t: Tensor, key: Hashable, make: Callable[[], Any]) -> Any:
    # 30 layers read the same positions tensor: derive rope tables and host-side values (a device sync
    # on CUDA) once per run, not once per layer.
    held = t.__dict__.setdefault(MEMO, {})
    if key not in held:
        held[key] = make()
    return held[key]


def span(t: Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, on the host."""
    return memo(t, "span", lambda: tuple(torch.stack(torch.aminmax(t)).tolist()))  # type: ignore[no-any-return]


def static_run(ctx: RunContext) -> bool:
    """A run whose kernels must not read device values on the host (it may be captured as a CUDA graph):
    the executable checked every index on the host inputs before the run."""
    return bool(ctx.extras.get("static"))


def check_indices(ctx: RunContext, idx: Tensor, bound: int, what: str) -> None:
    if idx.numel() and not static_run(ctx):
        lo, hi = span(idx)  # checked on the host: a bad index on CUDA would kill the context
        if lo < 0 or hi >= bound:
            raise OutOfRange(f"{what} index {hi if hi >= bound else lo} outside [0, {bound})", "INDEX_OUT_OF_RANGE")
