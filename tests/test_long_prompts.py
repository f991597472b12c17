"""A prompt as long as the context runs as chunks of --max-step-tokens, so no boundary wait has to outlast a whole
prefill: it never fences the mesh (it did: an 8,191-token prompt outlived the 60 s wait, was taken for a lost link
and rebuilt the mesh four times). A client that leaves mid-prefill stops its chunks on every stage."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from graphmesh import channels
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.model_fixtures import VOCAB, make_tiny_llama
from tests.test_metrics import scrape, value

CONTEXT = 8192
CHUNK = 128  # the coordinator's default --max-step-tokens on CPU executors


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    path = make_tiny_llama(tmp_path_factory.mktemp("llama-8k"), max_position=CONTEXT)
    with LocalMesh(2, "numpy", str(path), kvstore=False, metrics=True) as m:
        yield m


def _prompt(n: int) -> list[int]:
    return [3 + (7 * i) % (VOCAB - 3) for i in range(n)]


def _stage_sessions(mesh: LocalMesh) -> list[int]:
    out = []
    for address in mesh.executor_addresses:
        stub = stage_pb2_grpc.StageServiceStub(channels.channel(address, None, mesh_token=mesh.mesh_token))
        out.append(len(stub.Status(stage_pb2.StageServiceStatusRequest(), timeout=5).sessions))
    return out


def test_a_prompt_as_long_as_the_context_runs_without_a_fence(mesh: LocalMesh) -> None:
    with CoordinatorClient(mesh.coordinator_address) as client:
        before = client.status()
        chunks = list(client.generate(prompt_token_ids=_prompt(CONTEXT - 1), max_tokens=1, ignore_eos=True))
        after = client.status()
    assert sum(len(c.token_ids) for c in chunks) == 1
    assert chunks[0].prefill_computed_tokens == CONTEXT - 1
    assert after.incarnation == before.incarnation and after.recoveries == before.recoveries


def test_a_client_that_leaves_mid_prefill_stops_its_chunks_everywhere(mesh: LocalMesh) -> None:
    steps_before = value(scrape(mesh.metrics_ports["coordinator"]), "graphmesh_steps_total")
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(grpc.insecure_channel(mesh.coordinator_address))
    call = stub.Generate(coordinator_pb2.GenerateRequest(prompt_token_ids=_prompt(CONTEXT - 1), max_tokens=4,
                                                         ignore_eos=True))
    deadline = time.monotonic() + 30
    while sum(_stage_sessions(mesh)) < 2:  # its first chunk reached both stages
        assert time.monotonic() < deadline, "the prefill never started"
        time.sleep(0.02)
    call.cancel()
    deadline = time.monotonic() + 30
    while sum(_stage_sessions(mesh)):
        assert time.monotonic() < deadline, f"stages still hold the session: {_stage_sessions(mesh)}"
        time.sleep(0.05)
    # released after a few of its 32 chunks: the rest were never scheduled on any stage
    steps = value(scrape(mesh.metrics_ports["coordinator"]), "graphmesh_steps_total") - steps_before
    assert 1 <= steps < (CONTEXT - 1) // CHUNK
    with CoordinatorClient(mesh.coordinator_address) as client:
        status = client.status()
        assert status.active_sessions == 0
        # the mesh goes on serving, without having fenced anything
        assert len([t for c in client.generate(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True)
                    for t in c.token_ids]) == 3
        assert client.status().recoveries == status.recoveries == 0
