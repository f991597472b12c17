"""TLS, mutual TLS, bearer tokens, mesh roles and admission control for every gRPC hop of the mesh.

A service gets one certificate (--tls-cert/--tls-key) that it serves with and also presents as its client
certificate on every channel it opens to another service. With --tls-ca the server requires client
certificates signed by that CA (mutual TLS) and verifies its peers' servers against it. On top of that:
--allowed-peers limits which certificate identities (CN or SAN) may call, --auth-token-file makes clients
send `authorization: Bearer <token>`, and --health-listen serves grpc.health.v1 alone in plain text for
probes that cannot speak TLS (the kubelet's). Health and reflection are never behind the token, the roles
or the peer list: orchestrators and grpcurl must reach them.

Roles. Every caller has roles, and POLICY says which roles may call each method:
- under mutual TLS a peer's roles come from its certificate: a CN or SAN `<role>.graphmesh.internal` or
  `<role>-<ordinal>.graphmesh.internal` (`coordinator.graphmesh.internal`, `executor-0.graphmesh.internal`,
  `kvstore.graphmesh.internal`) names a mesh role; a certificate without such a name is a client. Only
  certificates of mesh services may carry these names: whoever runs the CA must never sign one for a user.
  (Not `<role>.graphmesh`: a CA that signs certificates for Kubernetes services by their DNS names would hand
  `executor.graphmesh` to any service called executor in a namespace called graphmesh.)
- without mutual TLS, a caller that sends this mesh's token (--mesh-token-file, metadata
  `x-graphmesh-mesh-token`) is a mesh member and holds every mesh role; any other caller is a client. The
  per-method checks between mesh roles (only the coordinator may Fence, ...) therefore hold under mutual
  TLS only; the token only keeps outsiders out.
- with neither, the service is unauthenticated: every caller may call everything, and it listens on
  loopback only unless --allow-insecure-remote is given (the convention of Redis's protected mode).
A mesh service's own channels (`channel()`) carry its mesh token, so callers inside the mesh do nothing.

Admission. At most --max-concurrent-rpcs calls run at once (default: the service's handler threads);
beyond that a call gets RESOURCE_EXHAUSTED at once instead of queueing. The thread pool has HEADROOM
threads more than that limit, so health checks and admin calls (UNCOUNTED) and refusals always find a thread.
Generation streams (QUEUED) are not counted: the coordinator queues them itself, bounded by its
--max-waiting-requests, and a queued stream holds no thread (aio_serving.Wait).
"""

from __future__ import annotations

import argparse
import collections
import hmac
import ipaddress
import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import grpc

from graphmesh.errors import GraphmeshError, InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated

if TYPE_CHECKING:
    from grpc_health.v1 import health

log = logging.getLogger("graphmesh.security")

Behavior = Callable[[Any, grpc.ServicerContext], Any]
# (behavior, response_streaming) -> the behavior that runs instead
Around = Callable[[Behavior, bool], Behavior]

_health_listeners: list[grpc.Server] = []

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
# Never counted by admission control: a probe must get its answer however loaded the service is. Watch is a
# stream that lives as long as its client, so it is counted like any other call.
UNCOUNTED = frozenset({"/grpc.health.v1.Health/Check",
                       # admin: an operator must see the coordinator's state whatever its load (quick, read-only)
                       "/graphmesh.v1.CoordinatorService/Status",
                       "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                       "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"})
# Not counted either: the serving code queues these itself, in order, with a bound of its own (the coordinator's
# --max-waiting-requests), and they hold no thread while they wait. Counting them refused the 65th concurrent
# Generate of a coordinator whose KV cache had room for far more.
QUEUED = frozenset({"/graphmesh.v1.CoordinatorService/Generate"})
HEADROOM = 8  # handler threads beyond the admission limit, for health checks and refusals

MESH_TOKEN_KEY = "x-graphmesh-mesh-token"


# strings: grpc's classes are generic only in the type stubs
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Handler | None]"


class Role(Enum):
    COORDINATOR = "coordinator"
    EXECUTOR = "executor"
    KVSTORE = "kvstore"
    CLIENT = "client"


MESH = frozenset({Role.COORDINATOR, Role.EXECUTOR, Role.KVSTORE})
ANYONE = frozenset(Role)
_ROLE_NAME = re.compile(r"(coordinator|executor|kvstore)(-\d+)?\.graphmesh\.internal")


def role_of(name: str) -> Role | None:
    """The mesh role a certificate name carries (`executor-0.graphmesh.internal` -> EXECUTOR); None for any other name."""
    match = _ROLE_NAME.fullmatch(name)
    return Role(match.group(1)) if match else None


def _methods(service: str, roles: frozenset[Role], *names: str) -> dict[str, frozenset[Role]]:
    return {f"/graphmesh.v1.{service}/{name}": roles for name in names}


_COORDINATOR, _KVSTORE_OR_COORDINATOR = frozenset({Role.COORDINATOR}), frozenset({Role.COORDINATOR, Role.KVSTORE})
_EXECUTOR_OR_COORDINATOR = frozenset({Role.COORDINATOR, Role.EXECUTOR})
# Method -> the roles that may call it; a key ending in "/" is the default of a whole service. A method found in
# neither is open to mesh roles only (fail closed). The rationale for each line is in README.md (threat model).
POLICY: dict[str, frozenset[Role]] = {
    # the pipeline protocol is the coordinator's alone: whoever drives it decides every user's tokens
    "/graphmesh.v1.StageService/": _COORDINATOR,
    **_methods("StageService", _COORDINATOR, "Install", "Fence", "ExecuteStep", "AbortStep", "ExecuteGroup", "Commit",
               "Abort", "ResolveEpoch", "ReleaseSession", "ShareSessionKv", "InjectFault"),
    **_methods("StageService", frozenset({Role.EXECUTOR}), "PushBoundary"),  # the previous stage
    # a link carries boundaries from the previous stage and row copies (what WriteSessionKv takes) from an executor or
    # the store's seeds; the listener takes a boundary from any link, which grants the store nothing: links are plain
    # TCP, so they exist only without TLS, where the mesh token gives every member every role
    **_methods("StageService", frozenset({Role.EXECUTOR, Role.KVSTORE}), "OpenBoundaryLink"),
    **_methods("StageService", _KVSTORE_OR_COORDINATOR, "ReadSessionKv", "PushSessionKv"),  # seeds and copies
    # a copy's source executor writes the rows into the destination itself (one hop); an executor already sees,
    # and could alter, every session's activations that pass through its stage, so this grants it nothing new
    **_methods("StageService", _KVSTORE_OR_COORDINATOR | {Role.EXECUTOR}, "WriteSessionKv"),
    **_methods("StageService", MESH, "Status"),
    # KV rows are users' prompts in another form: reading or writing them is for the mesh only
    "/graphmesh.v1.KvStoreService/": _COORDINATOR,
    **_methods("KvStoreService", _EXECUTOR_OR_COORDINATOR, "PutBlocks", "Lookup", "GetBlocks"),
    # the store calls executors with its own identity for these: only the coordinator may name them
    **_methods("KvStoreService", _COORDINATOR, "SeedExecutor", "CopyRows", "Evict"),
    # the roster is what SeedExecutor and CopyRows may name: whoever sets it picks where KV rows go
    **_methods("KvStoreService", _COORDINATOR, "RegisterExecutors"),
    **_methods("KvStoreService", MESH, "Stats"),
    "/graphmesh.v1.ExecutorService/": MESH,  # plus clients with --expose-executor-service
    "/graphmesh.v1.CoordinatorService/": ANYONE,  # the public APIs; the bearer token guards them
    "/inference.GRPCInferenceService/": ANYONE,
}


def allowed_roles(method: str, expose_executor_service: bool = False) -> frozenset[Role]:
    """The roles that may call `method` (a fully-qualified name, "/package.Service/Method")."""
    service = method[:method.rfind("/") + 1]
    roles = POLICY.get(method, POLICY.get(service, MESH))
    if expose_executor_service and service == "/graphmesh.v1.ExecutorService/":
        roles |= {Role.CLIENT}
    return roles


def wrap_handler(handler: Handler | None, around: Around) -> Handler | None:
    """The same handler (kind, serializers) with its behavior replaced by around(behavior, response_streaming)."""
    if handler is None:
        return None
    kinds: dict[tuple[bool, bool], tuple[Behavior | None, Callable[..., Handler]]] = {
        (True, True): (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
        (True, False): (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
        (False, True): (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
        (False, False): (handler.unary_unary, grpc.unary_unary_rpc_method_handler)}
    behavior, make = kinds[(handler.request_streaming, handler.response_streaming)]
    if behavior is None:
        return handler
    return make(around(behavior, handler.response_streaming), handler.request_deserializer, handler.response_serializer)


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
    if handler is None or _is_open(details.method):
        return handler

    def around(behavior: Behavior, streaming: bool) -> Behavior:
        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            error = refusal(details, context)
            if error is None:
                return behavior(request, context)
            return _refusal(error, streaming)(request, context)
        return checked

    return wrap_handler(handler, around)


def _is_open(method: str) -> bool:
    return method.startswith(OPEN_SERVICES)


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
        if _is_open(details.method):
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
        if _is_open(details.method):
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
        if _is_open(details.method):
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


class _Undecodable:
    """What a request that is not a valid message of its type deserializes to (see UndecodableRequests)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class UndecodableRequests(grpc.ServerInterceptor):
    """Bytes that do not parse as the method's request message get INVALID_ARGUMENT (reason BAD_REQUEST),
    not the INTERNAL grpc answers when a deserializer raises: garbage is the caller's mistake, not a bug of
    the service. Innermost of the interceptors, so identity and admission still decide first."""

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as e:  # DecodeError, or whatever a custom deserializer raises
                return _Undecodable(e)

        def error(bad: _Undecodable) -> InvalidArgument:
            return InvalidArgument(f"the request is not a valid {details.method} message: {bad.error}", "BAD_REQUEST")

        def checked_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for request in requests:
                if isinstance(request, _Undecodable):
                    context.abort_with_status(error(request).to_status())  # raises: the handler stops here
                yield request

        def around(behavior: Behavior, streaming: bool) -> Behavior:
            def checked(request: Any, context: grpc.ServicerContext) -> Any:
                if handler.request_streaming:
                    return behavior(checked_stream(request, context), context)
                if isinstance(request, _Undecodable):
                    return _refusal(error(request), streaming)(request, context)
                return behavior(request, context)
            return checked

        wrapped = wrap_handler(handler, around)
        assert wrapped is not None
        kinds = {(True, True): grpc.stream_stream_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
                 (False, True): grpc.unary_stream_rpc_method_handler, (False, False): grpc.unary_unary_rpc_method_handler}
        behavior = next(b for b in (wrapped.stream_stream, wrapped.stream_unary, wrapped.unary_stream,
                                    wrapped.unary_unary) if b is not None)
        return kinds[(handler.request_streaming, handler.response_streaming)](
            behavior, deserialize, handler.response_serializer)


@dataclass(frozen=True)
class Tls:
    """A service's certificate chain and key (PEM), and the CA its peers must be signed by (None: no mTLS)."""

    cert: bytes
    key: bytes
    ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str = "") -> Tls:
        if not cert or not key:
            raise InvalidArgument("TLS needs both --tls-cert and --tls-key", "TLS_INCOMPLETE")
        return cls(Path(cert).read_bytes(), Path(key).read_bytes(), Path(ca).read_bytes() if ca else None)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """This service as a client: its own certificate, and the CA (or the system roots) to check the server."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """Client credentials from PEM files: the CA that signed the server (empty: system roots) and, for
    mutual TLS, the client's own certificate and key."""
    def read(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None
    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (none for an empty token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def mesh_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that identifies a mesh member by the mesh token (none for an empty token)."""
    return ((MESH_TOKEN_KEY, token),) if token else ()


class CallDetails(collections.namedtuple("CallDetails", ("method", "timeout", "metadata", "credentials",
                                                         "wait_for_ready", "compression")), grpc.ClientCallDetails):
    """grpc.ClientCallDetails as a value, for client interceptors that change a call's metadata."""


class _MeshIdentity(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the mesh token to every call's metadata: `token`, or (None) this process's at the time of the call, so
    channels opened before the service's server was built carry it too."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def _call(self, continuation: Callable[[Any, Any], Any], d: grpc.ClientCallDetails, request: Any) -> Any:
        metadata = mesh_metadata(_process_mesh_token if self.token is None else self.token)
        if not metadata:
            return continuation(d, request)
        return continuation(CallDetails(d.method, d.timeout, [*(d.metadata or ()), *metadata], d.credentials,
                                        d.wait_for_ready, d.compression), request)

    def intercept_unary_unary(self, continuation: Any, client_call_details: grpc.ClientCallDetails, request: Any) -> Any:
        return self._call(continuation, client_call_details, request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails, request: Any) -> Any:
        return self._call(continuation, client_call_details, request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                               request_iterator: Any) -> Any:
        return self._call(continuation, client_call_details, request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                                request_iterator: Any) -> Any:
        return self._call(continuation, client_call_details, request_iterator)


# The mesh token of the service this process runs (set by ServerSecurity.server): one process is one mesh member,
# so every channel it opens to the mesh carries the same identity without each caller passing it along.
_process_mesh_token = ""


def as_mesh_member(channel: grpc.Channel, token: str | None = None) -> grpc.Channel:
    """`channel` with every call carrying the mesh token: `token`, or (None) this process's."""
    return grpc.intercept_channel(channel, _MeshIdentity(token)) if token != "" else channel


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """The one channel factory: TLS with `credentials` when given, else plaintext (loopback, or a mesh behind its
    own network policy)."""
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=list(options))


def channel(address: str, tls: Tls | None, options: Sequence[tuple[str, Any]] = (),
            mesh_token: str | None = None) -> grpc.Channel:
    """A channel from one service to another: TLS with this service's certificate when it has one, and the mesh
    token (`mesh_token`, or by default this process's) on every call."""
    return as_mesh_member(open_channel(address, tls.channel_credentials() if tls else None, options), mesh_token)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "" (every interface) or a host name: remote


@dataclass(frozen=True)
class ServerSecurity:
    tls: Tls | None = None
    allowed_peers: frozenset[str] = frozenset()  # empty: any certificate the CA signed
    auth_token: str = ""  # empty: no token needed
    health_listen: str = ""  # HOST:PORT of a plain-text grpc.health.v1-only listener; empty: none
    mesh_token: str = ""  # identifies mesh members without mutual TLS; empty: none
    expose_executor_service: bool = False  # clients may call ExecutorService (executors only)
    allow_insecure_remote: bool = False  # an unauthenticated service may listen beyond loopback
    max_concurrent_rpcs: int = 0  # admission limit; 0: the service's handler threads

    @property
    def mutual_tls(self) -> bool:
        return self.tls is not None and self.tls.ca is not None

    @property
    def authenticated(self) -> bool:
        """Whether any caller has to prove anything: mutual TLS, a mesh token or a bearer token."""
        return self.mutual_tls or bool(self.mesh_token or self.auth_token)

    def caller_roles(self, context: grpc.ServicerContext) -> frozenset[Role]:
        """The roles of the caller of a call in progress, for servicers whose answer depends on who asks (the
        coordinator's Status lists session ids to mesh members only). A service that authenticates nobody
        obeys everyone, so every caller holds every role there; with only a bearer token, every caller is a
        client. A wrong mesh token was refused before the servicer ran, and counts as a client here."""
        if not self.mutual_tls and not self.mesh_token:
            return ANYONE if not self.authenticated else frozenset({Role.CLIENT})
        try:
            return MeshRoles(self.mutual_tls, self.mesh_token).caller(context)[0]
        except Unauthenticated:
            return frozenset({Role.CLIENT})

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        """The identity checks, outermost first (admission is added by server())."""
        out: list[grpc.ServerInterceptor] = []
        if self.auth_token:
            out.append(BearerToken(self.auth_token))
        if self.allowed_peers:
            out.append(AllowedPeers(self.allowed_peers))
        if self.mutual_tls or self.mesh_token:
            out.append(MeshRoles(self.mutual_tls, self.mesh_token, self.expose_executor_service))
        return out

    def server(self, workers: int, options: Sequence[tuple[str, Any]] = (),
               interceptors: Sequence[grpc.ServerInterceptor] = (), thread_name_prefix: str = "rpc",
               asynchronous: bool = False) -> grpc.Server:
        """A grpc.Server for this service: `interceptors` (telemetry) outermost, then the identity checks, then
        admission of at most max_concurrent_rpcs (or `workers`) calls, on HEADROOM threads more than that.
        It also makes this process's mesh channels (channel()) carry this service's mesh token.

        asynchronous: a graphmesh.aio_serving.AioServer instead, for a service whose callers hold streams open
        (the coordinator): its calls live on an event loop, the synchronous servicers run on the same pool only
        while their code runs, async ones (health, streams that admit per request: its `admission`) on the loop."""
        global _process_mesh_token
        _process_mesh_token = self.mesh_token
        limit = self.max_concurrent_rpcs or workers
        pool = futures.ThreadPoolExecutor(max_workers=limit + HEADROOM, thread_name_prefix=thread_name_prefix)
        if asynchronous:
            from graphmesh.aio_serving import AioServer

            identity, admission = self.interceptors(), Admission(limit)
            gates = [cast(Any, i).refusal for i in identity]  # each identity check has refusal(details, context)
            return AioServer(pool, [*interceptors, *identity, admission, UndecodableRequests()], gates, options,
                             admission, garbage=lambda method, e: InvalidArgument(
                                 f"the request is not a valid {method} message: {e}", "BAD_REQUEST").to_status())
        return grpc.server(pool, options=list(options),
                           interceptors=[*interceptors, *self.interceptors(), Admission(limit),
                                         UndecodableRequests()])

    def add_port(self, server: grpc.Server, listen: str) -> int:
        """Binds `listen` with TLS when configured; returns the port (fails rather than returning 0). A service
        that authenticates nobody binds loopback only, unless allow_insecure_remote says otherwise."""
        host, _, port_text = listen.rpartition(":")
        if not self.authenticated and not _is_loopback(host):
            if self.allow_insecure_remote:
                log.warning("serving without authentication beyond loopback: anyone who reaches this port may "
                            "drive it", extra={"listen": listen})
            else:
                log.warning("no credentials configured (--mesh-token-file, mutual TLS or --auth-token-file): "
                            "listening on loopback only; --allow-insecure-remote listens as asked",
                            extra={"listen": listen, "bound": f"127.0.0.1:{port_text}"})
                listen = f"127.0.0.1:{port_text}"
        try:  # grpc returns 0 or raises RuntimeError, by version, and says only "failed to bind"
            port = (server.add_secure_port(listen, self.tls.server_credentials()) if self.tls is not None
                    else server.add_insecure_port(listen))
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {listen}: the port is in use, or the host is not an address of this "
                          "machine")
        return int(port)

    def start(self, server: grpc.Server, listen: str, services: Sequence[str],
              health_servicer: health.HealthServicer | None = None,
              states: Mapping[str, int] | None = None) -> tuple[int, health.HealthServicer]:
        """The one bootstrap of a service's server (after server() and its servicers): health, unless the caller
        brings its own servicer, and reflection over `services`; bound to `listen` (add_port), started, health
        set to `states` (by default SERVING, for the whole server and each service), and the plain-text health
        listener. Returns the port and the health servicer."""
        from grpc_health.v1 import health as grpc_health
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        if health_servicer is None:
            health_servicer = grpc_health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
        port = self.add_port(server, listen)
        server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        for service, state in (states if states is not None else {s: serving for s in ("", *services)}).items():
            health_servicer.set(service, state)
        self.serve_health(health_servicer)
        return port, health_servicer

    def serve_health(self, health_servicer: health.HealthServicer) -> None:
        """Starts the plain-text health listener, sharing the main server's health states. Like the metrics
        endpoint it lives as long as the process (a grpc.Server stops when collected, hence the list)."""
        if not self.health_listen:
            return
        from grpc_health.v1 import health_pb2_grpc

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if server.add_insecure_port(self.health_listen) == 0:
            raise OSError(f"cannot listen on {self.health_listen}")
        server.start()
        _health_listeners.append(server)


def add_arguments(parser: argparse.ArgumentParser, auth_token: bool = False, executor_service: bool = False) -> None:
    parser.add_argument("--tls-cert", default="", help="PEM certificate chain this service serves and calls with")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default="", help="PEM CA: callers must present certificates it signed (mutual TLS)")
    parser.add_argument("--allowed-peers", default="",
                        help="comma-separated certificate names (CN or SAN) allowed to call; default: any the CA signed")
    parser.add_argument("--health-listen", default="", help="HOST:PORT serving only grpc.health.v1 in plain text")
    parser.add_argument("--mesh-token-file", default="",
                        help="file holding the token that identifies mesh members (without mutual TLS)")
    parser.add_argument("--allow-insecure-remote", action="store_true",
                        help="listen beyond loopback even with no credentials configured (anyone may call)")
    parser.add_argument("--max-concurrent-rpcs", type=int, default=0,
                        help="calls served at once on handler threads; more get RESOURCE_EXHAUSTED (default: the "
                             "handler threads). Health checks, reflection and the coordinator's Status never count, "
                             "nor do its generation requests (Generate, KServe text inference, the HTTP API), which "
                             "queue instead, up to --max-waiting-requests")
    if auth_token:
        parser.add_argument("--auth-token-file", default="", help="file holding the bearer token clients must send")
    if executor_service:
        parser.add_argument("--expose-executor-service", action="store_true",
                            help="clients (not only mesh members) may call ExecutorService")


MIN_TOKEN_BYTES = 16  # a token anyone could guess is no credential: `graphmesh up` writes 43 random characters


def read_token(path: str) -> str:
    """The token in the file at `path` (surrounding whitespace dropped); empty for an empty path. A token shorter
    than MIN_TOKEN_BYTES is refused (WEAK_TOKEN); a file that its group or everyone may read is accepted with a
    warning (whoever reads it holds every role of the mesh, or its clients' access)."""
    if not path:
        return ""
    file = Path(path)
    token = file.read_text().strip()
    if not token:
        raise InvalidArgument(f"{path} holds no token", "EMPTY_TOKEN")
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise InvalidArgument(f"the token in {path} is {len(token.encode())} bytes; at least {MIN_TOKEN_BYTES} are "
                              "needed (e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)",
                              "WEAK_TOKEN")
    mode = file.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("the token file is readable by its group or everyone: chmod 600 it",
                    extra={"path": path, "mode": oct(mode)})
    return token


def from_args(args: argparse.Namespace) -> ServerSecurity:
    tls = Tls.from_files(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert or args.tls_key else None
    if args.tls_ca and tls is None:
        raise InvalidArgument("--tls-ca needs --tls-cert and --tls-key", "TLS_INCOMPLETE")
    peers = frozenset(p.strip() for p in args.allowed_peers.split(",") if p.strip())
    if peers and (tls is None or tls.ca is None):
        raise InvalidArgument("--allowed-peers needs mutual TLS (--tls-cert, --tls-key and --tls-ca)", "PEERS_WITHOUT_MTLS")
    return ServerSecurity(tls, peers, read_token(getattr(args, "auth_token_file", "")), args.health_listen,
                          read_token(args.mesh_token_file), getattr(args, "expose_executor_service", False),
                          args.allow_insecure_remote, args.max_concurrent_rpcs)
