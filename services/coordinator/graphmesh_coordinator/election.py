"""Coordinator leader election and incarnations on etcd v3, through its JSON gRPC gateway (/v3/...).

Coordinators of one cluster campaign for `/graphmesh/<cluster>/leader`, a key bound to each candidate's lease:
whoever creates it (compare create_revision == 0) leads until its lease lapses. The leader keeps the lease alive
and counts itself leader only until `last keepalive sent + TTL` on its own monotonic clock, which is never later
than when etcd (which starts the TTL when it receives the keepalive) can expire it: a leader that was paused
(SIGSTOP) or cut off from etcd knows it lost the lease no later than a standby can win it.

The incarnation lives in `/graphmesh/<cluster>/incarnation` and is advanced by one transaction that compares both
the counter's mod_revision (a compare-and-swap: no two coordinators ever get the same number) and the leader
key's value (only the current leader, in etcd's linearizable view, can issue one; a zombie's attempt fails even
if it still believes it leads). Executors refuse any incarnation but their newest, so the zombie's steps are
refused with STALE_INCARNATION as soon as the new leader installs.

The etcd calls are graphmesh_server.etcd's (a few plain HTTP calls to etcd's JSON gateway).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from graphmesh.errors import GraphmeshError, Unavailable
from graphmesh.protocol import ErrorClass
from graphmesh.v1 import stage_pb2
from graphmesh_coordinator.pipeline import InvocationFailed, Mesh
from graphmesh_coordinator.state import DurableState
from graphmesh_server.etcd import EtcdClient, KeyValue, b64, cluster_key, unb64

log = logging.getLogger("graphmesh.coordinator.election")

CLOCK_MARGIN_S = 0.1  # the leader counts its lease as lapsed this much early (clock rates differ a little)


class NotLeader(GraphmeshError):
    """UNAVAILABLE to a client (it resumes on the leader), but not an Unavailable inside the coordinator: Mesh.recover
    retries an Unavailable install until its deadline, and a coordinator that lost the lease must give up at once."""

    code = grpc.StatusCode.UNAVAILABLE
    default_reason = "NOT_LEADER"


class Election:
    """One coordinator's candidacy in `cluster`. campaign() blocks until this coordinator leads; is_leader() is
    then true until its lease lapses on its own clock (or etcd says so), when the on_lost callbacks run once, the
    lease is revoked (so that a standby need not wait out etcd's own expiry) and it never leads again."""

    def __init__(self, etcd: EtcdClient, cluster: str, address: str, ttl_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.etcd, self.cluster, self.address = etcd, cluster, address
        self.ttl_s, self.clock = ttl_s, clock
        self.id = uuid.uuid4().hex
        self.value = json.dumps({"id": self.id, "address": address})
        self.leader_key = cluster_key(cluster, "leader")
        self.incarnation_key = cluster_key(cluster, "incarnation")
        self.lease = 0
        self.granted_ttl_s = 0
        self.valid_until = 0.0  # monotonic; leader while clock() < valid_until
        self.lost = threading.Event()
        self._leading = False
        self._lock = threading.Lock()
        self._on_lost: list[Callable[[str], None]] = []
        self._stop = threading.Event()
        self._refusals = 0  # campaign polls in a row that found the leader's address refusing connections

    def on_lost(self, callback: Callable[[str], None]) -> None:
        self._on_lost.append(callback)

    def is_leader(self) -> bool:
        return self._leading and not self.lost.is_set() and self.clock() < self.valid_until

    def leader_address(self) -> str:
        """Where the current leader serves, "" when there is none (or etcd does not answer)."""
        try:
            kv = self.etcd.get(self.leader_key)
        except Unavailable:
            return ""
        return str(json.loads(kv.value).get("address", "")) if kv else ""

    def try_acquire(self) -> bool:
        """One campaign attempt: creates the leader key under a fresh lease if nobody holds it."""
        if self.lost.is_set():
            return False
        current = self.etcd.get(self.leader_key)
        if current is not None:
            self._revoke_if_gone(current)
            return False
        sent = self.clock()
        lease, ttl = self.etcd.grant(max(1, round(self.ttl_s)))
        won, _ = self.etcd.txn([{"key": b64(self.leader_key), "target": "CREATE", "result": "EQUAL",
                                 "create_revision": "0"}],
                               [{"request_put": {"key": b64(self.leader_key), "value": b64(self.value),
                                                 "lease": str(lease)}}], [])
        if not won:
            self._revoke(lease)
            return False
        with self._lock:
            self.lease, self.granted_ttl_s = lease, ttl
            self.valid_until = sent + ttl - CLOCK_MARGIN_S
            self._leading = True
        log.info("elected leader", extra={"cluster": self.cluster, "lease": lease, "ttl_s": ttl})
        return True

    def _revoke_if_gone(self, leader: KeyValue) -> None:
        """Revokes the lease of a leader whose process is gone: nothing listens at its address any more (a refused
        connection, twice in a row), so it died and waiting out its TTL only delays the failover. A leader that is
        merely silent (paused, cut off: a timeout, not a refusal) keeps its lease until etcd expires it. Safety does
        not rest on this guess: were it wrong, the live leader would learn at its next keepalive that it lost the
        lease, and every executor refuses its incarnation once the new leader installs."""
        try:
            address = str(json.loads(leader.value).get("address", ""))
        except ValueError:
            return
        if not _refuses_connections(address):
            self._refusals = 0
            return
        self._refusals += 1
        if self._refusals >= 2 and leader.lease:
            log.warning("the leader's process is gone (its address refuses connections): revoking its lease",
                        extra={"cluster": self.cluster, "leader": address, "lease": leader.lease})
            self._refusals = 0
            self._revoke(leader.lease)

    def campaign(self, poll_s: float = 0.1, stop: threading.Event | None = None) -> bool:
        """Waits until this coordinator leads (True), or `stop` is set (False); then keeps the lease alive."""
        while not (stop and stop.is_set()) and not self._stop.is_set():
            try:
                if self.try_acquire():
                    threading.Thread(target=self._keepalive_loop, name="lease-keepalive", daemon=True).start()
                    threading.Thread(target=self._watchdog, name="lease-watchdog", daemon=True).start()
                    return True
            except Unavailable as e:
                log.warning("campaign: etcd did not answer", extra={"error": e.message})
            time.sleep(poll_s)
        return False

    def renew(self) -> bool:
        """One keepalive; True while the lease holds. Never sent once the lease lapsed on this clock: a renewal
        that reached etcd before its own expiry would revive the leadership of a coordinator that stepped down."""
        if not self.is_leader():
            return False
        sent = self.clock()
        try:
            # A member that hangs (frozen, packets dropped) must not cost the lease: a short deadline per member
            # leaves time for the others within one TTL
            ttl = self.etcd.keepalive(self.lease, max(0.1, self.granted_ttl_s / (2 * len(self.etcd.endpoints))))
        except Unavailable as e:
            log.warning("lease keepalive failed", extra={"error": e.message})
            return self.is_leader()
        if ttl <= 0:
            self.step_down("etcd reports the lease expired")
            return False
        with self._lock:
            if self.is_leader():
                self.valid_until = max(self.valid_until, sent + ttl - CLOCK_MARGIN_S)
        return self.is_leader()

    def _keepalive_loop(self) -> None:
        while not self._stop.is_set() and self.renew():
            # often: etcd expires a dead leader's lease one TTL after its last renewal, and failover waits for that
            self._stop.wait(max(0.05, self.granted_ttl_s / 8))

    def _watchdog(self) -> None:
        """Steps down once the lease lapses on this clock, whatever the keepalive thread is waiting for."""
        while not self._stop.wait(0.05):
            if self._leading and not self.is_leader():
                self.step_down("the lease lapsed (etcd unreachable, or this process was paused past its TTL)")
                return

    def step_down(self, why: str) -> None:
        with self._lock:
            if self.lost.is_set():
                return
            self.lost.set()
            self._leading = False
        log.warning("stepping down", extra={"cluster": self.cluster, "reason": why})
        for callback in self._on_lost:
            try:
                callback(why)
            except Exception:  # every callback runs: one that fails must not keep the others from fencing
                log.exception("step-down callback failed")
        self._revoke(self.lease)

    def _revoke(self, lease: int) -> None:
        try:
            self.etcd.revoke(lease)
        except Unavailable:
            pass  # it lapses by itself

    def close(self) -> None:
        """Resigns (the standby takes over at once instead of after the TTL)."""
        self._stop.set()
        if self._leading and not self.lost.is_set():
            self.step_down("shutting down")

    def next_incarnation(self) -> int:
        """Advances the cluster's incarnation by compare-and-swap, only while this coordinator leads in etcd."""
        for _ in range(10):
            if not self.is_leader():
                raise NotLeader("this coordinator is not the leader (its lease lapsed or it never won the election): "
                                "it issues no incarnation")
            current = self.etcd.get(self.incarnation_key)
            value, revision = (int(current.value), current.mod_revision) if current else (0, 0)
            issued = value + 1
            ok, answer = self.etcd.txn(
                [{"key": b64(self.incarnation_key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)},
                 {"key": b64(self.leader_key), "target": "VALUE", "result": "EQUAL", "value": b64(self.value)}],
                [{"request_put": {"key": b64(self.incarnation_key), "value": b64(str(issued))}}],
                [{"request_range": {"key": b64(self.leader_key)}}])
            if ok:
                return issued
            kvs = (answer.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
            if not kvs or unb64(kvs[0].get("value", "")) != self.value:
                self.step_down("etcd names another leader")
                raise NotLeader("another coordinator leads this cluster now: this one issues no incarnation")
            # the counter moved under us while we still lead (only a previous leader's late write): read it again
        raise Unavailable("could not advance the incarnation in etcd after 10 attempts", "ETCD_CONTENDED")

    def advance_to(self, floor: int) -> None:
        """Raises the cluster's counter to at least `floor` (an incarnation executors already hold, issued before
        this cluster's counter existed: a coordinator that ran on its file state, or a counter deleted in etcd),
        so that the next one issued is newer than anything an executor has seen. Leader only, as next_incarnation."""
        for _ in range(10):
            if not self.is_leader():
                raise NotLeader("this coordinator is not the leader: it does not move the incarnation counter")
            current = self.etcd.get(self.incarnation_key)
            value, revision = (int(current.value), current.mod_revision) if current else (0, 0)
            if value >= floor:
                return
            ok, _ = self.etcd.txn(
                [{"key": b64(self.incarnation_key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)},
                 {"key": b64(self.leader_key), "target": "VALUE", "result": "EQUAL", "value": b64(self.value)}],
                [{"request_put": {"key": b64(self.incarnation_key), "value": b64(str(floor))}}], [])
            if ok:
                log.warning("incarnation counter raised to what the executors hold",
                            extra={"cluster": self.cluster, "from": value, "to": floor})
                return
        raise Unavailable("could not raise the incarnation counter in etcd after 10 attempts", "ETCD_CONTENDED")

    def current_incarnation(self) -> int:
        kv = self.etcd.get(self.incarnation_key)
        return int(kv.value) if kv else 0


class EtcdState(DurableState):
    """DurableState whose incarnations come from the cluster's counter in etcd (compare-and-swap, leader only);
    the decision log stays a local file + fsync beside it."""

    def __init__(self, election: Election, state_dir: str | Path, fsync_decisions: bool = True) -> None:
        super().__init__(state_dir, fsync_decisions)
        self.election = election
        self.incarnation = 0  # not the file's: the cluster's, read when this coordinator leads

    def refresh(self) -> int:
        """The newest incarnation any coordinator of the cluster issued (its predecessor's, to fence)."""
        self.incarnation = self.election.current_incarnation()
        return self.incarnation

    def advance_to(self, floor: int) -> None:
        with self._lock:
            self.election.advance_to(floor)
            self.incarnation = max(self.incarnation, floor)

    def next_incarnation(self) -> int:
        with self._lock:
            issued = self.election.next_incarnation()
            self.incarnation = issued
            return issued


def _refuses_connections(address: str, timeout_s: float = 0.2) -> bool:
    """True when a TCP connection to HOST:PORT is actively refused (nothing listens there); False when it connects,
    times out or cannot be tried (the address is not HOST:PORT)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def not_leader(election: Election) -> NotLeader:
    """The refusal of a coordinator that does not lead, naming the leader when etcd knows one."""
    why = "it stepped down when its etcd lease lapsed" if election.lost.is_set() else "it is a standby"
    leader = election.leader_address()
    return NotLeader(f"this coordinator is not the leader of cluster {election.cluster!r} ({why})"
                     + (f"; the leader is {leader}" if leader else ""), metadata={"leader": leader})


class LeaderMesh(Mesh):
    """A Mesh that drives executors only while its coordinator leads: once the lease lapsed a step fails before it
    is sent (as fenced), and the recovery that would follow refuses too (NOT_LEADER), so every session of a
    stepped-down leader ends with UNAVAILABLE and its client resumes on the new leader."""

    def __init__(self, election: Election, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.election = election
        # the health watch would otherwise keep re-planning (and failing NOT_LEADER) for a mesh it no longer drives
        election.on_lost(lambda why: self._watch_stop.set())

    def _not_leader(self) -> NotLeader:
        return not_leader(self.election)

    def execute_step(self, rows: Sequence[stage_pb2.StepRow], output: stage_pb2.OutputKind.ValueType,
                     incarnation: int, decode_steps: int = 1, sent: Callable[[], None] | None = None,
                     alone: bool = False) -> stage_pb2.ExecuteStepResponse:
        if not self.election.is_leader():
            raise InvocationFailed(ErrorClass.COMM, -1, self._not_leader())
        return super().execute_step(rows, output, incarnation, decode_steps, sent, alone)

    def recover(self, failed_incarnation: int, deadline_s: float = 120.0) -> None:
        if not self.election.is_leader():
            raise self._not_leader()
        super().recover(failed_incarnation, deadline_s)

    def install(self, addresses: Sequence[str] | None = None, replacing: int = 0) -> None:
        if not self.election.is_leader():
            raise self._not_leader()
        super().install(addresses, replacing)
