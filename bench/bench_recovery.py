"""Recovery time of the SmolLM2 mesh when one of its 3 torch executors is killed (kill -9) or frozen (SIGSTOP),
with and without the KV store, while 4 sessions generate.

Recovery time is what a client sees: the largest inter-token gap after the fault minus the normal inter-token
time (the median gap before it), taken over the 4 streams; the time from the fault to each stream's next token
is reported beside it. Each case is faulted `--faults` times, each on a fresh mesh (LocalMesh with fault
injection and the loopback proxies), the cases interleaved so that load from other processes hits all alike.
The first mesh also generates once without a fault: every faulted stream must equal it token for token (seeded
sampling), which shows that no token was lost, duplicated or changed. The coordinator's and executors' logs
split each recovery into detection, fencing, the re-install (of which the executors' weight loads) and the
restore and replay. Prints tables and writes bench/results/recovery.json.

Executors run with their default standby weights (the whole model held, so a re-plan reads no checkpoint);
"+cold" turns them off. The coordinator's health window is --health-window (0.5 s here; the coordinator's own
default is 1 s): it bounds how soon a frozen executor is found lost. Goals (issue 14): kill -9 <= 1.0 s and
SIGSTOP <= 1.5 s.

    .venv/bin/python bench/bench_recovery.py [--faults 3] [--before 8] [--after 24] [--victim 1]
        [--cases kill,kill+kv,stop,stop+kv,kill+kv+cold] [--health-window 0.5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import machine, median, progress, table, write_results
from graphmesh import security
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.kvstore_client import KvStoreClient
from graphmesh.launcher import LocalMesh
from graphmesh.tokenizer import Tokenizer
from graphmesh.v1 import kvstore_pb2
from graphmesh_server import faults

MODEL = "smollm2-135m"
EXECUTORS = 3
SESSIONS = 4
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."
GOAL_MS = {"kill -9": 1000.0, "SIGSTOP": 1500.0}


@dataclass(frozen=True)
class Case:
    fault: str  # "kill -9" or "SIGSTOP"
    kvstore: bool  # restore sessions from the KV store (else by recomputing their tokens)
    standby: bool = True  # executors hold the whole model's weights (their default): no checkpoint read on a re-plan

    @classmethod
    def parse(cls, text: str) -> Case:
        """"kill", "stop", with "+kv" and/or "+cold" (--standby-weights off)."""
        fault, *flags = text.split("+")
        if fault not in ("kill", "stop") or not set(flags) <= {"kv", "cold"}:
            raise ValueError(f"bad case {text!r}: kill or stop, then +kv and/or +cold")
        return cls("kill -9" if fault == "kill" else "SIGSTOP", "kv" in flags, "cold" not in flags)

    @property
    def name(self) -> str:
        return f"{self.fault}, {'with' if self.kvstore else 'without'} kvstore{'' if self.standby else ', no standby weights'}"

    @property
    def slug(self) -> str:
        return f"{self.fault.replace(' ', '')}{'-kv' if self.kvstore else ''}{'' if self.standby else '-cold'}"

    @property
    def goal_ms(self) -> float:
        return GOAL_MS[self.fault]


@dataclass
class Streams:
    """Token arrivals (perf_counter seconds) and token ids of the concurrent sessions."""

    arrivals: list[list[float]] = field(default_factory=lambda: [[] for _ in range(SESSIONS)])
    tokens: list[list[int]] = field(default_factory=lambda: [[] for _ in range(SESSIONS)])


def generate(mesh: LocalMesh, prompt: list[int], tokens: int, streams: Streams) -> None:
    def one(i: int) -> None:
        with CoordinatorClient(mesh.coordinator_address) as client:
            for chunk in client.generate(prompt_token_ids=prompt, max_tokens=tokens, temperature=0.8, top_k=40,
                                         seed=i, ignore_eos=True):
                streams.arrivals[i].append(time.perf_counter())
                streams.tokens[i] += chunk.token_ids

    with ThreadPoolExecutor(SESSIONS) as pool:
        list(pool.map(one, range(SESSIONS)))


def log_lines(path: Path, since: float) -> list[dict[str, Any]]:
    """The JSON log records of a service written at or after wall time `since`."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("ts", 0) >= since - 0.002:  # log stamps are rounded to ms
            out.append(record)
    return out


def first(records: list[dict[str, Any]], msg: str) -> dict[str, Any] | None:
    return next((r for r in records if r.get("msg") == msg), None)


def timeline(log_dir: Path, wall_fault: float, resumed_wall: float) -> dict[str, float]:
    """Where the recovery went, in ms from the fault, from the coordinator's and executors' logs."""
    coordinator = log_lines(log_dir / "coordinator.log", wall_fault)
    out: dict[str, float] = {}
    lost, fencing = first(coordinator, "executor lost"), first(coordinator, "fencing")
    installing, installed = first(coordinator, "installing"), first(coordinator, "installed")
    recovered = first(coordinator, "recovered")
    detected = min((r["ts"] for r in (lost, fencing) if r is not None), default=None)
    if detected is not None:
        out["detected_ms"] = (detected - wall_fault) * 1e3
    if recovered is not None:
        out["recovered_ms_logged"] = float(recovered["ms"])  # fence -> installed, as the coordinator counts it
        out["recovered_at_ms"] = (recovered["ts"] - wall_fault) * 1e3
    if installing is not None and installed is not None:
        out["install_ms"] = float(installed["ms"])
        loads = []
        for path in sorted(log_dir.glob("executor-*.log")):
            loaded = first(log_lines(path, installing["ts"]), "params loaded")
            if loaded is not None:
                loads.append(float(loaded["ms"]))
        if loads:
            out["weight_load_ms_max"] = max(loads)
            out["install_without_weight_load_ms"] = out["install_ms"] - max(loads)
    if recovered is not None:
        out["restore_and_replay_ms"] = (resumed_wall - recovered["ts"]) * 1e3
    return out


def faulted_run(case: Case, prompt: list[int], a: argparse.Namespace, log_dir: Path,
                baseline: list[list[int]] | None) -> tuple[dict[str, Any], list[list[int]]]:
    """One fresh mesh, one fault; returns the measurements and (on the first mesh) the fault-free tokens."""
    with LocalMesh(EXECUTORS, "torch", MODEL, kvstore=case.kvstore, fault_injection=True, proxied=True,
                   standby_weights=case.standby, log_dir=str(log_dir),
                   extra_coordinator_args=["--health-window", str(a.health_window)]) as mesh:
        if baseline is None:
            clean = Streams()
            generate(mesh, prompt, a.before + a.after, clean)
            baseline = clean.tokens
        victim = mesh.executor_processes[a.victim]
        store = KvStoreClient(mesh.kvstore_address, metadata=security.mesh_metadata(mesh.mesh_token)) if case.kvstore else None
        streams = Streams()
        fired: dict[str, float] = {}
        stats: dict[str, kvstore_pb2.StatsResponse] = {}

        def trigger() -> None:
            while min(len(s) for s in streams.arrivals) < a.before:
                time.sleep(0.002)
            if store:
                stats["at_fault"] = store.stats()  # what the recovery's restores then hit is counted from here
            fired["perf"], fired["wall"] = time.perf_counter(), time.time()
            if case.fault == "kill -9":
                faults.kill9(victim)
            else:
                faults.freeze(victim)

        threading.Thread(target=trigger, daemon=True).start()
        try:
            generate(mesh, prompt, a.before + a.after, streams)
        finally:
            if case.fault == "SIGSTOP":
                faults.thaw(victim)
        if store:
            stats["end"] = store.stats()
            store.close()
    if "perf" not in fired:
        raise RuntimeError("the sessions ended before the fault fired: raise --after")

    t_fault = fired["perf"]
    gaps = [list(itertools.pairwise(s)) for s in streams.arrivals]
    normal = median([end - start for pairs in gaps for start, end in pairs if end < t_fault])
    # each stream's largest gap after the fault: the worst one is the recovery a client saw
    worst_gap, resumed = max(max(((end - start, end) for start, end in pairs if end >= t_fault), default=(0.0, t_fault))
                             for pairs in gaps)
    next_token = [min(t for t in s if t >= t_fault) - t_fault for s in streams.arrivals]
    result: dict[str, Any] = {
        "fault": case.fault, "kvstore": case.kvstore, "standby_weights": case.standby, "victim_rank": a.victim,
        "normal_gap_ms": normal * 1e3, "largest_gap_ms": worst_gap * 1e3, "recovery_ms": (worst_gap - normal) * 1e3,
        "fault_to_next_token_ms": [t * 1e3 for t in next_token],
        "tokens_per_session": [len(t) for t in streams.tokens],
        "identical_to_fault_free": streams.tokens == baseline,
        "timeline_ms": timeline(log_dir, fired["wall"], fired["wall"] + resumed - t_fault), "log_dir": str(log_dir)}
    if stats:
        result["kvstore_after_fault"] = {"lookups": stats["end"].lookups - stats["at_fault"].lookups,
                                         "hit_tokens": stats["end"].hit_tokens - stats["at_fault"].hit_tokens,
                                         "miss_tokens": stats["end"].miss_tokens - stats["at_fault"].miss_tokens}
    return result, baseline


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=3, help="faults per case (median), each on a fresh mesh")
    p.add_argument("--before", type=int, default=8, help="tokens every session streams before the fault")
    p.add_argument("--after", type=int, default=24, help="tokens per session after that (they outlast the recovery)")
    p.add_argument("--victim", type=int, default=1, help="rank of the executor faulted (0..2)")
    p.add_argument("--cases", default="kill,kill+kv,stop,stop+kv,kill+kv+cold",
                   help="kill or stop, each with +kv (restore from the KV store) and/or +cold (--standby-weights off)")
    p.add_argument("--health-window", type=float, default=0.5,
                   help="the coordinator's --health-window, seconds (its default is 1.0)")
    a = p.parse_args(argv)
    cases = [Case.parse(c) for c in a.cases.split(",")]
    load = os.getloadavg()
    path = resolve_model(MODEL)
    tokenizer = Tokenizer.from_checkpoint(open_checkpoint(path))
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))
    progress(f"{len(cases)} cases x {a.faults} faults of executor rank {a.victim} of {EXECUTORS}, {SESSIONS} sessions of "
             f"{a.before}+{a.after} tokens (seeded sampling); a fresh mesh per fault; load average {load}")
    logs = Path(tempfile.mkdtemp(prefix="graphmesh-bench-recovery-"))
    results: dict[Case, list[dict[str, Any]]] = {case: [] for case in cases}
    baseline: list[list[int]] | None = None
    for i in range(a.faults):
        for case in cases:
            t0 = time.perf_counter()
            result, baseline = faulted_run(case, prompt, a, logs / f"{i}-{case.slug}", baseline)
            results[case].append(result)
            t = result["timeline_ms"]
            progress(f"fault {i + 1}/{a.faults}  {case.name:<44} recovery {result['recovery_ms']:7.0f} ms   "
                     f"(detected {t.get('detected_ms', float('nan')):5.0f} ms, install {t.get('install_ms', float('nan')):6.0f}"
                     f" ms, weights {t.get('weight_load_ms_max', float('nan')):6.0f} ms)   identical "
                     f"{result['identical_to_fault_free']}   [{time.perf_counter() - t0:.0f} s]")
    report(a, load, prompt, results, logs)


def report(a: argparse.Namespace, load: tuple[float, float, float], prompt: list[int],
           results: dict[Case, list[dict[str, Any]]], logs: Path) -> None:
    rows: list[list[Any]] = []
    phase_rows: list[list[Any]] = []
    cases: dict[str, Any] = {}
    nan = float("nan")
    for case, rs in results.items():
        name = case.name
        recovery = median([r["recovery_ms"] for r in rs])
        next_token = median([max(r["fault_to_next_token_ms"]) for r in rs])

        def phase(key: str, runs: list[dict[str, Any]] = rs) -> float:
            values = [r["timeline_ms"][key] for r in runs if key in r["timeline_ms"]]
            return median(values) if values else nan

        same = all(r["identical_to_fault_free"] for r in rs)
        hits = median([float(r["kvstore_after_fault"]["hit_tokens"]) for r in rs]) if case.kvstore else nan
        rows.append([name, median([r["normal_gap_ms"] for r in rs]), recovery, next_token,
                     f"{case.goal_ms / 1e3:.1f} s {'met' if recovery <= case.goal_ms else 'MISSED'}",
                     "yes" if same else "NO", hits])
        phase_rows.append([name, phase("detected_ms"), phase("recovered_ms_logged"), phase("install_ms"),
                           phase("weight_load_ms_max"), phase("install_without_weight_load_ms"),
                           phase("restore_and_replay_ms")])
        cases[name] = {"recovery_ms": recovery, "fault_to_last_next_token_ms": next_token,
                       "goal_ms": case.goal_ms, "goal_met": recovery <= case.goal_ms, "identical_to_fault_free": same,
                       "phases_ms": {k: phase(k) for k in ("detected_ms", "recovered_ms_logged", "install_ms",
                                                           "weight_load_ms_max", "install_without_weight_load_ms",
                                                           "restore_and_replay_ms")},
                       "runs": rs}
    print(f"\nrecovery of SmolLM2 over {EXECUTORS} torch executors, {SESSIONS} sessions generating, executor rank "
          f"{a.victim} faulted (median of {a.faults} faults per case; health window {a.health_window} s; load average "
          f"at start {load[0]:.2f} on {os.cpu_count()} cores):")
    print(table(["case", "normal gap ms", "recovery ms", "fault -> last stream's next token ms", "goal",
                 "tokens identical", "KV store hit tokens after the fault"], rows))
    print("\nwhere the recovery goes (ms, medians; detected: fault -> the coordinator's 'executor lost' or 'fencing'; "
          "recovered: the coordinator's fence -> installed; install: Install on the survivors, of which the slowest "
          "executor's weight load ('params loaded') and the rest (checkpoint, graph build, compile); restore + replay: "
          "'recovered' -> the end of the largest gap, when the last stream to resume resumes):")
    print(table(["case", "detected", "recovered", "install", "weight load", "install - load", "restore + replay"],
                phase_rows))
    print(f"\nlogs of every mesh under {logs}")
    write_results("recovery.json", {
        "machine": machine(load, note="the load average is part of the result"),
        "model": MODEL, "backend": "torch", "executors": EXECUTORS, "sessions": SESSIONS, "victim_rank": a.victim,
        "prompt_tokens": len(prompt), "tokens_before_fault": a.before, "tokens_after_fault": a.after,
        "faults_per_case": a.faults, "health_window_s": a.health_window,
        "definition": "recovery = largest inter-token gap after the fault (any stream) - median inter-token gap "
                      "before it", "cases": cases})


if __name__ == "__main__":
    main(sys.argv[1:])
