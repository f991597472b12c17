"""Executors that share a host run on cores of their own (graphmesh_executor/affinity.py, LocalMesh._core_shares),
and the CPU kernels' product helper borrows the others'."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.launcher import LocalMesh
from graphmesh_executor import affinity
from tests.model_fixtures import make_tiny_llama

CORES = sorted(os.sched_getaffinity(0))


def test_core_lists_parse_as_the_kernel_writes_them() -> None:
    assert affinity.parse("0-3,6") == {0, 1, 2, 3, 6}
    assert affinity.parse("5") == {5}
    for bad in ("", "3-1", "-2", "a", "0-"):
        with pytest.raises(ValueError):
            affinity.parse(bad)


def thread_cores(pid: int) -> dict[int, frozenset[int]]:
    """Each thread of the process and the cores it may run on."""
    return {int(tid): frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.serial  # pins executors across every core of the host
def test_two_executors_on_one_host_each_keep_to_their_cores_and_lend_their_helper(tmp_path: Path) -> None:
    """A 2-executor torch mesh on this host: with two cores or more, every thread of executor r (gRPC's own
    included) runs on the r-th half of the cores, but one: the product helper, started by a lone stream's decode,
    which runs on the other half (beside its caller it would only take turns with it). With one core nothing is
    pinned."""
    model = make_tiny_llama(tmp_path / "m")
    with LocalMesh(2, "torch", str(model), kvstore=False, extra_executor_args=("--kv-cache-bytes", "4Mi")) as mesh:
        with CoordinatorClient(mesh.coordinator_address) as client:
            tokens = [t for c in client.generate(prompt_token_ids=[5, 17, 99, 3], max_tokens=8, ignore_eos=True)
                      for t in c.token_ids]
        assert len(tokens) == 8
        half = len(CORES) // 2
        for rank, process in enumerate(mesh.executor_processes):
            cores = thread_cores(process.pid)
            if len(CORES) < 2:
                assert set(cores.values()) == {frozenset(CORES)}
                continue
            own = frozenset(CORES[rank * half:(rank + 1) * half])
            wide = [tid for tid, c in cores.items() if c != own]
            assert len(wide) == 1 and cores[wide[0]] == frozenset(CORES) - own, cores  # the helper, and it alone
            assert len(cores) > 5  # gRPC's, the engine's and the links' threads are all among the pinned


def test_an_executor_refuses_cores_it_may_not_use() -> None:
    from graphmesh_executor.server import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--cpus", str(max(CORES) + 1)])
    with pytest.raises(SystemExit):
        parse_args(["--cpus", "1-0"])
    assert parse_args(["--cpus", str(CORES[0])]).cpus == {CORES[0]}
