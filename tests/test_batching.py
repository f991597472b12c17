"""Continuous batching through the real mesh: SmolLM2-135M-Instruct f32 over 2 torch executors (real processes,
real gRPC), many sessions per step.

Every session's tokens in a busy mesh are exactly its tokens alone: 16 concurrent greedy streams of different
prompts and lengths, seeded sampled streams, a pool too small for all sessions at once (so the scheduler makes
them wait and preempts), decode runs (several tokens a row per step, fed back stage to stage), and a kill -9 of a
stage while 16 sessions generate. A request that could never fit the KV pool is refused at once, and one bad
request among good ones fails alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import InvalidArgument, ResourceExhausted
from graphmesh.launcher import LocalMesh
from graphmesh_server import faults
from tests.test_metrics import scrape, value

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
             "Name three prime numbers.", "Say good morning in Spanish.", "What is 12 times 7?",
             "Describe a cat in one sentence.", "What is the boiling point of water?"]
STREAMS = 16

pytestmark = pytest.mark.slow


def _prompts() -> list[str]:
    """16 chat prompts of different lengths (the coordinator applies the model's chat template)."""
    return [QUESTIONS[i % len(QUESTIONS)] + (" Answer briefly, please." if i >= len(QUESTIONS) else "")
            for i in range(STREAMS)]


def _job(i: int, prompts: list[str], sampled: bool = False) -> dict[str, Any]:
    job: dict[str, Any] = {"prompt": prompts[i], "max_tokens": 12 + (i % 5) * 4, "ignore_eos": True}
    if sampled:
        job.update(temperature=0.8, top_k=40, top_p=0.95, seed=1000 + i)
    return job


def _generate(address: str, job: dict[str, Any], progress: list[int] | None = None, i: int = 0) -> list[int]:
    out: list[int] = []
    with CoordinatorClient(address) as client:
        for chunk in client.generate(**job):
            out += chunk.token_ids
            if progress is not None:
                progress[i] = len(out)
    return out


def _concurrently(address: str, jobs: list[dict[str, Any]], progress: list[int] | None = None) -> list[list[int]]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda ij: _generate(address, ij[1], progress, ij[0]), enumerate(jobs)))


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return _prompts()


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    with LocalMesh(2, "torch", "smollm2-135m", kvstore=False, fault_injection=True) as m:
        yield m


@pytest.fixture(scope="module")
def solo(mesh: LocalMesh, prompts: list[str]) -> dict[str, list[list[int]]]:
    """Each job run alone, one after the other: the reference every batched run must equal."""
    return {kind: [_generate(mesh.coordinator_address, _job(i, prompts, kind == "sampled")) for i in range(STREAMS)]
            for kind in ("greedy", "sampled")}


def _incarnation(mesh: LocalMesh) -> int:
    with CoordinatorClient(mesh.coordinator_address) as client:
        return int(client.status().incarnation)


def test_sixteen_greedy_streams_equal_their_solo_runs(mesh: LocalMesh, prompts: list[str],
                                                      solo: dict[str, list[list[int]]]) -> None:
    got = _concurrently(mesh.coordinator_address, [_job(i, prompts) for i in range(STREAMS)])
    assert got == solo["greedy"]


def test_sixteen_seeded_sampled_streams_equal_their_solo_runs(mesh: LocalMesh, prompts: list[str],
                                                              solo: dict[str, list[list[int]]]) -> None:
    got = _concurrently(mesh.coordinator_address, [_job(i, prompts, sampled=True) for i in range(STREAMS)])
    assert got == solo["sampled"]
    assert got != solo["greedy"]  # the sampling really sampled


def test_each_stream_names_its_session_once(mesh: LocalMesh, prompts: list[str]) -> None:
    with CoordinatorClient(mesh.coordinator_address) as client:
        chunks = list(client.generate(**_job(0, prompts)))
    assert len(chunks[0].session_id) == 32 and not any(c.session_id for c in chunks[1:])


def test_a_bad_request_among_good_ones_fails_alone(mesh: LocalMesh, prompts: list[str],
                                                   solo: dict[str, list[list[int]]]) -> None:
    jobs = [_job(i, prompts) for i in range(4)]
    bad = {"prompt_token_ids": [1, 2, 10**6], "max_tokens": 4}
    errors: list[Exception] = []

    def attack() -> None:
        time.sleep(0.3)
        try:
            _generate(mesh.coordinator_address, bad)
        except InvalidArgument as e:
            errors.append(e)
    thread = threading.Thread(target=attack)
    thread.start()
    got = _concurrently(mesh.coordinator_address, jobs)
    thread.join()
    assert got == solo["greedy"][:4]
    assert len(errors) == 1 and "vocabulary" in str(errors[0])


def test_kill_9_of_a_stage_while_sixteen_sessions_generate(prompts: list[str],
                                                           solo: dict[str, list[list[int]]]) -> None:
    # Decode runs are on (4 tokens a row on CPU executors): the stage killed is the last, the one feeding each
    # run's tokens back to the first. The reference ran on 2 executors.
    jobs = [_job(i, prompts) for i in range(STREAMS)]
    with LocalMesh(3, "torch", "smollm2-135m", kvstore=False, metrics=True) as m:
        progress = [0] * STREAMS
        fired = threading.Event()

        def kill() -> None:
            while min(progress) < 3:
                time.sleep(0.01)
            faults.kill9(m.executor_processes[2])  # the last stage: the one feeding tokens back
            fired.set()
        threading.Thread(target=kill, daemon=True).start()
        before = _incarnation(m)
        got = _concurrently(m.coordinator_address, jobs, progress)
        assert fired.is_set(), "the kill came after generation ended: the test proved nothing"
        assert got == solo["greedy"]  # 16/16 complete, token-identical
        assert _incarnation(m) > before  # the mesh was really rebuilt
        assert value(scrape(m.metrics_ports["coordinator"]), "graphmesh_decode_run_tokens_total") > STREAMS


def test_a_pool_too_small_for_all_sessions_preempts_and_every_session_finishes_unchanged(
        prompts: list[str], solo: dict[str, list[list[int]]]) -> None:
    # 9 blocks of 16 tokens on the first stage (18 layers): two or three sessions at a time, not sixteen.
    with LocalMesh(2, "torch", "smollm2-135m", kvstore=False, extra_executor_args=("--kv-cache-bytes", "4Mi")) as m:
        got = _concurrently(m.coordinator_address, [_job(i, prompts) for i in range(STREAMS)])
        assert got == solo["greedy"]
        with pytest.raises(ResourceExhausted, match="KV blocks"):
            _generate(m.coordinator_address, {"prompt_token_ids": [100] * 200, "max_tokens": 8})
        assert _generate(m.coordinator_address, _job(0, prompts)) == solo["greedy"][0]  # still serving
