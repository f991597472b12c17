"""The end of every service's main(): serve until SIGTERM or SIGINT, then drain and flush telemetry."""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from graphmesh.errors import GraphmeshError
from graphmesh_server import telemetry

log = logging.getLogger("graphmesh")


def byte_size(text: str) -> int:
    """A command-line size in bytes, with an optional binary suffix: 4096, 64Mi, 1Gi."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as Linux lists them (avx2, fma, ...); empty where the file is missing."""
    try:
        with open(cpuinfo) as f:
            return set(next((line for line in f if line.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return set()


def user_dir(variable: str, fallback: str) -> Path:
    """A per-user base directory of the XDG Base Directory spec: $variable where it is absolute (the spec ignores
    relative ones), else ~/fallback (XDG_STATE_HOME: .local/state; XDG_CACHE_HOME: .cache)."""
    xdg = os.environ.get(variable, "")
    return Path(xdg) if os.path.isabs(xdg) else Path.home() / fallback


def memory_bytes() -> int:
    """The machine's physical memory in bytes (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int | None:
    """Memory the host can still give without swapping (Linux MemAvailable), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def fits_in_memory(cap: int, share: float = 0.5) -> int:
    """A default size limit that this machine can honour: `cap`, or `share` of its memory when that is less.
    A limit larger than the memory turns an oversized request into an out-of-memory kill instead of a refusal."""
    total = memory_bytes()
    return min(cap, int(total * share)) if total else cap


@contextmanager
def starting(program: str) -> Iterator[None]:
    """A service's start: what an operator can fix (a port in use, a file that cannot be read, a flag's bad value)
    ends the process with one line on stderr, `program: what is wrong; what to do`, and exit status 1, instead of
    a traceback."""
    try:
        yield
    except GraphmeshError as e:
        raise SystemExit(f"{program}: {e}") from e
    except OSError as e:  # ours say what to do; the system's name the file and the cause
        raise SystemExit(f"{program}: {e.strerror}: {e.filename}" if e.filename and e.strerror else f"{program}: {e}") \
            from e


# Net allocations of container objects between two runs of Python's cyclic collector (its default is 700)
COLLECT_EVERY = 50_000


def settle_heap() -> None:
    """Once a service has started: what start-up made (modules, the model's config and tokenizer, the plan) is
    frozen, never traversed by the cyclic collector again, and the collector runs every COLLECT_EVERY net
    allocations. By default it ran every 700, and every hundredth run traversed the whole heap with the GIL held: a
    good share of the coordinator's CPU at 256 streams, in pauses that stall every stream and the step in flight
    (bench/RESULTS.md). What serving allocates, reference counting frees nearly all of; the rare cycle still goes."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(COLLECT_EVERY, *gc.get_threshold()[1:])


def run_until_signalled(server: grpc.Server, grace_s: float, drain: Callable[[], None] | None = None) -> None:
    """Serves until SIGTERM or SIGINT; then `drain` (still serving: an executor leaving its mesh waits there until
    the coordinator has re-planned without it), then stops, letting calls in flight finish for `grace_s`."""
    settle_heap()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if drain is not None:
        drain()
    log.info("stopping", extra={"grace_s": grace_s})
    server.stop(grace=grace_s).wait()
    telemetry.shutdown()
