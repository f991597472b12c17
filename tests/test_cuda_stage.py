"""Two stages on a CUDA device, in-process: the path decode takes there (static runs, captured CUDA graphs, the fused
paged attention and the matmuls fused across weights that read the same activations) gives transformers' greedy
tokens, for one session and for every session of a batch. f32, so that the check is the tokens themselves. Skipped
without a GPU (CI has none); run on the lent H200 (see bench/bench_gpu_mesh.py for the mesh under load)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_types import StepRow
from tests.model_fixtures import make_tiny_llama
from tests.stage_pipeline import two_stages

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_step_ids = itertools.count(1)
TOKENS = 40  # past the captures: a static run is captured once its key has been seen a few times


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _pipeline(path: Path) -> list[StageRuntime]:
    return two_stages(path, "torch", 1, 2, device="cuda:0", kv_cache_bytes=16 << 20, dtype="f32")


def _generate(runtimes: list[StageRuntime], prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy tokens of every session, all of them in every step: the prompts in the first, then a row each."""
    tokens: dict[str, list[int]] = {sid: [] for sid in prompts}
    for epoch in range(1, TOKENS + 1):
        rows = [StepRow(sid, epoch, epoch - 1, 0, prompt) if epoch == 1 else
                StepRow(sid, epoch, epoch - 1, len(prompt) + epoch - 2, [tokens[sid][-1]])
                for sid, prompt in prompts.items()]
        step_id = next(_step_ids)
        runtimes[0].execute_step(1, step_id, rows, False, 30.0)
        result = runtimes[1].execute_step(1, step_id, rows, False, 30.0)
        for sid, token in zip(prompts, result.tokens):
            tokens[sid].append(token)
    return tokens


def _transformers(path: Path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def test_one_session_decodes_transformers_tokens_through_captured_graphs(tiny_llama: Path) -> None:
    prompt = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
    runtimes = _pipeline(tiny_llama)
    assert _generate(runtimes, {"s": prompt})["s"] == _transformers(tiny_llama, prompt)
    captured = [e for r in runtimes for e in r._executables.values() if getattr(e, "_captures", None)]
    assert captured, "no decode run was captured as a CUDA graph"


def test_every_session_of_a_batch_decodes_its_tokens_alone(tiny_llama: Path) -> None:
    prompts = {"a": [5, 17, 99], "b": [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
               "c": [300, 2], "d": [1, 2, 3, 4, 5, 6, 7]}
    batched = _generate(_pipeline(tiny_llama), prompts)
    assert batched == {sid: _transformers(tiny_llama, prompt) for sid, prompt in prompts.items()}


def test_every_decode_bucket_is_captured_at_load_and_no_step_compiles(tiny_llama: Path) -> None:
    """A CUDA stage meets every run shape at load (one block-table width; each decode bucket up to WARM_SEQS
    sessions captured, each prompt bucket up to WARM_TOKENS tokens compiled): a step never waits for a compile or a
    capture, and the tokens are transformers'."""
    from graphmesh_executor.stage_inputs import WARM_SEQS, ladder

    runtimes = _pipeline(tiny_llama)
    for runtime in runtimes:
        decodes = {key[1]: exe for key, exe in runtime._executables.items() if key[3]}
        assert sorted(decodes) == ladder(1, WARM_SEQS), sorted(decodes)
        assert all(getattr(exe, "_captures", None) for exe in decodes.values()), "a decode bucket was not captured"
        assert len({key[2] for key in runtime._executables}) == 1, "more than one block-table width"
    compiled = [r.compiles for r in runtimes]
    prompts = {"a": [5, 17, 99], "c": [300, 2], "d": [1, 2, 3, 4, 5, 6, 7]}
    assert _generate(runtimes, prompts) == {sid: _transformers(tiny_llama, prompt) for sid, prompt in prompts.items()}
    assert [r.compiles for r in runtimes] == compiled


def test_prompt_steps_of_short_runs_replay_captured_graphs_with_transformers_tokens(tiny_llama: Path) -> None:
    """A step of prompt chunks whose every run takes the row kernel runs its whole bucket static (no cut to its real
    rows, no host read) and, from the bucket's second run (the load's warm-up is its first), replays a captured
    graph: the tokens are transformers' still."""
    runtimes = _pipeline(tiny_llama)
    prompts = {"a": [5, 17, 99], "b": [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
               "c": [300, 2], "d": [1, 2, 3, 4, 5, 6, 7]}
    assert _generate(runtimes, prompts) == {sid: _transformers(tiny_llama, prompt) for sid, prompt in prompts.items()}
    for runtime in runtimes:
        prompt_buckets = [exe for key, exe in runtime._executables.items() if not key[3]]
        assert any(getattr(exe, "_captures", None) for exe in prompt_buckets), "no prompt step was captured"
