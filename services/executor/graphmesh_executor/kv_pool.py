"""Paged KV: a stage's pool of fixed-size blocks and one block table per session.

The pool tensors themselves (one K and one V per local layer, [blocks * block_tokens, kv_dim]) are handles of
the stage's executables; this module only lends their blocks. Block 0 is the scratch block: padded rows of a
step write their K/V there and padded table entries point at it, so a step's shapes can be bucketed without a
mask input. The coordinator counts every session's blocks the same way (ceil(tokens / block_tokens)) and
admits or preempts sessions so that a rank never runs out; running out here is a contract violation reported
as RESOURCE_EXHAUSTED before any work.

Whole blocks of a common prompt prefix are shared: a new session's table can start with another session's
first blocks (share), each block counted by the sessions holding it and free again when the last lets go.
Only whole committed blocks are ever shared, and a session only writes past its committed rows, so a shared
block is never written again. (The coordinator still counts a shared block once per session: conservative.)

A stage whose every layer has a sliding window drops a session's leading blocks once no query it can still run
sees them (drop): they return to the pool (a shared one when its last holder lets go) and their table entries
become SCRATCH_BLOCK, so a table keeps its length and positions but never names a block another session may hold
now. The window mask hides those positions from every attention kernel, which either skips them (numpy, the CPU and
CUDA row kernels) or reads the scratch block there and masks it (torch's gathers), as it does past a short row.
"""

from __future__ import annotations

import numpy as np

from graphmesh.errors import FailedPrecondition, ResourceExhausted
from graphmesh.kvkeys import blocks_for

SCRATCH_BLOCK = 0


class KvPool:
    def __init__(self, blocks: int, block_tokens: int) -> None:
        if blocks < 2:
            raise ResourceExhausted(f"a KV pool of {blocks} blocks holds no session (block 0 is scratch)",
                                    "KV_POOL_TOO_SMALL")
        self.blocks, self.block_tokens = blocks, block_tokens
        self._free: list[int] = []
        self._tables: dict[str, list[int]] = {}
        self._holders: dict[int, int] = {}  # block -> sessions holding it, for shared blocks only (absent: one)
        self._dropped: dict[str, int] = {}  # session -> its leading blocks dropped (absent: none)
        self.clear()

    @property
    def lendable(self) -> int:
        return self.blocks - 1

    @property
    def free(self) -> int:
        return len(self._free)

    def table(self, session_id: str) -> list[int]:
        return self._tables.get(session_id, [])

    def dropped(self, session_id: str) -> int:
        """The session's leading blocks dropped (their table entries are SCRATCH_BLOCK)."""
        return self._dropped.get(session_id, 0)

    def reserve(self, session_id: str, tokens: int) -> None:
        """Grows the session's table to hold `tokens` rows; all or nothing."""
        table = self._tables.setdefault(session_id, [])
        need = blocks_for(tokens, self.block_tokens) - len(table)
        if need > len(self._free):
            raise ResourceExhausted(f"session {session_id!r} needs {need} more KV blocks of {self.block_tokens} "
                                    f"tokens; {len(self._free)} of {self.lendable} are free", "KV_POOL_EXHAUSTED")
        for _ in range(max(0, need)):
            table.append(self._free.pop())

    def share(self, session_id: str, donor_id: str, blocks: int) -> None:
        """Starts a new session's table with the donor's first `blocks` blocks (whole, committed ones); those the
        donor dropped are dropped in the new table too (the caller checks that it can do without them)."""
        if self._tables.get(session_id):
            raise FailedPrecondition(f"session {session_id!r} already holds KV blocks", "SESSION_NOT_NEW")
        donor = self._tables.get(donor_id, [])
        if blocks > len(donor):
            raise FailedPrecondition(f"session {donor_id!r} holds {len(donor)} KV blocks, not {blocks}",
                                     "DONOR_TOO_SHORT")
        for b in donor[:blocks]:
            if b != SCRATCH_BLOCK:
                self._holders[b] = self._holders.get(b, 1) + 1
        self._tables[session_id] = donor[:blocks]
        if self.dropped(donor_id):
            self._dropped[session_id] = min(blocks, self.dropped(donor_id))

    def drop(self, session_id: str, blocks: int) -> int:
        """Lets go of the session's first `blocks` blocks (those no query it can still run sees: a sliding window
        passed them), leaving SCRATCH_BLOCK in their table entries; returns how many were newly dropped."""
        table = self._tables.get(session_id, [])
        done, blocks = self.dropped(session_id), min(blocks, len(table))
        for i in range(done, blocks):
            self._let_go(table[i])
            table[i] = SCRATCH_BLOCK
        if blocks <= done:
            return 0
        self._dropped[session_id] = blocks
        return blocks - done

    def release(self, session_id: str) -> None:
        self._dropped.pop(session_id, None)
        for b in reversed(self._tables.pop(session_id, [])):
            if b != SCRATCH_BLOCK:  # a dropped block: already let go
                self._let_go(b)

    def _let_go(self, block: int) -> None:
        holders = self._holders.pop(block, 1) - 1
        if holders:
            self._holders[block] = holders  # still in another session's table
        else:
            self._free.append(block)

    def clear(self) -> None:
        """Every block free again (a new incarnation trusts no session of the old one)."""
        self._free = list(range(self.blocks - 1, 0, -1))  # popped from the end: low block ids first
        self._tables, self._holders, self._dropped = {}, {}, {}

    def slots(self, session_id: str, start: int, end: int) -> np.ndarray:
        """Pool rows of positions [start, end) of the session (its table must already hold them)."""
        if end - start == 1:  # a decode row: no array of the whole table (this runs for every row of every step)
            return np.array([self._tables[session_id][start // self.block_tokens] * self.block_tokens
                             + start % self.block_tokens], np.int64)
        positions = np.arange(start, end)
        table = np.asarray(self._tables[session_id], np.int64)
        return table[positions // self.block_tokens] * self.block_tokens + positions % self.block_tokens
