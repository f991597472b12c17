"""The election and incarnation logic over arbitrary interleavings of campaign, renewal, lease expiry (on the
leader's clock, and in etcd behind a leader's back), install, restart and steps, against a real etcd and the
executors' real fencing state machine: two leaders never drive executors at the same incarnation, and an
executor never obeys an older incarnation once it saw a newer one."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from graphmesh.errors import FailedPrecondition, Unavailable
from graphmesh_coordinator.election import Election, EtcdState, NotLeader
from graphmesh_executor.fencing import Authority
from graphmesh_server.etcd import EtcdClient
from tests import etcd_fixtures

COORDINATORS = 2
TTL = 2.0


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdClient]:
    with etcd_fixtures.running(tmp_path_factory.mktemp("etcd-property"), 1) as cluster:
        yield EtcdClient(cluster.urls)


@dataclass
class Candidate:
    """One coordinator process: its election (threads off: the test drives every step), its own clock, and the
    incarnation it installed."""

    election: Election
    state: EtcdState
    now: list[float] = field(default_factory=lambda: [0.0])
    installed: int = 0
    lapsed_in_etcd: bool = False  # its lease was expired in etcd while it was not looking (paused, cut off)


# Weighted toward what makes a leader drive executors (campaign, install, step), so that most interleavings get
# there at least once and many have a zombie and its successor both trying.
# A coordinator that stepped down never leads again until it restarts (as the server does), hence restarts often.
_WEIGHTED = ["campaign"] * 4 + ["install"] * 3 + ["step"] * 3 + ["renew"] * 2 + ["lapse_etcd"] * 2 + \
    ["restart"] * 2 + ["lapse_local"]

# Hypothesis' own list strategy favours runs of one repeated action; drawing each action from a seeded Random keeps
# the interleavings varied (and still reproducible and shrinkable through the seed and the length).
@st.composite
def _actions(draw: st.DrawFn) -> list[tuple[str, int]]:
    rnd = draw(st.randoms(use_true_random=False))
    return [(rnd.choice(_WEIGHTED), rnd.randrange(COORDINATORS)) for _ in range(draw(st.integers(8, 40)))]


ACTIONS = _actions()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS)
def test_two_leaders_never_drive_executors_at_the_same_incarnation(etcd: EtcdClient, actions: list[tuple[str, int]],
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    cluster = uuid.uuid4().hex  # a fresh cluster per example: its own leader key and counter
    state_dir = tmp_path_factory.mktemp("state")

    def candidate(i: int, now: list[float] | None = None) -> Candidate:
        clock = now or [0.0]
        election = Election(etcd, cluster, f"coordinator-{i}", TTL, clock=lambda: clock[0])
        return Candidate(election, EtcdState(election, state_dir / f"{i}-{uuid.uuid4().hex}"), clock)

    coordinators = [candidate(i) for i in range(COORDINATORS)]
    executor = Authority()  # every executor runs this state machine; one stands for all of them
    issued: dict[int, str] = {}  # incarnation -> the election id that got it
    order: list[int] = []  # incarnations in the order they were issued
    accepted: list[tuple[str, int]] = []  # (election id, incarnation) of every step an executor obeyed
    def step(c: Candidate) -> None:
        try:
            executor.check(c.installed)
        except FailedPrecondition as refused:
            event("a step of an old incarnation refused by the executor")
            assert refused.reason in ("STALE_INCARNATION", "POISONED", "NOT_INSTALLED")
            return
        accepted.append((c.election.id, c.installed))

    for action, i in actions:
        c = coordinators[i]
        e = c.election
        if action == "campaign":
            if e.try_acquire():
                c.lapsed_in_etcd = False  # a new lease of its own
        elif action == "renew":
            e.renew()
        elif action == "lapse_local":  # time passes for this coordinator: past its TTL, the watchdog steps it down
            c.now[0] += TTL
            if e._leading and not e.is_leader():
                e.step_down("lease lapsed (test)")
        elif action == "lapse_etcd":  # etcd expires the lease behind its back: a zombie that still believes it leads
            if e.lease and not c.lapsed_in_etcd:
                try:
                    etcd.revoke(e.lease)
                except Unavailable:
                    continue  # it had stepped down and revoked it already
                c.lapsed_in_etcd = True
        elif action == "install" and e.is_leader():
            executor.poison(c.state.refresh(), "a new leader fences its predecessor")
            try:
                k = c.state.next_incarnation()
            except NotLeader:
                event("a zombie's incarnation refused by etcd")
                assert c.lapsed_in_etcd, "a coordinator that holds its lease was refused an incarnation"
                continue
            assert not c.lapsed_in_etcd, "a coordinator whose lease expired in etcd was issued an incarnation"
            assert k not in issued, f"incarnation {k} issued twice"
            assert not order or k > order[-1]
            issued[k], c.installed = e.id, k
            order.append(k)
            try:
                executor.install(k)
            except FailedPrecondition:
                pass  # only ever a newer one installed already
            step(c)  # a leader that installed drives at once
        elif action == "step" and c.installed and e.is_leader():
            step(c)
        elif action == "restart":  # a new process at the same place: a new candidacy, the same clock
            e.close()
            coordinators[i] = candidate(i, c.now)
    event(f"leaders that drove executors: {len({who for who, _ in accepted})}")
    for who, k in accepted:
        assert issued[k] == who, f"incarnation {k} driven by a coordinator it was not issued to"
    steps = [k for _, k in accepted]
    assert steps == sorted(steps), f"an executor obeyed an older incarnation after a newer one: {steps}"
    for c in coordinators:
        c.election.close()
