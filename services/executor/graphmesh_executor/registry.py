"""Executables held by one executor process, by id, each behind its own lock.

"One call at a time per executable, many executables in parallel": every
RPC that touches an executable holds that entry's lock for the whole call
(streams included). Calls that touch two executables take both locks in id
order, so two such calls in opposite directions cannot deadlock.

The registry is plain Python with no gRPC in it, and belongs to ExecutorService
alone (servicer.py): the ExecutableGraph trait over gRPC, the surface the op
conformance tests, the SDK's ExecutorClient and bench_executor.py drive, for
any graph of the op set. The stage protocol does not use it: StageRuntime
(stage.py) compiles its stage graphs through backends.compile_graph and runs
them on its engine thread, so ExecutorService neither lists nor touches what
StageService runs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from graphmesh.errors import AlreadyExists, NotFound
from graphmesh.graph import Graph
from graphmesh_executor.backends import executable_class
from graphmesh_executor.executable import Executable


@dataclass
class Entry:
    executable: Executable[Any]
    lock: threading.Lock = field(default_factory=threading.Lock)


class ExecutableRegistry:
    def __init__(self, backend: str = "numpy", device: str = "cpu") -> None:
        self.backend = backend
        self.device = device
        self.executable_class = executable_class(backend)  # fail at startup, not at the first Compile
        self._entries: dict[str, Entry] = {}
        self._guard = threading.Lock()  # protects _entries only; never held while a backend computes
        self._ids = itertools.count(1)

    def _add(self, executable: Executable[Any], executable_id: str) -> str:
        with self._guard:
            if executable_id:
                if executable_id in self._entries:
                    raise AlreadyExists(f"executable id {executable_id!r} is already in use", "EXECUTABLE_EXISTS",
                                        {"executable_id": executable_id})
            else:
                executable_id = next(f"exe-{n}" for n in self._ids if f"exe-{n}" not in self._entries)
            self._entries[executable_id] = Entry(executable)
            return executable_id

    def compile(self, graph: Graph, executable_id: str = "") -> tuple[str, Executable[Any]]:
        """Compiles outside the registry guard (it can take long) and then claims the id."""
        if executable_id and self.has(executable_id):
            raise AlreadyExists(f"executable id {executable_id!r} is already in use", "EXECUTABLE_EXISTS",
                                {"executable_id": executable_id})
        executable = self.executable_class(graph, self.device)
        return self._add(executable, executable_id), executable

    def has(self, executable_id: str) -> bool:
        with self._guard:
            return executable_id in self._entries

    def get(self, executable_id: str) -> Entry:
        with self._guard:
            entry = self._entries.get(executable_id)
        if entry is None:
            raise NotFound(f"no executable {executable_id!r} on this executor", "UNKNOWN_EXECUTABLE",
                           {"executable_id": executable_id})
        return entry

    def ids(self) -> list[str]:
        with self._guard:
            return list(self._entries)

    @contextmanager
    def use(self, executable_id: str) -> Iterator[Executable[Any]]:
        """Holds the executable's lock for the duration of one call."""
        entry = self.get(executable_id)
        with entry.lock:
            yield entry.executable

    @contextmanager
    def use_pair(self, executable_id: str, source_id: str) -> Iterator[tuple[Executable[Any], Executable[Any]]]:
        """Locks a destination and a source executable (in id order); the same id twice locks once."""
        dst, src = self.get(executable_id), self.get(source_id)
        if dst is src:
            with dst.lock:
                yield dst.executable, src.executable
            return
        first, second = (dst, src) if executable_id < source_id else (src, dst)
        with first.lock, second.lock:
            yield dst.executable, src.executable

    def release(self, executable_id: str) -> bool:
        """Drops the executable; a call already running on it finishes first. Idempotent."""
        with self._guard:
            entry = self._entries.pop(executable_id, None)
        if entry is None:
            return False
        with entry.lock:  # wait for the call in flight, so its memory is freed when this returns
            pass
        return True

    def clone(self, executable_id: str, clone_id: str = "") -> str | None:
        """Deep-copies an executable under a new id; None when the backend cannot clone."""
        if clone_id and self.has(clone_id):
            raise AlreadyExists(f"executable id {clone_id!r} is already in use", "EXECUTABLE_EXISTS",
                                {"executable_id": clone_id})
        with self.use(executable_id) as executable:
            if not executable.capabilities.clone:
                return None
            twin = executable.clone()
        return self._add(twin, clone_id)
