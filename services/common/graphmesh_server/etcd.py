"""The few etcd v3 calls graphmesh makes (coordinator election, executor membership), over etcd's JSON gRPC gateway
(/v3/...) of any of the cluster's members: plain HTTP through urllib. The gateway speaks JSON with base64 keys and
values and int64 fields as strings.

Why not etcd3gw (PyPI), which speaks the same gateway: tried (2.7.0, against the etcd 3.4 the Makefile installs),
its calls work, but an `Etcd3Client` talks to one host and port. --etcd names every member of the cluster and
this client fails over to the next when one is down (tests/test_election.py: "etcd losing a member changes
nothing"); with etcd3gw, stopping the member it was given made every call fail (ConnectionFailedError). Its timeout
is fixed per client, while a keepalive here must return within a third of its lease, and its lease() drops the TTL
etcd granted, which the election schedules its renewals by. Wrapping one client per member and per timeout would be
more code than these 100 lines, and would add requests, futurist, pbr and debtcollector to every service.
"""

from __future__ import annotations

import argparse
import base64
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from graphmesh.errors import Unavailable

HTTP_TIMEOUT_S = 2.0  # one gateway call; an endpoint that does not answer within it is skipped for the next


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unb64(data: str) -> str:
    return base64.b64decode(data).decode()


def cluster_key(cluster: str, name: str) -> str:
    """`/graphmesh/<cluster>/<name>`: where everything of one mesh lives in etcd (its leader, its incarnation
    counter, its executors' registrations under `executors/`)."""
    if not cluster or "/" in cluster:
        raise ValueError(f"cluster name {cluster!r} must be non-empty and hold no '/'")
    return f"/graphmesh/{cluster}/{name}"


def prefix_end(prefix: str) -> str:
    """The range_end that makes a range request cover every key starting with `prefix` (its last byte plus one)."""
    raw = prefix.encode()
    return base64.b64encode(raw[:-1] + bytes([raw[-1] + 1])).decode()


def add_arguments(parser: argparse.ArgumentParser, here: str) -> None:
    """--etcd and --cluster-name, as every service that finds its mesh in etcd takes them; `here`: what this
    service does there. args.etcd is the list of URLs (empty: none)."""
    parser.add_argument("--etcd", type=lambda text: [u for u in text.split(",") if u], default=[],
                        help=f"comma-separated etcd client URLs (http://HOST:PORT): {here}")
    parser.add_argument("--cluster-name", default="graphmesh",
                        help="the mesh's name in etcd: its coordinators elect one leader, its executors register there")


class EtcdUnavailable(Unavailable):
    default_reason = "ETCD_UNAVAILABLE"


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: str
    mod_revision: int
    lease: int
    create_revision: int = 0


class EtcdClient:
    """The few etcd v3 calls the election needs, over the JSON gateway of any of `endpoints` (the first that
    answers; a cluster member that is down costs one timeout, then the next one is tried first)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = HTTP_TIMEOUT_S) -> None:
        self.endpoints = [e.rstrip("/") for e in endpoints if e]
        if not self.endpoints:
            raise ValueError("no etcd endpoint given")
        self.timeout_s = timeout_s
        self._preferred = 0

    def call(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode()
        errors = []
        for i in range(len(self.endpoints)):
            index = (self._preferred + i) % len(self.endpoints)
            url = self.endpoints[index] + path
            request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as reply:
                    answer: dict[str, Any] = json.loads(reply.read() or b"{}")
            except urllib.error.HTTPError as e:  # etcd answered: a refusal is not a reason to try another member
                raise EtcdUnavailable(f"etcd {url}: HTTP {e.code}: {e.read()[:300]!r}") from e
            except (OSError, ValueError) as e:  # refused, timed out, reset, or not JSON: try the next member
                errors.append(f"{url}: {e}")
                continue
            if "error" in answer:  # the gateway's gRPC error (no leader, lease not found, ...)
                raise EtcdUnavailable(f"etcd {url}: {answer.get('error') or answer.get('message')}")
            self._preferred = index
            # A keepalive answers as a stream: {"result": {...}}
            return answer.get("result", answer) if isinstance(answer.get("result"), dict) else answer
        raise EtcdUnavailable(f"no etcd endpoint answered: {'; '.join(errors)}")

    def get(self, key: str) -> KeyValue | None:
        answer = self.call("/v3/kv/range", {"key": b64(key)})
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return _key_value(kv)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key under `prefix`, in key order."""
        answer = self.call("/v3/kv/range", {"key": b64(prefix), "range_end": prefix_end(prefix)})
        return [_key_value(kv) for kv in answer.get("kvs") or []]

    def put(self, key: str, value: str, lease: int = 0) -> None:
        self.call("/v3/kv/put", {"key": b64(key), "value": b64(value), **({"lease": str(lease)} if lease else {})})

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": b64(key)})

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted in seconds; it may raise a small one to its minimum)."""
        answer = self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        return int(answer["ID"]), int(answer["TTL"])

    def keepalive(self, lease: int, timeout_s: float | None = None) -> int:
        """Renews `lease`; returns its TTL in seconds, 0 when etcd no longer knows it (it lapsed)."""
        return int(self.call("/v3/lease/keepalive", {"ID": str(lease)}, timeout_s).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self.call("/v3/lease/revoke", {"ID": str(lease)})

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
            failure: list[dict[str, Any]]) -> tuple[bool, dict[str, Any]]:
        answer = self.call("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure})
        return bool(answer.get("succeeded", False)), answer  # proto3 JSON leaves a false out


def _key_value(kv: dict[str, Any]) -> KeyValue:
    return KeyValue(unb64(kv["key"]), unb64(kv.get("value", "")), int(kv.get("mod_revision", 0)),
                    int(kv.get("lease", 0)), int(kv.get("create_revision", 0)))
