"""The stage protocol in-process (no gRPC): two StageRuntimes wired by a direct pusher, against transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from graphmesh.errors import FailedPrecondition
from graphmesh_executor.fencing import AuthorityState, SessionPhase
from graphmesh_executor.stage import ProtocolError, Sampling, StageConfig, StageRuntime
from tests.model_fixtures import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _pipeline(path: Path, split: int, n_layers: int) -> list[StageRuntime]:
    runtimes: list[StageRuntime] = []

    def push(address: str, session_id: str, incarnation: int, epoch: int, hidden: np.ndarray, timeout_s: float) -> None:
        runtimes[int(address)].accept_boundary(incarnation, session_id, epoch, hidden)

    runtimes = [StageRuntime("numpy", pusher=push), StageRuntime("numpy", pusher=push)]
    runtimes[0].install(1, 0, 2, StageConfig(str(path), 0, split, True, False, "1"))
    runtimes[1].install(1, 1, 2, StageConfig(str(path), split, n_layers, False, True, ""))
    return runtimes


def _invoke(runtimes: list[StageRuntime], session: str, epoch: int, commit: int, start: int, ids: list[int]) -> int:
    # rank 1 waits for its boundary, so run rank 0 first in-process: its push lands in rank 1's mailbox
    runtimes[0].execute(1, session, epoch, commit, start, ids, Sampling(), False, 5.0)
    return runtimes[1].execute(1, session, epoch, commit, start, ids, Sampling(), False, 5.0).token


def test_two_stage_greedy_matches_transformers(tiny_llama: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    prompt = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=70, do_sample=False, min_new_tokens=70)[0, len(prompt):]
    runtimes = _pipeline(tiny_llama, 1, hf.config.num_hidden_layers)
    tokens, pending, start = [], prompt, 0
    for epoch in range(1, 71):  # 11 + 70 tokens cross the 64-row KV bucket: a rollover on both ranks
        token = _invoke(runtimes, "s", epoch, epoch - 1, start, pending)
        start += len(pending)
        tokens.append(token)
        pending = [token]
    assert tokens == expected.tolist()
    status = runtimes[1].sessions()[0][1]
    assert status.capacity == 128 and status.txn.kv_length == len(prompt) + 68  # epoch 70 is still open


def test_arch_failure_rolls_back_and_the_session_continues(tiny_llama: Path) -> None:
    runtimes = _pipeline(tiny_llama, 1, 2)
    _invoke(runtimes, "s", 1, 0, 0, [1, 2, 3])
    with pytest.raises(ProtocolError) as e:
        runtimes[0].execute(1, "s", 2, 1, 3, [10**6], Sampling(), False, 1.0)  # token id outside the vocabulary
    assert e.value.error_class == "ARCH"
    runtimes[1].abort(1, "s", 2, commit_epoch=1)  # rank 1 never saw the folded commit of epoch 1
    assert runtimes[0].authority.state is AuthorityState.ACTIVE
    txn = runtimes[0].sessions()[0][1].txn
    assert (txn.phase, txn.kv_length) == (SessionPhase.IDLE, 3)
    # epoch 1 was committed by the folded commit, epoch 2 aborted everywhere; epoch 3 continues from 3 tokens
    token = _invoke(runtimes, "s", 3, 0, 3, [4])
    assert isinstance(token, int)


def test_stale_incarnation_changes_nothing(tiny_llama: Path) -> None:
    runtimes = _pipeline(tiny_llama, 1, 2)
    _invoke(runtimes, "s", 1, 0, 0, [1, 2, 3])
    before = [(t.phase, t.epoch, t.kv_length) for t in (s.txn for _, s in runtimes[0].sessions())]
    with pytest.raises(FailedPrecondition) as e:
        runtimes[0].execute(0, "s", 2, 1, 3, [4], Sampling(), False, 1.0)
    assert e.value.reason == "STALE_INCARNATION"
    runtimes[0].fence(1, "test", False)
    with pytest.raises(FailedPrecondition) as e:
        runtimes[0].execute(1, "s", 2, 1, 3, [4], Sampling(), False, 1.0)
    assert e.value.reason == "POISONED"
    assert before == [(t.phase, t.epoch, t.kv_length) for t in (s.txn for _, s in runtimes[0].sessions())]


def test_boundary_timeout_is_a_comm_failure_that_poisons(tiny_llama: Path) -> None:
    runtimes = _pipeline(tiny_llama, 1, 2)
    with pytest.raises(ProtocolError) as e:
        runtimes[1].execute(1, "s", 1, 0, 0, [1, 2], Sampling(), False, 0.2)
    assert e.value.error_class == "COMM"
    assert runtimes[1].authority.state is AuthorityState.POISONED
