"""The coordinator's durable state: incarnations never reissued, decisions group-committed and read back."""

from __future__ import annotations

from pathlib import Path

from graphmesh_coordinator.state import Decision, DurableState


def test_a_step_of_decisions_is_one_group_commit_read_back_after_a_restart(tmp_path: Path) -> None:
    state = DurableState(tmp_path)
    state.record(*(Decision(f"s{i}", 3, "COMMITTED") for i in range(16)))
    state.record(Decision("s0", 4, "ABORTED"))
    state.record()  # a step without folded commits writes nothing
    state.close()
    assert len((tmp_path / "decisions.jsonl").read_text().splitlines()) == 17
    again = DurableState(tmp_path)
    assert [again.outcome(f"s{i}", 3) for i in range(16)] == ["COMMITTED"] * 16
    assert again.outcome("s0", 4) == "ABORTED" and again.outcome("s1", 4) is None


def test_a_torn_last_line_loses_only_itself_and_incarnations_only_grow(tmp_path: Path) -> None:
    state = DurableState(tmp_path)
    assert [state.next_incarnation(), state.next_incarnation()] == [1, 2]
    state.record(Decision("a", 1, "COMMITTED"))
    state.close()
    with open(tmp_path / "decisions.jsonl", "a") as f:
        f.write('{"session_id": "b", "ep')  # a crash mid-write
    again = DurableState(tmp_path)
    assert again.outcome("a", 1) == "COMMITTED" and again.outcome("b", 1) is None
    assert again.next_incarnation() == 3
    again.record(Decision("c", 1, "COMMITTED"))  # appended after the torn line was cut away, so readable
    again.close()
    assert DurableState(tmp_path).outcome("c", 1) == "COMMITTED"
