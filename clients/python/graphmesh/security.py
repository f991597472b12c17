"""TLS, mutual TLS, bearer tokens and peer identities for every gRPC hop of the mesh.

A service gets one certificate (--tls-cert/--tls-key) that it serves with and also presents as its client
certificate on every channel it opens to another service. With --tls-ca the server requires client
certificates signed by that CA (mutual TLS) and verifies its peers' servers against it. On top of that:
--allowed-peers limits which certificate identities (CN or SAN) may call, --auth-token-file makes clients
send `authorization: Bearer <token>`, and --health-listen serves grpc.health.v1 alone in plain text for
probes that cannot speak TLS (the kubelet's). Health and reflection are never behind the token or the
peer list: orchestrators and grpcurl must reach them.
"""

from __future__ import annotations

import argparse
import hmac
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import grpc

from graphmesh.errors import GraphmeshError, InvalidArgument, PermissionDenied, Unauthenticated

if TYPE_CHECKING:
    from grpc_health.v1 import health

Behavior = Callable[[Any, grpc.ServicerContext], Any]
# (behavior, response_streaming) -> the behavior that runs instead
Around = Callable[[Behavior, bool], Behavior]

_health_listeners: list[grpc.Server] = []

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


# strings: grpc's classes are generic only in the type stubs
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Handler | None]"


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


def _is_open(method: str) -> bool:
    return method.startswith(OPEN_SERVICES)


class BearerToken(grpc.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <token>` (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = continuation(details)
        if _is_open(details.method):
            return handler
        sent = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        # compare_digest: the time taken must not reveal how much of a guessed token was right
        if isinstance(sent, str) and hmac.compare_digest(sent.encode(), self._expected):
            return handler
        error = Unauthenticated("this coordinator needs 'authorization: Bearer <token>' metadata" if not sent
                                else "the bearer token is wrong", "MISSING_TOKEN" if not sent else "BAD_TOKEN")
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

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = continuation(details)
        if _is_open(details.method):
            return handler

        def around(behavior: Behavior, streaming: bool) -> Behavior:
            # The certificate is only known to the call's context, so the check runs inside the handler.
            def checked(request: Any, context: grpc.ServicerContext) -> Any:
                names = peer_names(context)
                if names & self.allowed:
                    return behavior(request, context)
                error = PermissionDenied(f"peer {sorted(names) or 'without a certificate'} is not among the allowed "
                                         f"peers {sorted(self.allowed)}", "PEER_NOT_ALLOWED")
                return _refusal(error, streaming)(request, context)
            return checked

        return wrap_handler(handler, around)


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


def channel(address: str, tls: Tls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel from one service to another: TLS with this service's certificate when it has one."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=list(options))


@dataclass(frozen=True)
class ServerSecurity:
    tls: Tls | None = None
    allowed_peers: frozenset[str] = frozenset()  # empty: any certificate the CA signed
    auth_token: str = ""  # empty: no token needed
    health_listen: str = ""  # HOST:PORT of a plain-text grpc.health.v1-only listener; empty: none

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        out: list[grpc.ServerInterceptor] = []
        if self.auth_token:
            out.append(BearerToken(self.auth_token))
        if self.allowed_peers:
            out.append(AllowedPeers(self.allowed_peers))
        return out

    def add_port(self, server: grpc.Server, listen: str) -> int:
        """Binds `listen` with TLS when configured; returns the port (fails rather than returning 0)."""
        port = (server.add_secure_port(listen, self.tls.server_credentials()) if self.tls is not None
                else server.add_insecure_port(listen))
        if port == 0:
            raise OSError(f"cannot listen on {listen}")
        return int(port)

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


def add_arguments(parser: argparse.ArgumentParser, auth_token: bool = False) -> None:
    parser.add_argument("--tls-cert", default="", help="PEM certificate chain this service serves and calls with")
    parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default="", help="PEM CA: callers must present certificates it signed (mutual TLS)")
    parser.add_argument("--allowed-peers", default="",
                        help="comma-separated certificate names (CN or SAN) allowed to call; default: any the CA signed")
    parser.add_argument("--health-listen", default="", help="HOST:PORT serving only grpc.health.v1 in plain text")
    if auth_token:
        parser.add_argument("--auth-token-file", default="", help="file holding the bearer token clients must send")


def from_args(args: argparse.Namespace) -> ServerSecurity:
    tls = Tls.from_files(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert or args.tls_key else None
    if args.tls_ca and tls is None:
        raise InvalidArgument("--tls-ca needs --tls-cert and --tls-key", "TLS_INCOMPLETE")
    peers = frozenset(p.strip() for p in args.allowed_peers.split(",") if p.strip())
    if peers and (tls is None or tls.ca is None):
        raise InvalidArgument("--allowed-peers needs mutual TLS (--tls-cert, --tls-key and --tls-ca)", "PEERS_WITHOUT_MTLS")
    token = ""
    if getattr(args, "auth_token_file", ""):
        token = Path(args.auth_token_file).read_text().strip()
        if not token:
            raise InvalidArgument(f"{args.auth_token_file} holds no token", "EMPTY_TOKEN")
    return ServerSecurity(tls, peers, token, args.health_listen)
