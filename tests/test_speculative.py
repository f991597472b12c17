"""Speculative decoding by prompt lookup (issue 39): the proposer, the owner rank's verification, and real meshes.

Speculation never changes a token: greedy and seeded streams are token-identical with it on and off, over 1, 2
and 3 executors of SmolLM2 (f32), alone and 16 at once, with a grammar, and across a kill -9 of a stage while
verified chunks are in flight. Sampled verification follows the target's distribution: a chi-square over many
seeds against a tiny random model's exact next-token distribution (transformers, float64).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from graphmesh import channels
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import InvalidArgument, from_rpc_error
from graphmesh.launcher import LocalMesh
from graphmesh.v1 import coordinator_pb2 as cpb
from graphmesh.v1 import stage_pb2, stage_pb2_grpc
from graphmesh_coordinator import speculative
from graphmesh_coordinator.speculative import Mode, PassCosts, Speculation, parse_mode, propose
from graphmesh_executor.stage import _positions, _verify
from graphmesh_executor.stage_types import StepResult, StepRow
from graphmesh_server import faults
from tests.test_metrics import scrape, value

ON = cpb.SpeculativeDecoding(method=cpb.SPECULATIVE_METHOD_PROMPT_LOOKUP, max_proposed=4)
OFF = cpb.SpeculativeDecoding(method=cpb.SPECULATIVE_METHOD_OFF)
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, and wrote "
           "the weather, the ships that passed and the state of the sea in a leather logbook.")
GROUNDED = [f"Repeat this passage word for word: {PASSAGE}",
            "Continue the list exactly as it goes: red, green, blue, red, green, blue, red, green, blue, red,",
            "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"]


# -- the proposer and k ----------------------------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    assert propose([1, 2, 3, 4, 5, 1, 2], 3) == [3, 4, 5]
    # the longest suffix wins: [7, 1, 2] occurs once, followed by 9; the bare [2] last occurred before 8
    assert propose([7, 1, 2, 9, 9, 1, 2, 8, 0, 7, 1, 2], 2) == [9, 9]
    assert propose([5, 6, 5, 6, 5], 4) == [6, 5]  # the latest occurrence, cut at what follows it
    assert propose([1, 2, 3], 4) == []  # nothing repeats
    assert propose([1, 2, 3, 1], 4) == []  # the last token alone: too weak a match to pay for a verified chunk
    assert propose([4, 4], 0) == [] and propose([4], 3) == []


def test_k_adapts_to_acceptance_and_backs_off_to_plain_decoding() -> None:
    spec = Speculation(4)
    assert spec.proposals([1, 2, 3, 1, 2], 10) == [3, 1, 2]
    assert spec.proposals([1, 2, 3, 1, 2], 1) == [3]  # never past what the session may still grow by
    spec.verified(4, 1)
    assert spec.k == 2  # the accepted prefix and one more
    spec.verified(2, 2)
    assert spec.k == 3
    for _ in range(6):  # nothing accepted: k falls to 0 within a few passes
        if spec.k:
            spec.verified(spec.k, 0)
    assert spec.k == 0 and spec.backoff > 0 and spec.proposals([1, 2, 3, 1, 2], 5) == []
    first = spec.backoff
    spec.plain(spec.backoff)
    assert spec.k == 1 and spec.proposals([1, 2, 3, 1, 2], 5) == [3]
    spec.verified(1, 0)  # the probe after a backoff fails: straight back to plain decoding, for twice as long
    assert spec.k == 0 and spec.backoff == 2 * first
    spec.plain(spec.backoff)
    spec.verified(1, 1)  # a probe that pays ends the probation: later misses count as before
    spec.verified(2, 0)
    assert spec.k == 1 and spec.backoff == 0


def test_a_step_verifies_only_where_its_passes_beat_a_decode_run() -> None:
    costs = PassCosts()
    assert costs.verify_pays([1.0], rows=1, run=8, draft=False)  # nothing measured yet: verify, and learn its cost
    costs.verified(0.5)  # the first pass is a first use of its shapes, not a cost
    costs.verified(0.004)
    assert costs.verify_s == 0.004
    assert costs.verify_pays([1.0], rows=1, run=8, draft=False)  # runs not measured yet
    costs.ran(0.016, steps=8)  # 2 ms a token of a run
    assert costs.verify_pays([0.0], rows=1, run=8, draft=False)  # no pass has given tokens yet: one must
    costs.turned(0.002)
    # a run of 8: 8 tokens in 8 * 2 + 2 = 18 ms; a pass: its tokens in 4 + 2 = 6 ms
    assert costs.verify_pays([3.0], rows=1, run=8, draft=False)  # 3 in 6 ms beats 8 in 18
    assert costs.verify_pays([2.5], rows=1, run=1, draft=False)  # the alternative is one token: a pass gives more
    assert costs.verify_s == 0.004
    assert not costs.verify_pays([2.5], rows=1, run=8, draft=False)
    assert costs.verify_s == pytest.approx(0.004 * speculative.AGING)  # a decline ages the pass's cost
    costs.verify_s = 0.004
    costs.drafted(0.006)
    assert not costs.verify_pays([3.0], rows=1, run=8, draft=True)  # the draft's pass counts: 3 in 12 ms
    costs.verify_s = 0.004
    # 16 rows, one of them speculating: a pass gives 15 + 4 tokens in 6 ms, a run 128 in 18
    assert not costs.verify_pays([4.0], rows=16, run=8, draft=False)
    declines = 0
    while not costs.verify_pays([2.0], rows=1, run=8, draft=False):
        declines += 1
    assert 5 < declines < 40  # aged until a pass of 2 tokens would pay: tried again, and measured
    spec = Speculation(8)
    assert costs.expected(spec) == 0.0  # nothing verified yet
    costs.passed(4)
    costs.passed(2)
    assert costs.expected(spec) == pytest.approx(0.7 * 4 + 0.3 * 2)  # a new session expects what passes gave lately
    spec.verified(8, 0)
    spec.verified(8, 8)
    assert costs.expected(spec) == spec.tokens_per_pass == pytest.approx(0.7 * 1 + 0.3 * 9)  # then its own


def test_modes_parse_and_refuse_clearly() -> None:
    assert parse_mode("off") == speculative.OFF and not parse_mode("off").on
    assert parse_mode("prompt-lookup") == Mode("prompt-lookup", speculative.DEFAULT_K)
    assert parse_mode("prompt-lookup:7").max_k == 7
    for bad in ("draft", "ngram", "prompt-lookup:0", "prompt-lookup:99", "prompt-lookup:x"):
        with pytest.raises(InvalidArgument) as e:
            parse_mode(bad)
        assert e.value.reason == "BAD_SPECULATIVE"
    default = Mode("prompt-lookup", 4)
    assert speculative.from_json(None, default) == default
    assert speculative.from_json("off", default) == speculative.OFF
    assert speculative.from_json({"max_proposed": 2}, default) == Mode("prompt-lookup", 2)
    assert speculative.from_proto(cpb.SpeculativeDecoding(), default) == default
    assert speculative.from_proto(OFF, default).on is False
    with pytest.raises(InvalidArgument):
        speculative.from_json({"method": "draft"}, default)


# -- the owner rank's verification ---------------------------------------------------------------------------
def test_verification_keeps_proposals_while_the_samples_agree() -> None:
    plain = StepRow("a", 3, 2, 10, [42])
    chunk = StepRow("b", 5, 4, 20, [7, 8, 9, 6], proposed=3)
    run_rows = [p for r in (plain, chunk) for p in _positions(r)]
    assert [(r.start, r.token_ids) for r in run_rows] == [(10, [42]), (20, [7]), (21, [8]), (22, [9]), (23, [6])]
    # the samples after 7, 8, 9, 6: 8 and 9 agree with the proposals, 5 does not (6 was proposed)
    result = StepResult(tokens=[11, 8, 9, 5, 3])
    _verify([plain, chunk], result)
    assert result.tokens == [11, 8] and result.run_tokens == [[], [8, 9, 5]] and result.accepted == [0, 2]
    result = StepResult(tokens=[11, 1, 9, 5, 3])  # the first proposal already rejected: the sample stands alone
    _verify([plain, chunk], result)
    assert result.run_tokens[1] == [1] and result.accepted[1] == 0
    result = StepResult(tokens=[11, 8, 9, 6, 3])  # all accepted: the sample after the last proposal comes too
    _verify([plain, chunk], result)
    assert result.run_tokens[1] == [8, 9, 6, 3] and result.accepted[1] == 3


# -- real meshes ----------------------------------------------------------------------------------------------
def _generate(address: str, prompt: str, spec: cpb.SpeculativeDecoding, **kw: Any) -> list[int]:
    kw.setdefault("ignore_eos", "guided" not in kw)  # a finished grammar allows only its end
    with CoordinatorClient(address) as client:
        return [t for chunk in client.generate(prompt, speculative=spec, **kw) for t in chunk.token_ids]


def _passes(mesh: LocalMesh) -> tuple[float, float]:
    samples = scrape(mesh.metrics_ports["coordinator"])
    return (value(samples, "graphmesh_speculative_passes_total"),
            value(samples, "graphmesh_speculative_accepted_tokens_total"))


# One token a plain step: against it a verified chunk always pays (PassCosts), so these meshes verify chunks
# whatever this host's timings. With decode runs, whether a step verifies is the measured costs' call.
ONE_TOKEN_STEPS = ["--decode-steps", "1"]


@pytest.fixture(scope="module", params=[1, 2, 3])
def mesh(request: pytest.FixtureRequest) -> Iterator[LocalMesh]:
    with LocalMesh(request.param, "torch", "smollm2-135m", kvstore=False, metrics=True, fault_injection=True,
                   extra_coordinator_args=["--speculative", "prompt-lookup", *ONE_TOKEN_STEPS]) as m:
        yield m


@pytest.mark.slow
def test_greedy_and_seeded_streams_equal_with_speculation_on_and_off(mesh: LocalMesh) -> None:
    before = _passes(mesh)
    for prompt in GROUNDED:
        for sampling in ({}, {"temperature": 0.8, "top_k": 40, "seed": 11}):
            off = _generate(mesh.coordinator_address, prompt, OFF, max_tokens=40, **sampling)
            assert _generate(mesh.coordinator_address, prompt, ON, max_tokens=40, **sampling) == off
    passes, accepted = (a - b for a, b in zip(_passes(mesh), before))
    assert passes > 0 and accepted > 0  # verified chunks ran, and proposals were taken: equality is not vacuous
    costs = scrape(mesh.metrics_ports["coordinator"])
    assert value(costs, "graphmesh_speculative_cost_seconds", kind="verify") > 0  # what the gate weighs passes by


def test_guided_streams_speculate_within_their_grammar(mesh: LocalMesh) -> None:
    """With a grammar, proposals stop where it refuses one and each position of a verified pass samples under its
    own mask (the grammar's after the proposals before it): greedy and seeded guided streams are their tokens
    without speculation, and a copied JSON object's proposals were accepted."""
    record = '{"keeper": "Margaret Innes", "built": 1874, "steps": 112, "light": "Skerry Point", "sea": "calm"}'
    cases = [(f"Repeat this JSON object exactly, nothing else: {record}", cpb.GuidedDecoding(json_object=True)),
             # the passage has capitals and a full stop the grammar refuses: masks decide where the copy goes
             (GROUNDED[0], cpb.GuidedDecoding(regex="[a-z ,]+"))]
    before = _passes(mesh)
    for prompt, guided in cases:
        for sampling in ({}, {"temperature": 0.8, "top_k": 40, "seed": 11}):
            off = _generate(mesh.coordinator_address, prompt, OFF, max_tokens=48, guided=guided, **sampling)
            on = _generate(mesh.coordinator_address, prompt, ON, max_tokens=48, guided=guided, **sampling)
            assert on == off, (guided, sampling)
    passes, accepted = (a - b for a, b in zip(_passes(mesh), before))
    assert passes > 0 and accepted > 0


@pytest.mark.slow
def test_sixteen_streams_equal_their_solo_runs_without_speculation(mesh: LocalMesh) -> None:
    """16 at once: speculation steps aside while the steps are busy and joins as they thin out; every stream is the
    token sequence of its run alone with speculation off (the coordinator's default here is on)."""
    prompts = [GROUNDED[i % len(GROUNDED)] + " " * (i // len(GROUNDED)) for i in range(16)]
    jobs = [dict(max_tokens=8 + 4 * (i % 5), **({"temperature": 0.7, "seed": 100 + i} if i % 2 else {}))
            for i in range(16)]
    solo = [_generate(mesh.coordinator_address, p, OFF, **job) for p, job in zip(prompts, jobs)]
    with ThreadPoolExecutor(16) as pool:
        batched = list(pool.map(lambda pj: _generate(mesh.coordinator_address, pj[0], cpb.SpeculativeDecoding(),
                                                     **pj[1]), zip(prompts, jobs)))
    assert batched == solo


@pytest.mark.slow
def test_streams_that_verify_or_run_by_measured_costs_keep_their_tokens() -> None:
    """At the coordinator's default decode runs, whether a step verifies proposals or runs is the measured costs'
    call (PassCosts), so which steps verify depends on this host's timings: whichever they are, four streams at
    once, greedy and seeded, are their tokens without speculation."""
    jobs: list[dict[str, Any]] = [{}, {"temperature": 0.8, "top_k": 40, "seed": 3}] * 2
    prompts = [GROUNDED[i % len(GROUNDED)] for i in range(len(jobs))]
    with LocalMesh(2, "torch", "smollm2-135m", kvstore=False, extra_coordinator_args=["--speculative", "prompt-lookup"]) \
            as mesh:
        plain = [_generate(mesh.coordinator_address, p, OFF, max_tokens=40, **job) for p, job in zip(prompts, jobs)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            speculated = list(pool.map(lambda pj: _generate(mesh.coordinator_address, pj[0], ON, max_tokens=40, **pj[1]),
                                   zip(prompts, jobs)))
    assert speculated == plain


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [2, 3], indirect=True)  # one executor has no other to re-plan its stage over
def test_a_kill_9_while_chunks_are_verified_changes_no_token(mesh: LocalMesh) -> None:
    """A greedy and a seeded stream speculate side by side (two decodes a step: speculation joins); the last stage,
    which verifies their chunks, is killed once both have tokens. Both streams are the tokens of fault-free runs
    with speculation off: the recovery restores each session's accepted rows and replays with the same seeds."""
    prompt, n = GROUNDED[0], 60
    jobs: list[dict[str, Any]] = [{}, {"temperature": 0.8, "top_k": 40, "seed": 5}]
    baseline = [_generate(mesh.coordinator_address, prompt, OFF, max_tokens=n, **job) for job in jobs]
    delivered = [0, 0]

    def stream(i: int) -> list[int]:
        out: list[int] = []
        with CoordinatorClient(mesh.coordinator_address) as client:
            for chunk in client.generate(prompt, speculative=ON, ignore_eos=True, max_tokens=n, **jobs[i]):
                out += chunk.token_ids
                delivered[i] = len(out)
        return out

    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream, i) for i in range(2)]
        deadline = time.monotonic() + 300
        while min(delivered) < 12:
            assert time.monotonic() < deadline and not any(f.done() for f in streams), delivered
            time.sleep(0.005)
        passes = _passes(mesh)[0]
        faults.kill9(mesh.executor_processes[-1])  # the last stage: it holds the chunks' verification
        assert [f.result() for f in streams] == baseline
    assert passes > 0 and _passes(mesh)[0] > passes  # chunks were verified before the kill and after the re-plan


@pytest.mark.slow
def test_an_executor_refuses_a_malformed_prediction_target(mesh: LocalMesh) -> None:
    """Refused before any row begins (ARCH, INVALID_ARGUMENT naming the row): nothing changes on the rank."""
    stub = stage_pb2_grpc.StageServiceStub(channels.channel(mesh.executor_addresses[0], None,
                                                            mesh_token=mesh.mesh_token))
    with CoordinatorClient(mesh.coordinator_address) as client:
        served = client.status()
    incarnation, words = served.incarnation, -(-served.vocab_size // 32)
    target = stage_pb2.PredictionTarget(proposed=2, proposer=stage_pb2.PROPOSER_PROMPT_LOOKUP)
    for i, (row, reason) in enumerate((
            (stage_pb2.StepRow(session_id="bad", epoch=1, token_ids=[1, 2], prediction_target=target),
             "BAD_PREDICTION_TARGET"),  # no token before its proposals
            (stage_pb2.StepRow(session_id="bad", epoch=1, token_ids=[1, 2, 3], prediction_target=target,
                               sampling=stage_pb2.SamplingParams(logprobs=True)), "BAD_PREDICTION_TARGET"),
            (stage_pb2.StepRow(session_id="bad", epoch=1, token_ids=[1], commit_epoch=1, commit_length=5),
             "BAD_COMMIT_LENGTH"),
            # a guided prediction target carries a mask for each of its 3 sampled positions, not one
            (stage_pb2.StepRow(session_id="bad", epoch=1, token_ids=[1, 2, 3], prediction_target=target,
                               allowed_tokens=b"\xff" * 4 * words), "BAD_ALLOWED_TOKENS"))):
        request = stage_pb2.ExecuteStepRequest(incarnation=incarnation, step_id=(1 << 50) + i, rows=[row],
                                               output=stage_pb2.OUTPUT_KIND_TOKEN, boundary_timeout_ms=2000)
        with pytest.raises(grpc.RpcError) as e:
            stub.ExecuteStep(request, timeout=10)
        error = from_rpc_error(e.value)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.reason == reason, error.message
        assert "bad" in error.message
    status = stub.Status(stage_pb2.StageServiceStatusRequest(), timeout=10)
    assert "bad" not in [s.session_id for s in status.sessions]


# -- the distribution of sampled verification --------------------------------------------------------------------
VOCAB = 16


def _tiny(path: Path) -> Path:
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         rms_norm_eps=1e-5, initializer_range=0.3, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return path


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z = 3.09) by Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow
def test_sampled_verification_follows_the_target_distribution(tmp_path: Path) -> None:
    """The second token of each stream is sampled in a verified chunk [t0, proposal]: accepted with its probability,
    else drawn from the rest. Over many seeds its counts must follow sum over t0 of p(t0) p(t1 | t0), exactly
    from transformers; a verification that favoured its proposal would put far too many draws on it."""
    path = _tiny(tmp_path / "models" / "tiny")
    # [2, t] occurs for every token t and the prompt ends on 2: a two-token match, so a proposal, whatever t0 is
    prompt = [*(x for t in range(VOCAB) for x in (2, t)), 2]
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float64).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1).numpy()
        second = np.stack([torch.softmax(model(torch.tensor([[*prompt, t]])).logits[0, -1], -1).numpy()
                           for t in range(VOCAB)])
    expected_p = first @ second
    n = 600
    with LocalMesh(2, "torch", str(path), kvstore=False, metrics=True, extra_coordinator_args=ONE_TOKEN_STEPS) as mesh:
        def draw(seed: int) -> int:
            with CoordinatorClient(mesh.coordinator_address) as client:
                tokens = [t for c in client.generate(prompt_token_ids=prompt, max_tokens=3, temperature=1.0,
                                                      seed=seed, ignore_eos=True, speculative=ON)
                          for t in c.token_ids]
            return tokens[1]
        with ThreadPoolExecutor(2) as pool:  # two at once: few enough decodes a step for speculation to join
            seconds = list(pool.map(draw, range(n)))
        passes, accepted = _passes(mesh)
    assert passes >= n * 0.9 and 0 < accepted < passes  # verified chunks, with proposals accepted and rejected
    counts = np.bincount(seconds, minlength=VOCAB).astype(np.float64)
    expected = expected_p * n
    keep = expected >= 5  # the rare tokens pooled into one bin
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < _chi2_critical(len(obs) - 1), (chi2, obs.tolist(), exp.round(1).tolist())
