"""Speculative decoding by a draft model (issue 39, item 1): --speculative draft:MODEL on real meshes.

The draft (a tiny random Llama truncated to fewer layers, or the target itself) runs on an executor of its own
through the stage protocol; its greedy tokens are verified as prompt lookup's are. It never changes a token:
greedy and seeded streams are token-identical with it on and off over 1 and 2 executors, alone and 16 at once, and
across a kill -9 of the draft's executor and of a target stage. The target as its own draft accepts nearly every
proposal. A draft asked of a coordinator without one is refused by name (gRPC INVALID_ARGUMENT, HTTP 400).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import InvalidArgument
from graphmesh.launcher import LocalMesh, free_port
from graphmesh.v1 import coordinator_pb2 as cpb
from graphmesh_coordinator import speculative
from graphmesh_coordinator.speculative import Mode, parse_mode
from graphmesh_server import faults
from tests.model_fixtures import VOCAB, make_tiny_llama
from tests.test_metrics import scrape, value
from tests.test_speculative import ONE_TOKEN_STEPS

DRAFT = cpb.SpeculativeDecoding(method=cpb.SPECULATIVE_METHOD_DRAFT, max_proposed=4)
OFF = cpb.SpeculativeDecoding(method=cpb.SPECULATIVE_METHOD_OFF)
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(n)] for n in (5, 19, 33)]
SEEDED = {"temperature": 0.8, "top_k": 40, "seed": 11}


# -- modes -------------------------------------------------------------------------------------------------------
def test_draft_modes_parse_and_refuse_clearly() -> None:
    assert parse_mode("draft:/models/a") == Mode("draft", speculative.DEFAULT_K, "/models/a")
    assert parse_mode("draft:/models/a:7") == Mode("draft", 7, "/models/a")
    assert parse_mode("draft:c:\\m:b") == Mode("draft", speculative.DEFAULT_K, "c:\\m:b")  # colons in the path
    assert str(parse_mode("draft:smollm2-135m:3")) == "draft:smollm2-135m k=3"
    for bad in ("draft", "draft:", "draft:m:0", "draft:m:99"):
        with pytest.raises(InvalidArgument) as e:
            parse_mode(bad)
        assert e.value.reason == "BAD_SPECULATIVE"
    drafting, looking = Mode("draft", 4, "m"), Mode("prompt-lookup", 4)
    assert speculative.from_json({"method": "draft"}, drafting) == drafting
    assert speculative.from_json("draft:2", drafting) == Mode("draft", 2, "m")
    assert speculative.from_json("prompt-lookup", drafting) == Mode("prompt-lookup", 4)
    assert speculative.from_proto(DRAFT, drafting) == drafting
    asks: list[Callable[[Mode], Mode]] = [lambda d: speculative.from_json({"method": "draft"}, d),
                                          lambda d: speculative.from_json("draft", d),
                                          lambda d: speculative.from_proto(DRAFT, d)]
    for ask in asks:
        with pytest.raises(InvalidArgument) as e:
            ask(looking)
        assert e.value.reason == "NO_DRAFT_MODEL" and "--speculative draft:MODEL" in e.value.message
    with pytest.raises(InvalidArgument) as e:
        speculative.from_json("draft:other-model", drafting)  # only the coordinator's own draft is installed
    assert "other-model" in e.value.message


# -- real meshes -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 3-layer target whose last layer writes little to the residual stream, and the draft: the target truncated
    to its first two layers (same embeddings, norm and head). Random weights would otherwise make a draft that
    agrees with its target about never, and equality with nothing accepted proves little."""
    root = tmp_path_factory.mktemp("models")
    target = make_tiny_llama(root / "target", seed=5, layers=3)
    model = LlamaForCausalLM.from_pretrained(target)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        last = model.model.layers[2]
        last.self_attn.o_proj.weight.mul_(0.2)
        last.mlp.down_proj.weight.mul_(0.2)
    model.save_pretrained(target)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    model.save_pretrained(root / "draft")
    return target, root / "draft"


def _mesh(executors: int, target: Path, draft: Path | None, **kw: Any) -> LocalMesh:
    """A mesh of the target; with a draft, one more executor runs it (LocalMesh.draft_executor)."""
    extra = ["--speculative", f"draft:{draft}", *ONE_TOKEN_STEPS] if draft is not None else []
    return LocalMesh(executors, "torch", str(target), kvstore=False, metrics=True, fault_injection=True,
                     extra_coordinator_args=extra, draft_executor=draft is not None, **kw)


@pytest.fixture(scope="module", params=[1, 2])
def drafted(request: pytest.FixtureRequest, models: tuple[Path, Path]) -> Iterator[LocalMesh]:
    with _mesh(request.param, *models) as m:
        yield m


def _generate(address: str, prompt: list[int], spec: cpb.SpeculativeDecoding, **kw: Any) -> list[int]:
    with CoordinatorClient(address) as client:
        return [t for chunk in client.generate(prompt_token_ids=prompt, speculative=spec, ignore_eos=True, **kw)
                for t in chunk.token_ids]


def _counters(mesh: LocalMesh) -> dict[str, float]:
    samples = scrape(mesh.metrics_ports["coordinator"])
    return {name: value(samples, f"graphmesh_speculative_{name}_total")
            for name in ("passes", "proposed_tokens", "accepted_tokens", "draft_steps")}


def _delta(mesh: LocalMesh, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in _counters(mesh).items()}


@pytest.mark.slow
def test_greedy_and_seeded_streams_equal_with_a_draft_on_and_off(drafted: LocalMesh) -> None:
    address, before = drafted.coordinator_address, _counters(drafted)
    for prompt in PROMPTS:
        for sampling in ({}, SEEDED):
            off = _generate(address, prompt, OFF, max_tokens=32, **sampling)
            assert _generate(address, prompt, DRAFT, max_tokens=32, **sampling) == off
    d = _delta(drafted, before)
    # the draft ran and verified chunks took some of its tokens: equality is not vacuous
    assert d["draft_steps"] > 0 and d["passes"] > 0 and d["accepted_tokens"] > 0, d


@pytest.mark.slow
def test_sixteen_streams_equal_their_solo_runs_without_speculation(drafted: LocalMesh) -> None:
    """16 at once (the coordinator's default is the draft): speculation steps aside while steps are busy and joins,
    with every drafting session of a step in one batched draft step, as they thin out. The last stream outlives the
    others by 24 tokens, so the steps thin to one session on any host, however the others' steps interleave."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(16)]
    jobs = [dict(max_tokens=48 if i == 15 else 8 + 4 * (i % 5), **({"temperature": 0.7, "seed": 100 + i} if i % 2 else {}))
            for i in range(16)]
    solo = [_generate(drafted.coordinator_address, p, OFF, **job) for p, job in zip(prompts, jobs)]
    before = _counters(drafted)
    with ThreadPoolExecutor(16) as pool:
        batched = list(pool.map(lambda pj: _generate(drafted.coordinator_address, pj[0],
                                                     cpb.SpeculativeDecoding(), **pj[1]), zip(prompts, jobs)))
    assert batched == solo
    assert _delta(drafted, before)["draft_steps"] > 0


def _kill9(process: subprocess.Popen[bytes] | None) -> None:
    assert process is not None
    faults.kill9(process)


def _streams_across(m: LocalMesh, kill: Any, n: int = 48) -> None:
    """A greedy and a seeded stream draft side by side; `kill` runs once both have tokens. Both must be the tokens
    of fault-free runs with speculation off."""
    address, prompt = m.coordinator_address, PROMPTS[1]
    jobs: list[dict[str, Any]] = [{}, SEEDED]
    baseline = [_generate(address, prompt, OFF, max_tokens=n, **job) for job in jobs]
    delivered = [0, 0]

    def stream(i: int) -> list[int]:
        out: list[int] = []
        with CoordinatorClient(address) as client:
            for chunk in client.generate(prompt_token_ids=prompt, speculative=DRAFT, ignore_eos=True, max_tokens=n,
                                         **jobs[i]):
                out += chunk.token_ids
                delivered[i] = len(out)
        return out

    before = _counters(m)
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream, i) for i in range(2)]
        deadline = time.monotonic() + 300
        while min(delivered) < 8:
            assert time.monotonic() < deadline and not any(f.done() for f in streams), delivered
            time.sleep(0.005)
        kill()
        assert [f.result() for f in streams] == baseline
    assert _delta(m, before)["draft_steps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("drafted", [2], indirect=True)  # one executor has no other to re-plan its stage over
def test_a_kill_9_of_a_target_stage_changes_no_token(drafted: LocalMesh) -> None:
    _streams_across(drafted, lambda: faults.kill9(drafted.executor_processes[-1]))


@pytest.mark.slow
def test_a_kill_9_of_the_draft_changes_no_token_and_the_draft_comes_back(drafted: LocalMesh) -> None:
    """The draft's executor dies mid-stream: the sessions fall back to prompt lookup (same tokens); restarted at its
    address, the draft is installed again and drafts."""
    _streams_across(drafted, lambda: _kill9(drafted.draft_process))
    drafted.start_draft_executor()
    deadline = time.monotonic() + 60
    while True:
        before = _counters(drafted)
        off = _generate(drafted.coordinator_address, PROMPTS[0], OFF, max_tokens=12)
        assert _generate(drafted.coordinator_address, PROMPTS[0], DRAFT, max_tokens=12) == off
        if _delta(drafted, before)["draft_steps"] > 0:
            break
        assert time.monotonic() < deadline, "the draft never came back"
        time.sleep(0.5)


@pytest.mark.slow
def test_the_target_as_its_own_draft_accepts_nearly_everything(models: tuple[Path, Path]) -> None:
    target = models[0]
    with _mesh(1, target, target) as m:
        before = _counters(m)
        for prompt in PROMPTS:
            off = _generate(m.coordinator_address, prompt, OFF, max_tokens=40)
            assert _generate(m.coordinator_address, prompt, DRAFT, max_tokens=40) == off
        d = _delta(m, before)
    assert d["draft_steps"] > 0 and d["proposed_tokens"] > 0
    assert d["accepted_tokens"] >= 0.95 * d["proposed_tokens"], d  # greedy draft == greedy target, bit for bit


@pytest.mark.slow
def test_a_draft_without_a_draft_model_is_refused_by_name(models: tuple[Path, Path]) -> None:
    http = f"127.0.0.1:{free_port()}"
    with _mesh(1, models[0], None, http_listen=http) as m:
        with pytest.raises(InvalidArgument) as e:  # the client's typed error for gRPC's INVALID_ARGUMENT
            _generate(m.coordinator_address, PROMPTS[0], DRAFT, max_tokens=4)
        assert e.value.reason == "NO_DRAFT_MODEL" and "--speculative draft:MODEL" in e.value.message
        assert e.value.metadata.get("parameter") == "speculative.method"
        body = {"model": str(models[0]), "prompt": PROMPTS[0], "max_tokens": 4, "speculative": {"method": "draft"}}
        request = urllib.request.Request(f"{m.http_url}/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        text = refused.value.read().decode()
        assert refused.value.code == 400 and "speculative" in text and "--speculative draft:MODEL" in text, text


def test_a_coordinator_refuses_a_draft_it_cannot_run(models: tuple[Path, Path], tmp_path: Path) -> None:
    """At start, by flag: no --draft-executor, one of the target's executors, or a draft of another vocabulary."""
    other = make_tiny_llama(tmp_path / "other", seed=1, layers=1)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB - 1}))
    for extra, needle in ((["--speculative", f"draft:{models[1]}"], "--draft-executor"),
                          (["--speculative", f"draft:{models[1]}", "--draft-executor", "127.0.0.1:1"], "of its own"),
                          (["--speculative", f"draft:{other}", "--draft-executor", "127.0.0.1:2"], "vocabulary")):
        done = subprocess.run([sys.executable, "-m", "graphmesh_coordinator.server", "--listen",
                               f"127.0.0.1:{free_port()}", "--executors", "127.0.0.1:1", "--model", str(models[0]),
                               "--state-dir", str(tmp_path / "state"), *extra], capture_output=True, timeout=120)
        assert done.returncode != 0 and needle in done.stderr.decode(), done.stderr.decode()[-2000:]
