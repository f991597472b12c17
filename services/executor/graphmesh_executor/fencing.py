"""The executor's two state machines: the communication authority and each session's transaction.

Authority:  NONE --install(k)--> ACTIVE(k) --poison(k, cause) | fence(k)--> POISONED(k, first cause)
            POISONED(k) --fence(k, terminal)--> TERMINAL(k);  any --install(k' > every k seen)--> ACTIVE(k')
Session:    IDLE --begin(e)--> IN_TXN(e) --advance(e)--> IN_TXN(e, voted) --commit(e)--> IDLE(last=COMMITTED)
            IN_TXN(e) --abort(e)--> IDLE(last=ABORTED, KV length restored)
            IN_TXN(e, voted) --begin(e' > e) | poisoned--> INDETERMINATE(e) --resolve(e, outcome) | abort(e)--> IDLE

A voted epoch ran here and its rows were answered (pushed on, or returned to the coordinator): the rank has done
its part and waits for the decision, which the coordinator folds into the session's next row. A request that
begins a later epoch without committing e (its folded commit is not e), or the loss of the authority that would
have sent the decision, leaves the rank unable to know whether e committed: the session turns INDETERMINATE,
keeps e's rows uncommitted but not rolled back, and refuses everything (SESSION_INDETERMINATE) until the
coordinator resolves e from its durable decision log (the seeds' Indeterminate{epoch, phase}: no rollback,
external recovery).

Both are plain classes, tested without gRPC; the caller holds a lock around them. Every refusal is a
FailedPrecondition with a machine-readable reason and changes nothing, but for the one that finds a voted epoch
undecided: it records INDETERMINATE first, so that every later request is refused too.

An incarnation more than MAX_INCARNATION_STEP beyond the highest seen (0 on a fresh executor) is refused
(INCARNATION_OUT_OF_RANGE), by install and by fence alike: one Fence(2**64 - 1) would otherwise make this
executor refuse every later Install for good. A coordinator issues incarnations one by one, so a million
rebuilds fit in one step; only a caller that is not the mesh's coordinator sends a number that far ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from graphmesh.errors import FailedPrecondition
from graphmesh.protocol import METADATA_KEY, ErrorClass

MAX_INCARNATION_STEP = 1 << 20

class AuthorityState(Enum):
    NONE = 1
    ACTIVE = 2
    POISONED = 3
    TERMINAL = 4


class Authority:
    def __init__(self) -> None:
        self.state = AuthorityState.NONE
        self.incarnation = 0
        self.cause = ""
        self.highest_seen = 0
        self.poisonings = 0  # incarnations this executor saw poisoned (a metric)

    def check_install(self, incarnation: int) -> None:
        """Refuses an incarnation that install() would refuse, before the caller does any work for it."""
        if incarnation <= self.highest_seen:
            raise FailedPrecondition(
                f"incarnation {incarnation} is not newer than {self.highest_seen}, the highest this executor has seen",
                "STALE_INCARNATION", {"current_incarnation": str(self.incarnation),
                                      "highest_seen": str(self.highest_seen)})
        self._check_in_range(incarnation)

    def _check_in_range(self, incarnation: int) -> None:
        if incarnation > self.highest_seen + MAX_INCARNATION_STEP:
            raise FailedPrecondition(
                f"incarnation {incarnation} is more than {MAX_INCARNATION_STEP} beyond {self.highest_seen}, the "
                f"highest this executor has seen", "INCARNATION_OUT_OF_RANGE",
                {"current_incarnation": str(self.incarnation), "highest_seen": str(self.highest_seen)})

    def install(self, incarnation: int) -> None:
        self.check_install(incarnation)
        self.state, self.incarnation, self.cause, self.highest_seen = AuthorityState.ACTIVE, incarnation, "", incarnation

    def check(self, incarnation: int) -> None:
        """Refuses a message unless it carries the current incarnation and the authority is ACTIVE."""
        meta = {"current_incarnation": str(self.incarnation)}
        if self.state is AuthorityState.NONE:
            raise FailedPrecondition("this executor has not been installed by a coordinator", "NOT_INSTALLED", meta)
        if incarnation != self.incarnation:
            raise FailedPrecondition(f"incarnation {incarnation} is stale; the current one is {self.incarnation}",
                                     "STALE_INCARNATION", meta)
        if self.state is not AuthorityState.ACTIVE:
            raise FailedPrecondition(f"incarnation {incarnation} is {self.state.name.lower()}: {self.cause}",
                                     "POISONED", meta)

    def poison(self, incarnation: int, cause: str, terminal: bool = False) -> None:
        """Fences `incarnation`. First cause wins and poison is never cleared; fencing a newer incarnation
        than the current one also fences the current one (a newer coordinator exists)."""
        self._check_in_range(incarnation)
        self.highest_seen = max(self.highest_seen, incarnation)
        if self.state is AuthorityState.NONE or incarnation < self.incarnation:
            return
        if self.state is AuthorityState.ACTIVE:
            self.state, self.cause = AuthorityState.POISONED, cause
            self.poisonings += 1
        if terminal:
            self.state = AuthorityState.TERMINAL


class SessionPhase(Enum):
    IDLE = 1
    IN_TXN = 2
    INDETERMINATE = 3


class Outcome(Enum):
    NONE = 0
    COMMITTED = 1
    ABORTED = 2
    INDETERMINATE = 3


@dataclass
class SessionTxn:
    """One session's commit epochs on one rank; kv_length only moves forward on commit."""

    phase: SessionPhase = SessionPhase.IDLE
    epoch: int = 0
    last_outcome: Outcome = Outcome.NONE
    kv_length: int = 0  # committed rows
    pending_length: int = 0  # rows written by the open epoch, committed on commit
    committed_epoch: int = 0  # the newest committed epoch
    voted: bool = False  # the open epoch ran here and was answered: only its decision is missing

    def check_decided(self, epoch: int) -> None:
        """Refuses to begin `epoch` while an earlier epoch's decision is unknown here (SESSION_INDETERMINATE)."""
        if self.phase is SessionPhase.IN_TXN and self.voted and epoch > self.epoch:
            # The caller applied the request's folded commit first: a later epoch that does not commit this one
            # means the decision for it was lost on the way (an abort that never arrived). Guessing either way
            # could keep rows the other ranks dropped, or drop rows they kept.
            self.mark_indeterminate(self.epoch)
        if self.phase is SessionPhase.INDETERMINATE:
            raise FailedPrecondition(f"epoch {self.epoch} is indeterminate; waiting for ResolveEpoch",
                                     "SESSION_INDETERMINATE", {"epoch": str(self.epoch), METADATA_KEY: ErrorClass.INDETERMINATE})

    def begin(self, epoch: int) -> None:
        self.check_decided(epoch)
        if self.phase is SessionPhase.IN_TXN:
            raise FailedPrecondition(f"epoch {self.epoch} is still open; commit or abort it before epoch {epoch}",
                                     "EPOCH_OPEN")
        if epoch <= self.epoch:
            raise FailedPrecondition(f"epoch {epoch} is not after the last epoch {self.epoch}", "STALE_EPOCH")
        self.phase, self.epoch, self.pending_length, self.voted = SessionPhase.IN_TXN, epoch, self.kv_length, False

    def advance(self, epoch: int, length: int) -> None:
        """This rank's part of `epoch` is done and answered: it votes commit and waits for the decision."""
        self._require_open(epoch)
        self.pending_length, self.voted = length, True

    def commit(self, epoch: int) -> None:
        if epoch <= self.committed_epoch:
            return  # a retried or folded-twice commit
        if self.phase is SessionPhase.INDETERMINATE and epoch == self.epoch:
            self.resolve(epoch, Outcome.COMMITTED)  # the lost decision arrived after all
            return
        self._require_open(epoch)
        self.phase, self.last_outcome, self.kv_length = SessionPhase.IDLE, Outcome.COMMITTED, self.pending_length
        self.committed_epoch, self.voted = epoch, False

    def abort(self, epoch: int) -> None:
        if epoch <= self.committed_epoch:
            raise FailedPrecondition(f"epoch {epoch} is already committed", "ALREADY_COMMITTED")
        if self.phase is SessionPhase.INDETERMINATE:
            if epoch == self.epoch:
                self.resolve(epoch, Outcome.ABORTED)  # the lost decision arrived after all
            # A later epoch never began here (its begin was refused): aborting it changes nothing, and the
            # indeterminate epoch still waits for its own decision.
            return
        if self.phase is SessionPhase.IDLE and self.epoch == epoch:
            return
        if self.phase is SessionPhase.IDLE and epoch > self.epoch:
            self.epoch, self.last_outcome = epoch, Outcome.ABORTED  # aborted before it began here
            return
        self._require_open(epoch)
        self.phase, self.last_outcome, self.pending_length = SessionPhase.IDLE, Outcome.ABORTED, self.kv_length
        self.voted = False

    def append_committed(self, start: int, rows: int) -> None:
        """Rows written from outside an invocation (a seeded prefix, a migration) extend the committed KV."""
        if self.phase is not SessionPhase.IDLE:
            raise FailedPrecondition(f"epoch {self.epoch} is open; KV rows can only be written between epochs",
                                     "EPOCH_OPEN")
        if start != self.kv_length:
            raise FailedPrecondition(f"rows start at {start} but {self.kv_length} rows are committed",
                                     "KV_LENGTH_MISMATCH")
        self.kv_length = self.pending_length = start + rows

    def mark_indeterminate(self, epoch: int) -> None:
        """The decision for voted `epoch` can no longer be observed: its rows stay as they are, uncommitted."""
        self._require_open(epoch)
        self.phase, self.last_outcome = SessionPhase.INDETERMINATE, Outcome.INDETERMINATE

    def resolve(self, epoch: int, outcome: Outcome) -> None:
        if self.phase is not SessionPhase.INDETERMINATE or self.epoch != epoch:
            raise FailedPrecondition(f"epoch {epoch} is not indeterminate here", "NOT_INDETERMINATE")
        if outcome is Outcome.COMMITTED:
            self.kv_length, self.committed_epoch = self.pending_length, epoch
        else:
            self.pending_length = self.kv_length
        self.phase, self.last_outcome, self.voted = SessionPhase.IDLE, outcome, False

    def _require_open(self, epoch: int) -> None:
        if self.phase is not SessionPhase.IN_TXN or self.epoch != epoch:
            raise FailedPrecondition(f"epoch {epoch} is not open (phase {self.phase.name}, epoch {self.epoch})",
                                     "EPOCH_NOT_OPEN")
