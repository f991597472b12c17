"""Backends, found by name: backends/<name>_backend.py defines one Executable subclass."""

from __future__ import annotations

import importlib
from typing import Any

from graphmesh.errors import FailedPrecondition, InvalidArgument
from graphmesh.graph import Graph
from graphmesh_executor.executable import Executable

NAMES = ("numpy", "torch", "mlx")


def executable_class(name: str) -> type[Executable[Any]]:
    if name not in NAMES:
        raise InvalidArgument(f"unknown backend {name!r}; expected one of {', '.join(NAMES)}", "UNKNOWN_BACKEND")
    try:
        module = importlib.import_module(f"graphmesh_executor.backends.{name}_backend")
    except ImportError as e:
        raise FailedPrecondition(f"backend {name!r} is not installed: {e}", "BACKEND_UNAVAILABLE") from e
    classes = [v for v in vars(module).values()
               if isinstance(v, type) and issubclass(v, Executable) and v is not Executable and v.__module__ == module.__name__]
    return classes[0]


def available() -> list[str]:
    found = []
    for name in NAMES:
        try:
            executable_class(name)
            found.append(name)
        except FailedPrecondition:
            pass
    return found


def compile_graph(graph: Graph, backend: str = "numpy", device: str = "cpu") -> Executable[Any]:
    return executable_class(backend)(graph, device)
