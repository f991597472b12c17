"""Resident-KV decode on every backend, through the stage runtime the mesh uses: KV rows written in-graph into
handles that never leave the executor, a power-of-two capacity ladder, and bucket rollovers that move the
committed rows into the next rung on the executor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from graphmesh_executor.backends import available
from graphmesh_executor.stage import Sampling, StageConfig, StageRuntime
from tests.model_fixtures import make_tiny_gpt2, make_tiny_llama, smollm2_hf_tokenizer

PROMPT = [5, 17, 99, 3, 250, 42, 7, 11]


def _pipeline(path: Path, backend: str, n_layers: int, min_kv_rows: int = 8) -> list[StageRuntime]:
    runtimes: list[StageRuntime] = []

    def push(address: str, session_id: str, incarnation: int, epoch: int, hidden: np.ndarray, timeout_s: float) -> None:
        runtimes[int(address)].accept_boundary(incarnation, session_id, epoch, hidden)

    runtimes = [StageRuntime(backend, pusher=push, min_kv_rows=min_kv_rows) for _ in range(2)]
    runtimes[0].install(1, 0, 2, StageConfig(str(path), 0, 1, True, False, "1"))
    runtimes[1].install(1, 1, 2, StageConfig(str(path), 1, n_layers, False, True, ""))
    return runtimes


def _greedy(runtimes: list[StageRuntime], prompt: list[int], steps: int) -> list[int]:
    tokens, pending, start = [], prompt, 0
    for epoch in range(1, steps + 1):
        for r in runtimes:  # rank 0 first: its push lands in rank 1's mailbox
            out = r.execute(1, "s", epoch, epoch - 1, start, pending, Sampling(), False, 10.0)
        start += len(pending)
        pending = [out.token]
        tokens.append(out.token)
    return tokens


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"llama": make_tiny_llama(tmp_path_factory.mktemp("llama")),
            "gpt2": make_tiny_gpt2(tmp_path_factory.mktemp("gpt2"))}


@pytest.mark.parametrize("backend", available())
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_32_tokens_across_bucket_rollovers_match_transformers(checkpoints: dict[str, Path], arch: str,
                                                              backend: str) -> None:
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32)
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    runtimes = _pipeline(checkpoints[arch], backend, hf.config.num_hidden_layers)
    assert _greedy(runtimes, PROMPT, 32) == expected[0, len(PROMPT):].tolist()
    capacity = runtimes[1].sessions()[0][1].capacity
    assert capacity == 64  # 8 -> 16 -> 32 -> 64: three rollovers for a 40-token sequence


QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to five.",
             "What is 2 + 2?", "Say hello in French."]


@pytest.mark.slow
def test_smollm2_packed_u8_weights_give_the_f32_tokens() -> None:
    tok = smollm2_hf_tokenizer()
    backend = "torch" if "torch" in available() else "numpy"
    outputs = {}
    for weights in ("f32", "packed"):
        runtime = StageRuntime(backend)
        runtime.install(1, 0, 1, StageConfig("smollm2-135m", 0, 30, True, True, "", weights=weights))
        if weights == "packed":
            assert any(t.dtype == "u8" for t in runtime._holder.graph.params.values())  # type: ignore[union-attr]
        runs = []
        for i, q in enumerate(QUESTIONS):
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            ids = ids if isinstance(ids, list) else ids["input_ids"]
            tokens, pending, start = [], list(ids), 0
            for epoch in range(1, 17):
                out = runtime.execute(1, f"s{i}", epoch, epoch - 1, start, pending, Sampling(), False, 10.0)
                start += len(pending)
                pending = [out.token]
                tokens.append(out.token)
            runs.append(tokens)
        outputs[weights] = runs
    assert outputs["packed"] == outputs["f32"]
