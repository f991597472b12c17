"""A grpc.aio server driven through grpc.Server's synchronous interface, for services whose callers hold streams open.

Why: a synchronous grpc.Server gives every call a thread for its whole life, so streams that hold no work (a
KServe ModelStreamInfer that tritonclient keeps open per client, a client that stopped reading) use up the
threads that health checks and new calls need. Here every call lives on one event loop: async handlers (health,
ModelStreamInfer) hold no thread while they wait, and the synchronous servicers run on a bounded thread pool, a
thread taken only while a call's code runs (a Generate waiting for its next token does hold one: that is work).

The synchronous servicers and interceptors of the mesh (grpc.ServerInterceptor, `context.abort_with_status`,
`context.add_callback`...) run unchanged: `_Bridge` applies the interceptors and runs each synchronous behavior
in the pool with a `SyncContext` that gives the grpc.ServicerContext interface over the call's aio context.
Async behaviors get the identity checks (`gates`) on the loop and count against admission themselves, per unit
of work (ModelStreamInfer admits each request it reads, not the stream).

A synchronous streaming behavior whose context has `yields_waits` may yield a `Wait` instead of blocking (a
Generate waiting for its next token, or for KV cache): its thread goes back to the pool, and the call asks for
its next response once the Wait is woken. So thousands of waiting streams hold no thread each. Once a stream has
yielded a Wait, its code runs up to each next Wait in a batch with the other streams woken at the same time (one
pool task and one loop wakeup for all of them), and a scheduler waking many (`deferred_wakes`) wakes the loop once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import _async as aio_health
from grpc_health.v1 import health

from graphmesh.errors import GraphmeshError
from graphmesh_server.interceptors import MAKE_HANDLER, Undecodable, behavior_of, lenient, undecodable_error

T = TypeVar("T")
_END = object()  # the end of a response iterator, as next(iterator, _END) returns it

# (method, context) -> a refusal or None: the identity checks an async behavior is subject to
Gate = Callable[[grpc.HandlerCallDetails, Any], "GraphmeshError | None"]


class Wait:
    """What a synchronous stream yields instead of blocking (where its context's `yields_waits` is True, or under
    aiterate): its server asks for the next item once wake() was called (from any thread) or `timeout_s` passed,
    whichever comes first; the stream then checks again whatever it waits for. Arm whatever calls wake() before
    checking the condition, so that a wake-up between the check and the yield is not lost.

    A stream that yielded a Wait is one that never blocks: from then on its code runs in batches with the other
    woken streams of its server (_Batches), so it must yield a Wait wherever it would block. Where its code may wait
    for a lock (a session's end takes the scheduler's), it yields `Wait.now()` before: the items before it leave at
    once, and the code after it runs on its own, holding back no other stream."""

    __slots__ = ("_future", "_lock", "_wakeups", "_woken", "alone", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._woken = False
        self._future: asyncio.Future[None] | None = None
        self._wakeups: _Wakeups | None = None
        self.alone = False  # the stream's code after it runs in a pool task of its own, not in a batch

    @classmethod
    def now(cls) -> Wait:
        """A Wait already woken: the items yielded before it leave before the stream's code goes on, alone."""
        wait = cls(0.0)
        wait._woken, wait.alone = True, True
        return wait

    def wake(self) -> None:
        with self._lock:
            self._woken, wakeups, future = True, self._wakeups, self._future
        if wakeups is not None and future is not None:
            wakeups.wake(future)

    async def wait(self, wakeups: _Wakeups | None = None) -> None:
        """On the event loop: returns once woken, or after timeout_s. A future and a timer, no task: a step wakes
        hundreds of these at once. `wakeups`: the running loop's, when the caller holds them (finding the loop
        costs a getpid system call)."""
        wakeups = wakeups or _Wakeups.of(asyncio.get_running_loop())
        loop = wakeups.loop
        future = loop.create_future()
        with self._lock:
            if self._woken:
                return
            self._future, self._wakeups = future, wakeups
        timer = loop.call_later(self.timeout_s, _settle, future)
        try:
            await future
        finally:
            timer.cancel()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _alive(loop: weakref.ref[asyncio.AbstractEventLoop]) -> asyncio.AbstractEventLoop:
    """The loop a weak reference names; RuntimeError (as from a closed loop) once it is gone."""
    alive = loop()
    if alive is None:
        raise RuntimeError("the event loop is gone")
    return alive


_deferred = threading.local()  # .wakeups: the _Wakeups that `deferred_wakes` will post when it ends, on this thread


class _Wakeups:
    """The Waits of one event loop woken from other threads, posted to it as one call_soon_threadsafe per batch:
    the scheduler wakes every session of a step at once, and a loop wakeup each (a write to the loop's self-pipe,
    a callback) was most of what the event loop did at 256 streams."""

    _of: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Wakeups] = weakref.WeakKeyDictionary()
    _of_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # a strong one would keep the key of `_of` alive: its entry never went
        self._lock = threading.Lock()
        self._due: list[asyncio.Future[None]] = []

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return _alive(self._loop)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Wakeups:
        with cls._of_lock:  # loops of several servers, each on its own thread
            wakeups = cls._of.get(loop)
            if wakeups is None:
                wakeups = cls._of[loop] = _Wakeups(loop)
            return wakeups

    def wake(self, future: asyncio.Future[None]) -> None:
        with self._lock:
            self._due.append(future)
            first = len(self._due) == 1
        if not first:
            return  # the post of the first of this batch is on its way (or deferred), and takes this one too
        batch = getattr(_deferred, "wakeups", None)
        if batch is not None:
            batch.add(self)
        else:
            self.post()

    def post(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop closed: nobody waits any more
            pass

    def _run(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for future in due:
            _settle(future)


@contextlib.contextmanager
def deferred_wakes() -> Iterator[None]:
    """Within the block, Waits woken on this thread reach their loops together when it ends: one loop wakeup per
    loop for all of them (a scheduler delivering a step's outputs to all of its sessions)."""
    outer = getattr(_deferred, "wakeups", None)
    if outer is not None:  # nested: the outermost block posts
        yield
        return
    batch: set[_Wakeups] = set()
    _deferred.wakeups = batch
    try:
        yield
    finally:
        _deferred.wakeups = None
        for wakeups in batch:
            wakeups.post()


Tail = Any  # what ended a run of a stream's items: a Wait, _END, or the exception it raised
HAND_BACK_S = 0.005  # a batch of streams hands back what it has this often (_Batches._advance): the GIL switch interval


def _until_wait(items: Iterator[Any]) -> tuple[list[Any], Tail]:
    """The items a waiting stream has ready, up to its next Wait, its end, or its exception."""
    got: list[Any] = []
    try:
        while True:
            item = next(items, _END)
            if item is _END or isinstance(item, Wait):
                return got, item
            got.append(item)
    except BaseException as e:  # handed to the stream's coroutine, which raises it
        return got, e


class _Batches:
    """Advances many woken streams (each up to its next Wait) in one pool task, and hands their items back to the
    loop with one call_soon_threadsafe: a pool hop per stream per step (submit, a thread woken, a future chained
    back to the loop) was most of the rest of the event loop's work at 256 streams. A stream waits for its own
    items only; its order is kept, since a stream has one request in a batch at a time."""

    _of: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[futures.Executor, _Batches]] = \
        weakref.WeakKeyDictionary()
    _of_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop, pool: futures.Executor) -> None:
        self._loop, self.pool = weakref.ref(loop), pool  # weak, as _Wakeups' is
        self._queued: list[tuple[Iterator[Any], asyncio.Future[tuple[list[Any], Tail]]]] = []
        self._ran: futures.Future[None] = futures.Future()  # of the batch being gathered

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return _alive(self._loop)

    @classmethod
    def of(cls, pool: futures.Executor) -> _Batches:
        """The batches of the running loop's streams on `pool` (only ever used on that loop's thread)."""
        loop = asyncio.get_running_loop()
        with cls._of_lock:
            batches = cls._of.setdefault(loop, {}).get(pool)
            if batches is None:
                batches = cls._of[loop][pool] = _Batches(loop, pool)
            return batches

    def next(self, items: Iterator[Any]) -> tuple[asyncio.Future[tuple[list[Any], Tail]], futures.Future[None]]:
        """The stream's next items (asyncio), and a future done once its batch's code stopped running (for a call
        that ends meanwhile: its generator may be closed only then)."""
        ready = self.loop.create_future()
        self._queued.append((items, ready))
        if len(self._queued) == 1:
            self.loop.call_soon(self._submit)  # after the other streams this loop iteration wakes joined the batch
        return ready, self._ran

    def _submit(self) -> None:
        batch, ran, self._queued, self._ran = self._queued, self._ran, [], futures.Future()
        try:
            self.pool.submit(self._advance, batch, ran)
        except RuntimeError as e:  # the pool shut down: the server is stopping
            ran.set_result(None)
            for _, ready in batch:
                if not ready.done():
                    ready.set_exception(e)

    def _advance(self, batch: list[tuple[Iterator[Any], asyncio.Future[tuple[list[Any], Tail]]]],
                 ran: futures.Future[None]) -> None:
        """Runs the batch's streams in turn, handing back what it has every HAND_BACK_S: a stream whose code waits
        for a lock (a session's end takes the scheduler's) holds back only the streams after it, and not for long."""
        results: list[tuple[list[Any], Tail]] = []
        handed, since = 0, time.monotonic()
        for items, _ in batch:
            results.append(_until_wait(items))
            if len(results) < len(batch) and time.monotonic() - since > HAND_BACK_S:
                self._post(batch[handed:len(results)], results[handed:])
                handed, since = len(results), time.monotonic()
        ran.set_result(None)
        self._post(batch[handed:], results[handed:])

    def _post(self, batch: list[tuple[Iterator[Any], asyncio.Future[tuple[list[Any], Tail]]]],
              results: list[tuple[list[Any], Tail]]) -> None:
        try:
            self.loop.call_soon_threadsafe(self._hand_back, batch, results)
        except RuntimeError:  # the loop closed
            pass

    @staticmethod
    def _hand_back(batch: list[tuple[Iterator[Any], asyncio.Future[tuple[list[Any], Tail]]]],
                   results: list[tuple[list[Any], Tail]]) -> None:
        for (_, ready), result in zip(batch, results):
            if not ready.done():  # else its call was cancelled meanwhile
                ready.set_result(result)


class _Advancing:
    """A synchronous stream's items, its code run on a pool: an item per pool call until it yields its first Wait;
    from then on (a stream that never blocks, by Wait's contract) up to each next Wait, in the pool's batches, except
    after a Wait.now() (an item per pool call again, until its next Wait).
    `running`: the pool work now running the stream's code, if any (a call that ends closes the stream after it)."""

    def __init__(self, pool: futures.Executor) -> None:
        self.pool = pool
        self.running: futures.Future[Any] | None = None

    async def items(self, items: Iterator[Any]) -> AsyncIterator[Any]:
        batches: _Batches | None = None
        wakeups: _Wakeups | None = None
        alone = True  # until its first Wait, and after a Wait.now()
        while True:
            tail: Tail
            if alone or batches is None:
                self.running = self.pool.submit(next, items, _END)
                item = await asyncio.wrap_future(self.running)
                got, tail = ([], item) if item is _END or isinstance(item, Wait) else ([item], None)
            else:
                ready, self.running = batches.next(items)
                got, tail = await ready
            for item in got:
                yield item
            if tail is _END:
                return
            if isinstance(tail, Wait):  # the stream waits: no thread is held meanwhile
                alone = tail.alone
                if batches is None or wakeups is None:
                    batches = _Batches.of(self.pool)
                    wakeups = _Wakeups.of(batches.loop)
                await tail.wait(wakeups)
            elif tail is not None:
                raise tail


async def aiterate(pool: futures.Executor, make: Callable[[], Iterator[Any]]) -> AsyncGenerator[Any, None]:
    """The items of the synchronous iterator `make()` returns, its code run on `pool` (_Advancing), its Waits awaited
    on the loop (none is yielded): a stream that mostly waits holds a thread only while its code runs. When the
    consumer stops early (or is cancelled), the iterator is closed on the pool once its code in progress, if any, is
    done (closing a generator while it runs would fail)."""
    advancing = _Advancing(pool)
    items: Iterator[Any] | None = None
    try:
        advancing.running = pool.submit(make)
        items = it = await asyncio.wrap_future(advancing.running)
        async for item in advancing.items(it):
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            work = advancing.running
            if work is None or work.done():
                pool.submit(close)
            else:
                work.add_done_callback(lambda _: pool.submit(close))


class _Aborted(Exception):
    """Raised in a pool thread by SyncContext.abort; the loop side sends the status (aio's abort is a coroutine)."""


class SyncContext:
    """grpc.ServicerContext for a synchronous behavior running in a pool thread, over the aio context of its call.

    Getters read the aio context directly; what would change the call (abort, codes, trailing metadata) is
    recorded here and applied by the loop side when the behavior returns or raises."""

    yields_waits = True  # a streaming behavior may yield Wait instead of blocking (the module's docstring)

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any], loop: asyncio.AbstractEventLoop) -> None:
        self._context, self._loop = context, loop
        self._callbacks: list[Callable[[], None]] = []
        self._ended = False
        self._left = False  # the loop side stopped waiting for the behavior (it returned, or the client left)
        self.aborted: tuple[grpc.StatusCode, str, Any] | None = None
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: Any = ()

    # -- what the call is
    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    def auth_context(self) -> Any:
        return self._context.auth_context()

    def peer(self) -> str:
        return self._context.peer()

    def peer_identities(self) -> Any:
        return self._context.peer_identities()

    def peer_identity_key(self) -> Any:
        return self._context.peer_identity_key()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def is_active(self) -> bool:
        """False once the call ended, the client's cancellation and deadline included (aio's done() stays False
        while a cancelled handler's pool thread still runs: the loop side marks it when it stops waiting)."""
        return not self._ended and not self._left and not self._context.done()

    def left(self) -> None:
        """The loop side will take no more from the behavior: a behavior still running should stop."""
        self._left = True

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Runs `callback` when the call ends, however it ends; False (not registered) if it already ended."""
        if self._ended:
            return False
        self._callbacks.append(callback)
        return True

    # -- ending the call
    def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self.aborted = (code, details, trailing_metadata or self._trailing)
        raise _Aborted(details)

    def abort_with_status(self, status: grpc.Status) -> None:
        self.abort(status.code, status.details, status.trailing_metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        self._trailing = trailing_metadata

    def code(self) -> grpc.StatusCode | None:
        return self.aborted[0] if self.aborted else self._code

    def details(self) -> str:
        return self.aborted[1] if self.aborted else self._details

    def trailing_metadata(self) -> Any:
        return self._trailing

    def send_initial_metadata(self, metadata: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._context.send_initial_metadata(metadata), self._loop).result()

    def set_compression(self, compression: grpc.Compression) -> None:
        self._context.set_compression(compression)

    def disable_next_message_compression(self) -> None:
        self._context.disable_next_message_compression()

    # -- the loop side
    def finish(self) -> None:
        """Applies what the behavior recorded, and runs the end-of-call callbacks (once; on the loop's thread)."""
        if self._ended:
            return
        self._ended = True
        if self._trailing:
            self._context.set_trailing_metadata(self._trailing)
        if self._code is not None and self.aborted is None:
            self._context.set_code(self._code)
            self._context.set_details(self._details)
        for callback in self._callbacks:
            callback()

    async def send_abort(self) -> None:
        assert self.aborted is not None
        code, details, trailing = self.aborted
        await self._context.abort(code, details, trailing)


def _returning(handler: Any) -> Callable[[grpc.HandlerCallDetails], Any]:
    """A continuation for a synchronous interceptor: the handler the inner ones made."""
    return lambda _: handler


def _is_async(behavior: Any) -> bool:
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


class _Bridge(grpc.aio.ServerInterceptor):
    """Runs the synchronous interceptors and behaviors on the pool, the async ones on the loop (see the module)."""

    def __init__(self, interceptors: Sequence[grpc.ServerInterceptor], gates: Sequence[Gate],
                 pool: futures.ThreadPoolExecutor) -> None:
        self.interceptors, self.gates, self.pool = list(interceptors), list(gates), pool

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        if _is_async(behavior_of(handler)):
            return self._gated(handler, details)
        for interceptor in reversed(self.interceptors):  # the first is outermost, as in grpc.server(interceptors=)
            handler = interceptor.intercept_service(_returning(handler), details)
            if handler is None:
                return None
        return self._pooled(handler)

    def _gated(self, handler: Any, details: grpc.HandlerCallDetails) -> Any:
        behavior, parse = behavior_of(handler), handler.request_deserializer

        async def abort_garbage(context: grpc.aio.ServicerContext[Any, Any], bad: Undecodable) -> None:
            status = undecodable_error(details.method, bad).to_status()
            await context.abort(status.code, status.details, status.trailing_metadata)

        async def parsed(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Undecodable):
                    await abort_garbage(context, request)
                yield request

        def checked_request(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            return parsed(request, context) if handler.request_streaming else request

        async def refused(context: grpc.aio.ServicerContext[Any, Any]) -> bool:
            for gate in self.gates:
                error = gate(details, context)
                if error is not None:
                    status = error.to_status()
                    await context.abort(status.code, status.details, status.trailing_metadata)
                    return True
            return False

        if inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                if await refused(context):
                    return
                if isinstance(request, Undecodable):
                    await abort_garbage(context, request)
                async for response in behavior(checked_request(request, context), context):
                    yield response
            checked: Any = stream
        else:
            async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                if await refused(context):
                    return None
                if isinstance(request, Undecodable):
                    await abort_garbage(context, request)
                return await behavior(checked_request(request, context), context)
            checked = unary
        return MAKE_HANDLER[(handler.request_streaming, handler.response_streaming)](
            checked, lenient(parse) if parse is not None else None, handler.response_serializer)

    def _pooled(self, handler: Any) -> Any:
        behavior, pool = behavior_of(handler), self.pool
        lazy = inspect.isgeneratorfunction(behavior)  # calling it runs none of its code: no pool task needed

        def sync_requests(requests: AsyncIterator[Any], loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
            """The aio request stream as the iterator a synchronous behavior reads, from its pool thread."""
            it = requests.__aiter__()
            while True:
                try:
                    yield asyncio.run_coroutine_threadsafe(_next(it), loop).result()
                except StopAsyncIteration:
                    return

        def prepare(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> tuple[Any, SyncContext]:
            loop = asyncio.get_running_loop()
            sync = SyncContext(context, loop)
            return (sync_requests(request, loop) if handler.request_streaming else request), sync

        def after(work: futures.Future[Any] | None, then: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
            """Runs `then` once `work` (a pool call) is over. A cancelled call's coroutine ends at once, but its
            pool thread runs on until the behavior returns: the call's end (its admission slot, closing its
            response generator) must wait for that thread, or the slot would be lent twice and close() would
            find the generator still running."""
            if work is None or work.done():
                then()
            else:
                work.add_done_callback(lambda _: loop.call_soon_threadsafe(then))

        if handler.response_streaming:
            async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                loop = asyncio.get_running_loop()
                request, sync = prepare(request, context)
                responses: Iterator[Any] | None = None
                advancing = _Advancing(pool)
                try:
                    if lazy:
                        responses = behavior(request, sync)
                    else:
                        advancing.running = pool.submit(behavior, request, sync)
                        responses = iter(await asyncio.wrap_future(advancing.running))
                    async for item in advancing.items(responses):
                        yield item
                except _Aborted:
                    sync.finish()
                    await sync.send_abort()
                finally:
                    sync.left()  # a cancelled call: the behavior sees is_active() False from now on

                    def end() -> None:
                        close = getattr(responses, "close", None)
                        # not a generator, the behavior never returned one, or a generator that ran to its end
                        if close is None or getattr(responses, "gi_frame", True) is None:
                            sync.finish()
                        else:  # the generator's finally blocks (a session's end) run in the pool, then the call ends
                            pool.submit(close).add_done_callback(lambda _: loop.call_soon_threadsafe(sync.finish))
                    after(advancing.running, end, loop)
            pooled: Any = stream
        else:
            async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                loop = asyncio.get_running_loop()
                request, sync = prepare(request, context)
                work = pool.submit(behavior, request, sync)
                try:
                    return await asyncio.wrap_future(work)
                except _Aborted:
                    sync.finish()
                    await sync.send_abort()
                    return None
                finally:
                    after(work, sync.finish, loop)
            pooled = unary
        return MAKE_HANDLER[(handler.request_streaming, handler.response_streaming)](
            pooled, handler.request_deserializer, handler.response_serializer)


async def _next(it: AsyncIterator[T]) -> T:
    return await it.__anext__()


class AioServer(grpc.Server):
    """A grpc.aio server on an event loop thread of its own, with grpc.Server's synchronous methods, so that
    servicers, `add_*Servicer_to_server`, reflection and run_until_signalled use it as any server."""

    def __init__(self, pool: futures.ThreadPoolExecutor, interceptors: Sequence[grpc.ServerInterceptor] = (),
                 gates: Sequence[Gate] = (), options: Sequence[tuple[str, Any]] = (), admission: Any = None) -> None:
        self.pool, self.admission = pool, admission  # admission: what async behaviors count their work against
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()
        bridge = _Bridge(interceptors, gates, pool)

        async def create() -> grpc.aio.Server:
            return grpc.aio.server(migration_thread_pool=pool, interceptors=[bridge], options=list(options))
        self._server = self.run(create())
        self._stopped = threading.Event()

    def run(self, coroutine: Awaitable[T]) -> T:
        """Runs `coroutine` on the server's loop and returns its result (from any other thread)."""
        async def wrapped() -> T:
            return await coroutine
        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result()

    def _on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        async def call() -> T:
            return fn(*args)
        return self.run(call())

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Any) -> None:
        self._on_loop(self._server.add_generic_rpc_handlers, generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: Any) -> None:
        self._on_loop(self._server.add_registered_method_handlers, service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._on_loop(self._server.add_insecure_port, address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._on_loop(self._server.add_secure_port, address, server_credentials)

    def start(self) -> None:
        self.run(self._server.start())

    def stop(self, grace: float | None) -> threading.Event:
        """Stops serving (calls in progress get `grace` seconds); the event is set once every call ended."""
        async def stop() -> None:
            await self._server.stop(grace)
            self._stopped.set()
        asyncio.run_coroutine_threadsafe(stop(), self.loop)
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)


class MirroredHealth(health.HealthServicer):  # type: ignore[misc]  # grpc_health ships no type hints
    """grpc.health.v1 answered on the server's loop (never behind the pool, however busy it is), with the
    synchronous HealthServicer's interface: set() from any thread. Being one, it also serves a plain-text
    health listener (ServerSecurity.serve_health) with the same states."""

    def __init__(self, server: AioServer) -> None:
        super().__init__()
        from grpc_health.v1 import health_pb2_grpc

        self._server = server
        self._async = aio_health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._async, server)

    def set(self, service: str, status: Any) -> None:
        super().set(service, status)
        self._server.run(self._async.set(service, status))

    def enter_graceful_shutdown(self) -> None:
        super().enter_graceful_shutdown()
        self._server.run(self._async.enter_graceful_shutdown())
