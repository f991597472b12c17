"""Resident paged-KV decode on every backend, through the stage runtime the mesh uses: K/V rows scattered in-graph
into the stage's pools (handles that never leave the executor), each session's blocks lent as it grows, and
steps that carry rows of many sessions at once, each of which must give the tokens it gives alone."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from graphmesh.kvkeys import blocks_for
from graphmesh.v1 import stage_pb2
from graphmesh_executor.backends import available
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_servicer import StageServicer
from graphmesh_executor.stage_types import Sampling, StageSpec, StepRow
from tests.model_fixtures import make_tiny_gpt2, make_tiny_llama, smollm2_hf_tokenizer
from tests.stage_pipeline import two_stages

PROMPT = [5, 17, 99, 3, 250, 42, 7, 11]
BLOCK = 16
KV_CACHE_BYTES = 1 << 20  # hundreds of blocks for these tiny layers, not the default pool of up to 512 MiB
_step_ids = itertools.count(1)  # never reused, like the coordinator's


def _pipeline(path: Path, backend: str, n_layers: int) -> list[StageRuntime]:
    return two_stages(path, backend, 1, n_layers, kv_cache_bytes=KV_CACHE_BYTES, kv_block_tokens=BLOCK)


@dataclass
class Run:
    """One session as a scheduler drives it: its prompt fed in chunks of at most `chunk` tokens from step `join`
    on, then one decode row per step until it has `tokens` outputs."""

    session_id: str
    prompt: list[int]
    tokens: int
    join: int = 0
    chunk: int = 1 << 30
    sampling: Sampling = field(default_factory=Sampling)
    out: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    start: int = 0
    epoch: int = 0


def _decode(runtimes: list[StageRuntime], runs: list[Run], after_step: list[list[int]] | None = None) -> None:
    """Steps over every live run's row until each has its tokens; the epoch of each row is committed by the
    session's next row (folded), as the coordinator does. `after_step` collects each step's rank-1 block counts."""
    for run in runs:
        run.pending, run.out, run.start, run.epoch = list(run.prompt), [], 0, 0
    for step in itertools.count():
        live = [r for r in runs if r.join <= step and len(r.out) < r.tokens]
        if not live and all(len(r.out) == r.tokens for r in runs):
            return
        rows = []
        for r in live:
            r.epoch += 1
            rows.append(StepRow(r.session_id, r.epoch, r.epoch - 1, r.start, r.pending[:r.chunk], r.sampling))
        if rows:
            step_id = next(_step_ids)
            for runtime in runtimes:  # rank 0 first: its push lands in rank 1's mailbox
                result = runtime.execute_step(1, step_id, rows, False, 30.0)
            assert result.kv_lengths == [row.start + len(row.token_ids) for row in rows]
            for r, row, token in zip(live, rows, result.tokens):
                r.start += len(row.token_ids)
                r.pending = r.pending[len(row.token_ids):]
                if not r.pending:  # the row held the rest of the prompt (or the last token): its token is real
                    r.out.append(token)
                    r.pending = [token]
        if after_step is not None:
            after_step.append([len(runtimes[1].pool.table(r.session_id)) for r in runs])


def _transformers(hf: Any, prompt: list[int], tokens: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return cast(list[int], out[0, len(prompt):].tolist())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"llama": make_tiny_llama(tmp_path_factory.mktemp("llama")),
            "gpt2": make_tiny_gpt2(tmp_path_factory.mktemp("gpt2"))}


@pytest.mark.parametrize("backend", available())
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_session_grows_across_kv_blocks_and_matches_transformers(checkpoints: dict[str, Path], arch: str,
                                                                   backend: str) -> None:
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32)
    runtimes = _pipeline(checkpoints[arch], backend, hf.config.num_hidden_layers)
    run = Run("s", PROMPT, 32)
    blocks: list[list[int]] = []  # per step: the session's blocks on rank 1
    _decode(runtimes, [run], blocks)
    assert run.out == _transformers(hf, PROMPT, 32)
    # 8 + 32 tokens, the last one never fed back: rows 0..38 written, in three blocks of 16, each lent on the
    # step that first needed it and kept (never copied into a bigger allocation) as the session grew.
    assert [b[0] for b in blocks] == [blocks_for(len(PROMPT) + i, BLOCK) for i in range(32)]
    for runtime in runtimes:
        table = runtime.pool.table("s")
        assert len(table) == 3 and len(set(table)) == 3 and 0 not in table  # block 0 is the scratch block
        status = StageServicer(runtime).Status(stage_pb2.StageServiceStatusRequest(), cast(grpc.ServicerContext, None))
        (session,) = status.sessions
        # kv_length counts committed rows (epoch 32 is open), kv_capacity the rows of the blocks the session holds
        assert (session.session_id, session.epoch, session.kv_length, session.kv_capacity) == ("s", 32, 38, 3 * BLOCK)
        assert session.phase == stage_pb2.SESSION_PHASE_IN_TXN
    assert runtimes[0].pool.free == runtimes[1].pool.free == runtimes[1].pool.lendable - 3
    for runtime in runtimes:  # released blocks go back to the pool
        assert runtime.release(1, "s")
        assert runtime.pool.free == runtime.pool.lendable and runtime.pool.table("s") == []


@pytest.mark.parametrize("backend", available())
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sessions_decoded_in_the_same_steps_each_match_their_solo_run(checkpoints: dict[str, Path], arch: str,
                                                                      backend: str) -> None:
    # Ragged prompts in one prefill step, a session that joins mid-decode with its prompt in two chunks (steps that
    # mix decode rows and prompt chunks), one that crosses into a third block, and one that samples: each must give
    # exactly the tokens it gives in steps of its own, and the greedy ones those of transformers.
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[arch], dtype=torch.float32)

    def runs() -> list[Run]:
        return [Run("a", PROMPT, 20), Run("b", [300, 301, 302], 12),
                Run("c", [40 + 7 * i for i in range(13)], 24, join=3, chunk=9),
                Run("d", [9, 8, 7, 6, 5], 16, join=1, sampling=Sampling(temperature=0.8, top_k=40, seed=1234))]

    batched = runs()
    _decode(_pipeline(checkpoints[arch], backend, hf.config.num_hidden_layers), batched)
    solo = _pipeline(checkpoints[arch], backend, hf.config.num_hidden_layers)
    for together, alone in zip(batched, runs()):
        alone.join = 0
        _decode(solo, [alone])
        assert together.out == alone.out, together.session_id
        if together.sampling.temperature == 0:
            assert together.out == _transformers(hf, together.prompt, together.tokens), together.session_id
    assert len({tuple(r.out) for r in batched}) == len(batched)  # the sessions' outputs differ: no row crosstalk
    assert [len(_pipeline_table(solo, r.session_id)) for r in batched] == \
        [blocks_for(len(r.prompt) + r.tokens - 1, BLOCK) for r in batched]


def _pipeline_table(runtimes: list[StageRuntime], session_id: str) -> list[int]:
    tables = [runtime.pool.table(session_id) for runtime in runtimes]
    assert all(len(t) == len(tables[0]) for t in tables)
    return tables[0]


QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to five.",
             "What is 2 + 2?", "Say hello in French."]


@pytest.mark.slow
def test_smollm2_packed_u8_weights_give_the_f32_tokens() -> None:
    tok = smollm2_hf_tokenizer()
    backend = "torch" if "torch" in available() else "numpy"
    outputs = {}
    for weights in ("f32", "packed"):
        runtime = StageRuntime(backend, kv_cache_bytes=64 << 20)
        runtime.install(1, 0, 1, StageSpec("smollm2-135m", 0, 30, True, True, weights=weights))
        if weights == "packed":
            assert any(t.dtype == "u8" for t in runtime._holder.graph.params.values())  # type: ignore[union-attr]
        runs = []
        for i, q in enumerate(QUESTIONS):
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            ids = ids if isinstance(ids, list) else ids["input_ids"]
            run = Run(f"s{i}", list(ids), 16)
            _decode([runtime], [run])
            runs.append(run.out)
        outputs[weights] = runs
    assert outputs["packed"] == outputs["f32"]
