"""The coordinator's durable state: incarnations never reissued, decisions group-committed, read back, and bounded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from graphmesh_coordinator import state as state_module
from graphmesh_coordinator.state import COMPACT_MIN_LINES, Decision, DurableState, default_state_dir


def test_a_step_of_decisions_is_one_group_commit_read_back_after_a_restart(tmp_path: Path) -> None:
    state = DurableState(tmp_path)
    state.record(*(Decision(f"s{i}", 3, "COMMITTED") for i in range(16)))
    state.record(Decision("s0", 4, "ABORTED"))
    state.record()  # a step without folded commits writes nothing
    assert state.fsyncs == 2  # one per step, not one per row
    state.close()
    assert len((tmp_path / "decisions.jsonl").read_text().splitlines()) == 17
    again = DurableState(tmp_path)
    assert [again.outcome(f"s{i}", 3) for i in range(16)] == ["COMMITTED"] * 16
    assert again.outcome("s0", 4) == "ABORTED"
    # presumed abort: commits are logged before any rank learns of them, so one not logged never happened
    assert again.outcome("s1", 4) == "ABORTED" and again.outcome("new", 1) == "ABORTED"
    assert again.outcome("s1", 2) is None  # older than the newest commit: no longer kept, never guessed


def test_a_decision_line_is_the_json_of_its_record_whatever_the_session_id(tmp_path: Path) -> None:
    ids = ["plain", 'quo"te', "back\\slash", "new\nline", "ünïcode", "tab\t", "{\"epoch\": 9}"]
    for sid in ids:
        assert state_module._line(sid, 7, "COMMITTED") == json.dumps(
            {"session_id": sid, "epoch": 7, "outcome": "COMMITTED"}) + "\n"
    state = DurableState(tmp_path)
    state.record(*(Decision(sid, 7, "COMMITTED") for sid in ids))
    state.close()
    again = DurableState(tmp_path)
    assert [again.outcome(sid, 7) for sid in ids] == ["COMMITTED"] * len(ids)
    assert again.log_lines == len(ids)


def test_a_torn_last_line_loses_only_itself_and_incarnations_only_grow(tmp_path: Path) -> None:
    state = DurableState(tmp_path)
    assert [state.next_incarnation(), state.next_incarnation()] == [1, 2]
    state.record(Decision("a", 1, "COMMITTED"))
    state.close()
    with open(tmp_path / "decisions.jsonl", "a") as f:
        f.write('{"session_id": "b", "ep')  # a crash mid-write
    again = DurableState(tmp_path)
    assert again.outcome("a", 1) == "COMMITTED" and again.outcome("b", 1) == "ABORTED"
    assert again.next_incarnation() == 3
    again.record(Decision("c", 1, "COMMITTED"))  # appended after the torn line was cut away, so readable
    again.close()
    assert DurableState(tmp_path).outcome("c", 1) == "COMMITTED"


def test_a_long_run_keeps_the_log_a_few_lines_per_live_session(tmp_path: Path) -> None:
    """64 sessions at a time, 16 rows a step, 40,000 decisions; sessions end (released everywhere, forgotten) and
    new ones start all along, and the roster is rebuilt twice: the file never holds more than the compaction
    threshold plus one step (it grew 88 bytes a token before), and what it holds still answers every resolution a
    live session can ask for (its newest epoch: committed, or not)."""
    state = DurableState(tmp_path, fsync_decisions=False)  # the same writes, without 2,500 fsyncs
    live = {f"s{i}": 0 for i in range(64)}  # session -> its newest committed epoch
    born, largest = 64, 0
    for step in range(2500):
        rows = sorted(live)[step % 4 * 16:(step % 4 + 1) * 16]
        for sid in rows:
            live[sid] += 1
        state.record(*(Decision(sid, live[sid], "COMMITTED") for sid in rows))
        if step % 7 == 0:  # a session finishes: released on every rank, then forgotten
            ended = sorted(live)[step % 64]
            del live[ended]
            state.forget(ended)
            live[f"s{born}"], born = 0, born + 1
        if step in (900, 1800):
            state.retire()  # a new install: every rank dropped every session
            live = dict.fromkeys(live, 0)  # and each starts its epochs' commits anew on the new roster
        largest = max(largest, state.log_lines)
    assert largest <= COMPACT_MIN_LINES + 16
    size = (tmp_path / "decisions.jsonl").stat().st_size
    assert size < (COMPACT_MIN_LINES + 16) * 80, f"{size} bytes after 40,000 decisions"
    state.close()
    again = DurableState(tmp_path)
    assert again.log_lines <= COMPACT_MIN_LINES + 16
    committed = {sid: epoch for sid, epoch in live.items() if epoch}
    assert len(committed) > 32
    assert all(again.outcome(sid, epoch) == "COMMITTED" for sid, epoch in committed.items())
    assert all(again.outcome(sid, epoch + 1) == "ABORTED" for sid, epoch in live.items())


def test_a_crash_mid_compaction_leaves_a_readable_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = DurableState(tmp_path)
    state.record(*(Decision(f"s{i}", 1, "COMMITTED") for i in range(8)))
    state.record(Decision("s0", 2, "COMMITTED"))

    def crash(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        state.retire()  # the compacted file is written but never renamed over the log
    monkeypatch.undo()
    assert (tmp_path / "decisions.jsonl.compact").exists()
    again = DurableState(tmp_path)  # the old log, whole: the half-finished compaction is ignored
    assert again.outcome("s0", 2) == "COMMITTED" and again.outcome("s7", 1) == "COMMITTED"
    again.record(Decision("s1", 2, "COMMITTED"))
    for i in range(COMPACT_MIN_LINES):  # past the threshold: compacted for real, over the leftover file
        again.record(Decision(f"s{i % 8}", 3 + i // 8, "COMMITTED"))
    assert again.log_lines < 64
    again.close()
    last = DurableState(tmp_path)
    assert [last.outcome(f"s{i}", 2 + COMPACT_MIN_LINES // 8) for i in range(8)] == ["COMMITTED"] * 8


def test_a_log_written_before_it_was_bounded_is_compacted_at_start(tmp_path: Path) -> None:
    state = DurableState(tmp_path, fsync_decisions=False)
    for epoch in range(1, 2 * COMPACT_MIN_LINES):
        state._log.write(state_module._line("old", epoch, "COMMITTED"))  # as the unbounded log grew, line by line
    state.close()
    again = DurableState(tmp_path)
    assert again.log_lines == 1 and again.outcome("old", 2 * COMPACT_MIN_LINES - 1) == "COMMITTED"


def test_the_default_state_dir_is_per_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "graphmesh" / "coordinator"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/dir")  # the spec says to ignore a relative path
    assert default_state_dir() == Path.home() / ".local" / "state" / "graphmesh" / "coordinator"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_state_dir() == Path.home() / ".local" / "state" / "graphmesh" / "coordinator"
