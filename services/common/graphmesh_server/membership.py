"""Executor membership on etcd: each executor of a cluster registers itself under `/graphmesh/<cluster>/executors/`
with a lease it keeps alive; the leading coordinator reads the registrations and plans over them. An executor that
dies stops renewing and its key lapses with the lease; one that is stopped revokes it first and drains, so the
coordinator re-plans without it while it still serves (graphmesh-executor --etcd).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphmesh.errors import Unavailable
from graphmesh_server.etcd import EtcdClient, cluster_key

log = logging.getLogger("graphmesh.membership")


def members_prefix(cluster: str) -> str:
    return cluster_key(cluster, "executors/")


@dataclass(frozen=True)
class Member:
    address: str  # where the coordinator and the other executors reach it (HOST:PORT)
    info: dict[str, Any]  # backend, device, memory_bytes: what it said of itself
    joined_revision: int  # etcd's create revision of its registration: members are planned in the order they joined


_unreadable: set[tuple[str, int]] = set()  # (key, revision) of registrations that are not JSON, logged once each


def registered(etcd: EtcdClient, cluster: str) -> list[Member]:
    """The executors registered in `cluster` now, in the order they registered (the pipeline order of new ranks)."""
    members = []
    for kv in etcd.get_prefix(members_prefix(cluster)):
        try:
            info = json.loads(kv.value)
        except ValueError:
            if (kv.key, kv.create_revision) not in _unreadable:  # the watch reads every 0.2 s: one line, not five a second
                _unreadable.add((kv.key, kv.create_revision))
                log.warning("ignoring a registration that is not JSON", extra={"key": kv.key})
            continue
        if isinstance(info, dict) and info.get("address"):
            members.append(Member(str(info["address"]), info, kv.create_revision))
    return sorted(members, key=lambda m: m.joined_revision)


def watch(etcd: EtcdClient, cluster: str, on_members: Callable[[list[Member]], None], stop: threading.Event,
          interval_s: float = 0.2) -> threading.Thread:
    """Reads the registrations every `interval_s` in a thread of its own and hands each reading to `on_members`,
    until `stop` is set. While etcd does not answer, nothing is handed on: the members last read stay members (an
    etcd outage must not empty a mesh that works), and one line is logged when it stops and when it answers again."""
    def loop() -> None:
        failing = False
        while not stop.is_set():
            try:
                members = registered(etcd, cluster)
            except Unavailable as e:
                if not failing:
                    log.warning("membership: etcd does not answer; keeping the members last read",
                                extra={"cluster": cluster, "error": e.message})
                failing = True
            else:
                if failing:
                    log.info("membership: etcd answers again", extra={"cluster": cluster, "members": len(members)})
                failing = False
                on_members(members)
            stop.wait(interval_s)

    thread = threading.Thread(target=loop, name="membership", daemon=True)
    thread.start()
    return thread


class Registration:
    """One executor's registration: put under a lease of `ttl_s`, renewed every ttl/3. When the lease is lost (etcd
    was down longer than the TTL, or restarted without its data) the key is put again under a new lease, so an
    executor that etcd forgot comes back by itself."""

    def __init__(self, etcd: EtcdClient, cluster: str, address: str, info: dict[str, Any], ttl_s: int = 2) -> None:
        self.etcd, self.address, self.ttl_s = etcd, address, max(1, ttl_s)
        self.key = members_prefix(cluster) + address
        self.value = json.dumps({"address": address, **info})
        self.lease = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Registers now, or (etcd does not answer) as soon as it does, and keeps the registration alive."""
        try:
            self._register()
        except Unavailable as e:
            log.warning("could not register in etcd yet; retrying", extra={"key": self.key, "error": e.message})
        self._thread = threading.Thread(target=self._keepalive_loop, name="registration", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        lease, _ = self.etcd.grant(self.ttl_s)
        self.etcd.put(self.key, self.value, lease)
        self.lease = lease
        log.info("registered in etcd", extra={"key": self.key, "lease": lease, "ttl_s": self.ttl_s})

    def _keepalive_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.lease and self.etcd.keepalive(self.lease, timeout_s=self.ttl_s / 3) > 0:
                    continue
                log.warning("registration lease lapsed; registering again", extra={"key": self.key})
                self._register()
            except Unavailable as e:
                log.warning("registration keepalive failed", extra={"key": self.key, "error": e.message})

    def close(self) -> None:
        """Deregisters: revokes the lease (the key goes with it), so the coordinator re-plans without this executor
        now rather than after the TTL."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.lease:
            try:
                self.etcd.revoke(self.lease)
            except Unavailable as e:
                log.warning("could not deregister; the registration lapses with its lease",
                            extra={"key": self.key, "error": e.message})
            self.lease = 0
