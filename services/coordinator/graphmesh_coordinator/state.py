"""The coordinator's durable state: the highest incarnation issued and the commit decision log.

An incarnation is written and fsynced before it is used, so a restarted coordinator never issues one
twice. Decisions are appended as JSON lines and read back at start; the log answers ResolveEpoch, also
after a restart.

The log is write-ahead and presumed-abort: a commit is durable before any rank can learn of it (the step that
folds it into a session's next row is sent after the fsync), so an epoch the log does not hold committed was
committed nowhere and resolves as ABORTED. A rank is only ever undecided about its newest voted epoch of a
session, and no commit of that session can come after it while it is undecided (every rank must run the next
epoch first), so per session the log needs only its newest committed epoch (and an abort after it, which says
the same as the presumption, but says it). It needs nothing of a session released on every rank, nor of any
session once a new incarnation is installed (every rank drops its sessions then): those are forgotten, and the
file is rewritten with what is left (atomically: a new file, fsynced, renamed over the old one) whenever it has
grown well past that, so it stays a few lines per live session however long the coordinator runs.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from graphmesh_server.serving import user_dir

COMPACT_MIN_LINES = 1024  # the log is rewritten once it holds this many lines and twice what it needs


@dataclass(frozen=True)
class Decision:
    session_id: str
    epoch: int
    outcome: str  # "COMMITTED" | "ABORTED"


def default_state_dir() -> Path:
    """Where a coordinator keeps its state unless told (--state-dir): the user's state directory of the XDG Base
    Directory spec, $XDG_STATE_HOME/graphmesh/coordinator, else ~/.local/state/graphmesh/coordinator. Not the
    directory it was started from: a restart from another one would lose the incarnation and the decision log."""
    return user_dir("XDG_STATE_HOME", ".local/state") / "graphmesh" / "coordinator"


def _fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _fsync_write(path: Path, text: str, suffix: str = ".tmp", fsync: bool = True) -> None:
    """Replaces `path` with `text` atomically: a crash leaves the old file or the new one, never a mix."""
    tmp = path.with_name(path.name + suffix)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(path.parent)


def _line(session_id: str, epoch: int, outcome: str) -> str:
    # json.dumps of the record's dict, byte for byte, at a third of its cost: a line per row of every step, written
    # before the step is sent
    return f'{{"session_id": {json.dumps(session_id)}, "epoch": {int(epoch)}, "outcome": {json.dumps(outcome)}}}\n'


class DurableState:
    def __init__(self, state_dir: str | Path, fsync_decisions: bool = True) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._incarnation_path = self.dir / "incarnation.json"
        self._log_path = self.dir / "decisions.jsonl"
        self._lock = threading.Lock()
        self._fsync_decisions = fsync_decisions
        self.incarnation = 0
        if self._incarnation_path.exists():
            self.incarnation = int(json.loads(self._incarnation_path.read_text())["incarnation"])
        self._committed: dict[str, int] = {}  # session -> its newest committed epoch
        self._aborted: dict[str, int] = {}  # session -> its newest aborted epoch, when after that commit
        self._lines = 0  # lines in the file now
        self.fsyncs = 0  # of the decision log (appends and compactions), for measuring the group commit
        if self._log_path.exists():
            data, valid = self._log_path.read_bytes(), 0
            for line in data.splitlines(keepends=True):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # a torn last line from a crash: everything before it was fsynced
                if not line.endswith(b"\n"):
                    break
                self._apply(Decision(record["session_id"], int(record["epoch"]), record["outcome"]))
                valid += len(line)
                self._lines += 1
            if valid < len(data):
                os.truncate(self._log_path, valid)  # or the next append would join the torn line and be unreadable
        self._log = open(self._log_path, "a")
        if self._oversized():
            with self._lock:
                self._compact()  # a log written before it was bounded, or by a run that crashed before compacting

    def advance_to(self, floor: int) -> None:
        """Moves the counter up to `floor` (an incarnation an executor has seen), durably, so that the next one
        issued is above it; never down: no value is issued twice."""
        with self._lock:
            if floor > self.incarnation:
                _fsync_write(self._incarnation_path, json.dumps({"incarnation": floor}))
                self.incarnation = floor

    def next_incarnation(self) -> int:
        """Issues a new incarnation, durable before it is returned."""
        with self._lock:
            issued = self.incarnation + 1
            _fsync_write(self._incarnation_path, json.dumps({"incarnation": issued}))
            self.incarnation = issued
            return issued

    def record(self, *decisions: Decision) -> None:
        """Appends decisions durably. A step's decisions are one group commit: one write and one fsync for all of
        its rows (an fsync costs 2-3 ms on this machine's disk: one per row made a 16-row step pay ~40 ms)."""
        if not decisions:
            return
        with self._lock:
            for d in decisions:
                self._apply(d)
            self._log.write("".join(_line(d.session_id, d.epoch, d.outcome) for d in decisions))
            self._log.flush()
            if self._fsync_decisions:
                os.fsync(self._log.fileno())
                self.fsyncs += 1
            self._lines += len(decisions)
            if self._oversized():
                self._compact()

    def _apply(self, d: Decision) -> None:
        if d.outcome == "COMMITTED":
            if d.epoch >= self._committed.get(d.session_id, 0):
                self._committed[d.session_id] = d.epoch
            if self._aborted.get(d.session_id, 0) <= d.epoch:
                self._aborted.pop(d.session_id, None)
        elif d.epoch > max(self._committed.get(d.session_id, 0), self._aborted.get(d.session_id, 0)):
            self._aborted[d.session_id] = d.epoch

    def outcome(self, session_id: str, epoch: int) -> str | None:
        """The decision for `epoch` of `session_id`: COMMITTED if the log holds it committed, ABORTED if it is
        later than the session's newest commit (logged aborted, or presumed: never committed), None if it is older
        than what the log keeps (no resolution asks for one; the caller must not guess)."""
        with self._lock:
            committed = self._committed.get(session_id, 0)
            if epoch == committed:
                return "COMMITTED"
            return "ABORTED" if epoch > committed else None

    def forget(self, session_id: str) -> None:
        """`session_id` was released on every rank: no rank will ever ask how its epochs ended."""
        with self._lock:
            self._committed.pop(session_id, None)
            self._aborted.pop(session_id, None)

    def retire(self) -> None:
        """A new incarnation is installed: every rank dropped every session, so no decision is needed any more."""
        with self._lock:
            self._committed.clear()
            self._aborted.clear()
            self._compact()

    def _oversized(self) -> bool:
        return self._lines >= max(COMPACT_MIN_LINES, 2 * (len(self._committed) + len(self._aborted)))

    def _compact(self) -> None:
        """Rewrites the log with only what a resolution can still need (under the lock). The new file is complete
        and fsynced before it is renamed over the old one, so a crash at any point leaves one readable log."""
        lines = [_line(s, e, "COMMITTED") for s, e in self._committed.items()]
        lines += [_line(s, e, "ABORTED") for s, e in self._aborted.items()]
        self._log.close()
        _fsync_write(self._log_path, "".join(lines), ".compact", self._fsync_decisions)
        if self._fsync_decisions:
            self.fsyncs += 2  # the new file and its directory
        self._log = open(self._log_path, "a")
        self._lines = len(lines)

    @property
    def log_lines(self) -> int:
        with self._lock:
            return self._lines

    def close(self) -> None:
        self._log.close()
