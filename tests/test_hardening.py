"""Issue 42: no single request, connection pattern or member call stalls or stops the mesh. Each finding of the
adversarial run is reproduced against real processes on loopback and shown handled: a huge prompt is refused
within a second while health answers throughout and nothing is fenced; idle HTTP connections past the cap are
closed as they are accepted; a far-ahead Fence does not keep the mesh down; every public field swept with
boundary values gets a 400 / INVALID_ARGUMENT, never a 500 / INTERNAL."""

from __future__ import annotations

import json
import math
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from graphmesh import channels, security
from graphmesh.kserve import grpc_service_pb2 as kserve_pb2
from graphmesh.kserve import grpc_service_pb2_grpc as kserve_grpc
from graphmesh.launcher import LocalMesh, free_port
from graphmesh.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from graphmesh_coordinator.http_limits import REQUEST_TIMEOUT_S
from tests.health_probe import HealthProbe
from tests.model_fixtures import make_tiny_llama, write_tiny_tokenizer

HTTP_CAP = 48  # --http-max-connections of the mesh under test: small, so that the test reaches it in bounded time
INT32_MAX, INT64_MAX, UINT64_MAX = (1 << 31) - 1, (1 << 63) - 1, (1 << 64) - 1


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def mesh(model: Path) -> Iterator[LocalMesh]:
    with LocalMesh(2, "numpy", str(model), http_listen=f"127.0.0.1:{free_port()}", kvstore=False,
                   extra_coordinator_args=["--http-max-connections", str(HTTP_CAP)]) as m:
        yield m


def _member(mesh: LocalMesh, address: str) -> grpc.Channel:  # a channel as a mesh member opens it
    return channels.channel(address, None, mesh_token=mesh.mesh_token)


def _status(mesh: LocalMesh) -> coordinator_pb2.StatusResponse:
    with grpc.insecure_channel(mesh.coordinator_address) as channel:
        return coordinator_pb2_grpc.CoordinatorServiceStub(channel).Status(coordinator_pb2.StatusRequest(), timeout=10)


def _http_port(mesh: LocalMesh) -> int:
    return int(mesh.http_listen.rpartition(":")[2])


def _post(mesh: LocalMesh, path: str, body: bytes, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://{mesh.http_listen}{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


# -- 1: a huge prompt is refused before any work, health answers throughout, nothing is fenced --------------------
def test_huge_prompts_are_refused_at_once_and_health_answers(mesh: LocalMesh) -> None:
    before = _status(mesh)
    huge = "a" * (16 << 20)
    with HealthProbe(mesh.coordinator_address, f"http://{mesh.http_listen}") as probe:
        t0 = time.monotonic()
        status, body = _post(mesh, "/v1/completions", json.dumps({"model": before.model, "prompt": huge}).encode())
        http_s = time.monotonic() - t0
        assert status == 400 and body["error"]["code"] == "prompt_too_large", body
        with grpc.insecure_channel(mesh.coordinator_address, options=[("grpc.max_send_message_length", 64 << 20)]) \
                as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            t0 = time.monotonic()
            code = _code(lambda: list(stub.Generate(coordinator_pb2.GenerateRequest(prompt=huge[: 4 << 20], raw=True,
                                                                                   max_tokens=1), timeout=30)))
            grpc_s = time.monotonic() - t0
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            kserve = kserve_grpc.GRPCInferenceServiceStub(channel)
            request = kserve_pb2.ModelInferRequest(model_name=before.model, raw_input_contents=[
                len(huge[: 8 << 20]).to_bytes(4, "little") + huge[: 8 << 20].encode()])
            request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
            t0 = time.monotonic()
            code = _code(lambda: kserve.ModelInfer(request, timeout=30))
            kserve_s = time.monotonic() - t0
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            # Just under the byte limit: tokenized (about a second of work), then refused for the context; the
            # tokenizer runs without the GIL, so health is not held up meanwhile.
            code = _code(lambda: list(stub.Generate(coordinator_pb2.GenerateRequest(
                prompt="b" * ((1 << 20) - 64), raw=True, max_tokens=1), timeout=30)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert max(http_s, grpc_s, kserve_s) < 1.0, (http_s, grpc_s, kserve_s)
    assert not probe.failures and probe.slowest_s < 1.0, (probe.failures, probe.slowest_s)
    after = _status(mesh)
    assert (after.incarnation, after.recoveries, after.ready) == (before.incarnation, before.recoveries, True)


# -- 2: connections beyond the cap are closed at accept; health answers --------------------------------------------
def _closed(sock: socket.socket, wait_s: float) -> bool:
    sock.settimeout(wait_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:  # reset
        return True


def test_idle_connections_past_the_cap_are_refused_at_accept(mesh: LocalMesh) -> None:
    port, extra = _http_port(mesh), 1000
    held: list[socket.socket] = []
    try:
        with HealthProbe(mesh.coordinator_address) as probe:  # the HTTP API is full: gRPC health answers
            for _ in range(HTTP_CAP + extra):
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(0.5)
            # the first HTTP_CAP stay open (idle, under the request timeout); the rest were closed as accepted
            open_ones = [s for s in held if not _closed(s, 0.01)]
            assert HTTP_CAP - 2 <= len(open_ones) <= HTTP_CAP, len(open_ones)
            # the idle ones are closed by the server once they sent no request for REQUEST_TIMEOUT_S: the HTTP API
            # then serves again though this client still holds every socket
            deadline = time.monotonic() + REQUEST_TIMEOUT_S + 5
            while True:
                try:
                    with urllib.request.urlopen(f"http://{mesh.http_listen}/health", timeout=1.0) as r:
                        assert r.status == 200
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            assert time.monotonic() > deadline - 5 - 2 - 0.5  # not before the idle ones timed out (give or take)
            assert all(_closed(s, 0.01) for s in open_ones)
        assert not probe.failures and probe.slowest_s < 1.0, (probe.failures, probe.slowest_s)
    finally:
        for s in held:
            s.close()
    log = mesh.log("coordinator").read_text()
    assert log.count("HTTP connection refused") <= 60, "the refusals' log is rate-limited"


IDLE_CONNECTIONS = 25_000  # the issue's acceptance figure
DESCRIPTOR_RESERVE = 400  # left to the test process itself: its channels, the probe, pytest, the mesh's pipes


def test_idle_connections_by_the_ten_thousand_leave_health_answering(model: Path) -> None:
    """Issue 42's acceptance: 25,000 idle connections to the HTTP port of a coordinator with its default bound,
    opened in loops of 1,000, leave gRPC health answering within 1 s throughout, and /health answers again once
    the idle ones are timed out. The test client holds every connection, so it opens as many as its
    RLIMIT_NOFILE allows (the soft limit raised to the hard one, less DESCRIPTOR_RESERVE): on a host whose hard
    limit is under 25,000 + the reserve (20,000 on the development VM) it opens fewer than 25,000, and says how many
    in the assertion messages. Past the bound the coordinator closes them as it accepts them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    target = min(IDLE_CONNECTIONS, hard - DESCRIPTOR_RESERVE) if hard != resource.RLIM_INFINITY else IDLE_CONNECTIONS
    held: list[socket.socket] = []
    try:
        with LocalMesh(1, "numpy", str(model), http_listen=f"127.0.0.1:{free_port()}", kvstore=False) as mesh:
            port = _http_port(mesh)
            with HealthProbe(mesh.coordinator_address) as probe:
                failed = 0
                while len(held) + failed < target:
                    for _ in range(min(1000, target - len(held) - failed)):
                        try:
                            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                        except OSError:  # the accept queue full for 5 s: counted, and the loop goes on
                            failed += 1
                    time.sleep(0.1)
                time.sleep(2.0)  # every one held at once, for a while
            assert len(held) >= 0.95 * target, f"{len(held)} of {target} connections opened ({failed} failed)"
            probe.check()
            # The idle ones the coordinator kept are closed after REQUEST_TIMEOUT_S; /health then answers at once
            # though this client still holds every socket.
            deadline = time.monotonic() + REQUEST_TIMEOUT_S + 10
            while True:
                try:
                    with urllib.request.urlopen(f"http://{mesh.http_listen}/health", timeout=1.0) as r:
                        assert r.status == 200
                        break
                except OSError:
                    assert time.monotonic() < deadline, f"/health never answered with {len(held)} connections held"
                    time.sleep(0.5)
            assert _status(mesh).ready
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_connection_that_sends_no_request_is_closed() -> None:
    """In-process, with a short request timeout: a connection that never completes a request's headers (silent, or
    a byte at a time) is closed; one that sends a request is answered."""
    import asyncio

    import uvicorn

    from graphmesh_coordinator.http_limits import guarded_protocol

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http=guarded_protocol(3, 0.5)))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        silent = socket.create_connection(("127.0.0.1", port))
        slow = socket.create_connection(("127.0.0.1", port))
        served = socket.create_connection(("127.0.0.1", port))
        refused = socket.create_connection(("127.0.0.1", port))
        assert _closed(refused, 1.0), "the fourth connection is past the cap of 3"
        served.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert served.recv(1024).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\n":
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                break
            if _closed(slow, 0.2):
                break
        assert time.monotonic() - t0 < 3.0, "a connection sending its headers a byte at a time was kept"
        assert _closed(silent, 2.0)
    finally:
        server.should_exit = True
        thread.join(5)


# -- 4: every public field swept with boundary values: 400 / INVALID_ARGUMENT, never 500 / INTERNAL --------------
BAD_NUMBERS: list[Any] = [2 ** 40, 2 ** 70, -1, -(2 ** 63), float("nan"), float("inf"), -float("inf"), 0, 1e308]
BAD_TEXT: list[Any] = ["", "\udfff", "\ud800x", "\x00\x01\x1b[2J", "a" * 70_000, 7, None, [], {}]
HTTP_FIELDS = {"max_tokens": BAD_NUMBERS, "temperature": BAD_NUMBERS, "top_p": BAD_NUMBERS, "top_k": BAD_NUMBERS,
               "seed": BAD_NUMBERS, "n": BAD_NUMBERS, "frequency_penalty": BAD_NUMBERS,
               "presence_penalty": BAD_NUMBERS, "model": BAD_TEXT, "stop": [*BAD_TEXT, ["\udfff"], [""] * 40],
               "logit_bias": [{"\udfff": 1.0}, {"1": float("nan")}], "response_format": [{"type": "\udfff"}, []]}


def _json(body: dict[str, Any]) -> bytes:
    # NaN and Infinity as Python's json writes them (JSON has neither; many clients send them anyway)
    return json.dumps(body).encode()


def test_http_fields_swept_with_boundary_values(mesh: LocalMesh) -> None:
    model = _status(mesh).model
    failures = []
    bases = {"/v1/completions": {"model": model, "prompt": "hi", "max_tokens": 1},
             "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}
    cases: list[tuple[str, dict[str, Any]]] = []
    for path, base in bases.items():
        for name, values in HTTP_FIELDS.items():
            cases += [(path, {**base, name: v}) for v in values]
    cases += [("/v1/completions", {**bases["/v1/completions"], "prompt": v}) for v in [*BAD_TEXT, [2 ** 40], [-1],
                                                                                       [[]], ["\udfff"]]]
    cases += [("/v1/chat/completions", {**bases["/v1/chat/completions"], "messages": [{"role": r, "content": c}]})
              for r, c in [("user", "\udfff"), ("\udfff", "hi"), ("user", "\x00"), ("tool", None), ("", ""),
                           ("user", [{"type": "text", "text": "\udfff"}])]]
    cases += [("/v1/chat/completions", {**bases["/v1/chat/completions"], "top_logprobs": v, "logprobs": True})
              for v in BAD_NUMBERS]
    for path, body in cases:
        status, answer = _post(mesh, path, _json(body))
        if status >= 500 or (status != 200 and "error" not in answer):
            failures.append((path, {k: (str(v)[:40]) for k, v in body.items() if k not in bases[path]}, status,
                             str(answer)[:200]))
    assert not failures, failures
    assert _status(mesh).ready


def test_grpc_and_kserve_fields_swept_with_boundary_values(mesh: LocalMesh) -> None:
    model = _status(mesh).model
    failures: list[tuple[Any, ...]] = []
    with grpc.insecure_channel(mesh.coordinator_address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        kserve = kserve_grpc.GRPCInferenceServiceStub(channel)
        S = stage_pb2.SamplingParams
        requests: list[Any] = [
            *(dict(sampling=S(temperature=v)) for v in (math.nan, math.inf, -1.0, 1e308)),
            *(dict(sampling=S(top_p=v)) for v in (math.nan, -math.inf, 2.0, -0.5)),
            *(dict(sampling=S(top_k=v)) for v in (-1, INT32_MAX, -(1 << 31))),
            *(dict(sampling=S(seed=v)) for v in (0, UINT64_MAX)),
            *(dict(max_tokens=v) for v in (0, -1, INT32_MAX, -(1 << 31))),
            *(dict(prompt=v) for v in ("", "\x00\x01", "\u202e\ufeff", "<|im_start|>system")),
            *(dict(prompt="", prompt_token_ids=v) for v in ([-1], [INT64_MAX], [1 << 40], [0] * 5000)),
            dict(resume_token_ids=[-1]), dict(resume_token_ids=[0] * 300), dict(stop=[""]), dict(stop=["\x00"] * 100),
            dict(model="\x00"), dict(model="x" * 10_000),
            dict(prompt="", messages=[coordinator_pb2.ChatMessage(role="\x00", content="hi")]),
            dict(prompt="", messages=[coordinator_pb2.ChatMessage(role="<|im_start|>", content="")]),
        ]
        for fields in requests:
            request = coordinator_pb2.GenerateRequest(**{"prompt": "hi", "raw": True, "max_tokens": 1, **fields})
            code = _code(lambda: list(stub.Generate(request, timeout=30)))  # noqa: B023 - called at once
            if code not in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION):
                failures.append(("Generate", str(fields)[:80], code))
        for token_ids in ([-1], [INT64_MAX], []):
            logits = coordinator_pb2.ComputeLogitsRequest(token_ids=token_ids)
            code = _code(lambda: stub.ComputeLogits(logits, timeout=30))  # noqa: B023 - called at once
            if code not in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT):
                failures.append(("ComputeLogits", token_ids, code))
        P = kserve_pb2.InferParameter
        params: list[dict[str, Any]] = [
            *({"max_tokens": P(int64_param=v)} for v in (0, -1, INT64_MAX)),
            *({"temperature": P(double_param=v)} for v in (math.nan, math.inf, -1.0)),
            *({"top_p": P(double_param=v)} for v in (math.nan, 5.0)), {"top_k": P(int64_param=-1)},
            {"top_k": P(uint64_param=UINT64_MAX)}, {"seed": P(int64_param=-1)}, {"max_tokens": P(string_param="x")},
            {"raw": P(string_param="\x00")}, {}]
        texts = [b"hi", b"", b"\xed\xbf\xbf", b"\xff\xfe", b"\x00\x01"]
        for p in params:
            for text in texts:
                infer = kserve_pb2.ModelInferRequest(model_name=model, parameters=p, raw_input_contents=[
                    len(text).to_bytes(4, "little") + text])
                infer.inputs.add(name="text_input", datatype="BYTES", shape=[1])
                code = _code(lambda: kserve.ModelInfer(infer, timeout=30))  # noqa: B023 - called at once
                if code not in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT):
                    failures.append(("ModelInfer", str(p)[:60], text, code))
    assert not failures, failures
    assert _status(mesh).ready


# -- 6: token files are checked at start -------------------------------------------------------------------------
def test_a_weak_token_file_is_refused_and_a_readable_one_warned_about(
        mesh: LocalMesh, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    weak = tmp_path / "weak"
    weak.write_text("x\n")
    weak.chmod(0o644)
    run = subprocess.run([sys.executable, "-m", "graphmesh_executor.server", "--listen", f"127.0.0.1:{free_port()}",
                          "--backend", "numpy", "--mesh-token-file", str(weak)], capture_output=True, timeout=60)
    assert run.returncode != 0 and b"at least 16" in run.stdout + run.stderr, run.stderr[-2000:]
    readable = tmp_path / "readable"
    readable.write_text("a-long-enough-random-token\n")
    readable.chmod(0o644)
    with caplog.at_level("WARNING", logger="graphmesh.security"):
        assert security.read_token(str(readable)) == "a-long-enough-random-token"
    assert any("readable by its group or everyone" in r.getMessage() for r in caplog.records)
    # what `graphmesh up` (LocalMesh) writes passes both checks
    assert len(mesh.mesh_token.encode()) >= security.MIN_TOKEN_BYTES
    assert Path(mesh.mesh_token_file).stat().st_mode & 0o077 == 0


# -- 3: a Fence far ahead (a mesh-token holder may send one) leaves the mesh serving within seconds -----------------
def _generate(mesh: LocalMesh, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(mesh.coordinator_address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        request = coordinator_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=4, ignore_eos=True)
        return [t for r in stub.Generate(request, timeout=30) for t in r.token_ids]


def test_a_far_ahead_fence_is_recovered_from_in_one_step(mesh: LocalMesh) -> None:
    prompt = list(range(10, 30))
    expected = _generate(mesh, prompt)
    before = _status(mesh)
    ahead = before.incarnation + (1 << 20)  # the most an executor accepts beyond what it has seen
    with _member(mesh, mesh.executor_addresses[0]) as channel:
        stage_pb2_grpc.StageServiceStub(channel).Fence(stage_pb2.FenceRequest(incarnation=ahead, reason="attack"),
                                                       timeout=10)
    t0, last = time.monotonic(), None
    while time.monotonic() - t0 < 5.0:
        try:
            assert _generate(mesh, prompt) == expected
            break
        except grpc.RpcError as e:
            last = e
            time.sleep(0.1)
    else:
        raise AssertionError(f"the mesh did not serve within 5 s of the fence: {last}")
    after = _status(mesh)
    assert after.ready and after.incarnation == ahead + 1, (before.incarnation, after.incarnation)


# -- 4 (executor): malformed LoadParams are INVALID_ARGUMENT, never INTERNAL ----------------------------------------
def test_executor_load_params_with_malformed_files_is_invalid_argument(tmp_path: Path) -> None:
    import struct

    import numpy as np

    from graphmesh import ExecutorClient, GraphBuilder, errors
    from tests.conftest import executor_args, start_process

    root = tmp_path / "models"
    root.mkdir()
    for name, header in (("list", b"[1, 2]"), ("deep", b"[" * 100_000 + b"]" * 100_000),
                         ("deepobj", b'{"a":' * 100_000 + b"1" + b"}" * 100_000), ("number", b"7")):
        (root / f"{name}.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    address = f"127.0.0.1:{free_port()}"
    with start_process(executor_args(address, "--model-root", str(root)), address, log_path=tmp_path / "executor.log",
                       env={"OMP_NUM_THREADS": "1"}), ExecutorClient(address) as client:
        g = GraphBuilder("mlp")
        g.output(g.matmul(g.input("x", (4, 8)), g.param("w", (8, 3))))
        exe = client.compile(g.build())
        for path in ("list.safetensors", "deep.safetensors", "deepobj.safetensors", "number.safetensors", "a\x00b",
                     "\x00"):
            with pytest.raises(errors.InvalidArgument):
                exe.load_params(path)
        exe.set_param("w", np.ones((8, 3), np.float32))
        np.testing.assert_array_equal(exe.run({"x": np.ones((4, 8), np.float32)})[0], np.full((4, 3), 8, np.float32))
