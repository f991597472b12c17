"""A service's gRPC server from its security flags: built (synchronous, or aio_serving's for streams), secured
(interceptors, admission), bound (TLS, loopback unless authenticated), started with health and reflection."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import socket
from collections.abc import Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, cast

import grpc
from grpc_health.v1 import health

from graphmesh import channels
from graphmesh.errors import InvalidArgument, Unauthenticated
from graphmesh.security import Tls, read_token
from graphmesh_server.aio_serving import AioServer
from graphmesh_server.interceptors import Admission, AllowedPeers, BearerToken, MeshRoles, UndecodableRequests
from graphmesh_server.policy import ANYONE, Role

log = logging.getLogger("graphmesh.security")

HEADROOM = 8  # handler threads beyond the admission limit, for health checks and refusals

_health_listeners: list[grpc.Server] = []


def unbindable(listen: str, flag: str) -> str:
    """Why HOST:PORT `listen` cannot be bound, and what to do, in one line: grpc says only "failed to bind", so the
    cause is found by binding a plain socket the same way."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.bind((host, int(port)))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return (f"cannot listen on {listen}: port {port} is in use by another process; stop it, or pass {flag} "
                    "with another port (port 0 picks a free one)")
        if e.errno == errno.EADDRNOTAVAIL:
            return f"cannot listen on {listen}: {host} is not an address of this machine; pass {flag} with one that is"
        if e.errno == errno.EACCES:
            return f"cannot listen on {listen}: ports below 1024 need privileges; pass {flag} with a higher port"
        return f"cannot listen on {listen}: {e.strerror}; pass {flag} with another address"
    except (ValueError, socket.gaierror):
        return f"cannot listen on {listen}: {flag} takes HOST:PORT with a numeric port"
    return f"cannot listen on {listen}: gRPC could not bind it (a plain socket can); pass {flag} with another port"


def is_loopback(host: str) -> bool:
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

        asynchronous: a graphmesh_server.aio_serving.AioServer instead, for a service whose callers hold streams open
        (the coordinator): its calls live on an event loop, the synchronous servicers run on the same pool only
        while their code runs, async ones (health, streams that admit per request: its `admission`) on the loop."""
        channels.use_mesh_token(self.mesh_token)
        limit = self.max_concurrent_rpcs or workers
        pool = futures.ThreadPoolExecutor(max_workers=limit + HEADROOM, thread_name_prefix=thread_name_prefix)
        if asynchronous:
            identity, admission = self.interceptors(), Admission(limit)
            gates = [cast(Any, i).refusal for i in identity]  # each identity check has refusal(details, context)
            return AioServer(pool, [*interceptors, *identity, admission, UndecodableRequests()], gates, options,
                             admission)
        return grpc.server(pool, options=list(options),
                           interceptors=[*interceptors, *self.interceptors(), Admission(limit),
                                         UndecodableRequests()])

    def add_port(self, server: grpc.Server, listen: str) -> int:
        """Binds `listen` with TLS when configured; returns the port (fails rather than returning 0). A service
        that authenticates nobody binds loopback only, unless allow_insecure_remote says otherwise."""
        host, _, port_text = listen.rpartition(":")
        if not self.authenticated and not is_loopback(host):
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
            raise OSError(unbindable(listen, "--listen"))
        return int(port)

    def start(self, server: grpc.Server, listen: str, services: Sequence[str],
              health_servicer: health.HealthServicer | None = None,
              states: Mapping[str, int] | None = None) -> tuple[int, health.HealthServicer]:
        """The one bootstrap of a service's server (after server() and its servicers): health, unless the caller
        brings its own servicer, and reflection over `services`; bound to `listen` (add_port), started, health
        set to `states` (by default SERVING, for the whole server and each service), and the plain-text health
        listener. Returns the port and the health servicer."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        if health_servicer is None:
            health_servicer = health.HealthServicer()
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
        try:  # as in add_port: 0 or RuntimeError, by grpc version
            bound = server.add_insecure_port(self.health_listen)
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise OSError(unbindable(self.health_listen, "--health-listen"))
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

