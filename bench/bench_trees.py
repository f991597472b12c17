"""Two versions of graphmesh against each other, interleaved in one run: a mesh of each source tree up at once
(each mesh's processes import their tree through PYTHONPATH), the same requests to each in turn.

On a small shared machine one stream moves ±15% between back-to-back runs of one code, so two runs of
bench_serving.py cannot rank a change of a few percent; interleaving the two codes in one run can. Make the other
tree with `git worktree add /tmp/base <commit>`. Prints a table, writes bench/results/trees.json (or --output).

    .venv/bin/python bench/bench_trees.py /tmp/base . [--executors 1,2] [--streams 1] [--tokens 256] [--repeats 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import machine, median, progress, table, write_results
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh

PROMPT = list(range(100, 140))
PACKAGES = ("clients/python", "services/common", "services/executor", "services/coordinator", "services/kvstore")


def tree_path(tree: Path) -> str:
    """PYTHONPATH that makes a process import graphmesh from `tree` (ahead of the venv's editable install)."""
    return os.pathsep.join(str(tree / p) for p in PACKAGES)


def commit(tree: Path) -> str:
    """The tree's commit, with -dirty for uncommitted changes."""
    return subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True,
                          text=True).stdout.strip()


def load(client: CoordinatorClient, streams: int, tokens: int, pool: ThreadPoolExecutor) -> float:
    """Aggregate tokens/s of `streams` concurrent greedy streams of `tokens` each."""
    def one(_: int) -> int:
        return sum(len(c.token_ids) for c in client.generate(prompt_token_ids=PROMPT, max_tokens=tokens,
                                                             ignore_eos=True, temperature=0.0))
    t0 = time.perf_counter()
    got = sum(pool.map(one, range(streams)))
    return got / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs=2, type=Path, help="the two source trees (the first is the base)")
    p.add_argument("--executors", default="1,2")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--weights", default="packed")
    p.add_argument("--output", default="trees.json")
    a = p.parse_args(argv)
    load_at_start = os.getloadavg()
    trees = [t.resolve() for t in a.trees]
    meshes: dict[tuple[int, Path], tuple[LocalMesh, CoordinatorClient]] = {}
    pool = ThreadPoolExecutor(a.streams)
    try:
        for n in [int(x) for x in a.executors.split(",")]:
            for tree in trees:
                os.environ["PYTHONPATH"] = tree_path(tree)
                mesh = LocalMesh(n, "torch", "smollm2-135m", weights=a.weights).start()
                meshes[(n, tree)] = (mesh, CoordinatorClient(mesh.coordinator_address, timeout=600))
                progress(f"{n} executor(s) of {tree} ready")
        for _, client in meshes.values():  # warm-up: every shape the runs use
            load(client, a.streams, a.tokens, pool)
        runs: dict[tuple[int, Path], list[float]] = {key: [] for key in meshes}
        for r in range(a.repeats):
            for key, (_, client) in meshes.items():
                runs[key].append(load(client, a.streams, a.tokens, pool))
            progress(f"repeat {r + 1}/{a.repeats}: " + "  ".join(f"{v[-1]:.1f}" for v in runs.values()))
    finally:
        for mesh, client in meshes.values():
            client.close()
            mesh.stop()
    rows = []
    for n in sorted({n for n, _ in runs}):
        base, new = runs[(n, trees[0])], runs[(n, trees[1])]
        faster = sum(b > x for x, b in zip(base, new))
        rows.append([n, median(base), median(new), median(new) / median(base), f"{faster}/{len(base)}"])
    print(f"\n{a.streams} stream(s) of {a.tokens} tokens, {a.weights} weights, median of {a.repeats} interleaved repeats "
          f"(load average at start {load_at_start[0]:.2f}, now {os.getloadavg()[0]:.2f}):")
    print(table(["executors", f"{trees[0].name} tok/s", f"{trees[1].name} tok/s", "ratio", "repeats faster"], rows))
    write_results(a.output, {"benchmark": "trees", "machine": machine(load_at_start),
                             "trees": [{"path": str(t), "commit": commit(t)} for t in trees],
                             "streams": a.streams, "tokens": a.tokens, "weights": a.weights, "repeats": a.repeats,
                             "runs": {f"{n} {t}": v for (n, t), v in runs.items()},
                             "rows": [dict(zip(["executors", "base", "new", "ratio", "faster"], r)) for r in rows]})


if __name__ == "__main__":
    main()
