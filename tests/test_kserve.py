"""The KServe v2 / Open Inference Protocol endpoint, driven by the real tritonclient.grpc client.

tritonclient pins protobuf < 7 and the product needs 7, so the client runs in its own venv (build/triton-venv,
made here on first use) as a subprocess: tests/kserve_client.py makes every call once and prints JSON, and the
tests below hold it against the native CoordinatorService on the same mesh (SmolLM2-135M over 2 torch executors).
Each runs twice: against the coordinator, which serves KServe over its own Generator, and against a front end, which
parses and answers the same requests and relays their sessions to the coordinator.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import InvalidArgument
from graphmesh.kserve import grpc_service_pb2 as pb
from graphmesh.kserve import grpc_service_pb2_grpc as pb_grpc
from graphmesh.launcher import LocalMesh
from graphmesh_coordinator.kserve import FINAL, pack_bytes, unpack_bytes
from tests.test_metrics import scrape, value

ROOT = Path(__file__).resolve().parents[1]
TRITON_VENV = ROOT / "build" / "triton-venv"
MODEL = "smollm2-135m"
PROMPT = "Write a haiku about the sea."
SAMPLING: dict[str, Any] = {"max_tokens": 24, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 1234}
TOKEN_IDS = [1, 504, 3458, 282, 4649, 314, 260, 1345]


def triton_python() -> Path:
    """The tritonclient venv's python, made once: never install tritonclient into the product's .venv."""
    python = TRITON_VENV / "bin" / "python"
    stamp = TRITON_VENV / ".installed"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRITON_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "tritonclient[grpc]"], check=True)
        stamp.touch()
    return python


def run_client(mode: str, config: dict[str, Any]) -> dict[str, Any]:
    """Runs tests/kserve_client.py in the tritonclient venv and returns what it printed."""
    done = subprocess.run([str(triton_python()), str(ROOT / "tests" / "kserve_client.py"), mode, json.dumps(config)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_bytes_elements_round_trip_and_truncation_is_refused() -> None:
    items = [b"", "h\u00e9llo".encode(), bytes(range(256)) * 3]
    raw = pack_bytes(items)
    assert raw[:4] == b"\x00\x00\x00\x00" and raw[4:8] == (6).to_bytes(4, "little")
    assert unpack_bytes(raw, "x") == items
    for cut in (len(raw) - 1, 2, 4 + 6 + 3):
        with pytest.raises(InvalidArgument):
            unpack_bytes(raw[:cut], "x")


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    with LocalMesh(2, "torch", MODEL, metrics=True, frontend=True) as mesh:  # metrics: whether verified chunks ran
        yield mesh


@pytest.fixture(scope="module", params=["coordinator", "frontend"])
def address(request: pytest.FixtureRequest, mesh: LocalMesh) -> str:
    """Where KServe's calls go: the coordinator's server, or the front end relaying to it."""
    return mesh.coordinator_address if request.param == "coordinator" else mesh.frontend_address


@pytest.fixture(scope="module")
def client_run(address: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    logits_path = tmp_path_factory.mktemp("kserve") / "logits.npy"
    out = run_client("check", {"address": address, "model": MODEL, "prompt": PROMPT,
                               "params": SAMPLING, "token_ids": TOKEN_IDS, "logits_path": str(logits_path)})
    out["logits"] = np.load(logits_path)
    return out


@pytest.fixture(scope="module")
def native_text(mesh: LocalMesh) -> str:
    """What `graphmesh generate` prints for the same prompt, seed and sampling parameters."""
    with CoordinatorClient(mesh.coordinator_address) as client:
        return "".join(chunk.text for chunk in client.generate(PROMPT, **SAMPLING))


@pytest.mark.slow
def test_health_and_metadata(client_run: dict[str, Any], mesh: LocalMesh) -> None:
    assert client_run["live"] is True and client_run["ready"] is True and client_run["model_ready"] is True
    assert client_run["server_metadata"]["name"] == "graphmesh"
    assert client_run["server_metadata"]["version"]
    with CoordinatorClient(mesh.coordinator_address) as client:
        vocab = int(client.compute_logits(TOKEN_IDS).size)
    assert client_run["model_metadata"] == {
        "name": MODEL, "versions": ["1"], "platform": "graphmesh",
        "inputs": {"input_ids": ["INT64", [1, -1]], "text_input": ["BYTES", [1]]},
        "outputs": {"logits": ["FP32", [1, vocab]], "text_output": ["BYTES", [1]]}}


@pytest.mark.slow
def test_text_generation_is_identical_to_graphmesh_generate(client_run: dict[str, Any], native_text: str) -> None:
    assert native_text  # 24 sampled tokens of a chat reply are never all swallowed
    assert client_run["text"]["text"] == native_text
    assert client_run["text"]["id"] == "text-1"
    assert client_run["text"]["finish_reason"] in ("length", "eos")


@pytest.mark.slow
def test_logits_equal_the_native_path(client_run: dict[str, Any], mesh: LocalMesh) -> None:
    with CoordinatorClient(mesh.coordinator_address) as client:
        expected = client.compute_logits(TOKEN_IDS)
    got = client_run["logits"]
    assert client_run["logits_dtype"] == "float32" and got.shape == (1, expected.size)
    np.testing.assert_allclose(got.reshape(-1), expected.reshape(-1).astype(np.float32), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_streaming_gives_the_same_text_piece_by_piece(client_run: dict[str, Any], native_text: str) -> None:
    stream = client_run["stream"]
    assert stream["errors"] == []
    s1 = stream["responses"]["s-1"]
    assert "".join(s1["chunks"]) == native_text
    assert len(s1["chunks"]) > 1  # one response per piece, not one at the end
    assert s1["finals"] == [False] * (len(s1["finals"]) - 1) + [True]


@pytest.mark.slow
def test_bad_requests_get_the_protocol_statuses_and_the_server_keeps_serving(client_run: dict[str, Any],
                                                                              native_text: str) -> None:
    errors = client_run["errors"]
    for case in ("unknown_model", "unknown_model_ready", "unknown_model_metadata"):
        assert errors[case]["status"] == "StatusCode.NOT_FOUND", case
        assert "no-such-model" in errors[case]["message"]
    for case in ("wrong_datatype", "shape_mismatch", "text_shape_mismatch", "bad_parameter"):
        assert errors[case]["status"] == "StatusCode.INVALID_ARGUMENT", case
    assert "INT32" in errors["wrong_datatype"]["message"] and "INT64" in errors["wrong_datatype"]["message"]
    assert "shape" in errors["shape_mismatch"]["message"]
    assert "max_tokens" in errors["bad_parameter"]["message"]
    # On a stream the errors travel in-band, and the good request sent after them on the same stream completes.
    after = client_run["stream_after_error"]
    assert sorted(m.split(":")[0] for m in after["errors"]) == ["INVALID_ARGUMENT", "NOT_FOUND"]
    assert "".join(after["responses"]["s-2"]["chunks"]) == native_text
    assert set(after["responses"]) == {"s-2"}
    assert client_run["text_after_errors"]["text"] == native_text


@pytest.mark.slow
def test_typed_contents_and_the_rarer_refusals_over_our_own_stubs(mesh: LocalMesh, address: str) -> None:
    """What tritonclient never sends (typed contents instead of raw bytes) and the refusals it cannot provoke,
    through graphmesh's own stubs of the same wire protocol."""
    Tensor = pb.ModelInferRequest.InferInputTensor
    with grpc.insecure_channel(address) as channel, \
            CoordinatorClient(mesh.coordinator_address) as native:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        ids = Tensor(name="input_ids", datatype="INT64", shape=[1, len(TOKEN_IDS)],
                     contents=pb.InferTensorContents(int64_contents=TOKEN_IDS))
        reply = stub.ModelInfer(pb.ModelInferRequest(model_name=MODEL, inputs=[ids], id="typed"), timeout=120)
        assert reply.id == "typed" and [(o.name, o.datatype, list(o.shape)) for o in reply.outputs] == \
            [("logits", "FP32", [1, len(reply.raw_output_contents[0]) // 4])]
        np.testing.assert_allclose(np.frombuffer(reply.raw_output_contents[0], "<f4"),
                                   native.compute_logits(TOKEN_IDS).reshape(-1), rtol=0, atol=1e-5)

        text = Tensor(name="text_input", datatype="BYTES", shape=[1], contents=pb.InferTensorContents(
            bytes_contents=[PROMPT.encode()]))
        greedy = {"max_tokens": pb.InferParameter(int64_param=8), "raw": pb.InferParameter(bool_param=True)}
        reply = stub.ModelInfer(pb.ModelInferRequest(model_name=MODEL, inputs=[text], parameters=greedy), timeout=120)
        assert unpack_bytes(reply.raw_output_contents[0], "text_output") == \
            ["".join(c.text for c in native.generate(PROMPT, max_tokens=8, raw=True)).encode()]

        # A logits request on the stream is one response, the final one.
        streamed = list(stub.ModelStreamInfer(iter([pb.ModelInferRequest(model_name=MODEL, inputs=[ids], id="s")]),
                                              timeout=120))
        assert [(r.error_message, r.infer_response.id, r.infer_response.parameters[FINAL].bool_param)
                for r in streamed] == [("", "s", True)]

        raw_text = pack_bytes([PROMPT.encode()])
        bad: dict[str, tuple[pb.ModelInferRequest, grpc.StatusCode]] = {
            "unknown version": (pb.ModelInferRequest(model_name=MODEL, model_version="2", inputs=[ids]),
                                grpc.StatusCode.NOT_FOUND),
            "unknown input": (pb.ModelInferRequest(model_name=MODEL, inputs=[Tensor(name="prompt", datatype="BYTES",
                                                                                     shape=[1])],
                                                   raw_input_contents=[raw_text]), grpc.StatusCode.INVALID_ARGUMENT),
            "two inputs": (pb.ModelInferRequest(model_name=MODEL, inputs=[ids, text]), grpc.StatusCode.INVALID_ARGUMENT),
            "raw and typed": (pb.ModelInferRequest(model_name=MODEL, inputs=[ids],
                                                   raw_input_contents=[np.array(TOKEN_IDS, "<i8").tobytes()]),
                              grpc.StatusCode.INVALID_ARGUMENT),
            "truncated bytes": (pb.ModelInferRequest(model_name=MODEL, inputs=[Tensor(name="text_input",
                                                                                       datatype="BYTES", shape=[1])],
                                                     raw_input_contents=[raw_text[:-1]]),
                                grpc.StatusCode.INVALID_ARGUMENT),
            "output of the other kind": (pb.ModelInferRequest(
                model_name=MODEL, inputs=[ids], outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(
                    name="text_output")]), grpc.StatusCode.INVALID_ARGUMENT),
            "top_p out of range": (pb.ModelInferRequest(model_name=MODEL, inputs=[text], parameters={
                "top_p": pb.InferParameter(double_param=1.5)}), grpc.StatusCode.INVALID_ARGUMENT),
            "negative seed": (pb.ModelInferRequest(model_name=MODEL, inputs=[text], parameters={
                "seed": pb.InferParameter(int64_param=-1)}), grpc.StatusCode.INVALID_ARGUMENT),
        }
        for case, (request, code) in bad.items():
            with pytest.raises(grpc.RpcError) as failed:
                stub.ModelInfer(request, timeout=120)
            assert failed.value.code() == code, (case, failed.value.details())
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live


GROUNDED = ("Repeat this passage word for word: The lighthouse keeper climbed the spiral stairs every evening at dusk, "
            "lit the great lamp, and wrote the weather, the ships that passed and the state of the sea in a logbook.")


@pytest.mark.slow
def test_the_speculative_parameter_keeps_every_token_and_refuses_bad_values(mesh: LocalMesh, address: str) -> None:
    """`speculative` as Generate's field: prompt lookup verifies proposals (the coordinator counts its passes) and
    the text is that of the same request without it, greedy and seeded; a bad value is INVALID_ARGUMENT naming it,
    on ModelInfer and in-band on ModelStreamInfer."""
    Tensor = pb.ModelInferRequest.InferInputTensor
    text = Tensor(name="text_input", datatype="BYTES", shape=[1])

    def request(extra: dict[str, pb.InferParameter], sampling: dict[str, pb.InferParameter]) -> pb.ModelInferRequest:
        params = {"max_tokens": pb.InferParameter(int64_param=40), "ignore_eos": pb.InferParameter(bool_param=True),
                  **sampling, **extra}
        return pb.ModelInferRequest(model_name=MODEL, inputs=[text], parameters=params,
                                    raw_input_contents=[pack_bytes([GROUNDED.encode()])])

    def passes() -> float:
        return value(scrape(mesh.metrics_ports["coordinator"]), "graphmesh_speculative_passes_total")

    seeded = {"temperature": pb.InferParameter(double_param=0.8), "top_k": pb.InferParameter(int64_param=40),
              "seed": pb.InferParameter(int64_param=11)}
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        def infer(extra: dict[str, pb.InferParameter], sampling: dict[str, pb.InferParameter]) -> str:
            reply = stub.ModelInfer(request(extra, sampling), timeout=300)
            return unpack_bytes(reply.raw_output_contents[0], "text_output")[0].decode()

        for sampling in ({}, seeded):
            before = passes()
            plain = infer({}, sampling)  # the coordinator's default: off
            assert passes() == before
            assert plain  # 40 tokens of a repeated passage
            for mode in ("prompt-lookup", "prompt-lookup:8", "off"):
                assert infer({"speculative": pb.InferParameter(string_param=mode)}, sampling) == plain, mode
            assert passes() > before  # proposals were verified: the equality is not vacuous

        bad = {"draft:smollm2-135m": "draft", "prompt-lookup:99": "[1, 16]", "sometimes": "'sometimes'"}
        for mode, words in bad.items():
            with pytest.raises(grpc.RpcError) as failed:
                stub.ModelInfer(request({"speculative": pb.InferParameter(string_param=mode)}, {}), timeout=60)
            assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, mode
            assert "speculative" in (failed.value.details() or "") or "draft" in mode, failed.value.details()
            assert words in (failed.value.details() or ""), failed.value.details()
        with pytest.raises(grpc.RpcError) as failed:
            stub.ModelInfer(request({"speculative": pb.InferParameter(int64_param=4)}, {}), timeout=60)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'speculative' must be string_param" in (failed.value.details() or "")

        streamed = list(stub.ModelStreamInfer(iter([request({"speculative": pb.InferParameter(
            string_param="ngram")}, {})]), timeout=60))
        assert len(streamed) == 1 and streamed[0].error_message.startswith("INVALID_ARGUMENT: ")
        assert "speculative" in streamed[0].error_message and "'ngram'" in streamed[0].error_message


@pytest.mark.slow
def test_a_client_that_leaves_ends_its_session(mesh: LocalMesh, address: str) -> None:
    """A ModelStreamInfer stream cancelled after its first piece, and a ModelInfer call cancelled while it generates:
    the coordinator's sessions end with them, where each would otherwise generate 2,000 tokens."""
    long = {"max_tokens": pb.InferParameter(int64_param=2000), "ignore_eos": pb.InferParameter(bool_param=True)}
    request = pb.ModelInferRequest(model_name=MODEL, id="long", parameters=long,
                                   inputs=[pb.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES",
                                                                                 shape=[1])],
                                   raw_input_contents=[pack_bytes([PROMPT.encode()])])

    def sessions_end(native: CoordinatorClient) -> None:
        deadline = time.monotonic() + 60  # a bound on a hang, not a timing
        while native.status().active_sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert native.status().active_sessions == 0

    with grpc.insecure_channel(address) as channel, CoordinatorClient(mesh.coordinator_address) as native:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stream = stub.ModelStreamInfer(iter([request]), timeout=300)
        first = next(stream)
        assert first.error_message == "" and not first.infer_response.parameters[FINAL].bool_param
        assert native.status().active_sessions == 1
        stream.cancel()
        sessions_end(native)

        unary = stub.ModelInfer.future(request, timeout=300)
        deadline = time.monotonic() + 60
        while not native.status().active_sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert native.status().active_sessions == 1 and not unary.done()
        unary.cancel()
        sessions_end(native)
