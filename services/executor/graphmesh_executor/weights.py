"""LoadParams: the executor reads an executable's params from a checkpoint under its model root.

Only the params the graph declares are read; the checkpoint readers are
memory-mapped, so the rest of the file costs nothing. The path is confined to
the model root after resolving symlinks, so a request cannot read arbitrary
files of the executor's host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from graphmesh import dtypes
from graphmesh.checkpoints import open_checkpoint
from graphmesh.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from graphmesh.models.moe import has_param, read_param
from graphmesh_executor.executable import Executable

log = logging.getLogger("graphmesh.executor")

PROGRESS_EVERY_S = 1.0
_SUFFIXES = {"gguf": (".gguf",), "safetensors": (".safetensors", "")}  # "" : a Hugging Face model directory


def resolve_under_root(root: Path | None, path: str) -> Path:
    """The real path of `path` taken relative to `root`; refuses anything that leaves the root."""
    if root is None:
        raise FailedPrecondition("this executor has no --model-root, so it cannot load params from files",
                                 "NO_MODEL_ROOT")
    if "\x00" in path:  # the OS refuses it with a ValueError, which would answer INTERNAL
        raise InvalidArgument(f"path {path!r} contains a NUL character", "BAD_PATH", {"path": path})
    real_root = root.resolve()
    target = (real_root / path).resolve()  # an absolute `path` replaces the root here and is then refused below
    if not target.is_relative_to(real_root):
        raise PermissionDenied(f"path {path!r} resolves to {str(target)!r}, outside the model root {str(real_root)!r}",
                               "PATH_OUTSIDE_MODEL_ROOT", {"path": path})
    if not target.exists():
        raise NotFound(f"no file {path!r} under the model root {str(real_root)!r}", "FILE_NOT_FOUND", {"path": path})
    return target


def check_format(target: Path, fmt: str) -> None:
    """fmt is "gguf", "safetensors" or "" (guess from the suffix)."""
    if fmt and (target.suffix if target.is_file() else "") not in _SUFFIXES[fmt]:
        raise InvalidArgument(f"{target.name!r} is not a {fmt} checkpoint (suffix {target.suffix!r})", "BAD_FORMAT")


def load_params(executable: Executable[Any], target: Path, name_map: Mapping[str, str],
                skip: Collection[str] = ()) -> tuple[list[str], int]:
    """Sets every declared param from the checkpoint, but those in `skip` (already set); returns (names, bytes
    loaded)."""
    try:
        ckpt = open_checkpoint(target)
    except (AttributeError, RecursionError, LookupError, TypeError, ValueError, OverflowError) as e:
        # a header of the wrong JSON type (a list), nested 100k deep, ...: the caller's file, not this executor's bug
        raise InvalidArgument(f"{target.name} is not a readable checkpoint: {type(e).__name__}: {str(e)[:200]}",
                              "BAD_CHECKPOINT", {"path": target.name}) from None
    available = set(ckpt.names())
    params = executable.graph.params
    sources = {name: name_map.get(name, name) for name in params}
    missing = [f"{name!r} (as {src!r})" if src != name else repr(name) for name, src in sources.items()
               if not has_param(src, available)]
    if missing:
        raise NotFound(f"{target.name} has no tensor for param(s) {', '.join(missing)}", "PARAM_NOT_IN_CHECKPOINT",
                       {"path": target.name})
    total_bytes = sum(dtypes.itemsize(t.dtype) * int(np.prod(t.shape)) for t in params.values())
    loaded_bytes = 0
    started = last_report = time.monotonic()
    for i, (name, want) in enumerate(params.items()):
        if name in skip:
            continue
        src = sources[name]
        if want.dtype == "u8":
            packed = ckpt.packed(src)
            if packed is None:
                raise InvalidArgument(f"param {name!r} is u8 (packed blocks) but {src!r} in {target.name} is not "
                                      "stored in a packed scheme", "NOT_PACKED", {"param": name})
            array = packed[1]
        else:
            array = read_param(ckpt, src, want.dtype, available)  # MoE experts: stacked from the checkpoint's
        if tuple(array.shape) != want.shape:
            raise InvalidArgument(f"param {name!r} is declared {list(want.shape)} but {src!r} in {target.name} has "
                                  f"shape {list(array.shape)}", "SHAPE_MISMATCH", {"param": name})
        executable.set_param_typed(name, array)
        loaded_bytes += array.nbytes
        now = time.monotonic()
        if now - last_report >= PROGRESS_EVERY_S:
            last_report = now
            log.info("loading params", extra={
                "checkpoint": target.name, "params_loaded": i + 1, "params_total": len(params),
                "mb_loaded": round(loaded_bytes / 2**20, 1), "mb_total": round(total_bytes / 2**20, 1)})
    log.info("params loaded", extra={"checkpoint": target.name, "params": len(params),
                                     "mb": round(loaded_bytes / 2**20, 1), "ms": round((time.monotonic() - started) * 1e3, 1)})
    return list(params), loaded_bytes
