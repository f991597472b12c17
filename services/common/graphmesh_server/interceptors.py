"""The server interceptors that enforce the security flags (bearer token, allowed peers, mesh roles), admission
control, and requests that do not parse. (The client interceptors' base is graphmesh.channels': clients use it.)"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias, cast

import grpc

from graphmesh.errors import GraphmeshError, InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated
from graphmesh.security import MESH_TOKEN_KEY
from graphmesh_server.policy import MESH, QUEUED, UNCOUNTED, Role, allowed_roles, is_open, role_of

Behavior = Callable[[Any, grpc.ServicerContext], Any]
# (behavior, response_streaming) -> the behavior that runs instead
Around = Callable[[Behavior, bool], Behavior]

# strings: grpc's classes are generic only in the type stubs
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Handler | None]"
# (request_streaming, response_streaming) -> grpc's constructor of that kind of handler
MAKE_HANDLER: dict[tuple[bool, bool], Callable[..., Any]] = {
    (False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def wrap_handler(handler: Handler | None, around: Around) -> Handler | None:
    """The same handler (kind, serializers) with its behavior replaced by around(behavior, response_streaming)."""
    if handler is None:
        return None
    behavior = behavior_of(handler)
    if behavior is None:
        return handler
    return MAKE_HANDLER[(handler.request_streaming, handler.response_streaming)](
        around(behavior, handler.response_streaming), handler.request_deserializer, handler.response_serializer)


def behavior_of(handler: Handler) -> Any:
    """The one behavior a handler has (the attribute of its kind): a Behavior, or under grpc.aio a coroutine
    function or async generator function."""
    return {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
            (True, False): handler.stream_unary, (True, True): handler.stream_stream}[
        (handler.request_streaming, handler.response_streaming)]


def _refusal(error: GraphmeshError, response_streaming: bool) -> Behavior:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort_with_status(error.to_status())

    def refuse_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort_with_status(error.to_status())
        yield  # a generator, as grpc expects of a response-streaming behavior

    return refuse_stream if response_streaming else refuse


def _checked(handler: Handler | None, details: grpc.HandlerCallDetails,
             refusal: Callable[[grpc.HandlerCallDetails, Any], GraphmeshError | None]) -> Handler | None:
    """`handler` behind a check that needs the call's context: refused with refusal()'s error, if any."""
    if handler is None or is_open(details.method):
        return handler

    def around(behavior: Behavior, streaming: bool) -> Behavior:
        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            error = refusal(details, context)
            if error is None:
                return behavior(request, context)
            return _refusal(error, streaming)(request, context)
        return checked

    return wrap_handler(handler, around)


def _metadata(pairs: Iterable[tuple[str, str | bytes]] | None, key: str) -> str:
    value = next((v for k, v in pairs or () if k == key), "")
    return value if isinstance(value, str) else ""


def _same_secret(sent: str, expected: str) -> bool:
    # compare_digest: the time taken must not reveal how much of a guessed token was right
    return hmac.compare_digest(sent.encode(), expected.encode())


class BearerToken(grpc.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}"

    def refusal(self, details: grpc.HandlerCallDetails, context: Any = None) -> GraphmeshError | None:
        """Why the call must be refused, or None (the metadata is in `details`: no context needed)."""
        if is_open(details.method):
            return None
        sent = _metadata(details.invocation_metadata, "authorization")
        if sent and _same_secret(sent, self._expected):
            return None
        return Unauthenticated("this coordinator needs 'authorization: Bearer <token>' metadata" if not sent
                               else "the bearer token is wrong", "MISSING_TOKEN" if not sent else "BAD_TOKEN")

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = continuation(details)
        error = self.refusal(details)
        if error is None:
            return handler
        return wrap_handler(handler, lambda _, streaming: _refusal(error, streaming))


def peer_names(context: grpc.ServicerContext) -> set[str]:
    """The identities in the caller's verified client certificate: its CN and every SAN."""
    auth = cast(Mapping[str, Sequence[bytes]], context.auth_context())  # each key maps to a list of values
    return {v.decode(errors="replace") for key in ("x509_common_name", "x509_subject_alternative_name")
            for v in auth.get(key, ())}


class AllowedPeers(grpc.ServerInterceptor):
    """Refuses callers whose certificate names none of `allowed` (PERMISSION_DENIED)."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.allowed = frozenset(allowed)

    def refusal(self, details: grpc.HandlerCallDetails, context: Any) -> GraphmeshError | None:
        if is_open(details.method):
            return None
        names = peer_names(context)
        if names & self.allowed:
            return None
        return PermissionDenied(f"peer {sorted(names) or 'without a certificate'} is not among the allowed "
                                f"peers {sorted(self.allowed)}", "PEER_NOT_ALLOWED")

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        # The certificate is only known to the call's context, so the check runs inside the handler.
        return _checked(continuation(details), details, self.refusal)


class MeshRoles(grpc.ServerInterceptor):
    """Lets a call through only when its caller holds a role POLICY allows for the method: UNAUTHENTICATED for
    a caller without credentials (or with a wrong mesh token), PERMISSION_DENIED for a known caller whose role
    may not call it. Roles come from the certificate under mutual TLS, from the mesh token otherwise."""

    def __init__(self, mutual_tls: bool, mesh_token: str, expose_executor_service: bool = False) -> None:
        self.mutual_tls, self.mesh_token = mutual_tls, mesh_token
        self.expose_executor_service = expose_executor_service

    def caller(self, context: grpc.ServicerContext) -> tuple[frozenset[Role], bool]:
        """The caller's roles, and whether it proved who it is (a certificate or a right token)."""
        if self.mutual_tls:  # the handshake already proved the certificate
            roles = frozenset(r for r in map(role_of, peer_names(context)) if r is not None)
            return roles or frozenset({Role.CLIENT}), True
        sent = _metadata(context.invocation_metadata(), MESH_TOKEN_KEY)
        if not sent:
            return frozenset({Role.CLIENT}), False
        if not _same_secret(sent, self.mesh_token):
            raise Unauthenticated("the mesh token is wrong", "BAD_MESH_TOKEN")
        return MESH, True

    def refusal(self, details: grpc.HandlerCallDetails, context: Any) -> GraphmeshError | None:
        if is_open(details.method):
            return None
        allowed = allowed_roles(details.method, self.expose_executor_service)
        try:
            roles, proven = self.caller(context)
        except Unauthenticated as e:
            return e
        if roles & allowed:
            return None
        names = ", ".join(sorted(r.value for r in allowed))
        if proven:
            return PermissionDenied(f"{'/'.join(sorted(r.value for r in roles))} may not call {details.method} "
                                    f"(allowed: {names})", "ROLE_NOT_ALLOWED")
        return Unauthenticated(f"{details.method} is for mesh members ({names}): send the mesh token "
                               f"as {MESH_TOKEN_KEY!r} metadata", "MESH_TOKEN_REQUIRED")

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        return _checked(continuation(details), details, self.refusal)


class Admission(grpc.ServerInterceptor):
    """At most `limit` calls at once (health checks and QUEUED generation aside); the next gets RESOURCE_EXHAUSTED
    at once. A slot is
    taken when the handler starts and given back when the call ends however it ends (done, failed, cancelled),
    so an idle stream holds its slot exactly as long as it is open."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise InvalidArgument(f"--max-concurrent-rpcs must be >= 1, got {limit}", "BAD_LIMIT")
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)
        self.refused = 0  # calls turned away (a metric)

    def enter(self) -> bool:
        """Takes a slot for one unit of work (a call, or one request of a stream that admits per request); False,
        counted as refused, when every slot is taken. The caller gives it back with leave()."""
        if self._free.acquire(blocking=False):
            return True
        self.refused += 1
        return False

    def leave(self) -> None:
        self._free.release()

    def error(self) -> ResourceExhausted:
        return ResourceExhausted(f"this service is running its limit of {self.limit} concurrent calls "
                                 f"(--max-concurrent-rpcs); retry later", "TOO_MANY_CALLS", {"limit": str(self.limit)})

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = continuation(details)
        if details.method in UNCOUNTED or details.method in QUEUED:
            return handler

        def around(behavior: Behavior, streaming: bool) -> Behavior:
            def admitted(request: Any, context: grpc.ServicerContext) -> Any:
                if not self.enter():
                    return _refusal(self.error(), streaming)(request, context)
                if not context.add_callback(self.leave):  # the call already ended
                    self.leave()
                return behavior(request, context)
            return admitted

        return wrap_handler(handler, around)


class Undecodable:
    """What a request that is not a valid message of its type deserializes to (see lenient())."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`parse` returning an Undecodable instead of raising, so that the handler (UndecodableRequests, or
    aio_serving's for async behaviors) answers INVALID_ARGUMENT rather than grpc's INTERNAL."""
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as e:  # DecodeError, or whatever a custom deserializer raises
            return Undecodable(e)
    return deserialize


def undecodable_error(method: str, bad: Undecodable) -> InvalidArgument:
    return InvalidArgument(f"the request is not a valid {method} message: {bad.error}", "BAD_REQUEST")


class UndecodableRequests(grpc.ServerInterceptor):
    """Bytes that do not parse as the method's request message get INVALID_ARGUMENT (reason BAD_REQUEST),
    not the INTERNAL grpc answers when a deserializer raises: garbage is the caller's mistake, not a bug of
    the service. Innermost of the interceptors, so identity and admission still decide first."""

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def checked_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for request in requests:
                if isinstance(request, Undecodable):
                    # raises: the handler stops here
                    context.abort_with_status(undecodable_error(details.method, request).to_status())
                yield request

        def around(behavior: Behavior, streaming: bool) -> Behavior:
            def checked(request: Any, context: grpc.ServicerContext) -> Any:
                if handler.request_streaming:
                    return behavior(checked_stream(request, context), context)
                if isinstance(request, Undecodable):
                    return _refusal(undecodable_error(details.method, request), streaming)(request, context)
                return behavior(request, context)
            return checked

        behavior = behavior_of(handler)
        assert behavior is not None
        return MAKE_HANDLER[(handler.request_streaming, handler.response_streaming)](
            around(behavior, handler.response_streaming), lenient(parse), handler.response_serializer)
