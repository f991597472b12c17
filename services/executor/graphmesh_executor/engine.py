"""The one loop that owns the executor's device.

Every piece of work that touches a stage executable or the KV pools (compiling, running a step, reading or
writing KV rows) is a task run by this thread, in arrival order; RPC handler threads enqueue a task and wait
for its result. Nothing else launches kernels, so a CUDA graph capture can never race another thread's launch,
and a step of many sessions reads the weights once for all of them.

What follows a run that the device has not finished (reading its output, pushing it on) is handed to the engine's
completion thread (`after`), in launch order: the engine thread is free to launch a rank's other micro-batch
while the device works, instead of waiting for each output in turn.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from graphmesh_executor.executable import HostOutput
from graphmesh_server import telemetry

log = logging.getLogger("graphmesh.executor.engine")
R = TypeVar("R")


class Engine:
    def __init__(self, name: str = "engine") -> None:
        self._tasks: queue.SimpleQueue[tuple[str, Callable[[], object], Future[object], telemetry.Context]] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self._waits: queue.SimpleQueue[tuple[str, Callable[[], object], telemetry.Context]] = queue.SimpleQueue()
        self._completer: threading.Thread | None = None  # started at the first output that is not ready

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

    def after(self, name: str, output: HostOutput, then: Callable[[], object]) -> None:
        """Runs `then`, which reads `output` (its result()): at once, on the caller's thread, when `output` is on
        the host already (a run on the host), else on the completion thread, after every output handed over before
        it. `then` handles its own errors; one that escapes is logged."""
        if output.ready:
            then()
            return
        if self._completer is None:
            self._completer = threading.Thread(target=self._complete, name=f"{self._thread.name}-done", daemon=True)
            self._completer.start()
        self._waits.put((name, then, telemetry.current_context()))

    def _complete(self) -> None:
        while True:
            name, then, context = self._waits.get()
            try:
                with telemetry.span(name, parent=context):
                    then()  # which waits in output.result(), its errors its own
            except BaseException as e:
                log.warning("engine completion failed", extra={"task": name, "error": repr(e)})

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
