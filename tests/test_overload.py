"""Overload of the coordinator, against real processes: 256 idle ModelStreamInfer streams (tritonclient keeps one
open per client) and 200 concurrent Generate calls at once. Health answers within a second throughout, the idle
streams hold neither a handler thread nor an admission slot, and every Generate completes with the tokens of a solo
run: generation queues (--max-waiting-requests) instead of counting against --max-concurrent-rpcs, so a burst of
several times that limit is served in full, not refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.kserve import grpc_service_pb2 as kserve_pb2
from graphmesh.kserve import grpc_service_pb2_grpc as kserve_grpc
from graphmesh.launcher import LocalMesh
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2
from tests.health_probe import HealthProbe
from tests.model_fixtures import make_tiny_llama

LIMIT = 32  # the coordinator's --max-concurrent-rpcs: non-generation calls; GENERATES is several times it
IDLE_STREAMS = 256
GENERATES = 200
MAX_TOKENS = 4
PROMPTS = [[100 + 13 * i + j for j in range(12)] for i in range(4)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    model = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    with LocalMesh(1, "numpy", str(model), kvstore=False,
                   extra_coordinator_args=["--max-concurrent-rpcs", str(LIMIT)]) as m:
        yield m


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no thread count in /proc")


def _solo(mesh: LocalMesh, prompt: list[int]) -> list[int]:
    with CoordinatorClient(mesh.coordinator_address, timeout=60) as c:
        return [t for chunk in c.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
                for t in chunk.token_ids]


async def _burst(address: str, pid: int, model: str) -> tuple[list[list[int] | str], int, int]:
    """Opens the idle streams, then fires the Generate calls at once. Returns each call's tokens (or the
    status code's name), and the coordinator's thread counts before and after the streams opened."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(8)]
    release = asyncio.Event()

    async def idle(late: bool) -> AsyncIterator[kserve_pb2.ModelInferRequest]:
        """Sends nothing until released; the `late` one then sends one prefill: a stream that idled through
        the burst still serves."""
        await release.wait()
        if late:
            ids = kserve_pb2.ModelInferRequest.InferInputTensor(
                name="input_ids", datatype="INT64", shape=[1, len(PROMPTS[0])],
                contents=kserve_pb2.InferTensorContents(int64_contents=PROMPTS[0]))
            yield kserve_pb2.ModelInferRequest(model_name=model, id="late", inputs=[ids])

    try:
        before = _threads(pid)
        streams = [kserve_grpc.GRPCInferenceServiceStub(channels[i % len(channels)]).ModelStreamInfer(idle(i == 0))
                   for i in range(IDLE_STREAMS)]
        await asyncio.sleep(2.0)  # every stream reached the server
        assert not any(s.done() for s in streams), "an idle stream was refused or ended"
        after = _threads(pid)

        async def generate(i: int) -> list[int] | str:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channels[i % len(channels)])
            request = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS,
                                                      ignore_eos=True, sampling=stage_pb2.SamplingParams())
            try:
                return [t async for r in stub.Generate(request, timeout=50) for t in r.token_ids]
            except grpc.aio.AioRpcError as e:
                return e.code().name

        results = await asyncio.gather(*(generate(i) for i in range(GENERATES)))
        assert not any(s.done() for s in streams), "an idle stream ended during the burst"
        release.set()
        late = [r async for r in streams[0]]
        assert len(late) == 1 and not late[0].error_message, late
        assert late[0].infer_response.id == "late" and late[0].infer_response.outputs[0].name == "logits"
        for s in streams[1:]:
            s.cancel()
        return list(results), before, after
    finally:
        release.set()
        for channel in channels:
            await channel.close()


@pytest.mark.serial
def test_idle_streams_and_a_burst_leave_health_answering(mesh: LocalMesh) -> None:
    solo = [_solo(mesh, p) for p in PROMPTS]
    pid = mesh.coordinator_process.pid if mesh.coordinator_process else 0
    with HealthProbe(mesh.coordinator_address) as probe:
        results, before, after = asyncio.run(_burst(mesh.coordinator_address, pid, mesh.model))
    # the idle streams hold no handler thread each (a few for the connections at most)
    assert after - before < 16, f"{IDLE_STREAMS} idle streams took {after - before} threads"
    refused = [r for r in results if isinstance(r, str)]
    assert not refused, f"{len(refused)} of {GENERATES} calls beyond --max-concurrent-rpcs were refused: {set(refused)}"
    # every call, LIMIT and the rest queued behind them while the streams idled, completed unchanged
    assert all(r == solo[i % len(PROMPTS)] for i, r in enumerate(results))
    probe.check()
    assert _solo(mesh, PROMPTS[0]) == solo[0]  # and the coordinator serves on


def test_clients_that_leave_mid_stream_give_their_slots_and_sessions_back(mesh: LocalMesh) -> None:
    """LIMIT Generate streams, each cancelled after its first token: their sessions end and their places come
    back (a cancelled call's end waits for its code on the pool, so nothing is given back twice), so a second
    round of LIMIT calls completes in full."""
    async def leave_early() -> None:
        async with grpc.aio.insecure_channel(mesh.coordinator_address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            calls = [stub.Generate(coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPTS[0], max_tokens=200,
                                                                   ignore_eos=True), timeout=50)
                     for _ in range(LIMIT)]
            for call in calls:
                await call.read()  # its first token: the session runs
            for call in calls:
                call.cancel()

    asyncio.run(leave_early())
    deadline = time.monotonic() + 20
    with CoordinatorClient(mesh.coordinator_address, timeout=60) as c:
        while True:  # Status is admin: never counted against --max-concurrent-rpcs, never refused for load
            if not c.status().active_sessions:
                break
            assert time.monotonic() < deadline, "the sessions of the clients that left never ended"
            time.sleep(0.1)

    async def full_round() -> list[list[int] | str]:
        async with grpc.aio.insecure_channel(mesh.coordinator_address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)

            async def one() -> list[int] | str:
                request = coordinator_pb2.GenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=MAX_TOKENS,
                                                          ignore_eos=True)
                try:
                    return [t async for r in stub.Generate(request, timeout=50) for t in r.token_ids]
                except grpc.aio.AioRpcError as e:
                    return e.code().name
            return list(await asyncio.gather(*(one() for _ in range(LIMIT))))

    expected = _solo(mesh, PROMPTS[1])
    assert asyncio.run(full_round()) == [expected] * LIMIT
