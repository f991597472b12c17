"""What the decision log's group commit saves: fsyncs (and their time) per generated token, one fsync per row as it
was vs one per step (DurableState.record with every row's decision at once), at --rows rows a step.

    .venv/bin/python scripts/decision_log_fsyncs.py            # 16 rows a step, 200 steps, on the repo's disk
    .venv/bin/python scripts/decision_log_fsyncs.py --rows 64

Each row of a decode step commits the previous epoch of its session, i.e. one decision per generated token. The
counts include the compactions that keep the log bounded (2 fsyncs each: the new file and its directory).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from graphmesh_coordinator.state import Decision, DurableState


def run(state_dir: Path, rows: int, steps: int, per_row: bool) -> tuple[float, float, int]:
    """(fsyncs per token, ms of logging per token, bytes on disk at the end) for `steps` steps of `rows` rows."""
    state = DurableState(state_dir)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        decisions = [Decision(f"session-{i:04d}", step, "COMMITTED") for i in range(rows)]
        if per_row:
            for d in decisions:
                state.record(d)
        else:
            state.record(*decisions)
    elapsed = time.perf_counter() - t0
    tokens = rows * steps
    size = (state_dir / "decisions.jsonl").stat().st_size
    state.close()
    return state.fsyncs / tokens, elapsed * 1e3 / tokens, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16, help="rows (sessions) a step")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent / "build"),
                        help="where the logs are written (a real disk: tmpfs fsyncs cost nothing)")
    args = parser.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    print(f"{args.rows} rows a step, {args.steps} steps ({args.rows * args.steps} tokens), logs under {args.dir}")
    print(f"{'':10} {'fsyncs/token':>13} {'ms/token':>9} {'log bytes':>10}")
    results = {}
    for name, per_row in (("per row", True), ("per step", False)):
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="decision-log-") as d:
            results[name] = run(Path(d), args.rows, args.steps, per_row)
        fsyncs, ms, size = results[name]
        print(f"{name:10} {fsyncs:13.4f} {ms:9.3f} {size:10}")
    (row_f, row_ms, _), (step_f, step_ms, _) = results["per row"], results["per step"]
    print(f"group commit: {row_f / step_f:.1f}x fewer fsyncs, {row_ms / step_ms:.1f}x less logging time per token")


if __name__ == "__main__":
    main()
