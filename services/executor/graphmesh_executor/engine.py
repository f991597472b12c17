"""The one loop that owns the executor's device.

Every piece of work that touches a stage executable or the KV pools (compiling, running a step, reading or
writing KV rows) is a task run by this thread, in arrival order; RPC handler threads enqueue a task and wait
for its result. Nothing else launches kernels, so a CUDA graph capture can never race another thread's launch,
and a step of many sessions reads the weights once for all of them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from graphmesh_server import telemetry

log = logging.getLogger("graphmesh.executor.engine")
R = TypeVar("R")


class Engine:
    def __init__(self, name: str = "engine") -> None:
        self._tasks: queue.SimpleQueue[tuple[str, Callable[[], object], Future[object], telemetry.Context]] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, name: str, task: Callable[[], R]) -> R:
        """Runs `task` on the engine thread (in a span `name` of the caller's trace) and returns its result, or
        raises its exception."""
        if threading.current_thread() is self._thread:
            return task()  # a task that needs another engine task runs it inline
        return self.submit(name, task).result()

    def submit(self, name: str, task: Callable[[], R]) -> Future[R]:
        """Queues `task`; its future holds what it returned or raised."""
        future: Future[R] = Future()
        self._tasks.put((name, task, future, telemetry.current_context()))  # type: ignore[arg-type]
        return future

    def post(self, name: str, task: Callable[[], object]) -> None:
        """Queues `task` without waiting for it (its exception, if any, is logged)."""
        def report(done: Future[object]) -> None:
            if done.exception() is not None:
                log.warning("engine task failed", extra={"task": name, "error": repr(done.exception())})
        self.submit(name, task).add_done_callback(report)

    def _loop(self) -> None:
        while True:
            name, task, future, context = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with telemetry.span(name, parent=context):
                    future.set_result(task())
            except BaseException as e:  # handed to the waiting handler, which maps it to a status
                future.set_exception(e)
