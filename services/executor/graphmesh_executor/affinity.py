"""Which cores an executor's threads run on (`--cpus`).

Executors that share a host each get their own cores (graphmesh.launcher splits them): the scheduler otherwise moves a
stage's threads between cores at every hand-off of a boundary, and wakes them wherever the other stage just ran. The
CPU kernels' product helper is the exception: it exists to borrow a core the other stages leave idle (a lone stream
computes on one stage at a time), so it starts on the cores the process had before it was pinned, less its own: woken
beside its caller, it would only take the caller's core in turns with it."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

_unpinned: frozenset[int] | None = None  # the process's cores before pin(); None: never pinned


def parse(spec: str) -> frozenset[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6}; ValueError on anything else."""
    cpus: set[int] = set()
    for part in spec.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        first, last = (int(found[1]), int(found[2] or found[1])) if found else (0, -1)
        if last < first:
            raise ValueError(f"not a core or a range of cores: {part!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def pin(cpus: frozenset[int]) -> None:
    """Runs the calling thread, and every thread it starts from now on, on `cpus` (threads inherit their creator's
    cores: call it first thing in a process)."""
    global _unpinned
    if _unpinned is None:
        _unpinned = frozenset(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus)


def unpinned() -> frozenset[int]:
    """The cores this process may use, as they were before pin()."""
    return _unpinned if _unpinned is not None else frozenset(os.sched_getaffinity(0))


@contextlib.contextmanager
def borrowing_threads() -> Iterator[None]:
    """Threads the calling thread starts meanwhile run on the cores of unpinned() that are not its own (where that
    leaves any: else on its own)."""
    own = os.sched_getaffinity(0)
    others = unpinned() - own
    if not others:
        yield
        return
    os.sched_setaffinity(0, others)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)
