"""Coordinator failover and executor join on the SmolLM2 mesh: two coordinators elected through etcd, executors that
register themselves there, a KV store; 4 sessions stream through clients given both coordinators' addresses.

Failover time is what a client sees: the largest inter-token gap of a stream after the kill minus the stream's
median gap before it, the largest over the 4 streams; the time from the kill to each stream's next token is
reported beside it. It is bounded below by the lease TTL (--lease-ttl, the coordinators' default 2 s): the standby
may take over only once etcd expired the dead leader's lease. Every resumed stream must equal a fault-free run
token for token (seeded sampling). Each of --faults kills runs on a fresh cluster. Goal (issue 15): <= 3 s.

Join: while the sessions stream, a third executor is started with --etcd; the leader takes it in (a re-plan over 3
ranks). Executors read the model before they register (--preload-model). Reported: from its registration in etcd,
and from starting its process (Python, torch and the weights: the platform's start-up, here on the same 2 cores the
mesh computes on), to the first token of any stream served by the new plan; and the largest extra inter-token gap
the re-plan cost a stream. Goal (issue 15): <= 5 s from the registration.

Prints a table and writes bench/results/failover.json.

    .venv/bin/python bench/bench_failover.py [--faults 3] [--joins 3] [--before 8] [--after 24] [--lease-ttl 2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` and `tests` importable

from bench.common import free_address, machine, median, progress, table, write_results
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import wait_healthy
from graphmesh.tokenizer import Tokenizer
from graphmesh_server import faults
from graphmesh_server.etcd import EtcdClient
from graphmesh_server.membership import registered
from tests.etcd_fixtures import EtcdCluster

MODEL = "smollm2-135m"
EXECUTORS = 2
SESSIONS = 4
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."
GOAL_MS = 3000.0
JOIN_GOAL_MS = 5000.0
CLUSTER = "bench"


class Cluster:
    """etcd (one member), a KV store, EXECUTORS torch executors registered in etcd and two coordinators of one
    election, as real processes."""

    def __init__(self, root: Path, lease_ttl: float) -> None:
        self.root = root
        self.processes: list[subprocess.Popen[bytes]] = []
        self.etcd = EtcdCluster(root / "etcd", 1)
        (root / "etcd").mkdir(parents=True)
        self.etcd.start()
        self.kvstore = free_address()
        wait_healthy(self.kvstore, self._spawn("kvstore", ["graphmesh_kvstore.server", "--listen", self.kvstore]),
                     60.0, "kvstore")
        self.executors: list[str] = []
        for _ in range(EXECUTORS):
            self.start_executor()
        for i, address in enumerate(self.executors):
            wait_healthy(address, None, 300.0, f"executor {i}")
        self.coordinators = [free_address() for _ in range(2)]
        self.coordinator_processes: list[subprocess.Popen[bytes]] = []
        for i, address in enumerate(self.coordinators):
            self.coordinator_processes.append(self._spawn(f"coordinator-{i}", [
                "graphmesh_coordinator.server", "--listen", address, "--min-executors", str(EXECUTORS),
                "--model", MODEL, "--state-dir", str(root / f"state-{i}"), "--etcd", ",".join(self.etcd.urls),
                "--cluster-name", CLUSTER, "--lease-ttl", str(lease_ttl), "--kvstore", self.kvstore]))
            if i == 0:  # the first leads: the test knows which one to kill
                wait_healthy(address, self.coordinator_processes[0], 300.0, "coordinator 0")

    def start_executor(self) -> subprocess.Popen[bytes]:
        """An executor that reads the model, then registers itself in etcd (the leader plans it in); threads: the
        machine's cores over the mesh's first EXECUTORS."""
        threads = max(1, (os.cpu_count() or 2) // EXECUTORS)
        address = free_address()
        self.executors.append(address)
        return self._spawn(f"executor-{len(self.executors) - 1}", [
            "graphmesh_executor.server", "--listen", address, "--backend", "torch", "--threads", str(threads),
            "--etcd", ",".join(self.etcd.urls), "--cluster-name", CLUSTER, "--preload-model", MODEL],
            {"OMP_NUM_THREADS": str(threads)})

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.root / f"{name}.log", "wb") as log:
            process = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})})
        self.processes.append(process)
        return process

    def close(self) -> None:
        for p in self.processes:  # killed: a stopping executor would drain for a coordinator that is gone too
            if p.poll() is None:
                p.kill()
                p.wait()
        self.etcd.stop()


def run(addresses: list[str], prompt: list[int], tokens: int, after: int = 0,
        action: Callable[[], None] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """The streams' tokens and arrival times (perf_counter); `action` runs once every stream has `after` tokens."""
    arrivals: list[list[float]] = [[] for _ in range(SESSIONS)]

    def one(i: int) -> list[int]:
        out: list[int] = []
        with CoordinatorClient(addresses) as client:
            for chunk in client.generate(prompt_token_ids=prompt, max_tokens=tokens, temperature=0.8, top_k=40,
                                         seed=100 + i, ignore_eos=True):
                out += chunk.token_ids
                arrivals[i].append(time.perf_counter())
        return out

    def trigger() -> None:
        while min(len(a) for a in arrivals) < after:
            time.sleep(0.005)
        assert action is not None
        action()

    if action is not None:
        threading.Thread(target=trigger, daemon=True).start()
    with ThreadPoolExecutor(SESSIONS) as pool:
        results = list(pool.map(one, range(SESSIONS)))
    return results, arrivals


def extra_gap_ms(arrivals: list[list[float]], since: float) -> float:
    """The largest inter-token gap of any stream from `since` on, less that stream's median gap before it (ms)."""
    extra = 0.0
    for times in arrivals:
        before = [b - a for a, b in itertools.pairwise(times) if b < since]
        after = [b - a for a, b in itertools.pairwise(times) if b >= since]
        if after and before:
            extra = max(extra, max(after) - median(before))
    return extra * 1e3


def first_token_after(arrivals: list[list[float]], since: float) -> float:
    """How long after `since` the first token of any stream arrived (ms; inf when none did)."""
    return (min((t for times in arrivals for t in times if t >= since), default=float("inf")) - since) * 1e3


def failover(cluster: Cluster, prompt: list[int], tokens: int, before: int) -> tuple[list[list[int]], dict[str, float]]:
    killed = [0.0]

    def kill() -> None:
        killed[0] = time.perf_counter()
        faults.kill9(cluster.coordinator_processes[0])

    results, arrivals = run(cluster.coordinators, prompt, tokens, before, kill)
    next_token = max((next(t for t in times if t >= killed[0]) - killed[0]) * 1e3 for times in arrivals)
    return results, {"failover_ms": extra_gap_ms(arrivals, killed[0]), "next_token_ms": next_token}


def join(cluster: Cluster, prompt: list[int], tokens: int, before: int) -> tuple[list[list[int]], dict[str, float]]:
    """Starts a third executor while the sessions stream; times its way into the plan."""
    marks: dict[str, float] = {}
    etcd = EtcdClient(cluster.etcd.urls)

    def start() -> None:
        marks["started"] = time.perf_counter()
        cluster.start_executor()
        address = cluster.executors[-1]
        with CoordinatorClient(cluster.coordinators[0]) as client:
            while "planned" not in marks and time.perf_counter() - marks["started"] < 120:
                if "registered" not in marks and address in [m.address for m in registered(etcd, CLUSTER)]:
                    marks["registered"] = time.perf_counter()
                status = client.status()
                if status.ready and address in [stage.address for stage in status.stages]:
                    marks["planned"] = time.perf_counter()
                time.sleep(0.02)

    results, arrivals = run(cluster.coordinators, prompt, tokens, before, start)
    if "planned" not in marks:
        raise RuntimeError("the new executor was never planned in (or after every stream ended)")
    served = marks["planned"] + first_token_after(arrivals, marks["planned"]) / 1e3
    return results, {"join_ms": (served - marks.get("registered", marks["planned"])) * 1e3,
                     "process_start_to_token_ms": (served - marks["started"]) * 1e3,
                     "extra_gap_ms": extra_gap_ms(arrivals, marks["started"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=3)
    parser.add_argument("--joins", type=int, default=3)
    parser.add_argument("--before", type=int, default=8, help="tokens every stream has before the kill or the join")
    parser.add_argument("--after", type=int, default=24, help="tokens after the kill")
    parser.add_argument("--join-after", type=int, default=96, help="tokens after a join starts (they must outlast it)")
    parser.add_argument("--lease-ttl", type=float, default=2.0)
    args = parser.parse_args()
    load = os.getloadavg()
    ckpt = open_checkpoint(resolve_model(MODEL))
    prompt = Tokenizer.from_checkpoint(ckpt).encode_chat([{"role": "user", "content": QUESTION}])
    references: dict[int, list[list[int]]] = {}
    cases = [("leader kill -9", failover, args.after)] * args.faults + [("executor join", join, args.join_after)] * args.joins
    runs: list[dict[str, Any]] = []
    rows: list[list[Any]] = []
    for n, (name, case, after) in enumerate(cases):
        tokens = args.before + after
        with tempfile.TemporaryDirectory(prefix="graphmesh-failover-") as tmp:
            cluster = Cluster(Path(tmp), args.lease_ttl)
            try:
                if tokens not in references:
                    references[tokens] = run(cluster.coordinators, prompt, tokens)[0]
                results, figures = case(cluster, prompt, tokens, args.before)
            finally:
                cluster.close()
        identical = results == references[tokens]
        progress(f"{name} {n + 1}/{len(cases)}: " + ", ".join(f"{k} {v:.0f}" for k, v in figures.items())
                 + f", identical {identical}")
        runs.append({"case": name, **figures, "identical": identical})
        main_ms = figures.get("failover_ms", figures.get("join_ms", 0.0))
        detail = figures.get("next_token_ms", figures.get("process_start_to_token_ms", 0.0))
        rows.append([name, main_ms, detail, figures.get("extra_gap_ms", main_ms), "yes" if identical else "NO"])
    print(table(["case", "failover / join ms", "kill -> next token / process start -> token ms", "extra gap ms",
                 "token-identical"], rows))
    summary = {}
    for name, key, goal in (("leader kill -9", "failover_ms", GOAL_MS), ("executor join", "join_ms", JOIN_GOAL_MS)):
        measured = [float(r[key]) for r in runs if r["case"] == name]
        if measured:
            summary[name] = {"worst_ms": max(measured), "median_ms": median(measured), "goal_ms": goal,
                             "goal_met": max(measured) <= goal}
            print(f"{name}: worst {max(measured):.0f} ms, median {median(measured):.0f} ms (goal <= {goal:.0f} ms)")
    write_results("failover.json", {"machine": machine(load, model=MODEL, executors=EXECUTORS, sessions=SESSIONS,
                                                       lease_ttl_s=args.lease_ttl, kvstore=True),
                                    "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
