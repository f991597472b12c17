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
from google.protobuf.message_factory import GetMessageClass
from google.rpc import status_pb2

from graphmesh import channels, errors, security
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


def _wait_for_health(mesh: LocalMesh, deadline: float, held: str) -> None:
    """Until the HTTP API's /health answers 200 (its idle connections timed out), at most until `deadline`."""
    while True:
        try:
            with urllib.request.urlopen(f"http://{mesh.http_listen}/health", timeout=1.0) as r:
                assert r.status == 200
                return
        except OSError:
            assert time.monotonic() < deadline, f"/health never answered {held}"
            time.sleep(0.5)


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
@pytest.mark.serial
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


@pytest.mark.serial
def test_idle_connections_past_the_cap_are_refused_at_accept(mesh: LocalMesh) -> None:
    port, extra = _http_port(mesh), 1000
    held: list[socket.socket] = []
    try:
        with HealthProbe(mesh.coordinator_address) as probe:  # the HTTP API is full: gRPC health answers
            reset = 0
            for _ in range(HTTP_CAP + extra):
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except ConnectionResetError:  # refused as accepted, before this side's connect() returned
                    reset += 1
            time.sleep(0.5)
            # the first HTTP_CAP stay open (idle, under the request timeout); the rest were closed as accepted
            open_ones = [s for s in held if not _closed(s, 0.01)]
            assert HTTP_CAP - 2 <= len(open_ones) <= HTTP_CAP, (len(open_ones), reset)
            # the idle ones are closed by the server once they sent no request for REQUEST_TIMEOUT_S: the HTTP API
            # then serves again though this client still holds every socket
            deadline = time.monotonic() + REQUEST_TIMEOUT_S + 5
            _wait_for_health(mesh, deadline, f"with {len(held)} connections held")
            assert time.monotonic() > deadline - 5 - 2 - 0.5  # not before the idle ones timed out (give or take)
            # and every idle one is closed: the server times each out on its own, so the last may close a little
            # after the first freed the slot /health answered through
            still, settle = open_ones, time.monotonic() + 5
            while still and time.monotonic() < settle:
                still = [s for s in still if not _closed(s, 0.05)]
            assert not still, f"{len(still)} of {len(open_ones)} idle connections still open"
        assert not probe.failures and probe.slowest_s < 1.0, (probe.failures, probe.slowest_s)
    finally:
        for s in held:
            s.close()
    log = mesh.log("coordinator").read_text()
    assert log.count("HTTP connection refused") <= 60, "the refusals' log is rate-limited"


IDLE_CONNECTIONS = 25_000  # the issue's acceptance figure
DESCRIPTOR_RESERVE = 400  # left to the test process itself: its channels, the probe, pytest, the mesh's pipes


@pytest.mark.serial
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
            _wait_for_health(mesh, time.monotonic() + REQUEST_TIMEOUT_S + 10, f"with {len(held)} connections held")
            assert _status(mesh).ready
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every request with "app:" and its path."""
    body = b"app:" + scope["path"].encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _serve(health: Callable[[], bytes] | None, cap: int = 3, timeout_s: float = 0.5) -> tuple[Any, int]:
    """`_app` served as the HTTP API is (http_limits.serve) on a free port, in-process."""
    from graphmesh_coordinator import http_limits

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    return http_limits.serve(_app, sock, health, cap, timeout_s, log_level="warning"), port


def _response(sock: socket.socket) -> bytes:
    """One whole response with a content-length (its head and body may come in pieces)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
            data.lower().split(b"content-length: ")[1].split(b"\r\n")[0]):
        piece = sock.recv(4096)
        if not piece:
            break
        data += piece
    return data


def test_a_connection_that_sends_no_request_is_closed() -> None:
    """In-process, with a short request timeout: a connection that never completes a request's headers (silent, or
    a byte at a time) is closed; one that sends a request is answered; one past the cap is closed as accepted."""
    for health in (None, lambda: b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"):  # handed on at once, or peeked
        serving, port = _serve(health)
        try:
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
            assert serving.acceptor.refused == 1
        finally:
            serving.stop()


def test_health_is_answered_while_the_apis_loop_is_held() -> None:
    """A plain-HTTP `GET /health` is answered on the acceptor's thread: while the API's loop is held (as a burst
    of streams holds it), the probe gets its answer and a request to the app waits for the loop. Anything that is
    not one whole health request (another path, a body, a request in pieces) reaches the app untouched."""
    from starlette.responses import PlainTextResponse

    from graphmesh_coordinator.http_limits import response_bytes

    serving, port = _serve(lambda: response_bytes(PlainTextResponse("ok")), cap=16)
    release = threading.Event()
    try:
        serving.server.loop.call_soon_threadsafe(release.wait, 60)
        waiting = socket.create_connection(("127.0.0.1", port))
        waiting.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
            assert (r.status, r.read(), r.headers["connection"]) == (200, b"ok", "close")
        assert not release.is_set() and not _closed(waiting, 0.2), "answered while the loop was held"
        release.set()
        assert _response(waiting).endswith(b"app:/x")
        for request, pieces in ((b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 1),
                                (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi", 1),
                                (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", 2)):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                cut = len(request) // pieces
                c.sendall(request[:cut])
                time.sleep(0.2)
                c.sendall(request[cut:])
                answer = _response(c)
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"app:" + request.split(b" ")[1]), answer
    finally:
        release.set()
        serving.stop()


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


# -- 4 (executor): every RPC of ExecutorService and StageService swept with boundary values ---------------------
_INT_VALUES = {
    "int32": [-1, -(1 << 31), (1 << 31) - 1], "int64": [-1, -(1 << 63), (1 << 63) - 1, 1 << 40],
    "uint32": [(1 << 32) - 1], "uint64": [(1 << 64) - 1, 1 << 63],
}


def _field_values(field: Any) -> list[Any]:
    """Boundary values for one field of a request: huge, negative, NaN and infinities, empty, unknown enum values,
    control characters and a path's NUL in strings (lone surrogates cannot be set in a message: _RAW sends them)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    t = field.type
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        values: list[Any] = _INT_VALUES["int32"]
    elif t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        values = _INT_VALUES["int64"]
    elif t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        values = _INT_VALUES["uint32"]
    elif t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        values = _INT_VALUES["uint64"]
    elif t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        values = [math.nan, math.inf, -math.inf, -1.0, 3e38]
    elif t == F.TYPE_BOOL:
        values = [True]
    elif t == F.TYPE_STRING:
        values = ["", "\x00", "a\x00b", "\u202e\x1b[2J\r\n", "../../../etc/passwd", "x" * 100_000]
    elif t == F.TYPE_BYTES:
        values = [b"", b"\xff" * 64, b"\x00" * (1 << 20)]
    elif t == F.TYPE_ENUM:
        values = [9999, -1]
    else:
        return []
    if field.is_repeated:
        return [[v] for v in values] + [[values[0]] * 10_000]  # many of a short one: a list, not a gigabyte
    return values


def _message(descriptor: Any, **fields: Any) -> Any:
    cls: Any = GetMessageClass(descriptor)
    return cls(**fields)


def _variants(message_type: Any, base: Any, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """`base` (a request of `message_type`) with one field, at most two messages deep, set to each boundary
    value in turn."""
    for field in message_type.fields:
        for value in _field_values(field):
            request = type(base)()
            request.CopyFrom(base)
            try:
                target = getattr(request, field.name)
                if field.is_repeated:
                    del target[:]
                    target.extend(value)
                else:
                    setattr(request, field.name, value)
            except (ValueError, TypeError):  # a value the field cannot hold (an enum's range in some runtimes)
                continue
            yield f"{field.name}={str(value)[:24]!r}", request
        if field.message_type is not None and depth < 2 and not field.message_type.GetOptions().map_entry:
            child_base = _message(field.message_type)
            if not field.is_repeated and base.HasField(field.name):
                child_base.CopyFrom(getattr(base, field.name))
            for what, child in _variants(field.message_type, child_base, depth + 1):
                request = type(base)()
                request.CopyFrom(base)
                if field.is_repeated:
                    del getattr(request, field.name)[:]
                    getattr(request, field.name).add().CopyFrom(child)
                else:
                    getattr(request, field.name).CopyFrom(child)
                yield f"{field.name}.{what}", request


# What is not a valid message at all: bytes that end inside a field, a lone surrogate (UTF-8 of U+D800) in field 1,
# a varint where field 1 is length-delimited (or the other way round), a length far past the end.
_RAW = [b"\xff\xff\xff", b"\x0a\x03\xed\xa0\x80", b"\x0a\x02\xc3\x28", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
        b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x04\xed\xbf\xbfx"]
_BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


def _call(channel: grpc.Channel, service: str, method: Any, payload: Any, raw: bool, timeout: float) -> grpc.StatusCode:
    path = f"/{service}/{method.name}"
    serialize = (lambda b: b) if raw else (lambda m: m.SerializeToString())
    kinds = (method.client_streaming, method.server_streaming)
    try:
        if kinds == (False, False):
            channel.unary_unary(path, request_serializer=serialize)(payload, timeout=timeout)
        elif kinds == (False, True):
            for _ in channel.unary_stream(path, request_serializer=serialize)(payload, timeout=timeout):
                pass
        elif kinds == (True, False):
            channel.stream_unary(path, request_serializer=serialize)(iter([payload, payload]), timeout=timeout)
        else:
            messages: Iterator[bytes] = channel.stream_stream(path, request_serializer=serialize)(iter([payload]),
                                                                                               timeout=timeout)
            for message in messages:
                if method.output_type.full_name == "graphmesh.v1.GenerateStreamsResponse":  # calls end in-band
                    for event in coordinator_pb2.GenerateStreamsResponse.FromString(message).events:
                        ended = errors.from_status_proto(status_pb2.Status.FromString(event.status)) \
                            if event.HasField("status") else None
                        if ended is not None:  # not OK
                            return ended.code
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _sweep(channel: grpc.Channel, service: Any, bases: dict[str, Any], skip: tuple[str, ...] = (),
           timeout: float = 30.0) -> tuple[list[tuple[str, str, Any]], int]:
    """Calls every method of `service` with each variant of its base request (`bases`, by method; else empty),
    and with _RAW; the calls answered INTERNAL or UNKNOWN (or not at all within `timeout`), and how many were made."""
    failures: list[tuple[str, str, Any]] = []
    calls = 0
    for method in service.methods:
        if method.name in skip:
            continue
        base = bases.get(method.name) or _message(method.input_type)
        cases = [("base", base, False), *((w, r, False) for w, r in _variants(method.input_type, base)),
                 *((f"raw {b[:8]!r}", b, True) for b in _RAW)]
        for what, payload, raw in cases:
            code = _call(channel, service.full_name, method, payload, raw, timeout)
            calls += 1
            if code in _BAD_CODES or code == grpc.StatusCode.DEADLINE_EXCEEDED:
                failures.append((method.name, what, code))
    return failures, calls


def test_every_executor_rpc_swept_with_boundary_values(tmp_path: Path) -> None:
    """Every ExecutorService and StageService method, called with each field (two messages deep) set to boundary
    values and with bytes that are not its message, answers a precise code (INVALID_ARGUMENT, NOT_FOUND,
    FAILED_PRECONDITION, RESOURCE_EXHAUSTED, ...), never INTERNAL or UNKNOWN; the executor serves throughout and
    computes the same token afterwards. The stage is installed first, so calls that carry its incarnation reach
    the stage's own checks; the fencing calls go last."""
    import numpy as np

    from graphmesh import ExecutorClient, GraphBuilder, tensors
    from graphmesh.v1 import executor_pb2, tensor_pb2
    from tests.conftest import executor_args, start_process

    root = tmp_path / "models"
    model = make_tiny_llama(root / "llama")
    address = f"127.0.0.1:{free_port()}"
    with start_process(executor_args(address, "--model-root", str(root), "--enable-fault-injection"), address,
                       log_path=tmp_path / "executor.log", env={"OMP_NUM_THREADS": "1"}), \
            ExecutorClient(address) as client, grpc.insecure_channel(address) as channel:
        g = GraphBuilder("mlp")
        g.output(g.matmul(g.input("x", (4, 8)), g.param("w", (8, 3))))
        exe = client.compile(g.build())
        stage = stage_pb2_grpc.StageServiceStub(channel)
        spec = stage_pb2.StageSpec(model=str(model.relative_to(root)), layer_start=0, layer_end=2, first=True,
                                   last=True, max_context_tokens=64)
        stage.Install(stage_pb2.InstallRequest(incarnation=1, rank=0, world_size=1, stage=spec), timeout=120)

        def one_token(incarnation: int, session: str) -> int:
            row = stage_pb2.StepRow(session_id=session, epoch=1, start_position=0, token_ids=[5, 17, 99, 3],
                                    sampling=stage_pb2.SamplingParams(temperature=0.0))
            answer = stage.ExecuteStep(stage_pb2.ExecuteStepRequest(incarnation=incarnation, step_id=1, rows=[row]),
                                       timeout=60)
            return answer.rows[0].token

        before = one_token(1, "before")
        executor_service = executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"]
        stage_service = stage_pb2.DESCRIPTOR.services_by_name["StageService"]
        x = tensor_pb2.NamedTensor(name="x", tensor=tensors.to_proto(np.ones((4, 8), np.float32)))
        eid = exe.id
        executor_bases: dict[str, Any] = {
            name: _message(executor_service.methods_by_name[name].input_type, executable_id=eid)
            for name in executor_service.methods_by_name
            if "executable_id" in executor_service.methods_by_name[name].input_type.fields_by_name}
        executor_bases["Run"] = executor_pb2.RunRequest(executable_id=eid, inputs=[x])
        executor_bases["RunPipelined"] = executor_pb2.RunPipelinedRequest(run=executor_bases["Run"])
        executor_bases["Compile"] = executor_pb2.CompileRequest(graph=g.build())
        failures, calls = _sweep(channel, executor_service, executor_bases)
        header = stage_pb2.FencingHeader(incarnation=1, session_id="s", epoch=1)
        row = stage_pb2.StepRow(session_id="sweep", epoch=1, token_ids=[1, 2], sampling=stage_pb2.SamplingParams())
        stage_bases: dict[str, Any] = {
            "Install": stage_pb2.InstallRequest(incarnation=1, world_size=1, stage=spec),
            "ExecuteStep": stage_pb2.ExecuteStepRequest(incarnation=1, step_id=7, rows=[row], boundary_timeout_ms=500),
            "AbortStep": stage_pb2.AbortStepRequest(incarnation=1, step_id=7, rows=[row]),
            "PushBoundary": stage_pb2.PushBoundaryRequest(header=header, step_id=7),
            **{name: _message(stage_service.methods_by_name[name].input_type, header=header)
               for name in ("Commit", "Abort", "ResolveEpoch", "ReleaseSession", "ShareSessionKv", "ReadSessionKv",
                            "WriteSessionKv", "PushSessionKv")},
        }
        more, n = _sweep(channel, stage_service, stage_bases, skip=("Fence", "InjectFault", "Install"))
        failures += more
        calls += n
        # last: what changes the stage for good (a re-install, a fence, an injected fault)
        for name in ("Install", "InjectFault", "Fence"):
            more, n = _sweep(channel, stage_service, stage_bases, skip=tuple(
                m for m in stage_service.methods_by_name if m != name))
            failures += more
            calls += n
        assert not failures, (f"{len(failures)} of {calls} calls", failures[:40])
        # still serving: a fresh incarnation computes the same token as before the sweep
        highest = stage.Status(stage_pb2.StageServiceStatusRequest(), timeout=10).incarnation
        stage.Install(stage_pb2.InstallRequest(incarnation=highest + 1, rank=0, world_size=1, stage=spec), timeout=120)
        assert one_token(highest + 1, "after") == before
        exe2 = client.compile(g.build())
        exe2.set_param("w", np.ones((8, 3), np.float32))
        np.testing.assert_array_equal(exe2.run({"x": np.ones((4, 8), np.float32)})[0], np.full((4, 3), 8, np.float32))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_run_needing_more_than_the_host_has_is_resource_exhausted(backend: str, tmp_path: Path) -> None:
    """A graph whose input takes 128 GiB (or twice the host's available memory, if more), run without that input
    (inputs not given are zeros), is refused RESOURCE_EXHAUSTED before anything is allocated; torch's allocation
    failure was INTERNAL, and a host that overcommits would have handed out the zeros."""
    import numpy as np

    from graphmesh import ExecutorClient, GraphBuilder, errors
    from graphmesh_server import serving
    from tests.conftest import executor_args, start_process

    width = 1 << 18
    rows = max(128 << 30, 2 * (serving.available_memory_bytes() or 0)) // (4 * width)
    address = f"127.0.0.1:{free_port()}"
    with start_process(executor_args(address, backend=backend), address, log_path=tmp_path / "executor.log",
                       env={"OMP_NUM_THREADS": "1"}), ExecutorClient(address) as client:
        g = GraphBuilder("huge")
        g.output(g.matmul(g.input("x", (rows, width)), g.param("w", (width, 3))))
        huge = client.compile(g.build())
        with pytest.raises(errors.ResourceExhausted) as e:
            huge.run({})
        assert e.value.reason == "RUN_TOO_LARGE", e.value
        small = GraphBuilder("mlp")
        small.output(small.matmul(small.input("x", (4, 8)), small.param("w", (8, 3))))
        exe = client.compile(small.build())
        exe.set_param("w", np.ones((8, 3), np.float32))
        np.testing.assert_array_equal(exe.run({"x": np.ones((4, 8), np.float32)})[0], np.full((4, 3), 8, np.float32))


def test_coordinator_and_kserve_rpcs_swept_field_by_field(mesh: LocalMesh) -> None:
    """The descriptor-driven sweep of the executor test over the coordinator's public gRPC services
    (CoordinatorService, KServe's GRPCInferenceService): every field of every request, two messages deep, set to
    each boundary value, and bytes that are no message; none answered INTERNAL or UNKNOWN, and the mesh generates
    the same tokens afterwards. The hand-picked cases above check the codes of the fields that matter most."""
    prompt = list(range(10, 30))
    expected = _generate(mesh, prompt)
    model = _status(mesh).model
    infer = kserve_pb2.ModelInferRequest(model_name=model, raw_input_contents=[(2).to_bytes(4, "little") + b"hi"],
                                         parameters={"max_tokens": kserve_pb2.InferParameter(int64_param=1)})
    infer.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    bases: dict[str, Any] = {
        "Generate": coordinator_pb2.GenerateRequest(prompt="hi", raw=True, max_tokens=1),
        "GenerateStreams": coordinator_pb2.GenerateStreamsRequest(
            id=1, generate=coordinator_pb2.GenerateRequest(prompt="hi", raw=True, max_tokens=1)),
        "ComputeLogits": coordinator_pb2.ComputeLogitsRequest(token_ids=[1, 2, 3]),
        "ModelInfer": infer, "ModelStreamInfer": infer,
        "ModelMetadata": kserve_pb2.ModelMetadataRequest(name=model),
        "ModelReady": kserve_pb2.ModelReadyRequest(name=model),
    }
    failures: list[tuple[str, str, Any]] = []
    calls = 0
    with grpc.insecure_channel(mesh.coordinator_address) as channel:
        for service in (coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"],
                        kserve_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]):
            more, n = _sweep(channel, service, bases, timeout=60.0)
            failures += more
            calls += n
    assert not failures, (f"{len(failures)} of {calls} calls", failures[:40])
    assert _status(mesh).ready
    assert _generate(mesh, prompt) == expected


def _raw_post(mesh: LocalMesh, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{mesh.http_listen}{path}", data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


RESPONSES_FIELDS: dict[str, list[Any]] = {
    "input": [*BAD_TEXT, [{"role": "user", "content": "\udfff"}], [{"role": "\x00", "content": "hi"}], [[]], [7]],
    "instructions": BAD_TEXT, "max_output_tokens": BAD_NUMBERS, "temperature": BAD_NUMBERS, "top_p": BAD_NUMBERS,
    "previous_response_id": [*BAD_TEXT, "resp_" + "0" * 64], "store": ["yes", 7, None],
    "text": [{"format": {"type": "\udfff"}}, {"format": {"type": "json_schema", "schema": {"type": "\x00"}}}, 7],
    "tools": [[{"type": "function", "name": "\udfff"}], [{}], "x"], "tool_choice": ["\udfff", 7, {"type": "x"}],
}


def test_http_bodies_that_are_not_requests_and_the_responses_fields(mesh: LocalMesh) -> None:
    """The HTTP half of the sweep beyond the fields above: bodies that are not a request at all (empty, not JSON,
    not an object, 100k deep, invalid UTF-8, a lone surrogate escaped in JSON, numbers past a double, the wrong
    content type) on every POST route, every /v1/responses field with boundary values, and odd ids on the GET
    routes: each a 4xx with an error body, never a 5xx; the mesh is still ready."""
    model = _status(mesh).model
    bodies = [b"", b"{", b"[]", b"null", b"7", b'"x"', b"[" * 100_000 + b"]" * 100_000,
              b'{"a":' * 100_000 + b"1" + b"}" * 100_000, b'{"model": "\xff\xfe", "prompt": "hi"}',
              b'{"model": "m", "prompt": "\\udfff", "input": "\\ud800"}', b'{"max_tokens": 1e400, "prompt": "hi"}',
              b'{"prompt": "hi", "prompt": 7}', b"\x00" * 1000]
    failures: list[tuple[Any, ...]] = []
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        for body in bodies:
            status, answer = _raw_post(mesh, path, body)
            if not 400 <= status < 500 or b"error" not in answer:
                failures.append((path, body[:40], status, answer[:200]))
        status, answer = _raw_post(mesh, path, b'{"model": "x"}', content_type="text/plain\x7f")
        if status >= 500:
            failures.append((path, "content type", status, answer[:200]))
    base = {"model": model, "input": "hi", "max_output_tokens": 1}
    for name, values in RESPONSES_FIELDS.items():
        for value in values:
            status, answer_json = _post(mesh, "/v1/responses", _json({**base, name: value}))
            if status >= 500 or (status != 200 and "error" not in answer_json):
                failures.append(("/v1/responses", name, str(value)[:40], status, str(answer_json)[:200]))
    for path in ("/v1/responses/%00", "/v1/responses/" + "x" * 10_000, "/v1/responses/..%2F..%2Fetc",
                 "/v1/models/%ED%A0%80", "/v1/models/%FF%FE", "/v1/models/%E2%80%AE%00"):
        try:
            with urllib.request.urlopen(f"http://{mesh.http_listen}{path}", timeout=30) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        if status >= 500:
            failures.append(("GET", path[:40], status))
    assert not failures, failures
    assert _status(mesh).ready


def test_a_serving_heap_is_frozen_and_its_cycles_still_collected() -> None:
    """settle_heap (run before every service serves): start-up's objects leave the collector's traversal, the
    collector runs every COLLECT_EVERY net allocations instead of 700, and a cycle made while serving is still
    collected once that many more objects live. In a process of its own: the settings are process-wide."""
    script = """
import gc, weakref
from graphmesh_server.serving import COLLECT_EVERY, settle_heap
settle_heap()
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
assert gc.get_threshold()[0] == COLLECT_EVERY, gc.get_threshold()
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b
kept = [[] for _ in range(500)]
assert gone() is not None, "collected after 500 allocations: the threshold is not in force"
kept += [[] for _ in range(COLLECT_EVERY)]
assert gone() is None, "a cycle outlived COLLECT_EVERY allocations"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
