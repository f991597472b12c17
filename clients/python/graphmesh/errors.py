"""Typed errors shared by services and clients, and their gRPC status mapping.

A service raises one of these where the problem is found; the servicer turns
it into a status with a google.rpc.ErrorInfo (reason, domain) attached, and
the client turns the status back into the same exception type.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "graphmesh.dev"
MAX_MESSAGE_CHARS = 1024  # of an error's message on the wire


def _clip(text: str, limit: int) -> str:
    text = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 1] + "…"


class GraphmeshError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"

    def __init__(self, message: str, reason: str | None = None, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata = metadata or {}

    def to_status(self) -> grpc.Status:
        return rpc_status.to_status(self.to_status_proto())

    def to_status_proto(self) -> status_pb2.Status:
        """The google.rpc.Status a gRPC status carries, for transports without one (executors' boundary links).
        Message and metadata are cut short and made valid UTF-8: they often quote what a caller sent (a model
        name, a path), and a status over gRPC's 8 KiB of trailing metadata reached the client as RESOURCE_EXHAUSTED
        instead of the error."""
        info = error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN,
                                           metadata={_clip(k, 64): _clip(v, 256) for k, v in self.metadata.items()})
        status = status_pb2.Status(code=self.code.value[0], message=_clip(self.message, MAX_MESSAGE_CHARS))
        status.details.add().Pack(info)
        return status


class InvalidArgument(GraphmeshError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"


class NotFound(GraphmeshError):
    code = grpc.StatusCode.NOT_FOUND
    default_reason = "NOT_FOUND"


class AlreadyExists(GraphmeshError):
    code = grpc.StatusCode.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(GraphmeshError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class OutOfRange(GraphmeshError):
    code = grpc.StatusCode.OUT_OF_RANGE
    default_reason = "OUT_OF_RANGE"


class PermissionDenied(GraphmeshError):
    code = grpc.StatusCode.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class ResourceExhausted(GraphmeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class Unauthenticated(GraphmeshError):
    code = grpc.StatusCode.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class Unavailable(GraphmeshError):
    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class DeadlineExceeded(GraphmeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"


class Cancelled(GraphmeshError):
    code = grpc.StatusCode.CANCELLED
    default_reason = "CANCELLED"


class Internal(GraphmeshError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[GraphmeshError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, OutOfRange, PermissionDenied,
                ResourceExhausted, Unauthenticated, Unavailable, DeadlineExceeded, Cancelled, Internal)
}


def from_rpc_error(error: grpc.RpcError) -> GraphmeshError:
    """The typed exception for a failed call, with the server's reason when it sent one."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = error.details() if isinstance(error, grpc.Call) else str(error)
    status = rpc_status.from_call(error) if isinstance(error, grpc.Call) else None
    return _typed(code, details, status)


def from_status_proto(status: status_pb2.Status) -> GraphmeshError | None:
    """The typed exception a google.rpc.Status stands for; None for OK."""
    if status.code == grpc.StatusCode.OK.value[0]:
        return None
    code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
    return _typed(code, status.message, status)


def _typed(code: grpc.StatusCode, details: str, status: status_pb2.Status | None) -> GraphmeshError:
    reason: str | None = None
    metadata: dict[str, str] = {}
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            reason, metadata = info.reason, dict(info.metadata)
    cls = _BY_CODE.get(code, Internal)
    exc = cls(details or code.name, reason or code.name, metadata)
    exc.code = code
    return exc


log = logging.getLogger("graphmesh")
F = TypeVar("F", bound=Callable[..., Any])


def _bad_input() -> tuple[tuple[type[Exception], str], ...]:
    # Imported late: these modules are below this one and must not import it back.
    from graphmesh.dtypes import DTypeError
    from graphmesh.graph import GraphError
    from graphmesh.ops import OpError
    from graphmesh.tensors import TensorError

    return ((GraphError, "BAD_GRAPH"), (OpError, "BAD_OP"), (TensorError, "BAD_TENSOR"), (DTypeError, "UNKNOWN_DTYPE"))


def to_status(exc: BaseException, method: str = "") -> grpc.Status:
    """The status for any exception a call raised (see refusal)."""
    return refusal(exc, method).to_status()


def refusal(exc: BaseException, method: str = "") -> GraphmeshError:
    """What a call that raised `exc` answers: typed errors keep their code and reason, malformed input is
    INVALID_ARGUMENT, running out of memory RESOURCE_EXHAUSTED (the request was too big for this service now,
    not a bug), anything else INTERNAL (and logged with its traceback)."""
    if isinstance(exc, GraphmeshError):
        err = exc
    elif isinstance(exc, MemoryError):
        err = ResourceExhausted(f"out of memory{': ' + str(exc) if str(exc) else ''}", "OUT_OF_MEMORY")
    else:
        reason = next((r for cls, r in _bad_input() if isinstance(exc, cls)), None)
        if reason is None:
            log.error("internal error", exc_info=exc, extra={"method": method})
            return Internal(f"{type(exc).__name__}: {exc}", "INTERNAL")
        err = InvalidArgument(str(exc), reason)
    log.warning("request refused", extra={"method": method, "code": err.code.name, "reason": err.reason,
                                          "error": err.message})
    return err


def _aborted(context: grpc.ServicerContext) -> bool:
    """Whether the call was aborted already (an interceptor refused a streamed request as the handler read it, with
    INVALID_ARGUMENT): its status stands, where answering again would have turned it into INTERNAL."""
    code = getattr(context, "code", None)
    status = code() if callable(code) else None
    return isinstance(status, grpc.StatusCode) and status is not grpc.StatusCode.OK


def rpc(fn: F) -> F:
    """Aborts the call with `to_status` of whatever the handler raised (unary and streaming handlers alike): the
    one place where every service turns exceptions into statuses, so a bad request never takes the server down."""
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def streaming(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from fn(self, request, context)
            except Exception as e:
                if _aborted(context):
                    raise
                if context.is_active():
                    context.abort_with_status(to_status(e, fn.__name__))
        return cast(F, streaming)

    @functools.wraps(fn)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Exception as e:
            if _aborted(context):
                raise
            if not context.is_active():
                # The caller is gone (it cancelled: a coordinator recovering the mesh cancels the steps in flight),
                # so nobody reads a status. Raising would have grpc log the failure as a crash of the handler.
                log.info("call failed after its caller left", extra={"method": fn.__name__, "error": repr(e)})
                return None
            context.abort_with_status(to_status(e, fn.__name__))
    return cast(F, unary)
