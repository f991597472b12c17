"""The executor's state machines, without gRPC: explicit cases and hypothesis property tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphmesh.errors import FailedPrecondition
from graphmesh_executor.fencing import MAX_INCARNATION_STEP, Authority, AuthorityState, Outcome, SessionPhase, SessionTxn


def test_authority_lifecycle() -> None:
    a = Authority()
    with pytest.raises(FailedPrecondition) as e:
        a.check(1)
    assert e.value.reason == "NOT_INSTALLED"
    a.install(1)
    a.check(1)
    with pytest.raises(FailedPrecondition) as e:
        a.check(2)
    assert e.value.reason == "STALE_INCARNATION"
    a.poison(1, "first")
    a.poison(1, "second")
    assert (a.state, a.cause) == (AuthorityState.POISONED, "first")
    with pytest.raises(FailedPrecondition) as e:
        a.check(1)
    assert e.value.reason == "POISONED"
    with pytest.raises(FailedPrecondition):
        a.install(1)  # never re-activate a poisoned incarnation
    a.install(2)
    a.check(2)
    with pytest.raises(FailedPrecondition) as e:
        a.check(1)
    assert e.value.reason == "STALE_INCARNATION"


def test_fencing_a_newer_incarnation_blocks_installing_older_ones() -> None:
    a = Authority()
    a.install(3)
    a.poison(7, "a newer coordinator exists")
    assert a.cause == "a newer coordinator exists" and a.highest_seen == 7
    for k in (4, 5, 6, 7):
        with pytest.raises(FailedPrecondition):
            a.install(k)
    a.install(8)
    a.check(8)


def test_an_incarnation_far_beyond_the_highest_seen_is_refused_and_changes_nothing() -> None:
    """One Fence(2**64 - 1) must not make every later Install stale: far-ahead numbers are refused outright."""
    fresh = Authority()
    for call in (fresh.install, fresh.poison, fresh.check_install):
        with pytest.raises(FailedPrecondition) as e:
            call(MAX_INCARNATION_STEP + 1, *(("attack",) if call == fresh.poison else ()))
        assert e.value.reason == "INCARNATION_OUT_OF_RANGE"
    assert (fresh.state, fresh.highest_seen) == (AuthorityState.NONE, 0)
    a = Authority()
    a.install(5)
    with pytest.raises(FailedPrecondition) as e:
        a.poison(2**64 - 1, "attack")
    assert e.value.reason == "INCARNATION_OUT_OF_RANGE"
    assert (a.state, a.incarnation, a.highest_seen, a.cause) == (AuthorityState.ACTIVE, 5, 5, "")
    a.install(5 + MAX_INCARNATION_STEP)  # the largest step is still a legal one
    assert a.incarnation == 5 + MAX_INCARNATION_STEP


def test_session_commit_abort_and_indeterminate() -> None:
    t = SessionTxn()
    t.begin(1)
    t.advance(1, 10)
    t.commit(1)
    assert (t.phase, t.kv_length) == (SessionPhase.IDLE, 10)
    t.commit(1)  # a retried commit is idempotent
    t.begin(2)
    t.advance(2, 11)
    t.abort(2)
    assert (t.kv_length, t.last_outcome) == (10, Outcome.ABORTED)
    with pytest.raises(FailedPrecondition) as e:
        t.begin(2)
    assert e.value.reason == "STALE_EPOCH"
    t.begin(3)
    t.advance(3, 11)
    t.mark_indeterminate(3)
    with pytest.raises(FailedPrecondition) as e:
        t.begin(4)
    assert e.value.reason == "SESSION_INDETERMINATE"
    t.resolve(3, Outcome.COMMITTED)
    assert (t.phase, t.kv_length) == (SessionPhase.IDLE, 11)
    with pytest.raises(FailedPrecondition):
        t.abort(3)  # committed epochs cannot be rolled back


def test_a_later_epoch_that_does_not_decide_a_voted_one_makes_it_indeterminate_until_resolved() -> None:
    t = SessionTxn()
    t.begin(1)
    with pytest.raises(FailedPrecondition) as e:
        t.begin(2)  # epoch 1 has not run here yet: an ordinary refusal, nothing marked
    assert (e.value.reason, t.phase) == ("EPOCH_OPEN", SessionPhase.IN_TXN)
    t.advance(1, 10)  # ran and answered: only its decision is missing
    for _ in range(2):  # marked by the first refusal, and refused until resolved
        with pytest.raises(FailedPrecondition) as e:
            t.begin(2)
        assert e.value.reason == "SESSION_INDETERMINATE" and e.value.metadata["epoch"] == "1"
        assert (t.phase, t.epoch, t.kv_length, t.pending_length) == (SessionPhase.INDETERMINATE, 1, 0, 10)
    t.abort(2)  # the refused epoch never began here: aborting it leaves epoch 1 waiting
    assert t.phase is SessionPhase.INDETERMINATE
    with pytest.raises(FailedPrecondition) as e:
        t.resolve(2, Outcome.ABORTED)
    assert e.value.reason == "NOT_INDETERMINATE"
    t.resolve(1, Outcome.ABORTED)
    assert (t.phase, t.kv_length, t.pending_length, t.last_outcome) == (SessionPhase.IDLE, 0, 0, Outcome.ABORTED)
    t.begin(3)
    t.advance(3, 4)
    with pytest.raises(FailedPrecondition):
        t.begin(4)
    t.commit(3)  # a late decision is a decision: the commit resolves it
    assert (t.phase, t.kv_length, t.committed_epoch) == (SessionPhase.IDLE, 4, 3)
    t.begin(5)
    t.advance(5, 6)
    t.mark_indeterminate(5)
    t.abort(5)  # and so is a late abort
    assert (t.phase, t.kv_length, t.last_outcome) == (SessionPhase.IDLE, 4, Outcome.ABORTED)


authority_events = st.lists(st.tuples(st.sampled_from(["install", "check", "poison", "terminal"]),
                                      st.integers(min_value=0, max_value=6)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(authority_events)
def test_no_sequence_accepts_a_stale_or_poisoned_token(events: list[tuple[str, int]]) -> None:
    a = Authority()
    poisoned: set[int] = set()
    installed: list[int] = []
    for kind, k in events:
        try:
            if kind == "install":
                a.install(k)
                installed.append(k)
            elif kind == "poison":
                if a.state is AuthorityState.ACTIVE and k >= a.incarnation:
                    poisoned.add(a.incarnation)
                a.poison(k, "x")
            elif kind == "terminal":
                if a.state is AuthorityState.ACTIVE and k >= a.incarnation:
                    poisoned.add(a.incarnation)
                a.poison(k, "x", terminal=True)
            else:
                a.check(k)
                # accepted: k is the newest installed incarnation, and was never poisoned
                assert installed and k == installed[-1] == max(installed)
                assert k not in poisoned
        except FailedPrecondition:
            pass
        assert installed == sorted(set(installed))  # incarnations only ever increase


txn_events = st.lists(st.tuples(st.sampled_from(["begin", "advance", "commit", "abort", "indet", "resolve_c",
                                                 "resolve_a"]),
                                st.integers(min_value=1, max_value=5), st.integers(min_value=0, max_value=50)),
                      max_size=50)


@settings(max_examples=300, deadline=None)
@given(txn_events)
def test_no_sequence_loses_a_committed_kv_row(events: list[tuple[str, int, int]]) -> None:
    t = SessionTxn()
    committed = 0
    for kind, epoch, length in events:
        before = (t.phase, t.epoch, t.kv_length, t.pending_length, t.last_outcome)
        undecided = t.phase is SessionPhase.IN_TXN and t.voted and epoch > t.epoch
        try:
            if kind == "begin":
                t.begin(epoch)
            elif kind == "advance":
                t.advance(epoch, committed + length)  # execution only appends rows
            elif kind == "commit":
                t.commit(epoch)
            elif kind == "abort":
                t.abort(epoch)
            elif kind == "indet":
                t.mark_indeterminate(epoch)
            else:
                t.resolve(epoch, Outcome.COMMITTED if kind == "resolve_c" else Outcome.ABORTED)
        except FailedPrecondition as e:
            after = (t.phase, t.epoch, t.kv_length, t.pending_length, t.last_outcome)
            if kind == "begin" and undecided:  # the one refusal that records something: the epoch is undecided
                assert e.reason == "SESSION_INDETERMINATE"
                assert after == (SessionPhase.INDETERMINATE, *before[1:4], Outcome.INDETERMINATE)
            else:
                assert before == after  # refusals change nothing
        assert t.kv_length >= committed  # committed rows are never lost
        committed = t.kv_length
