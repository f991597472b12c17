"""Sliding-window attention over the paged KV drops the blocks every window has passed (issue 38): a stage whose
layers all have a window returns a session's blocks wholly older than its window to the pool, and a stage with any
global layer keeps them all. Tiny random Mistral (every layer windowed) and Gemma 2 (a sliding and a global layer)
checkpoints with a window of 16 tokens, one block, under sessions several windows long: the tokens are those of
transformers and of the same run with nothing dropped, through speculation's rollbacks, a batch of 16 sessions of
mixed lengths and the real mesh; the pool counts the dropped blocks free, and their rows are never exported."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from graphmesh import plan as dag
from graphmesh.errors import FailedPrecondition
from graphmesh_executor.kv_pool import SCRATCH_BLOCK, KvPool
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_kv import StageKv
from graphmesh_executor.stage_types import Boundary, StageSpec, StepRow
from tests import model_fixtures
from tests.test_gemma import SHAPE, TYPES

WINDOW = 16
BLOCK = 16
KV_CACHE_BYTES = 1 << 20
CHUNK = 16  # prompt rows per step: a long prompt arrives in chunks, each attending to the window over the pool


def make_mistral(path: Path) -> Path:
    torch.manual_seed(21)
    config = MistralConfig(**SHAPE, sliding_window=WINDOW, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return model_fixtures._save(MistralForCausalLM(config), path)


def make_gemma2(path: Path) -> Path:
    torch.manual_seed(22)
    config = Gemma2Config(**SHAPE, head_dim=16, sliding_window=WINDOW, layer_types=TYPES, query_pre_attn_scalar=24,
                          attn_logit_softcapping=2.0, final_logit_softcapping=4.0, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return model_fixtures._save(Gemma2ForCausalLM(config), path)


MODELS = {"mistral": make_mistral, "gemma2": make_gemma2}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return MODELS[request.param](tmp_path_factory.mktemp(request.param))


def transformers_tokens(path: Path, prompt: list[int], n: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return list(out[0, len(prompt):].tolist())


def ranks(path: Path, backend: str, splits: list[tuple[int, int]]) -> list[StageRuntime]:
    """The stages of `splits` in-process, each pushing its boundary straight into the next one's mailbox."""
    runtimes: list[StageRuntime] = []

    def push(address: str, incarnation: int, boundary: Boundary, timeout_s: float,
             delivered: Callable[[Exception | None], None]) -> None:
        runtimes[int(address)].accept_boundary(incarnation, boundary)
        delivered(None)

    runtimes = [StageRuntime(backend, pusher=push, kv_cache_bytes=KV_CACHE_BYTES) for _ in splits]
    plan = dag.pipeline(splits, [str(i) for i in range(len(splits))], SHAPE["hidden_size"])
    for i, (a, b) in enumerate(splits):
        runtimes[i].install(1, i, len(splits), StageSpec(str(path), a, b, i == 0, i == len(splits) - 1), plan)
    return runtimes


@dataclasses.dataclass
class Session:
    sid: str
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    start: int = 0  # the next row's first position
    epoch: int = 0  # the open epoch (0: none yet)
    commit_length: int = 0  # the next row's folded commit keeps this many rows (after a verified chunk)
    row_start: int = 0  # where its last row started


Proposer = Callable[[Session, int], list[int]]  # (session, step) -> the proposals of its next decode row


def generate(runtimes: list[StageRuntime], prompts: dict[str, list[int]], n: int,
             propose: Proposer | None = None) -> dict[str, Session]:
    """Every session's prompt in chunks of CHUNK rows, then n greedy tokens, all sessions a row of each step (a
    prompt's chunks beside the others' decodes); with `propose`, decode rows carry proposals (prediction targets)
    and the next row's folded commit rolls the rejected ones back, as the coordinator's speculation does."""
    sessions = {sid: Session(sid, p) for sid, p in prompts.items()}
    step_id = 0
    while any(len(s.tokens) < n for s in sessions.values()):
        step_id += 1
        rows = []
        for s in sessions.values():
            if len(s.tokens) >= n:
                continue
            if s.start < len(s.prompt):
                ids, proposed = s.prompt[s.start:s.start + CHUNK], 0
            else:
                proposals = propose(s, step_id)[:n - len(s.tokens) - 1] if propose else []
                ids, proposed = [s.tokens[-1], *proposals], len(proposals)
            rows.append(StepRow(s.sid, s.epoch + 1, s.epoch, s.start, ids, proposed=proposed,
                                commit_length=s.commit_length))
        for r in runtimes[:-1]:  # each pushes its boundary into the next one's mailbox before it runs
            r.execute_step(1, step_id, rows, False, 5.0)
        result = runtimes[-1].execute_step(1, step_id, rows, False, 5.0)
        for i, row in enumerate(rows):
            s = sessions[row.session_id]
            s.epoch, s.commit_length, s.row_start = row.epoch, 0, row.start
            if row.proposed:
                kept = result.run_tokens[i]  # the accepted proposals and the sample after them
                s.tokens += kept
                s.start += len(kept)  # the last real token and the accepted proposals hold KV rows
                s.commit_length = s.start
            else:
                s.start += len(row.token_ids)
                if s.start >= len(s.prompt):
                    s.tokens.append(result.tokens[i])
    return sessions


def dropped_rows(runtime: StageRuntime, s: Session) -> int:
    """The rows a stage must have dropped by the session's last row: whole blocks before its window."""
    return max(0, (s.row_start - WINDOW + 1) // BLOCK) * BLOCK if runtime.kv_window else 0


def no_drops(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    monkeypatch.setattr(StageKv, "_drop_outside_window", lambda *args: None)
    return lambda: monkeypatch.undo()


def test_a_shared_block_is_free_again_only_once_its_last_holder_dropped_or_released_it() -> None:
    pool = KvPool(12, BLOCK)
    pool.reserve("a", 4 * BLOCK)
    pool.share("b", "a", 3)  # b's prompt: a's first three blocks
    pool.reserve("b", 5 * BLOCK)
    assert pool.free == 11 - 6
    a_blocks = pool.table("a")
    assert pool.drop("a", 2) == 2 and pool.free == 11 - 6  # b still holds both
    assert pool.table("a")[:2] == [SCRATCH_BLOCK] * 2 and pool.drop("a", 2) == 0
    pool.share("c", "a", 3)  # a's dropped blocks are dropped in c's table too; its third is shared
    assert pool.dropped("c") == 2 and pool.table("c") == [SCRATCH_BLOCK] * 2 + a_blocks[2:3]
    assert pool.drop("b", 3) == 3 and pool.free == 11 - 4  # the first two are free; the third, a and c hold
    pool.release("a")
    pool.release("c")
    assert pool.free == 11 - 2  # b's own two blocks
    pool.release("b")
    assert pool.free == 11 and SCRATCH_BLOCK not in pool._free


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_long_session_drops_the_blocks_its_window_passed_and_keeps_its_tokens(
        model: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = [(7 * i + 3) % 997 + 1 for i in range(40)]
    n = 80  # 40 + 80 rows: seven blocks, all but the window's last two dropped on a windowed stage
    want = transformers_tokens(model, prompt, n)
    undo = no_drops(monkeypatch)
    kept = generate(ranks(model, backend, [(0, 1), (1, 2)]), {"s": prompt}, n)["s"].tokens
    undo()
    assert kept == want

    def propose(s: Session, step: int) -> list[int]:  # all right, one wrong in the middle, or none
        right = want[len(s.tokens):len(s.tokens) + 3]
        return right if step % 3 == 0 else [right[0], (right[1] + 1) % 997, *right[2:]] if step % 3 == 1 else []
    for splits in ([(0, 2)], [(0, 1), (1, 2)]):
        runtimes = ranks(model, backend, splits)
        sessions = generate(runtimes, {"s": prompt}, n, propose)
        s = sessions["s"]
        assert s.tokens == want, splits
        # Mistral's every stage is windowed; Gemma 2's global layer keeps every block of the stages that hold it
        assert [bool(r.kv_window) for r in runtimes] == [
            "mistral" in str(model) or (a, b) == (0, 1) for a, b in splits]
        for r in runtimes:
            gone = dropped_rows(r, s)
            table = r.pool.table("s")
            assert r.pool.dropped("s") * BLOCK == gone and table[:gone // BLOCK] == [0] * (gone // BLOCK)
            assert r.pool.free == r.pool.lendable - (len(table) - gone // BLOCK)  # dropped blocks are free again
            if gone:  # a dropped row is never exported; the live ones are
                with pytest.raises(FailedPrecondition) as e:
                    r.read_kv(1, "s", 0, gone)
                assert e.value.reason == "ROWS_DROPPED" and f"before {gone}" in e.value.message
                rows = r.read_kv(1, "s", gone, gone + 4)
                pieces = [np.frombuffer(b"".join(p), np.float32).reshape(4, -1)
                          for p in r.read_kv_pieces(1, "s", gone, gone + 4)]
                assert len(pieces) == 2 * rows.shape[1] and rows.any()
                for j, piece in enumerate(pieces):  # K, then V, of each layer
                    np.testing.assert_array_equal(piece, rows[:, j // 2, j % 2])
                with pytest.raises(FailedPrecondition) as e:  # nor shared with a session that would see it
                    r.share_kv(1, "t", "s", (prompt + s.tokens)[:gone])
                assert e.value.reason == "PREFIX_NOT_HELD"
            assert gone > 0 or not r.kv_window
            r.release(1, "s")
            assert r.pool.free == r.pool.lendable


def test_sixteen_sessions_of_mixed_lengths_batched_equal_their_solo_runs(model: Path) -> None:
    """Rows of sessions that dropped blocks beside rows of sessions that dropped none (and prompt chunks beside
    decodes) in every step: each session's tokens are those it has alone."""
    prompts = {f"s{i}": [(13 * i + 5 * j) % 997 + 1 for j in range(3 + 5 * i)] for i in range(16)}  # 3..78 tokens
    n = 40
    splits = [(0, 1), (1, 2)]
    solo = {sid: generate(ranks(model, "torch", splits), {sid: p}, n)[sid].tokens for sid, p in prompts.items()}
    runtimes = ranks(model, "torch", splits)
    batched = generate(runtimes, prompts, n)
    assert {sid: s.tokens for sid, s in batched.items()} == solo
    first = runtimes[0]  # windowed in both models
    assert first.kv_window == WINDOW and sum(first.pool.dropped(sid) for sid in prompts) * BLOCK == sum(
        dropped_rows(first, s) for s in batched.values()) > 0


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_the_mesh_drops_windowed_blocks_and_keeps_every_sessions_tokens(backend: str, tmp_path: Path) -> None:
    """The real mesh (coordinator and two executor processes, both windowed: prompt chunks, decode runs,
    prompt-lookup speculation), sixteen sessions at once and one alone: each session's greedy tokens are
    transformers'."""
    from graphmesh.launcher import LocalMesh

    path = make_mistral(tmp_path / "mistral")
    prompts = [[(11 * i + 3 * j) % 997 + 1 for j in range(5 + 7 * i)] for i in range(16)]
    prompts[0] = [5, 6, 7, 8] * 6  # repeats: prompt-lookup proposes
    n = 48
    want = [transformers_tokens(path, p, n) for p in prompts]
    with LocalMesh(2, backend, str(path), startup_timeout_s=120, extra_executor_args=("--kv-cache-bytes", "4Mi"),
                   extra_coordinator_args=("--max-step-tokens", "32", "--speculative", "prompt-lookup")) as mesh:
        got = generate_all(mesh.coordinator_address, prompts, n)
        assert generate_all(mesh.coordinator_address, prompts[:1], n) == want[:1]  # alone: speculation runs
    assert got == want


def generate_all(address: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens of each prompt, all streams at once, through the coordinator's gRPC API."""
    from graphmesh.coordinator_client import CoordinatorClient

    def run(prompt: list[int]) -> list[int]:
        with CoordinatorClient(address) as client:
            return [t for chunk in client.generate(prompt_token_ids=prompt, max_tokens=n, ignore_eos=True)
                    for t in chunk.token_ids]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(run, prompts))


def test_the_coordinator_admits_windowed_sessions_longer_than_the_pool(tmp_path: Path) -> None:
    """Both stages of the Mistral are windowed, so the coordinator counts the blocks a window passed as free once
    the row that dropped them is done (Scheduler._most_held): two sessions each ~twice the smallest pool's tokens are
    admitted, not refused, take turns in it (preempted and recomputed) and keep transformers' tokens."""
    from graphmesh.launcher import LocalMesh
    from tests.test_metrics import scrape, value

    path = make_mistral(tmp_path / "mistral")
    prompts = [[(13 * j + 5 * i) % 997 + 1 for j in range(24)] for i in range(2)]
    n = 216
    want = [transformers_tokens(path, p, n) for p in prompts]
    block_bytes = 2 * 1 * 32 * 4 * BLOCK  # K and V of a stage's one layer (kv_dim 32), f32, per block
    with LocalMesh(2, "torch", str(path), kvstore=False, metrics=True, startup_timeout_s=120,
                   extra_executor_args=("--kv-cache-bytes", str(9 * block_bytes)),
                   extra_coordinator_args=("--max-step-tokens", "32")) as mesh:
        pool = value(scrape(mesh.metrics_ports["coordinator"]), "graphmesh_kv_blocks_total")
        assert pool == 8 and (24 + n) / BLOCK > 1.5 * pool  # every session outgrows the pool
        got = generate_all(mesh.coordinator_address, prompts, n)
    assert got == want
