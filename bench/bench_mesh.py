"""SmolLM2-135M-Instruct: time to first token and decode tokens/s of transformers `generate`, one in-process
executor (StageRuntime, the whole model) and the mesh with 1, 2 and 3 torch executors, all in one run; then the
aggregate tokens/s of 1, 4 and 8 concurrent sessions on the 2-executor mesh, and where a mesh token's time goes.

Every engine gets the same chat-templated prompt (token ids), greedy, f32 weights dequantized from the bundled
GGUF, and the machine's cores as compute threads (the in-process engines set torch's threads; LocalMesh splits
the cores between its executors). The in-process executor also runs on 1 thread: a single session's pipeline
computes on one stage at a time. The meshes run without a KV store: repeated prompts would otherwise be seeded
from it and their prefill skipped. Rounds interleave the engines, so load from other processes hits all alike;
the tables show medians over the rounds (on a shared 2-core machine the 2-thread engines suffer most from that
load: a team of 2 threads waits at every barrier for a thread that another process holds).

The profile, in rounds of its own, drives each mesh's executors directly with the stage protocol (the
coordinator's own incarnation and ranks) between generations through the coordinator, and reads each rank's
compute_us: a token's time splits into graph compute, the stage runtime with the protocol RPCs (one single-row
ExecuteStep per rank per token) and boundary pushes, and the coordinator (its scheduler) with the client
stream. It also runs the in-process engine from a worker thread, as an executor's gRPC handler runs it. Prints
tables and writes bench/results/mesh.json.

    .venv/bin/python bench/bench_mesh.py [--tokens 64] [--rounds 3] [--sessions 1,4,8] [--concurrent-tokens 32]
        [--meshes 1,2,3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import cpu_seconds, machine, median, progress, table, write_results
from graphmesh import channels
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import open_checkpoint
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from graphmesh.tokenizer import Tokenizer
from graphmesh.v1 import stage_pb2, stage_pb2_grpc
from graphmesh_coordinator.scheduler import DECODE_STEPS_CPU
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_types import StageSpec, StepRow

MODEL = "smollm2-135m"
QUESTION = "Explain in one paragraph why the sky is blue."
GOAL_MESH_VS_INPROCESS = 0.9
GOAL_CONCURRENCY = 1.6
# Step ids of the profile's directly driven steps: far above the coordinator's own counter (from 1), so that a
# step of ours never shares an id (an executor's boundary mailbox key) with one of the coordinator's.
PROFILE_STEP_IDS = itertools.count(1 << 62)


@dataclass
class Run:
    """One generation: when the request left and when each chunk of its tokens arrived (perf_counter seconds; a
    mesh may stream a decode run's tokens together)."""

    started: float
    arrivals: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    compute_us: list[float] = field(default_factory=list)  # per token, where the engine reports it

    @property
    def ttft_ms(self) -> float:
        return (self.arrivals[0] - self.started) * 1e3

    @property
    def decode_tokens_per_s(self) -> float:
        """From the first token (the prompt's, alone in its chunk) to the last."""
        return (len(self.tokens) - 1) / (self.arrivals[-1] - self.arrivals[0])

    @property
    def ms_per_token(self) -> float:
        return 1e3 / self.decode_tokens_per_s


Engine = Callable[[list[int], int], Run]


# -- the engines --------------------------------------------------------------------------------------------
class _Stamps:
    """A transformers streamer (duck-typed: generate calls put and end) that stamps each new token."""

    def __init__(self, run: Run) -> None:
        self.run, self._prompt_seen = run, False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        self.run.arrivals.append(time.perf_counter())
        self.run.tokens += [int(t) for t in value.reshape(-1).tolist()]

    def end(self) -> None:
        pass


def transformers_engine(path: Path, threads: int) -> Engine:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id  # silence the per-call warning

    def generate(prompt: list[int], tokens: int) -> Run:
        torch.set_num_threads(threads)
        run = Run(time.perf_counter())
        with torch.no_grad():
            model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           streamer=_Stamps(run))
        return run

    return generate


def inprocess_engine(path: Path, threads: int) -> Engine:
    """The whole model as one stage in this process: StageRuntime.execute_step per token, no gRPC."""
    import torch

    torch.set_num_threads(threads)
    config = open_checkpoint(path).config
    assert config is not None
    runtime = StageRuntime("torch")
    runtime.install(1, 0, 1, StageSpec(str(path), 0, config.n_layers, True, True))
    step_ids = itertools.count(1)

    def generate(prompt: list[int], tokens: int) -> Run:
        torch.set_num_threads(threads)
        session = uuid.uuid4().hex
        run = Run(time.perf_counter())
        pending, start = list(prompt), 0
        for epoch in range(1, tokens + 1):
            row = StepRow(session, epoch, epoch - 1, start, pending)
            result = runtime.execute_step(1, next(step_ids), [row], False, 30.0)
            run.arrivals.append(time.perf_counter())
            run.tokens.append(result.tokens[0])
            run.compute_us.append(result.compute_us)
            start += len(pending)
            pending = [result.tokens[0]]
        runtime.release(1, session)
        return run

    return generate


def mesh_engine(mesh: LocalMesh) -> Engine:
    client = CoordinatorClient(mesh.coordinator_address)

    def generate(prompt: list[int], tokens: int) -> Run:
        run = Run(time.perf_counter())
        for chunk in client.generate(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=True):
            run.arrivals.append(time.perf_counter())
            run.tokens += chunk.token_ids
        return run

    return generate


# -- measurements -----------------------------------------------------------------------------------------------
@dataclass
class Concurrent:
    tokens_per_s: float  # every token delivered over the wall time
    cpu_ms_per_token: dict[str, float]  # CPU time of each process of the mesh, and of this client, per token
    cpu_busy: float  # all that CPU time over (wall time x cores)


def concurrent(mesh: LocalMesh, prompt: list[int], sessions: int, tokens: int) -> Concurrent:
    """`sessions` streams started together."""
    engine = mesh_engine(mesh)
    barrier = threading.Barrier(sessions + 1)
    assert mesh.coordinator_process is not None
    pids = {f"executor {i}": p.pid for i, p in enumerate(mesh.executor_processes)}
    pids |= {"coordinator": mesh.coordinator_process.pid, "client (this process)": os.getpid()}

    def one(_: int) -> Run:
        barrier.wait()
        return engine(prompt, tokens)

    with ThreadPoolExecutor(sessions) as pool:
        futures = [pool.submit(one, i) for i in range(sessions)]
        cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        barrier.wait()
        started = time.perf_counter()
        runs = [f.result() for f in futures]
        cpu = {name: cpu_seconds(pid) - cpu[name] for name, pid in pids.items()}
    wall = max(r.arrivals[-1] for r in runs) - started
    total = sum(len(r.tokens) for r in runs)
    return Concurrent(total / wall, {name: s * 1e3 / total for name, s in cpu.items()},
                      sum(cpu.values()) / (wall * (os.cpu_count() or 1)))


@dataclass
class Profile:
    """Per decode token, in seconds: the client's time (a run's decode time over its decode tokens: a mesh streams
    a decode run's tokens in one chunk, so the gaps between chunks are not a token's time), a decode run driven
    directly (every rank's ExecuteStep of one row and the coordinator's run length on CPUs, commit folded in, over
    its tokens), and each rank's graph time (ExecuteStepResponse.compute_us over the run's tokens)."""

    client: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    compute: list[list[float]] = field(default_factory=list)


def profile_round(mesh: LocalMesh, prompt: list[int], tokens: int, out: Profile) -> None:
    """Generates once through the coordinator, then drives the mesh's executors as the coordinator does (under
    its incarnation, with a session of our own)."""
    out.client.append(mesh_engine(mesh)(prompt, tokens).ms_per_token / 1e3)
    with CoordinatorClient(mesh.coordinator_address) as client:
        status = client.status()
    stage_channels = [channels.channel(s.address, None, mesh_token=mesh.mesh_token)  # as the coordinator: a mesh member
                for s in sorted(status.stages, key=lambda s: s.rank)]
    stubs = [stage_pb2_grpc.StageServiceStub(c) for c in stage_channels]
    out.compute = out.compute or [[] for _ in stubs]
    session = f"bench-profile-{uuid.uuid4().hex}"
    pending, start, commit, epoch, made = list(prompt), 0, 0, 0, 0
    while made < tokens:
        steps = 1 if epoch == 0 else min(DECODE_STEPS_CPU, tokens - made)  # the prompt, then decode runs
        epoch += 1
        row = stage_pb2.StepRow(session_id=session, epoch=epoch, commit_epoch=commit, start_position=start,
                                token_ids=pending)
        request = stage_pb2.ExecuteStepRequest(
            incarnation=status.incarnation, step_id=next(PROFILE_STEP_IDS), rows=[row],
            output=stage_pb2.OUTPUT_KIND_TOKEN, boundary_timeout_ms=30_000, decode_steps=steps)
        t0 = time.perf_counter()
        calls = [stub.ExecuteStep.future(request, timeout=60) for stub in reversed(stubs)][::-1]
        replies = [c.result() for c in calls]
        if epoch > 1:  # decode runs only
            out.direct.append((time.perf_counter() - t0) / steps)
            for samples, reply in zip(out.compute, replies):
                samples.append(reply.compute_us / 1e6 / steps)
        sampled = list(replies[-1].rows[0].tokens) or [int(replies[-1].rows[0].token)]
        start, pending, commit, made = start + len(pending) + steps - 1, [sampled[-1]], epoch, made + steps
    header = stage_pb2.FencingHeader(incarnation=status.incarnation, session_id=session)
    for stub in stubs:
        stub.ReleaseSession(stage_pb2.ReleaseSessionRequest(header=header), timeout=30)
    for channel in stage_channels:
        channel.close()


# -- the benchmark ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    p.add_argument("--rounds", type=int, default=3, help="runs of each engine (median), interleaved")
    p.add_argument("--sessions", default="1,4,8", help="concurrent session counts on the 2-executor mesh")
    p.add_argument("--concurrent-tokens", type=int, default=32, help="tokens per session in the concurrency runs")
    p.add_argument("--meshes", default="1,2,3", help="executor counts of the meshes measured")
    a = p.parse_args(argv)
    load = os.getloadavg()
    threads = os.cpu_count() or 1
    sizes = [int(n) for n in a.meshes.split(",")]
    if 2 not in sizes:
        p.error("--meshes must include 2: the goals are about the 2-executor mesh")
    path = resolve_model(MODEL)
    tokenizer = Tokenizer.from_checkpoint(open_checkpoint(path))
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}]))
    progress(f"SmolLM2 {path.name}; prompt of {len(prompt)} tokens, {a.tokens} tokens per run, {a.rounds} rounds; "
             f"{threads} threads; load average {load}")

    meshes: dict[int, LocalMesh] = {}
    try:
        engines: dict[str, Engine] = {}
        engine_threads: dict[str, str] = {}
        progress("loading transformers (GGUF -> f32)")
        engines["transformers generate"], engine_threads["transformers generate"] = \
            transformers_engine(path, threads), str(threads)
        progress("installing the in-process executor")
        engines["in-process executor"], engine_threads["in-process executor"] = inprocess_engine(path, threads), \
            str(threads)
        if threads > 1:  # what one core does: a single session's pipeline runs one stage at a time
            engines["in-process, 1 thread"], engine_threads["in-process, 1 thread"] = inprocess_engine(path, 1), "1"
        for n in sizes:
            t0 = time.perf_counter()
            meshes[n] = LocalMesh(n, "torch", MODEL, kvstore=False).start()
            name = f"mesh, {n} executor{'s' if n > 1 else ''}"
            engines[name] = mesh_engine(meshes[n])
            engine_threads[name] = "+".join([str(max(1, threads // n))] * n)  # LocalMesh's split of the cores
            progress(f"{name} ready in {time.perf_counter() - t0:.0f} s (logs in {meshes[n].log_dir})")

        runs: dict[str, list[Run]] = {name: [] for name in engines}
        for name, engine in engines.items():
            progress(f"warm-up: {name}")
            engine(prompt, a.tokens)  # compiles the buckets this prompt and length use
        for r in range(a.rounds):
            for name, engine in engines.items():
                run = engine(prompt, a.tokens)
                runs[name].append(run)
                progress(f"round {r + 1}/{a.rounds}  {name:<22} TTFT {run.ttft_ms:7.1f} ms   "
                         f"{run.decode_tokens_per_s:6.2f} tokens/s")

        counts = [int(s) for s in a.sessions.split(",")]
        aggregate: dict[int, list[Concurrent]] = {k: [] for k in counts}
        for r in range(a.rounds):
            for k in counts:
                aggregate[k].append(concurrent(meshes[2], prompt, k, a.concurrent_tokens))
                progress(f"round {r + 1}/{a.rounds}  {k} concurrent sessions on 2 executors: "
                         f"{aggregate[k][-1].tokens_per_s:6.2f} tokens/s aggregate, CPU "
                         f"{aggregate[k][-1].cpu_busy:.0%} busy")

        progress("profile: the in-process engines, and each mesh through its client and driven directly, alternating")
        inprocess = [name for name in engines if name.startswith("in-process")]
        # executors run graphs on gRPC handler threads: the same engine on a thread that is not the main one
        worker = ThreadPoolExecutor(1)
        engines["in-process, worker thread"] = lambda ids, n: worker.submit(engines["in-process executor"], ids, n).result()
        inprocess.append("in-process, worker thread")
        profiles: dict[str, Profile] = {name: Profile(compute=[[]]) for name in inprocess}
        profiles |= {f"mesh, {n} executor{'s' if n > 1 else ''}": Profile() for n in sizes}
        for _ in range(a.rounds):
            for name in inprocess:
                run = engines[name](prompt, a.tokens)
                profiles[name].client.append(run.ms_per_token / 1e3)
                profiles[name].compute[0] += [us / 1e6 for us in run.compute_us[1:]]
            for n in sizes:
                profile_round(meshes[n], prompt, a.tokens, profiles[f"mesh, {n} executor{'s' if n > 1 else ''}"])
    finally:
        for mesh in meshes.values():
            mesh.stop()

    report(a, prompt, threads, load, runs, engine_threads, aggregate, profiles)


def report(a: argparse.Namespace, prompt: list[int], threads: int, load: tuple[float, float, float],
           runs: dict[str, list[Run]], engine_threads: dict[str, str], aggregate: dict[int, list[Concurrent]],
           profiles: dict[str, Profile]) -> None:
    reference = runs["transformers generate"][0].tokens
    inprocess = median([r.decode_tokens_per_s for r in runs["in-process executor"]])
    rows: list[list[Any]] = []
    variants: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        rate = median([r.decode_tokens_per_s for r in rs])
        same = all(r.tokens == reference for r in rs)
        variants[name] = {"threads": engine_threads[name], "ttft_ms": median([r.ttft_ms for r in rs]),
                          "decode_tokens_per_s": rate, "ms_per_token": 1e3 / rate, "vs_in_process": rate / inprocess,
                          "same_tokens_as_transformers": same,
                          "runs": [{"ttft_ms": r.ttft_ms, "decode_tokens_per_s": r.decode_tokens_per_s} for r in rs]}
        rows.append([name, engine_threads[name], variants[name]["ttft_ms"], rate, 1e3 / rate, rate / inprocess,
                     "yes" if same else "NO"])
    print(f"\nSmolLM2-135M-Instruct f32, prompt {len(prompt)} tokens, {a.tokens} generated, greedy "
          f"(median of {a.rounds} interleaved rounds; load average at start {load[0]:.2f} on {threads} cores):")
    print(table(["engine", "threads", "TTFT ms", "decode tok/s", "ms/token", "x in-process",
                 "same tokens as transformers"], rows))

    tps = {k: median([c.tokens_per_s for c in v]) for k, v in aggregate.items()}
    one = tps[min(aggregate)]
    names = list(aggregate[min(aggregate)][0].cpu_ms_per_token)
    cpu = {k: {n: median([c.cpu_ms_per_token[n] for c in v]) for n in names} for k, v in aggregate.items()}
    busy = {k: median([c.cpu_busy for c in v]) for k, v in aggregate.items()}
    conc_rows = [[k, tps[k], tps[k] / one, f"{busy[k]:.0%}", *cpu[k].values()] for k in aggregate]
    print(f"\naggregate tokens/s of concurrent sessions on the 2-executor mesh ({a.concurrent_tokens} tokens each, "
          f"prefill included; median of {a.rounds}), the machine's CPU busy with the mesh and its client, and each "
          "process's CPU ms per token:")
    print(table(["sessions", "tokens/s", f"x {min(aggregate)} session", "CPU busy", *names], conc_rows))

    mesh2 = variants["mesh, 2 executors"]["decode_tokens_per_s"] / inprocess
    biggest = max(aggregate)
    scaling = tps[biggest] / one
    goals = {"mesh2_vs_in_process": {"value": mesh2, "goal": GOAL_MESH_VS_INPROCESS, "met": mesh2 >= GOAL_MESH_VS_INPROCESS},
             f"sessions_{biggest}_vs_{min(aggregate)}": {"value": scaling, "goal": GOAL_CONCURRENCY,
                                                          "met": scaling >= GOAL_CONCURRENCY}}
    print("\ngoals:")
    print(f"  2-executor mesh / in-process executor tokens/s = {mesh2:.2f} (goal >= {GOAL_MESH_VS_INPROCESS}): "
          f"{'met' if mesh2 >= GOAL_MESH_VS_INPROCESS else 'MISSED'}")
    if "in-process, 1 thread" in variants:
        one_thread = variants["mesh, 2 executors"]["decode_tokens_per_s"] / variants["in-process, 1 thread"][
            "decode_tokens_per_s"]
        goals["mesh2_vs_in_process_1_thread"] = {"value": one_thread, "goal": None, "met": None}
        print(f"  (against the in-process executor on 1 thread, what one session's pipeline has at any moment: "
              f"{one_thread:.2f})")
    print(f"  {biggest} sessions / {min(aggregate)} session aggregate = {scaling:.2f} (goal >= {GOAL_CONCURRENCY}): "
          f"{'met' if scaling >= GOAL_CONCURRENCY else 'MISSED'}")

    prof_rows: list[list[Any]] = []
    breakdown: dict[str, dict[str, Any]] = {}
    for name, prof in profiles.items():
        client = median(prof.client) * 1e3
        direct = median(prof.direct) * 1e3 if prof.direct else client  # in-process: no protocol around the runtime
        per_rank = [median(c) * 1e3 for c in prof.compute]
        compute = sum(per_rank)
        mesh = name.startswith("mesh")
        prof_rows.append([name, client, compute, direct - compute, client - direct if mesh else float("nan")])
        breakdown[name] = {"ms_per_token": client, "compute_ms_per_rank": per_rank, "direct_ms_per_token": direct,
                           "stage_runtime_and_protocol_ms": direct - compute,
                           "coordinator_and_client_ms": client - direct if mesh else None}
    print("\nwhere a decode token's time goes, in ms (median per token, measured after the table above in rounds of "
          "their own: each engine once, each mesh through the client and then driven directly with the stage "
          "protocol in decode runs as long as the coordinator's; compute: graph runs summed over the ranks, from "
          "compute_us; stage runtime + protocol: a directly driven run minus compute = the runtime's Python, the "
          "ExecuteStep RPCs and the boundary pushes; "
          "coordinator + client: the client's time minus a directly driven run's; 'worker thread': the in-process "
          "engine called from a thread that is not the main one, as an executor's gRPC handler is):")
    print(table(["engine", "ms/token", "compute", "stage runtime + protocol", "coordinator + client"], prof_rows))

    write_results("mesh.json", {
        "machine": machine(load, threads=threads, note="a 2-core machine shared with other helpers' work: the load "
                           "average is part of the result"),
        "model": MODEL, "weights": "f32", "backend": "torch", "kvstore": False, "question": QUESTION,
        "prompt_tokens": len(prompt), "tokens_per_run": a.tokens, "rounds": a.rounds, "variants": variants,
        "concurrency": {"mesh_executors": 2, "tokens_per_session": a.concurrent_tokens,
                        "aggregate_tokens_per_s": {str(k): v for k, v in tps.items()},
                        "cpu_busy": {str(k): v for k, v in busy.items()},
                        "cpu_ms_per_token": {str(k): v for k, v in cpu.items()},
                        "runs": {str(k): [vars(c) for c in v] for k, v in aggregate.items()}},
        "goals": goals, "breakdown": breakdown})


if __name__ == "__main__":
    main(sys.argv[1:])
