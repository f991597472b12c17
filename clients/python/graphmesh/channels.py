"""The channels every client and service opens: one factory, one set of message-size options, and the mesh token
that a service's own channels carry, and the base of the client interceptors that change a call's metadata."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, Self

import grpc

from graphmesh.security import Tls, bearer, mesh_metadata

MAX_MESSAGE_BYTES = 64 << 20  # tensors, KV rows and logits travel in one message up to this size (services' default)


def message_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """grpc's channel and server options that let messages of up to `max_bytes` through both ways."""
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


MESSAGE_OPTIONS = message_options()
# A frozen (SIGSTOPped, partitioned) server keeps its TCP connections open and sends nothing: only a ping that goes
# unanswered breaks a stream to it. These ping every second and give it a second to answer (the coordinator's server
# allows pings that often).
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 1000),
                                            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


class CallDetails(collections.namedtuple("CallDetails", ("method", "timeout", "metadata", "credentials",
                                                         "wait_for_ready", "compression")), grpc.ClientCallDetails):
    """grpc.ClientCallDetails as a value, for client interceptors that change a call's metadata."""


class ForwardingClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """A client interceptor that treats every kind of call alike: a subclass writes intercept() once."""

    def intercept(self, continuation: Callable[[Any, Any], Any], details: grpc.ClientCallDetails, request: Any) -> Any:
        raise NotImplementedError

    def intercept_unary_unary(self, continuation: Any, client_call_details: grpc.ClientCallDetails, request: Any) -> Any:
        return self.intercept(continuation, client_call_details, request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails, request: Any) -> Any:
        return self.intercept(continuation, client_call_details, request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                               request_iterator: Any) -> Any:
        return self.intercept(continuation, client_call_details, request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: grpc.ClientCallDetails,
                                request_iterator: Any) -> Any:
        return self.intercept(continuation, client_call_details, request_iterator)


# The mesh token of the service this process runs (set by graphmesh_server.bootstrap.ServerSecurity.server): one
# process is one mesh member, so every channel it opens to the mesh carries the same identity without each caller
# passing it along.
_process_mesh_token = ""


def use_mesh_token(token: str) -> None:
    """Makes this process's mesh channels (channel(), as_mesh_member()) carry `token`."""
    global _process_mesh_token
    _process_mesh_token = token


class _MeshIdentity(ForwardingClientInterceptor):
    """Adds the mesh token to every call's metadata: `token`, or (None) this process's at the time of the call, so
    channels opened before the service's server was built carry it too."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def intercept(self, continuation: Callable[[Any, Any], Any], d: grpc.ClientCallDetails, request: Any) -> Any:
        metadata = mesh_metadata(_process_mesh_token if self.token is None else self.token)
        if not metadata:
            return continuation(d, request)
        return continuation(CallDetails(d.method, d.timeout, [*(d.metadata or ()), *metadata], d.credentials,
                                        d.wait_for_ready, d.compression), request)


def as_mesh_member(channel: grpc.Channel, token: str | None = None) -> grpc.Channel:
    """`channel` with every call carrying the mesh token: `token`, or (None) this process's."""
    return grpc.intercept_channel(channel, _MeshIdentity(token)) if token != "" else channel


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, Any]] = MESSAGE_OPTIONS) -> grpc.Channel:
    """The one channel factory: TLS with `credentials` when given, else plaintext (loopback, or a mesh behind its
    own network policy)."""
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=list(options))


def channel(address: str, tls: Tls | None, options: Sequence[tuple[str, Any]] = MESSAGE_OPTIONS,
            mesh_token: str | None = None) -> grpc.Channel:
    """A channel from one service to another: TLS with this service's certificate when it has one, and the mesh
    token (`mesh_token`, or by default this process's) on every call."""
    return as_mesh_member(open_channel(address, tls.channel_credentials() if tls else None, options), mesh_token)


class ChannelClient:
    """The SDK clients' common part: one channel (closed by close() or a with-block), and the deadline of `timeout`
    seconds and the metadata (with `token` as a bearer token) that every call carries."""

    def __init__(self, address: str, channel: grpc.Channel, timeout: float, metadata: Sequence[tuple[str, str]],
                 token: str) -> None:
        self.address = address
        self.timeout = timeout
        self.metadata = (*metadata, *bearer(token))
        self.channel = channel

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()
