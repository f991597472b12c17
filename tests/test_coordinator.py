"""The main job end to end: real executor and coordinator processes on loopback, against transformers.

Random-weight Llama and GPT-2 split 1, 2 and 3 ways; SmolLM2-135M-Instruct (the bundled GGUF) over 2
executors and over 3 executors on mixed backends, greedy output token-identical to transformers loading
the same GGUF; 16 concurrent streams; bad input and a coordinator that cannot reach its executors.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import InvalidArgument, NotFound
from graphmesh.launcher import LocalMesh, free_port
from tests.model_fixtures import INIT, VOCAB, _save, make_tiny_llama, smollm2_hf, smollm2_hf_tokenizer

PROMPT = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning, my friend' into Spanish and German.",
]


def _generate_ids(address: str, **kwargs: Any) -> list[int]:
    with CoordinatorClient(address) as client:
        return [t for chunk in client.generate(**kwargs) for t in chunk.token_ids]


def _tiny(arch: str, path: Path) -> Path:
    """4 layers, so a 3-way split is possible."""
    if arch == "llama":
        return make_tiny_llama(path, seed=7, layers=4)
    torch.manual_seed(7)
    return _save(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=256,
                                            initializer_range=INIT, bos_token_id=0, eos_token_id=0)), path)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_random_models_split_1_2_3_ways_match_transformers(arch: str, tmp_path: Path) -> None:
    path = _tiny(arch, tmp_path / arch)
    hf = (LlamaForCausalLM if arch == "llama" else GPT2LMHeadModel).from_pretrained(path, dtype=torch.float32)
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
    expected_ids = expected[0, len(PROMPT):].tolist()
    for n in (1, 2, 3):
        with LocalMesh(n, "numpy", str(path), startup_timeout_s=120) as mesh:
            got = _generate_ids(mesh.coordinator_address, prompt_token_ids=PROMPT, max_tokens=40, ignore_eos=True)
        assert got == expected_ids, f"{arch} split {n} ways"


@pytest.fixture(scope="module")
def smollm2_reference() -> dict[str, list[int]]:
    """Greedy continuations of the chat-templated questions by transformers on the same GGUF."""
    model, tok = smollm2_hf(), smollm2_hf_tokenizer()
    out = {}
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        out[q] = gen[0, len(ids):].tolist()
    return out


@pytest.fixture(scope="module")
def smollm2_mesh() -> Iterator[LocalMesh]:
    with LocalMesh(2, "torch", "smollm2-135m") as mesh:
        yield mesh


@pytest.mark.slow
def test_smollm2_over_two_executors_matches_transformers(smollm2_mesh: LocalMesh,
                                                         smollm2_reference: dict[str, list[int]]) -> None:
    for q in QUESTIONS:
        assert _generate_ids(smollm2_mesh.coordinator_address, prompt=q, max_tokens=64) == smollm2_reference[q], q


@pytest.mark.slow
def test_sixteen_concurrent_streams_are_all_correct(smollm2_mesh: LocalMesh,
                                                    smollm2_reference: dict[str, list[int]]) -> None:
    jobs = [QUESTIONS[i % len(QUESTIONS)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda q: _generate_ids(smollm2_mesh.coordinator_address, prompt=q, max_tokens=24),
                                jobs))
    for q, got in zip(jobs, results):
        assert got == smollm2_reference[q][:24], q


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(smollm2_mesh: LocalMesh) -> None:
    kwargs: dict[str, Any] = {"prompt": QUESTIONS[1], "max_tokens": 24, "temperature": 0.9, "top_k": 40,
                              "top_p": 0.95, "seed": 1234}
    first = _generate_ids(smollm2_mesh.coordinator_address, **kwargs)
    assert first == _generate_ids(smollm2_mesh.coordinator_address, **kwargs)
    assert first != _generate_ids(smollm2_mesh.coordinator_address, **{**kwargs, "seed": 99})


@pytest.mark.slow
def test_bad_requests_get_clear_statuses_and_the_mesh_keeps_serving(smollm2_mesh: LocalMesh) -> None:
    address = smollm2_mesh.coordinator_address
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"prompt": ""}, InvalidArgument, "empty"),
        ({"prompt_token_ids": [1] * 9000}, InvalidArgument, "context"),
        ({"prompt": "hi", "max_tokens": 0}, InvalidArgument, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -3}, InvalidArgument, "max_tokens"),
        ({"prompt": "hi", "temperature": -1.0}, InvalidArgument, "temperature"),
        ({"prompt": "hi", "model": "no-such-model"}, NotFound, "no-such-model"),
        ({"prompt_token_ids": [10**7]}, InvalidArgument, "vocabulary"),
    ]
    for kwargs, error, words in cases:
        with pytest.raises(error) as e:
            _generate_ids(address, **{"max_tokens": 4, **kwargs})
        assert words in str(e.value), (kwargs, str(e.value))
    assert _generate_ids(address, prompt=QUESTIONS[0], max_tokens=8)  # still serving
    with CoordinatorClient(address) as client:
        status = client.status()
    assert status.ready and len(status.stages) == 2 and not status.sessions


@pytest.mark.slow
def test_three_executors_on_mixed_backends_match_transformers(smollm2_reference: dict[str, list[int]]) -> None:
    with LocalMesh(3, ["numpy", "torch", "torch"], "smollm2-135m") as mesh:
        with CoordinatorClient(mesh.coordinator_address) as client:
            assert [s.backend for s in client.status().stages] == ["numpy", "torch", "torch"]
        for q in QUESTIONS:  # 24 tokens each: the numpy stage decodes at a few tokens a second
            assert _generate_ids(mesh.coordinator_address, prompt=q, max_tokens=24) == smollm2_reference[q][:24], q


def test_coordinator_reports_an_executor_that_does_not_answer(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    run = subprocess.run([sys.executable, "-m", "graphmesh_coordinator.server", "--listen",
                          f"127.0.0.1:{free_port()}", "--executors", dead, "--startup-timeout", "2",
                          "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert dead in run.stderr and "did not answer" in run.stderr


def test_coordinator_refuses_an_unknown_model(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "graphmesh_coordinator.server", "--listen",
                          f"127.0.0.1:{free_port()}", "--executors", "127.0.0.1:1", "--model", "no-such-model",
                          "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "no-such-model" in run.stderr


def test_cli_embedded_mesh_says_why_a_text_prompt_needs_a_tokenizer(tmp_path: Path) -> None:
    path = _tiny("llama", tmp_path / "llama")  # random weights, no tokenizer: text prompts are refused clearly
    run = subprocess.run([sys.executable, "-m", "graphmesh.cli", "generate", "--prompt", "hi", "--model", str(path),
                          "--backend", "numpy", "--executors", "1", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "FAILED_PRECONDITION" in run.stderr and "prompt_token_ids" in run.stderr


@pytest.mark.parametrize("command", [["status"], ["generate", "--prompt", "hi"]])
def test_cli_says_in_one_line_when_no_coordinator_answers(command: list[str]) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    run = subprocess.run([sys.executable, "-m", "graphmesh.cli", *command, "--coordinator", address],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip() == (f"graphmesh: no coordinator answers at {address}: start a mesh with `graphmesh up`, "
                                  f"or pass --coordinator HOST:PORT"), run.stderr


def test_a_backgrounded_graphmesh_up_stops_on_sigint(tmp_path: Path) -> None:
    """A shell's background job starts with SIGINT ignored; `kill -INT` must still stop the mesh, children (its front
    end among them) too."""
    import signal

    path = _tiny("gpt2", tmp_path / "gpt2")
    up = subprocess.Popen([sys.executable, "-m", "graphmesh.cli", "up", "--model", str(path), "--backend", "numpy",
                           "--executors", "1", "--listen", f"127.0.0.1:{free_port()}", "--http-listen", "", "--frontend"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert up.stdout is not None
        lines = []
        for line in up.stdout:  # the mesh is up once it says how to stop it
            lines.append(line)
            if "Ctrl-C to stop" in line:
                break
        assert any("Ctrl-C to stop" in line for line in lines), lines
        front = next(line.split()[2] for line in lines if line.startswith("front end "))
        with CoordinatorClient(front) as client:
            assert client.status().ready
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        with grpc.insecure_channel(front) as channel:  # the front end stopped with the rest
            with pytest.raises(grpc.FutureTimeoutError):
                grpc.channel_ready_future(channel).result(timeout=2)
    finally:
        if up.poll() is None:  # SIGTERM unwinds the CLI's mesh, children included; kill only what still stands
            up.terminate()
            try:
                up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                up.kill()


@pytest.mark.slow
def test_cli_generate_json_on_smollm2(smollm2_mesh: LocalMesh) -> None:
    import json

    run = subprocess.run([sys.executable, "-m", "graphmesh.cli", "generate", "--prompt", QUESTIONS[0],
                          "--coordinator", smollm2_mesh.coordinator_address, "--max-tokens", "16", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert set(out) >= {"text", "prompt_token_ids", "token_ids", "ttft_ms", "tokens_per_s"}
    assert "Paris" in out["text"] and out["ttft_ms"] > 0 and len(out["token_ids"]) <= 16
    status = subprocess.run([sys.executable, "-m", "graphmesh.cli", "status", "--coordinator",
                             smollm2_mesh.coordinator_address, "--json"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and json.loads(status.stdout)["incarnation"]


def test_grpc_reflection_lists_the_coordinator_service(tmp_path: Path) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    path = _tiny("gpt2", tmp_path / "gpt2")
    with LocalMesh(1, "numpy", str(path)) as mesh, grpc.insecure_channel(mesh.coordinator_address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
    assert "graphmesh.v1.CoordinatorService" in names and "grpc.health.v1.Health" in names


@pytest.mark.parametrize("flag", ["--decode-steps", "--max-step-tokens"])
def test_a_negative_step_setting_is_refused_at_start(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    from graphmesh_coordinator.server import main

    with pytest.raises(SystemExit) as exit_:
        main([flag, "-1"])
    assert exit_.value.code == 2
    assert f"{flag} must be >= 0" in capsys.readouterr().err
