"""The OpenAI HTTP API as a process serves it, the coordinator or a front end alike: its flags, where it listens and
its start. FastAPI is imported only when it starts (~0.3 s of a start that serves no HTTP)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from graphmesh_server.bootstrap import ServerSecurity, is_loopback

if TYPE_CHECKING:
    from graphmesh_coordinator.openai_server import OpenAIServer
    from graphmesh_coordinator.upstream import Upstream

log = logging.getLogger("graphmesh.coordinator.http")


@dataclass
class HttpApi:
    listen: str = ""  # HOST:PORT; "": off
    ready_wait_s: float = 10.0  # how long a request waits out a recovering mesh before its 503
    max_connections: int = 0  # open connections at most; 0: by the descriptor limit (http_limits)
    redis_url: str = ""  # the Responses API's store: redis://HOST:PORT/DB; "": in memory
    redis_password_file: Path | None = None  # the store's password, read once at start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--http-listen", default="", help="HOST:PORT of the OpenAI-compatible HTTP API (default: off)")
    parser.add_argument("--http-ready-wait", type=float, default=10.0,
                        help="seconds an HTTP request waits for a recovering mesh before a 503")
    parser.add_argument("--http-max-connections", type=int, default=0,
                        help="open connections the HTTP API keeps at most; more are closed as they are accepted. "
                             "Default 0: a quarter of the process's descriptor limit, at most 4096")
    parser.add_argument("--redis-url", default="",
                        help="redis://HOST:PORT/DB (Redis or Valkey; rediss:// for TLS) keeping the Responses API's "
                             "stored responses, so that every process serving the API on it continues their "
                             "conversations (previous_response_id). Default: in this process's memory")
    parser.add_argument("--redis-password-file", type=Path, help="file holding the password of --redis-url's server")


def from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> HttpApi:
    if args.redis_url and not args.redis_url.startswith(("redis://", "rediss://", "unix://")):
        parser.error(f"--redis-url must be redis://HOST:PORT/DB, rediss://... or unix://..., not {args.redis_url!r}")
    if args.redis_password_file and not args.redis_url:
        parser.error("--redis-password-file needs --redis-url")
    if args.http_max_connections < 0:
        parser.error(f"--http-max-connections must be >= 0 (0: the default), not {args.http_max_connections}")
    return HttpApi(args.http_listen, args.http_ready_wait, args.http_max_connections, args.redis_url,
                   args.redis_password_file)


def listen_address(api: HttpApi, security: ServerSecurity) -> str:
    """The address under the gRPC port's rule: a process that authenticates nobody serves loopback only unless
    --allow-insecure-remote says otherwise."""
    host, _, port = api.listen.rpartition(":")
    if security.authenticated or security.allow_insecure_remote or is_loopback(host):
        return api.listen
    log.warning("no credentials configured: the HTTP API listens on loopback only; --allow-insecure-remote "
                "listens as asked", extra={"http_listen": api.listen})
    return f"127.0.0.1:{port}"


def start(api: HttpApi, upstream: Upstream, model_name: str, security: ServerSecurity,
          leader_gate: Callable[[], None] | None = None) -> OpenAIServer:
    """The API serving `upstream` on `api.listen` (in a thread of its own)."""
    from graphmesh_coordinator import responses
    from graphmesh_coordinator.openai_server import OpenAIServer

    http = OpenAIServer(upstream, model_name, security.auth_token, api.ready_wait_s, leader_gate,
                        responses.open_store(api.redis_url, api.redis_password_file))
    http.start(listen_address(api, security), security.tls, max_connections=api.max_connections)
    log.info("HTTP API", extra={"http_listen": api.listen, "port": http.port})
    return http
