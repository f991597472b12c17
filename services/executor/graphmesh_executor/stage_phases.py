"""A session's epochs on this rank once they ran: commit (folded into the session's next row, or alone), rollback
(abort, keeping a verified chunk's accepted rows), the resolution of an INDETERMINATE epoch from the coordinator's
decision log, and release; with the write-behind of whole committed blocks to the KV store that a commit starts."""

from __future__ import annotations

import logging

from graphmesh_executor.fencing import Outcome, SessionPhase
from graphmesh_executor.stage_kv import StageKv
from graphmesh_executor.stage_types import BlockWriter, KvBlocks, StageSession
from graphmesh_server import telemetry

log = logging.getLogger("graphmesh.executor.stage")


class StagePhases(StageKv):
    """The phases after a step (under the runtime's lock): set by StageRuntime.__init__ and install."""

    model_identity: str
    _block_writer: BlockWriter | None

    def commit(self, incarnation: int, session_id: str, epoch: int) -> int:
        with self._lock:
            self.authority.check(incarnation)
            session = self._session_or_404(session_id)
            self._commit(incarnation, session_id, session, epoch)
            return session.txn.kv_length

    def _commit(self, incarnation: int, session_id: str, session: StageSession, epoch: int) -> None:
        """Commits under the lock, then hands whole new blocks to the write-behind."""
        if epoch <= session.txn.committed_epoch:
            return
        with telemetry.span("stage.commit", session=session_id, epoch=epoch, incarnation=incarnation):
            session.txn.commit(epoch)
            self._committed(incarnation, session_id, session, epoch)

    def _truncate(self, session: StageSession, length: int) -> None:
        """Rolls a committed verified chunk back to its accepted rows (under the lock; idempotent): the rows past
        `length` are no longer the session's. Its blocks stay lent to it (the coordinator counts them until it ends,
        and its next chunk writes them again); blocks already written behind hold the tokens they were keyed by,
        whatever was accepted, so only the count of stored tokens moves back."""
        txn = session.txn
        if txn.phase is not SessionPhase.IDLE or length >= txn.kv_length:
            return
        txn.kv_length = txn.pending_length = length
        del session.tokens[length:]
        block = self.pool.block_tokens
        session.stored_tokens = min(session.stored_tokens, length // block * block)

    def _committed(self, incarnation: int, session_id: str, session: StageSession, epoch: int) -> None:
        """What follows a commit of `epoch` (folded, or resolved): its tokens are recorded, its blocks written behind."""
        session.tokens += session.pending_tokens
        session.pending_tokens = []
        self._write_behind(incarnation, session_id, session, epoch)

    def _write_behind(self, incarnation: int, session_id: str, session: StageSession, epoch: int) -> None:
        spec = self.spec
        if self._block_writer is None or spec is None or not spec.kvstore_address:
            return
        block = spec.kv_block_tokens or 16
        whole = session.txn.kv_length // block * block
        if whole <= session.stored_tokens or len(session.tokens) < whole or session.untokened:
            return
        # Read on the engine thread after the step that wrote the rows, without holding up this commit (the caller
        # holds the lock): the slots are taken now, so a release and reuse of the blocks later cannot race it.
        writer, slots, tokens, first = self._block_writer, self.pool.slots(session_id, session.stored_tokens, whole), \
            session.tokens[:whole], session.stored_tokens // block
        self.engine.post("stage.kv_write_behind", lambda: writer(KvBlocks(
            spec.kvstore_address, self.model_identity, spec.layer_start, spec.layer_end, self.kv_dim, block, tokens,
            first, self._take(slots), incarnation, epoch)))
        session.stored_tokens = whole

    def abort(self, incarnation: int, session_id: str, epoch: int, commit_epoch: int = 0, commit_length: int = 0) -> int:
        """Local rollback of one session's epoch; allowed under poison (but not for an older incarnation)."""
        with self._lock:
            if incarnation != self.authority.incarnation:
                self.authority.check(incarnation)
            session = self._sessions.get(session_id)
            if session is None:
                return 0
            if commit_epoch and session.txn.epoch == commit_epoch:
                self._commit(incarnation, session_id, session, commit_epoch)  # tokens recorded, blocks written behind
                if commit_length:
                    self._truncate(session, commit_length)
            session.txn.abort(epoch)
            return session.txn.kv_length

    def resolve(self, incarnation: int, session_id: str, epoch: int, outcome: Outcome) -> int:
        """Settles an INDETERMINATE epoch with the coordinator's logged decision. Allowed under poison (not for an
        older incarnation), as a rollback is: a restarted coordinator resolves its predecessor's epochs after
        fencing it, so that a committed epoch's blocks are still written behind."""
        with self._lock:
            if incarnation != self.authority.incarnation:
                self.authority.check(incarnation)
            session = self._session_or_404(session_id)
            with telemetry.span("stage.resolve", session=session_id, epoch=epoch, outcome=outcome.name):
                session.txn.resolve(epoch, outcome)
                if outcome is Outcome.COMMITTED:
                    self._committed(incarnation, session_id, session, epoch)
            log.info("epoch resolved", extra={"session": session_id, "epoch": epoch, "outcome": outcome.name})
            return session.txn.kv_length

    def release(self, incarnation: int, *session_ids: str) -> bool:
        """Whether this rank held any of the sessions."""
        held = False
        with self._lock:
            self.authority.check(incarnation)
            for session_id in session_ids:
                self.pool.release(session_id)
                held = self._sessions.pop(session_id, None) is not None or held
        return held
