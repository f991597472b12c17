"""Queue, never refuse for load (issue 37): a coordinator started with default flags takes 1,000 concurrent
generation streams (gRPC Generate, KServe ModelStreamInfer and the OpenAI API together) against a CPU mesh and
completes every one, with no RESOURCE_EXHAUSTED, while gRPC health answers within a second throughout. Only past
the waiting queue's bound (--max-waiting-requests) is a request refused: RESOURCE_EXHAUSTED on gRPC, 429 on HTTP,
saying which queue was full."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import grpc.aio
import pytest

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.kserve import grpc_service_pb2 as kserve_pb2
from graphmesh.kserve import grpc_service_pb2_grpc as kserve_grpc
from graphmesh.launcher import LocalMesh, free_port
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.health_probe import HealthProbe
from tests.model_fixtures import make_tiny_llama, write_tiny_tokenizer
from tests.test_openai_api import coordinator_without_a_mesh, metric, post

STREAMS = 1000  # concurrent, all at once: far beyond the old limit of 64 calls
KSERVE, HTTP = 50, 50  # of them through KServe and the OpenAI API; the rest through Generate
MAX_TOKENS = 3
PROMPTS = [[100 + 13 * i + j for j in range(8)] for i in range(4)]
CHANNELS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a byte-level tokenizer, so that KServe's text requests are served too."""
    return write_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("llama")))


def _solo(address: str, prompt: list[int]) -> list[int]:
    with CoordinatorClient(address, timeout=60) as c:
        return [t for chunk in c.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
                for t in chunk.token_ids]


async def _http_stream(http: str, model: str, i: int) -> str:
    """One streamed /v1/completions over a raw connection (the test has no async HTTP client): "ok" once its
    [DONE] came, else the status line or the error it got."""
    host, port = http.split(":")
    body = json.dumps({"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS,
                       "ignore_eos": True, "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: " + http.encode() + b"\r\nContent-Type: application/json"
                     b"\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        response = await asyncio.wait_for(reader.read(-1), 300)
    finally:
        writer.close()
    status = response.split(b"\r\n", 1)[0].decode()
    if " 200 " not in status:
        return status
    return "ok" if b"data: [DONE]" in response else response.decode(errors="replace")[-200:]


def _kserve_request(model: str, i: int) -> kserve_pb2.ModelInferRequest:
    text = kserve_pb2.ModelInferRequest.InferInputTensor(
        name="text_input", datatype="BYTES", shape=[1], contents=kserve_pb2.InferTensorContents(bytes_contents=[b"hi"]))
    return kserve_pb2.ModelInferRequest(
        model_name=model, id=str(i), inputs=[text],
        parameters={"max_tokens": kserve_pb2.InferParameter(int64_param=MAX_TOKENS),
                    "ignore_eos": kserve_pb2.InferParameter(bool_param=True)})


async def _burst(mesh: LocalMesh, http: str) -> list[list[int] | str]:
    """Every stream at once. Returns each Generate's tokens, "ok" for each other stream that completed, else the
    status code's name (or the error) it ended with."""
    channels = [grpc.aio.insecure_channel(mesh.coordinator_address) for _ in range(CHANNELS)]

    async def generate(i: int) -> list[int] | str:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channels[i % CHANNELS])
        request = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS,
                                                  ignore_eos=True)
        try:
            return [t async for r in stub.Generate(request, timeout=300) for t in r.token_ids]
        except grpc.aio.AioRpcError as e:
            return e.code().name

    async def kserve(i: int) -> str:
        stub = kserve_grpc.GRPCInferenceServiceStub(channels[i % CHANNELS])
        try:
            responses = [r async for r in stub.ModelStreamInfer(iter([_kserve_request(mesh.model, i)]), timeout=300)]
        except grpc.aio.AioRpcError as e:
            return e.code().name
        errors = [r.error_message for r in responses if r.error_message]
        final = responses[-1].infer_response.parameters["triton_final_response"].bool_param if responses else False
        return errors[0] if errors else "ok" if final else f"{len(responses)} responses, none final"

    try:
        calls = [generate(i) for i in range(STREAMS - KSERVE - HTTP)]
        calls += [kserve(i) for i in range(KSERVE)]
        calls += [_http_stream(http, mesh.model, i) for i in range(HTTP)]
        return list(await asyncio.gather(*calls))
    finally:
        for channel in channels:
            await channel.close()


@pytest.fixture(scope="module")
def mesh(model: Path) -> Iterator[LocalMesh]:
    # Default flags: no --max-concurrent-rpcs, no --max-waiting-requests
    with LocalMesh(1, "numpy", str(model), kvstore=False, http_listen=f"127.0.0.1:{free_port()}") as m:
        yield m


@pytest.mark.serial
def test_a_thousand_concurrent_streams_all_complete_and_health_answers_throughout(mesh: LocalMesh) -> None:
    solo = [_solo(mesh.coordinator_address, p) for p in PROMPTS]
    with HealthProbe(mesh.coordinator_address) as probe:
        results = asyncio.run(_burst(mesh, mesh.http_listen))
    generated = results[:STREAMS - KSERVE - HTTP]
    others = results[STREAMS - KSERVE - HTTP:]
    refused = [r for r in results if isinstance(r, str) and r != "ok"]
    assert not refused, f"{len(refused)} of {STREAMS} streams failed: {sorted(set(refused))[:5]}"
    assert all(r == solo[i % len(PROMPTS)] for i, r in enumerate(generated))  # every one the tokens of a solo run
    assert others == ["ok"] * (KSERVE + HTTP)
    probe.check()
    assert _solo(mesh.coordinator_address, PROMPTS[0]) == solo[0]  # and the coordinator serves on


def test_past_the_waiting_queue_a_request_is_refused_saying_which_queue_was_full(tmp_path: Path, model: Path) -> None:
    """A coordinator whose executor never comes: every request waits for the mesh, so the queue fills exactly."""
    bound = 3
    grpc_port = free_port()
    with coordinator_without_a_mesh(tmp_path, "--model", str(model), "--listen", f"127.0.0.1:{grpc_port}",
                                    "--max-waiting-requests", str(bound)) as http:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            request = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPTS[0], max_tokens=MAX_TOKENS)
            # the sync stubs' calls are grpc.Future too (done, cancel); the type stubs say only _CallIterator
            waiting = [cast("grpc.Future[Any]", stub.Generate(request, timeout=60)) for _ in range(bound)]

            waits = f"http://{http}/v1"

            def until(n: int) -> None:  # the coordinator's own count of what waits in its queue
                deadline = time.monotonic() + 30
                while metric(waits, "graphmesh_waiting_requests") != n:
                    assert time.monotonic() < deadline, f"never {n} waiting requests"
                    time.sleep(0.1)
            until(bound)
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.Generate(request, timeout=10))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            details = str(refused.value.details())
            assert "waiting queue is full" in details and "--max-waiting-requests" in details, details
            assert not any(w.done() for w in waiting)  # those queued still wait
            status, body = post(f"http://{http}/v1/completions", {"model": str(model), "prompt": PROMPTS[0],
                                                                       "max_tokens": 1})
            assert status == 429 and body["error"]["type"] == "rate_limit_error", body
            assert "waiting queue is full" in body["error"]["message"], body
            for w in waiting:  # clients that leave give their places back
                w.cancel()
            until(0)
