"""TLS, mutual TLS, bearer tokens, mesh roles and admission control for every gRPC hop of the mesh.

This module holds what a process presents: its certificate (Tls), client credentials, and the tokens it reads
from files and sends as call metadata. The rest lives beside it:
- graphmesh_server/policy.py: the roles, and which roles may call each method (POLICY);
- graphmesh_server/interceptors.py: the server interceptors that enforce them, and admission control;
- graphmesh/channels.py: the channels a service or client opens (one message-size option set);
- graphmesh_server/bootstrap.py: a service's server built, secured, bound and started from its flags.

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
A mesh service's own channels (`channels.channel()`) carry its mesh token, so callers inside the mesh do nothing.

Admission. At most --max-concurrent-rpcs calls run at once (default: the service's handler threads);
beyond that a call gets RESOURCE_EXHAUSTED at once instead of queueing. The thread pool has HEADROOM
threads more than that limit, so health checks and admin calls (UNCOUNTED) and refusals always find a thread.
Generation streams (QUEUED) are not counted: the coordinator queues them itself, bounded by its
--max-waiting-requests, and a queued stream holds no thread (graphmesh_server.aio_serving.Wait).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from graphmesh.errors import InvalidArgument

log = logging.getLogger("graphmesh.security")

MESH_TOKEN_KEY = "x-graphmesh-mesh-token"


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


MIN_TOKEN_BYTES = 16  # a token anyone could guess is no credential: `graphmesh up` writes 43 random characters


def read_token(path: str) -> str:
    """The token in the file at `path` (surrounding whitespace dropped); empty for an empty path. A token shorter
    than MIN_TOKEN_BYTES is refused (WEAK_TOKEN); a file that its group or everyone may read is accepted with a
    warning (whoever reads it holds every role of the mesh, or its clients' access)."""
    if not path:
        return ""
    file = Path(path)
    try:
        token = file.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read the token file {path}: {getattr(e, 'strerror', None) or e}",
                              "BAD_TOKEN_FILE") from e
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
