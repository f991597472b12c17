"""Prefix caching through the mesh: a new session shares the whole prompt blocks a live session holds on every
stage (the local tier); committed KV is also written behind to the KV store, and a new session seeds its longest
stored prefix on every stage (the second tier), computing only the rest (counted by the executors)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from graphmesh import security
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.kvstore_client import KvStoreClient
from graphmesh.launcher import LocalMesh
from tests.model_fixtures import make_tiny_llama

SYSTEM = list(range(100, 148))  # three whole 16-token blocks shared by every prompt


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    path = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    with LocalMesh(2, "numpy", str(path)) as m:
        yield m


def _generate(mesh: LocalMesh, prompt: list[int]) -> tuple[list[int], int]:
    with CoordinatorClient(mesh.coordinator_address) as client:
        chunks = list(client.generate(prompt_token_ids=prompt, max_tokens=12, ignore_eos=True))
    return [t for c in chunks for t in c.token_ids], chunks[0].prefill_computed_tokens


def _wait_for_blocks(mesh: LocalMesh, blocks: int) -> None:
    with KvStoreClient(mesh.kvstore_address, metadata=security.mesh_metadata(mesh.mesh_token)) as kv:
        deadline = time.monotonic() + 30
        while kv.stats().blocks < blocks:
            assert time.monotonic() < deadline, "the write-behind never reached the store"
            time.sleep(0.05)


def test_the_same_prompt_twice_computes_only_the_suffix(mesh: LocalMesh) -> None:
    prompt = [*SYSTEM, 7, 8, 9]
    first, computed = _generate(mesh, prompt)
    assert computed == len(prompt)
    _wait_for_blocks(mesh, 3 * 2)  # 3 blocks on each of the 2 stages
    second, computed = _generate(mesh, prompt)
    assert second == first
    assert computed == len(prompt) - 48


def test_a_shared_system_prompt_hits_only_the_shared_blocks(mesh: LocalMesh) -> None:
    _generate(mesh, [*SYSTEM, 1, 2, 3])
    _wait_for_blocks(mesh, 6)
    other = [*SYSTEM[:40], 999, *SYSTEM[41:], 4, 5]  # one changed token inside block 2 invalidates blocks 2 and on
    cold, _ = _generate(mesh, other)
    with KvStoreClient(mesh.kvstore_address, metadata=security.mesh_metadata(mesh.mesh_token)) as kv:
        kv.evict()
    _, computed_cold = _generate(mesh, other)  # nothing stored: everything is computed
    assert computed_cold == len(other)
    _wait_for_blocks(mesh, 6)
    again, computed = _generate(mesh, other)
    assert again == cold and computed == len(other) - 48
    _, computed = _generate(mesh, [*SYSTEM[:40], 5, *SYSTEM[41:], 4, 5])
    assert computed == len(other) - 32  # blocks 0 and 1 shared, block 2 differs


def test_prefix_seeding_does_not_change_the_output(mesh: LocalMesh, tmp_path: Path) -> None:
    prompt = [*SYSTEM, 42, 43, 44, 45]
    with KvStoreClient(mesh.kvstore_address, metadata=security.mesh_metadata(mesh.mesh_token)) as kv:
        kv.evict()
    cold, computed = _generate(mesh, prompt)
    assert computed == len(prompt)
    _wait_for_blocks(mesh, 6)
    warm, computed = _generate(mesh, prompt)
    assert computed < len(prompt) and warm == cold


def test_a_live_sessions_prompt_blocks_are_shared_not_recomputed(mesh: LocalMesh) -> None:
    with CoordinatorClient(mesh.coordinator_address) as client:
        first = client.generate(prompt_token_ids=[*SYSTEM, 1, 2, 3], max_tokens=80, ignore_eos=True)
        next(first), next(first), next(first)  # its prompt is committed on both stages now
        with KvStoreClient(mesh.kvstore_address, metadata=security.mesh_metadata(mesh.mesh_token)) as kv:
            kv.evict()  # so the KV store cannot be where the prefix comes from
        prompt = [*SYSTEM, 4, 5]
        shared, computed = _generate(mesh, prompt)
        assert computed == len(prompt) - 48  # SYSTEM's three whole blocks came from the live session
        list(first)  # the donor finishes
    with KvStoreClient(mesh.kvstore_address, metadata=security.mesh_metadata(mesh.mesh_token)) as kv:
        kv.evict()
    alone, computed = _generate(mesh, prompt)  # nobody alive to share with, nothing stored
    assert computed == len(prompt) and alone == shared
