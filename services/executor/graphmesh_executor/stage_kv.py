"""A stage's KV import and export: committed rows of a session read out (a copy to a peer, the KV store's seeds),
written in (a seeded prefix, a migration), a prompt prefix's whole blocks shared with a new session, and the blocks a
sliding window has passed dropped.

A session's dropped rows are gone from this stage: reading them out (a copy, an export) is refused with
FailedPrecondition ROWS_DROPPED rather than exporting only the live ones, since every reader (a peer's write_kv, the
store's seeds) appends rows from where the session's rows end there, so live rows alone would land in the wrong
place. Live rows are read out as any others."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial

import numpy as np

from graphmesh.errors import FailedPrecondition, InvalidArgument, OutOfRange
from graphmesh.models.config import ModelConfig
from graphmesh_executor.stage_types import BlockWriter, StageSession, StageSpec, StageState


class StageKv(StageState):
    """The KV import and export part of StageRuntime."""

    _block_writer: BlockWriter | None
    _window_of: tuple[StageSpec | None, ModelConfig | None, int] = (None, None, 0)  # what kv_window was worked out for

    @property
    def kv_window(self) -> int:
        """This stage's sliding window for its KV (ModelConfig.kv_window): 0 keeps every row."""
        spec, config = self.spec, self.config
        if spec is None or config is None:
            return 0
        if self._window_of[0] is not spec or self._window_of[1] is not config:
            self._window_of = (spec, config, config.kv_window(spec.layer_start, spec.layer_end))
        return self._window_of[2]

    def _drop_outside_window(self, session_id: str, session: StageSession, oldest_query: int) -> None:
        """Drops the session's leading blocks that no query at `oldest_query` or later sees (under the lock), where
        the stage's layers all have a window. `oldest_query` is the first position of the row the session begins:
        a rollback (an aborted epoch, the folded commit_length of a verified chunk) never goes back past it, so no
        query ever needs a dropped row again. Rows not yet written behind to the KV store are kept until they are."""
        window = self.kv_window
        if not window:
            return
        keep_from = oldest_query - window + 1  # the first key a query at oldest_query sees
        spec = self.spec
        assert spec is not None
        if self._block_writer is not None and spec.kvstore_address and not session.untokened:
            keep_from = min(keep_from, session.stored_tokens)
        if keep_from >= self.pool.block_tokens:
            self.pool.drop(session_id, keep_from // self.pool.block_tokens)

    @property
    def kv_dim(self) -> int:
        return self.config.kv_dim if self.config is not None else 0

    def _take(self, slots: np.ndarray) -> np.ndarray:
        """Pool rows `slots` as f32 [rows, layers, 2, kv_dim], moved off the device row by row (engine thread)."""
        assert self._holder is not None
        names = self._pool_names()
        rows = np.empty((len(slots), len(names) // 2, 2, self.kv_dim), np.float32)
        for j, name in enumerate(names):
            rows[:, j // 2, j % 2] = self._holder.take_rows(self._pools[name], slots)
        return rows

    def _committed_slots(self, incarnation: int, session_id: str, from_row: int, to_row: int) -> np.ndarray:
        with self._lock:
            self.authority.check(incarnation)
            session = self._session_or_404(session_id)
            if not 0 <= from_row <= to_row <= session.txn.kv_length:
                raise OutOfRange(f"rows [{from_row}, {to_row}) outside the {session.txn.kv_length} committed rows of "
                                 f"session {session_id!r}", "ROW_OUT_OF_RANGE")
            live = self.pool.dropped(session_id) * self.pool.block_tokens
            if from_row < min(live, to_row):
                raise FailedPrecondition(f"rows [{from_row}, {to_row}) of session {session_id!r}: its rows before "
                                         f"{live} were dropped here (outside the sliding window of every layer of "
                                         "this stage)", "ROWS_DROPPED")
            return self.pool.slots(session_id, from_row, to_row)

    def read_kv(self, incarnation: int, session_id: str, from_row: int, to_row: int) -> np.ndarray:
        """Committed rows [from_row, to_row) as f32 [rows, layers, 2, kv_dim]."""
        if self.kv_window:
            return self._read_queued(incarnation, session_id, from_row, to_row).result()
        slots = self._committed_slots(incarnation, session_id, from_row, to_row)
        return self.engine.run("stage.read_kv", lambda: self._take(slots))

    def _read_queued(self, incarnation: int, session_id: str, from_row: int, to_row: int) -> Future[np.ndarray]:
        """read_kv's rows, read by an engine task queued under the lock: a windowed stage drops a stepping session's
        old blocks (under the lock) and lends them to rows the engine writes later, so the read must come first."""
        with self._lock:
            slots = self._committed_slots(incarnation, session_id, from_row, to_row)
            return self.engine.submit("stage.read_kv", lambda: self._take(slots))

    def read_kv_pieces(self, incarnation: int, session_id: str, from_row: int, to_row: int) -> Iterator[list[memoryview]]:
        """The same rows a pool at a time (K, then V, of each layer in order), each piece f32 [rows, kv_dim] as the
        byte buffers that hold it in order. Where the pools are host memory these are views of the session's
        blocks in place (nothing is copied, nor does the engine take part: the rows are committed, nothing writes
        them); elsewhere each piece is an engine task of its own, the next one queued before a piece is handed out,
        so a row copy sends one piece while the engine reads the next and steps run between them."""
        names = self._pool_names()
        if self.kv_window:  # not in place: the blocks may be dropped and written again while the pieces go out
            rows = self._read_queued(incarnation, session_id, from_row, to_row).result()
            return iter([[np.ascontiguousarray(rows[:, j // 2, j % 2]).reshape(-1).view(np.uint8).data]
                         for j in range(len(names))])
        slots = self._committed_slots(incarnation, session_id, from_row, to_row)  # checked now, not at first next()
        holder = self._holder
        assert holder is not None
        views = [v for v in (holder.host_view(self._pools[name]) for name in names) if v is not None]
        if len(views) == len(names):
            runs = _runs(slots)
            return iter([[view[a:b].reshape(-1).view(np.uint8).data for a, b in runs] for view in views])

        def take(name: str) -> list[memoryview]:
            assert self._holder is not None
            piece = np.asarray(self._holder.take_rows(self._pools[name], slots), np.float32)
            return [piece.reshape(-1).view(np.uint8).data]

        def pieces() -> Iterator[list[memoryview]]:
            ahead = self.engine.submit("stage.read_kv", partial(take, names[0]))
            for j in range(len(names)):
                piece = ahead.result()
                if j + 1 < len(names):
                    ahead = self.engine.submit("stage.read_kv", partial(take, names[j + 1]))
                yield piece
        return pieces()

    def committed_tokens(self, incarnation: int, session_id: str, from_row: int, to_row: int) -> list[int]:
        """The token ids of committed rows [from_row, to_row), or [] when this rank does not know them all (rows
        that came without their tokens): a copy then carries none rather than wrong ones."""
        with self._lock:
            self.authority.check(incarnation)
            session = self._session_or_404(session_id)
            if session.untokened or to_row > len(session.tokens):
                return []
            return session.tokens[from_row:to_row]

    def write_kv(self, incarnation: int, session_id: str, start: int, rows: np.ndarray, token_ids: list[int]) -> int:
        """Appends committed rows to an idle session (a seeded prefix or a migration); returns the KV length."""
        self.check_kv_rows(str(rows.dtype), rows.shape)
        write = self.begin_write_kv(incarnation, session_id, start, rows.shape[0], token_ids)

        def put_all() -> None:
            for j in range(write.pieces):
                write.put_now(j, rows[:, j // 2, j % 2])
        self.engine.run("stage.write_kv", put_all)  # outside the lock: the engine may be busy with another step
        return write.finish()

    def check_kv_rows(self, dtype: str, shape: tuple[int, ...]) -> None:
        """Refuses KV rows that are not this stage's f32 [n, layers, 2, kv_dim] (`dtype` as numpy or the wire
        spells it)."""
        if dtype not in ("float32", "f32") or len(shape) != 4 or shape[1:] != (self.layers, 2, self.kv_dim):
            raise InvalidArgument(f"KV rows {dtype}{list(shape)} do not match this stage's "
                                  f"f32[n, {self.layers}, 2, {self.kv_dim}]", "BAD_KV_ROWS")

    @property
    def layers(self) -> int:
        assert self.spec is not None
        return self.spec.layer_end - self.spec.layer_start

    def begin_write_kv(self, incarnation: int, session_id: str, start: int, n: int, token_ids: list[int]) -> KvRowsWrite:
        """Checks an append of `n` committed rows to an idle session and reserves their blocks; the rows are then
        put a pool at a time (KvRowsWrite.put) and committed by KvRowsWrite.finish."""
        assert self.spec is not None
        if token_ids and len(token_ids) != n:
            raise InvalidArgument(f"{len(token_ids)} token ids for {n} rows", "BAD_KV_ROWS")
        limit = self.spec.max_context_tokens or (self.config.max_position if self.config else 0)
        if start + n > limit:
            raise OutOfRange(f"{start + n} rows exceed the context of {limit}", "CONTEXT_EXCEEDED")
        with self._lock:
            self.authority.check(incarnation)
            session = self._session(session_id)
            session.txn.append_committed(start, 0)  # refuses an open epoch or a gap before touching anything
            self.pool.reserve(session_id, start + n)
            slots = self.pool.slots(session_id, start, start + n)
        return KvRowsWrite(self, incarnation, session, start, n, token_ids, slots)

    def share_kv(self, incarnation: int, session_id: str, donor_id: str, token_ids: list[int]) -> int:
        """Starts a new session with the KV of a prompt prefix that `donor_id` holds here: its first whole blocks,
        shared (kv_pool.KvPool.share), committed at once. Refused unless the donor's committed tokens begin with
        exactly `token_ids`: a shared block must hold what the new session would have computed itself."""
        block = self.pool.block_tokens
        n = len(token_ids)
        if n == 0 or n % block:
            raise InvalidArgument(f"a shared prefix is whole blocks of {block} tokens, not {n} tokens",
                                  "BAD_SHARED_PREFIX")
        with self._lock:
            self.authority.check(incarnation)
            donor = self._sessions.get(donor_id)
            if donor is None or donor.untokened or donor.txn.kv_length < n or donor.tokens[:n] != token_ids:
                raise FailedPrecondition(f"session {donor_id!r} holds no committed prefix of these {n} tokens here",
                                         "PREFIX_NOT_HELD")
            if session_id in self._sessions:
                raise FailedPrecondition(f"session {session_id!r} already exists here", "SESSION_NOT_NEW")
            # the donor's dropped blocks can be dropped in the new session too, if its first query (at n) sees none
            window = self.kv_window
            if self.pool.dropped(donor_id) * block > (n - window + 1 if window else 0):
                raise FailedPrecondition(f"session {donor_id!r} dropped rows of this prefix that a session starting "
                                         f"at {n} sees here (its sliding window passed them)", "PREFIX_NOT_HELD")
            self.pool.share(session_id, donor_id, n // block)
            session = self._session(session_id)
            session.txn.append_committed(0, n)
            # the donor wrote (or writes) these blocks behind: this session starts past them
            session.tokens, session.stored_tokens = list(token_ids), n
            return n


def _runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """`slots` as runs of consecutive pool rows [a, b), in order."""
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(slots)]])
    return [(int(slots[a]), int(slots[b - 1]) + 1) for a, b in zip(starts, ends)]


class KvRowsWrite:
    """Committed rows being appended to an idle session (StageKv.begin_write_kv): their blocks are reserved, a
    pool's piece (f32 [n, kv_dim]) is written by an engine task, and finish commits them all."""

    def __init__(self, runtime: StageKv, incarnation: int, session: StageSession, start: int, n: int,
                 token_ids: list[int], slots: np.ndarray) -> None:
        self._rt, self._incarnation, self._session = runtime, incarnation, session
        self.start, self.n, self._token_ids, self._slots = start, n, token_ids, slots
        self._names = runtime._pool_names()

    @property
    def pieces(self) -> int:
        return len(self._names)

    def put(self, j: int, piece: np.ndarray) -> Future[None]:
        """Writes piece `j` (K, then V, of each layer in order) on the engine; `piece` must not change until the
        future is done."""
        if piece.shape != (self.n, self._rt.kv_dim) or piece.dtype != np.float32:
            raise InvalidArgument(f"KV piece {piece.dtype}{list(piece.shape)}, expected f32[{self.n}, "
                                  f"{self._rt.kv_dim}]", "BAD_KV_ROWS")
        return self._rt.engine.submit("stage.write_kv", lambda: self.put_now(j, piece))

    def put_now(self, j: int, piece: np.ndarray) -> None:
        """put, on the engine thread itself."""
        rt = self._rt
        assert rt._holder is not None
        name = self._names[j]
        rt._pools[name] = rt._holder.put_rows(rt._pools[name], self._slots, piece)

    def finish(self) -> int:
        """Commits the rows (every piece written); returns the session's KV length."""
        rt, session, start = self._rt, self._session, self.start
        with rt._lock:
            rt.authority.check(self._incarnation)
            session.txn.append_committed(start, self.n)
            if not self._token_ids or len(session.tokens) != start:
                session.untokened = True  # the tokens would no longer line up with the rows they key
            elif not session.untokened:
                session.tokens += self._token_ids
                if session.stored_tokens == start:
                    # These rows came from the store or a peer: their whole blocks are not written behind again. A
                    # partial last block is, once the session completes it (its rows are all here by then).
                    assert rt.spec is not None
                    block = rt.spec.kv_block_tokens or 16
                    session.stored_tokens = session.txn.kv_length // block * block
            return session.txn.kv_length
