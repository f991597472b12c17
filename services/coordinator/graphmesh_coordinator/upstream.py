"""What the request APIs (the OpenAI API, the Responses API, KServe) run their sessions on: an Upstream, either the
Generator in the coordinator's own process (LocalUpstream) or a coordinator that a front end relays to
(frontend.RelayUpstream), and the sessions of one request as asyncio tasks (Sessions). An API written against it
serves in either process alike.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Protocol

import numpy as np
from opentelemetry.trace import Span

from graphmesh.errors import Unavailable
from graphmesh.tokenizer import Tokenizer
from graphmesh_coordinator.generation import Event, GenerationRequest, Generator
from graphmesh_coordinator.pipeline import Mesh
from graphmesh_coordinator.speculative import Mode
from graphmesh_server import telemetry
from graphmesh_server.aio_serving import Wait, aiterate


class Upstream(Protocol):
    """What the APIs' requests run on: the Generator of the coordinator they are served by (LocalUpstream), or a
    coordinator that a front end relays them to (frontend.RelayUpstream)."""

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def context_tokens(self) -> int: ...

    @property
    def session_tokens(self) -> int:
        """The most tokens one session may hold (Generator.session_tokens): a request without max_tokens
        generates up to it."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def speculative(self) -> Mode:
        """The default of requests that do not choose (--speculative)."""

    def ready(self) -> bool:
        """Whether a request would be served now (/health)."""

    def events(self, request: GenerationRequest, sessions: Sessions) -> AsyncGenerator[Event, None]:
        """One session's events, on the server's loop; closing the generator ends the session."""

    async def logits(self, token_ids: list[int], pool: Executor, ready_wait_s: float) -> np.ndarray:
        """The logits of the prompt's last position ([vocab] f32), waiting up to ready_wait_s for the mesh; `pool`
        runs whatever code blocks."""


class LocalUpstream:
    """The Generator in this process: each session's code runs on the server's pool only while it computes
    (aiterate)."""

    def __init__(self, generator: Generator, mesh: Mesh) -> None:
        self.generator, self.mesh = generator, mesh

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.generator.tokenizer

    @property
    def context_tokens(self) -> int:
        return self.generator.context_tokens

    @property
    def session_tokens(self) -> int:
        return self.generator.session_tokens

    @property
    def vocab_size(self) -> int:
        return self.mesh.config.vocab_size

    @property
    def speculative(self) -> Mode:
        return self.generator.speculative

    def ready(self) -> bool:
        return self.mesh.ready

    def events(self, request: GenerationRequest, sessions: Sessions) -> AsyncGenerator[Event, None]:
        def run() -> Iterator[Event | Wait]:
            with telemetry.use(sessions.span):  # the Generator's spans and the steps join the request's trace
                yield from self.generator.generate_waiting(request, alive=lambda: not sessions.cancelled,
                                                           ready_wait_s=sessions.ready_wait_s)
        return aiterate(sessions.pool, run)

    async def logits(self, token_ids: list[int], pool: Executor, ready_wait_s: float) -> np.ndarray:
        def run() -> np.ndarray:
            if not self.mesh.wait_ready(ready_wait_s):
                raise Unavailable(f"the mesh has not been ready for {ready_wait_s:.0f} s", "MESH_NOT_READY")
            return self.generator.logits(token_ids)
        return await asyncio.get_running_loop().run_in_executor(pool, run)


class Sessions:
    """The sessions of one request, each an asyncio task on the server's loop; their events come to the request
    through one queue as (choice index, Event | the error that ended it | None at the end). A session that waits for
    the mesh, for KV cache or for its tokens holds no thread, so thousands of queued requests cost no thread each."""

    def __init__(self, upstream: Upstream, requests: Sequence[GenerationRequest], span: Span,
                 pool: ThreadPoolExecutor, ready_wait_s: float) -> None:
        self.queue: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()
        self.cancelled = False
        self.span, self.pool, self.ready_wait_s = span, pool, ready_wait_s
        self._tasks = [asyncio.create_task(self._run(index, upstream.events(request, self)))
                       for index, request in enumerate(requests)]

    async def _run(self, index: int, events: AsyncGenerator[Event, None]) -> None:
        try:
            async with contextlib.aclosing(events):  # cancelled (cancel()): closing it ends the session
                async for event in events:
                    self.queue.put_nowait((index, event))
            self.queue.put_nowait((index, None))
        except Exception as e:
            self.queue.put_nowait((index, e))

    def cancel(self) -> None:
        self.cancelled = True
        for task in self._tasks:
            task.cancel()
