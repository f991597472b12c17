"""The partition plan as a DAG (graphmesh.plan): groups, routes with schemas, waves, and an optional encoder root
that only some steps activate; in-process over two stage runtimes and end to end through a real mesh, each kind of
request token-identical to transformers."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from graphmesh import plan as dag
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import InvalidArgument
from graphmesh.launcher import LocalMesh
from graphmesh.protocol import ErrorClass, ProtocolError
from graphmesh_executor.fencing import AuthorityState
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_types import Boundary, StageSpec, StepResult, StepRow
from graphmesh_server import faults
from tests.model_fixtures import add_tiny_encoder, hf_greedy_with_encoder, make_tiny_llama

HIDDEN = 64
TOKEN = 999  # the tiny encoder's placeholder token
PLAIN = [5, 17, 99, 3, 250, 42, 7, 11]
IMAGE = [5, TOKEN, TOKEN, TOKEN, 17, 99, 3, 250, 42]  # three placeholders
_step_ids = itertools.count(1)


def _features(seed: int, n: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 24)).astype(np.float32)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_tiny_encoder(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-encoder"), layers=4))


@pytest.fixture(scope="module")
def plain_reference(model: Path) -> list[int]:
    hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32)
    out = hf.generate(torch.tensor([PLAIN]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    return list(out[0, len(PLAIN):].tolist())


# -- the plan ------------------------------------------------------------------------------------------

def test_a_pipeline_with_an_encoder_is_a_dag_whose_waves_follow_the_activity() -> None:
    plan = dag.pipeline([(0, 2), (2, 4)], ["a", "b"], HIDDEN, encoder_rank=1)
    encoder, first, last = plan.groups
    assert (encoder.kind, encoder.optional, encoder.rank) == (dag.ENCODER, True, 1)
    assert first.depends_on == (0,) and last.depends_on == (1,)
    assert [(r.source_group, r.destination_group, r.feedback) for r in plan.routes] == \
        [(0, 1, False), (1, 2, False), (2, 1, True)]
    assert [(w.ordinal, w.group.id) for w in plan.schedule(set())] == [(0, 1), (1, 2)]  # the encoder idles
    assert [(w.ordinal, w.group.id) for w in plan.schedule({0})] == [(0, 0), (1, 1), (2, 2)]
    assert plan.decoder(1) == last and plan.owned(1) == [encoder, last]


@pytest.mark.parametrize("why,groups,routes", [
    ("cycle", [dag.Group(0, dag.DECODER, 0, 0, 1, depends_on=(1,)), dag.Group(1, dag.DECODER, 0, 1, 2, depends_on=(0,))],
     []),
    ("optional non-root", [dag.Group(0, dag.DECODER, 0, 0, 1), dag.Group(1, dag.ENCODER, 0, optional=True,
                                                                          depends_on=(0,))], []),
    ("unknown owner", [dag.Group(0, dag.DECODER, 5, 0, 1)], []),
    ("route off the edges", [dag.Group(0, dag.DECODER, 0, 0, 1), dag.Group(1, dag.DECODER, 0, 1, 2)],
     [dag.Route(0, 0, 1, 0, 0, dag.activation_schema(HIDDEN))]),
    ("route between other ranks", [dag.Group(0, dag.DECODER, 0, 0, 1), dag.Group(1, dag.DECODER, 0, 1, 2,
                                                                                 depends_on=(0,))],
     [dag.Route(0, 0, 1, 0, 1, dag.activation_schema(HIDDEN))]),
])
def test_a_plan_no_rank_could_run_is_refused(why: str, groups: list[dag.Group], routes: list[dag.Route]) -> None:
    with pytest.raises(InvalidArgument) as e:
        dag.Plan(tuple(groups), tuple(routes), ("a", "b"))
    assert e.value.reason == "BAD_PLAN", why


def test_schemas_resolve_per_invocation_and_check_bundles() -> None:
    schema = dag.activation_schema(HIDDEN)
    dims = {dag.TOKENS: 5, dag.ROWS: 2, dag.ENCODED: 0}
    assert schema.resolve(dims) == {dag.ACTIVATION: ("f32", (5, HIDDEN))}
    assert schema.resolve(dims, iteration=1) == {dag.ACTIVATION: ("f32", (5, HIDDEN)), dag.RUN_TOKENS: ("i64", (2,))}
    good = {dag.ACTIVATION: np.zeros((5, HIDDEN), np.float32)}
    assert schema.check(good, dims) == ""
    assert "schema wants" in schema.check({dag.ACTIVATION: np.zeros((4, HIDDEN), np.float32)}, dims)
    assert "schema wants" in schema.check({dag.ACTIVATION: np.zeros((5, HIDDEN), np.float64)}, dims)
    assert "roles" in schema.check(good, dims, iteration=1)  # a decode run's later iteration carries its tokens
    assert dag.activation_schema(HIDDEN).identity == schema.identity != dag.activation_schema(HIDDEN + 1).identity
    # what a receiver checks before it knows the step: declared roles, dtypes, ranks and fixed sizes
    assert schema.admits({dag.ACTIVATION: np.zeros((3, HIDDEN), np.float32)}) == ""
    assert "no role" in schema.admits({dag.ENCODED_ROWS: np.zeros((3, HIDDEN), np.float32)})
    assert "breaks schema" in schema.admits({dag.ACTIVATION: np.zeros((3, HIDDEN - 1), np.float32)})
    assert "breaks schema" in schema.admits({dag.RUN_TOKENS: np.zeros((3, 1), np.int64)})


def test_the_wire_plan_round_trips_and_a_forged_identity_is_refused() -> None:
    plan = dag.pipeline([(0, 1), (1, 3), (3, 4)], ["a", "b", "c"], HIDDEN, encoder_rank=2)
    wire = dag.to_proto(plan)
    assert dag.from_proto(wire) == plan
    wire.routes[1].schema.identity = "0" * 16
    with pytest.raises(InvalidArgument, match="identity"):
        dag.from_proto(wire)


# -- in process: two ranks, the encoder on the last -------------------------------------------------------

def _ranks(model: Path, plan: dag.Plan) -> list[StageRuntime]:
    runtimes: list[StageRuntime] = []

    def push(address: str, incarnation: int, boundary: Boundary, timeout_s: float,
             delivered: Callable[[Exception | None], None]) -> None:
        runtimes[int(address)].accept_boundary(incarnation, boundary)
        delivered(None)

    runtimes = [StageRuntime("numpy", pusher=push, kv_cache_bytes=1 << 20) for _ in plan.addresses]
    for rank, group in enumerate(plan.decoder(r) for r in range(len(plan.addresses))):
        runtimes[rank].install(1, rank, len(plan.addresses), StageSpec(
            str(model), group.layer_start, group.layer_end, rank == 0, rank == len(plan.addresses) - 1), plan)
    return runtimes


def _step(runtimes: list[StageRuntime], rows: list[StepRow], active: frozenset[int]) -> list[StepResult]:
    step_id = next(_step_ids)
    with ThreadPoolExecutor(len(runtimes)) as pool:
        calls = [pool.submit(r.execute_step, 1, step_id, rows, False, 10.0, 1, active) for r in runtimes]
        return [c.result() for c in calls]


def _generate(runtimes: list[StageRuntime], prompts: dict[str, tuple[list[int], np.ndarray | None]],
              tokens: int, encoder: int = 0) -> tuple[dict[str, list[int]], list[list[StepResult]]]:
    """Greedy decoding of every prompt at once, one row each per step (the prompt first, whole)."""
    out: dict[str, list[int]] = {s: [] for s in prompts}
    pending = {s: list(p) for s, (p, _) in prompts.items()}
    start = dict.fromkeys(prompts, 0)
    replies = []
    for epoch in range(1, tokens + 1):
        rows = []
        for s, (prompt, features) in prompts.items():
            row = StepRow(s, epoch, epoch - 1, start[s], pending[s])
            if epoch == 1 and features is not None:
                row = replace(row, encoder_input=features,
                              encoded_offsets=tuple(i for i, t in enumerate(prompt) if t == TOKEN))
            rows.append(row)
        reply = _step(runtimes, rows, frozenset({encoder}) if any(r.encoded_offsets for r in rows) else frozenset())
        replies.append(reply)
        for s, token in zip(prompts, reply[-1].tokens):
            out[s].append(token)
            start[s] += len(pending[s])
            pending[s] = [token]
    return out, replies


def test_an_encoder_root_activated_by_some_rows_matches_transformers(model: Path, plain_reference: list[int]) -> None:
    plan = dag.pipeline([(0, 2), (2, 4)], ["0", "1"], HIDDEN, encoder_rank=1)
    runtimes = _ranks(model, plan)
    got, replies = _generate(runtimes, {"image-a": (IMAGE, _features(1)), "plain": (PLAIN, None),
                                        "image-b": (IMAGE, _features(2))}, 12)
    assert got["image-a"] == hf_greedy_with_encoder(model, IMAGE, _features(1), 12)
    assert got["image-b"] == hf_greedy_with_encoder(model, IMAGE, _features(2), 12)
    assert got["image-a"] != got["image-b"]  # the features reach the tokens
    assert got["plain"] == plain_reference
    # waves: the prompt step runs the encoder (on rank 1) first; decode steps leave it idle
    assert [r.waves for r in replies[0]] == [[(1, 1, True)], [(0, 0, True), (2, 2, True)]]
    assert [r.waves for r in replies[1]] == [[(0, 1, True)], [(1, 2, True)]]
    for runtime in runtimes:  # a session whose KV depends on features never keys blocks by its tokens
        sessions = dict(runtime.sessions())
        assert sessions["image-a"].untokened and not sessions["plain"].untokened


def test_an_encoder_on_the_first_rank_feeds_it_in_place(model: Path) -> None:
    runtimes = _ranks(model, dag.pipeline([(0, 4)], ["0"], HIDDEN, encoder_rank=0))
    got, _ = _generate(runtimes, {"image": (IMAGE, _features(1))}, 6)
    assert got["image"] == hf_greedy_with_encoder(model, IMAGE, _features(1), 6)


def test_rows_and_activity_that_disagree_are_refused_before_any_row_begins(model: Path) -> None:
    runtimes = _ranks(model, dag.pipeline([(0, 2), (2, 4)], ["0", "1"], HIDDEN, encoder_rank=1))
    row = StepRow("s", 1, 0, 0, IMAGE, encoder_input=_features(1), encoded_offsets=(1, 2, 3))
    cases: list[tuple[list[StepRow], frozenset[int], str]] = [
        ([row], frozenset(), "BAD_ACTIVE_GROUPS"),  # rows bring encoder input, the step does not run it
        ([replace(row, encoder_input=None, encoded_offsets=())], frozenset({0}), "BAD_ACTIVE_GROUPS"),
        ([row], frozenset({2}), "BAD_ACTIVE_GROUPS"),  # not an optional group
        ([replace(row, encoded_offsets=(0, 1, 2))], frozenset({0}), "BAD_ENCODER_INPUT"),  # not on placeholders
        ([replace(row, encoder_input=_features(1, 2))], frozenset({0}), "BAD_ENCODER_INPUT"),
    ]
    for rows, active, reason in cases:
        for runtime in runtimes:
            with pytest.raises(ProtocolError) as e:
                runtime.execute_step(1, next(_step_ids), rows, False, 5.0, 1, active)
            assert (e.value.error_class, e.value.reason) == (ErrorClass.ARCH, reason)
            assert runtime.sessions() == [] and runtime.authority.state is AuthorityState.ACTIVE


def test_a_bundle_from_another_plan_poisons_the_receiver(model: Path) -> None:
    runtimes = _ranks(model, dag.pipeline([(0, 2), (2, 4)], ["0", "1"], HIDDEN))
    other = dag.activation_schema(HIDDEN + 1)
    with pytest.raises(InvalidArgument) as e:
        runtimes[1].accept_boundary(1, Boundary(1, 0, 0, {dag.ACTIVATION: np.zeros((2, HIDDEN), np.float32)},
                                                other.identity))
    assert e.value.metadata["error_class"] == "CONTRACT" and "schema" in e.value.message
    assert runtimes[1].authority.state is AuthorityState.POISONED


def test_with_cross_stage_collective_waves_every_rank_takes_every_wave_and_a_failure_fences(model: Path) -> None:
    base = dag.pipeline([(0, 2), (2, 4)], ["0", "1"], HIDDEN, encoder_rank=1)
    plan = dag.Plan(base.groups, base.routes, base.addresses, cross_stage_collective_waves=True)
    runtimes = _ranks(model, plan)
    _, replies = _generate(runtimes, {"image": (IMAGE, _features(1))}, 2)
    assert [r.waves for r in replies[0]] == [[(0, 0, False), (1, 1, True), (2, 2, False)],
                                             [(0, 0, True), (1, 1, False), (2, 2, True)]]
    runtimes[1].faults_enabled = True
    runtimes[1].inject_fault("device", 1)  # fails a wave on rank 1 after the step began everywhere
    errors: list[ProtocolError] = []

    def run(runtime: StageRuntime) -> None:
        try:
            runtime.execute_step(1, step_id, [StepRow("s", 1, 0, 0, PLAIN)], False, 5.0)
        except ProtocolError as e:
            errors.append(e)
    step_id = next(_step_ids)
    threads = [threading.Thread(target=run, args=(r,)) for r in runtimes]
    for t in threads:
        t.start()
    threads[1].join(10)
    assert errors and errors[0].error_class is ErrorClass.COMM
    assert runtimes[1].authority.state is AuthorityState.POISONED
    runtimes[0].fence(1, "test over", False)
    for t in threads:
        t.join(10)


# -- end to end: a real mesh ------------------------------------------------------------------------

def _stream(address: str, **kwargs: Any) -> list[int]:
    with CoordinatorClient(address) as client:
        return [t for chunk in client.generate(**kwargs) for t in chunk.token_ids]


def test_a_mesh_serves_requests_with_and_without_encoder_input_at_once(model: Path,
                                                                       plain_reference: list[int]) -> None:
    expected = {seed: hf_greedy_with_encoder(model, IMAGE, _features(seed), 12) for seed in (1, 2)}
    with LocalMesh(2, "numpy", str(model), startup_timeout_s=120, kvstore=False) as mesh:
        address = mesh.coordinator_address
        with ThreadPoolExecutor(6) as pool:
            images = {seed: [pool.submit(_stream, address, prompt_token_ids=IMAGE, max_tokens=12, ignore_eos=True,
                                         encoder_input=_features(seed)) for _ in range(2)] for seed in (1, 2)}
            plain = [pool.submit(_stream, address, prompt_token_ids=PLAIN, max_tokens=12, ignore_eos=True)
                     for _ in range(2)]
            for seed, calls in images.items():
                assert [c.result() for c in calls] == [expected[seed]] * 2
            assert [c.result() for c in plain] == [plain_reference] * 2
        for bad, why in ((_features(1, 2), "placeholder"), (np.zeros((3, 5), np.float32), "f32")):
            with pytest.raises(InvalidArgument, match=why):
                _stream(address, prompt_token_ids=IMAGE, max_tokens=2, encoder_input=bad)
        with pytest.raises(InvalidArgument, match="placeholder"):
            _stream(address, prompt_token_ids=PLAIN, max_tokens=2, encoder_input=_features(1, 1))
        assert _stream(address, prompt_token_ids=PLAIN, max_tokens=12, ignore_eos=True) == plain_reference
        with CoordinatorClient(address) as client:  # the plan as every rank has it, for operators to see
            plan = dag.from_proto(client.status().plan)
        assert plan.encoder() == dag.Group(0, dag.ENCODER, 1, optional=True)
        first, last = plan.groups[1:]
        assert (first.rank, first.layer_start, first.layer_end == last.layer_start, last.rank, last.layer_end) == \
            (0, 0, True, 1, 4)
        cli = subprocess.run([sys.executable, "-m", "graphmesh.cli", "status", "--coordinator", address],
                             capture_output=True, text=True, timeout=60)
        assert "rank 1 also runs the encoder (group 0, optional)" in cli.stdout, cli.stdout + cli.stderr


def test_losing_the_encoders_rank_mid_generation_loses_no_token(model: Path) -> None:
    """The encoder lives on the last rank; killing it re-plans the encoder onto the new last rank, and the
    session's restore recomputes its prompt through the encoder again."""
    expected = hf_greedy_with_encoder(model, IMAGE, _features(1), 40)
    with LocalMesh(3, "numpy", str(model), startup_timeout_s=120, kvstore=False) as mesh:
        address = mesh.coordinator_address
        with CoordinatorClient(address) as client:
            got: list[int] = []
            for chunk in client.generate(prompt_token_ids=IMAGE, max_tokens=40, ignore_eos=True,
                                         encoder_input=_features(1)):
                got += chunk.token_ids
                if len(got) >= 8 and mesh.executor_processes[2].poll() is None:
                    faults.kill9(mesh.executor_processes[2])
            status = client.status()
        assert got == expected
        assert status.recoveries >= 1 and len(status.stages) == 2
        encoder = dag.from_proto(status.plan).encoder()  # re-planned onto the last rank of the new roster
        assert encoder is not None and encoder.rank == 1
