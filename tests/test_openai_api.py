"""The coordinator's OpenAI HTTP API driven by the official `openai` client, held against the native Generate on the
same mesh (SmolLM2-135M over 2 torch executors, f32: token-exact), and its refusals, each with its status."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import GraphmeshError
from graphmesh.launcher import LocalMesh, free_port
from tests import pki

MODEL = "smollm2-135m"
TOKEN = "test-openai-token"
QUESTION = "What is the capital of France?"
PROMPT = "The sky is blue because"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN)
    with LocalMesh(2, "torch", MODEL, http_listen=f"127.0.0.1:{free_port()}", auth_token_file=str(token_file)) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.http_url, api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(mesh: LocalMesh) -> Iterator[CoordinatorClient]:
    with CoordinatorClient(mesh.coordinator_address, token=TOKEN) as c:
        yield c


def post(url: str, body: bytes | dict[str, Any], token: str | None = TOKEN,
         context: ssl.SSLContext | None = None) -> tuple[int, dict[str, Any]]:
    """A raw POST: for bodies the openai client would refuse to send. Returns (status, parsed JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=120, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(url: str, name: str) -> float:
    """A label-less sample of the coordinator's /metrics."""
    _, text = get(url.removesuffix("/v1") + "/metrics")
    return next(float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0] == name)


def test_models_health_and_metrics(mesh: LocalMesh, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    root = mesh.http_url.removesuffix("/v1")
    assert get(root + "/health") == (200, "ok")  # health and metrics need no token: probes and scrapers have none
    assert metric(mesh.http_url, "graphmesh_mesh_ready") == 1.0


def test_greedy_chat_and_completion_equal_generate(client: openai.OpenAI, grpc_client: CoordinatorClient) -> None:
    native = list(grpc_client.generate(QUESTION, max_tokens=8, temperature=0.0))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == "".join(c.text for c in native)
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    assert chat.id.startswith("chatcmpl-") and chat.created > 0 and chat.model == MODEL
    assert chat.usage is not None and chat.usage.prompt_tokens == len(native[0].prompt_token_ids)
    assert chat.usage.completion_tokens == sum(len(c.token_ids) for c in native)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    finish = {"length": "length", "eos": "stop", "stop": "stop"}[native[-1].finish_reason]
    assert chat.choices[0].finish_reason == finish

    raw = list(grpc_client.generate(PROMPT, raw=True, max_tokens=8, temperature=0.0))
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert text.choices[0].text == "".join(c.text for c in raw)
    assert text.usage is not None and text.usage.prompt_tokens == len(raw[0].prompt_token_ids)
    # token ids are a prompt too, and a list of prompts is a batch: one choice each, in order
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "Paris is"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert text.choices[0].text.startswith(batch.choices[0].text)
    assert batch.usage is not None and batch.usage.completion_tokens == 8
    ids = client.completions.create(model=MODEL, prompt=[raw[0].prompt_token_ids], max_tokens=4, temperature=0)
    assert ids.choices[0].text == batch.choices[0].text


def test_streams_equal_their_non_streamed_answers(mesh: LocalMesh, client: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 10, "temperature": 0.9, "seed": 11}
    messages: Any = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(messages=messages, **args)
    chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # include_usage: a last chunk, usage only
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1

    text = client.completions.create(prompt=PROMPT, **args)
    streamed = list(client.completions.create(prompt=PROMPT, stream=True, **args))
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert streamed[-1].choices[0].finish_reason == text.choices[0].finish_reason == "length"
    # the wire format itself: Server-Sent Events ending in `data: [DONE]`
    request = urllib.request.Request(mesh.http_url + "/completions", json.dumps(
        {"prompt": PROMPT, "stream": True, **args, "max_tokens": 2}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


def test_seeds_reproduce_and_each_choice_draws_its_own(client: openai.OpenAI) -> None:
    def chat(seed: int, n: int = 1) -> list[str]:
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                               max_tokens=8, temperature=1.0, top_p=0.95, seed=seed, n=n)
        assert [c.index for c in reply.choices] == list(range(n))
        assert reply.usage is not None and reply.usage.completion_tokens == 8 * n
        return [c.message.content or "" for c in reply.choices]

    pair = chat(7, n=2)
    assert pair == chat(7) + chat(8)  # choice i draws with seed + i: n > 1 is reproducible too
    assert chat(7) == pair[:1]
    # sampling, not greedy: the draws differ between seeds (3 seeds, so a coincidence cannot pass this)
    assert len({pair[0], pair[1], chat(9)[0]}) > 1


def test_stop_strings_end_the_text_before_them(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 4, full
    stop = words[len(words) // 2]
    for form in (stop, [stop, "no such text"]):
        cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=form)
        assert cut.choices[0].text == full[: full.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=12, temperature=0, stop=stop, stream=True)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=12, temperature=0, stop=stop)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content
    assert stop not in (whole.choices[0].message.content or "")


def test_logprobs_come_from_the_last_stage_and_leave_the_tokens_alone(client: openai.OpenAI,
                                                                      grpc_client: CoordinatorClient) -> None:
    messages: Any = [{"role": "user", "content": QUESTION}]
    sampled: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0.9, "seed": 3}
    plain = client.chat.completions.create(**sampled)
    scored = client.chat.completions.create(logprobs=True, top_logprobs=3, **sampled)
    assert scored.choices[0].message.content == plain.choices[0].message.content  # the same draws either way
    assert scored.choices[0].logprobs is not None and scored.usage is not None
    content = scored.choices[0].logprobs.content or []
    assert len(content) == scored.usage.completion_tokens == 6
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= 0
        assert sum(np.exp(tops)) <= 1 + 1e-6 and entry.bytes == list(entry.token.encode())
    streamed = list(client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True, **sampled))
    assert [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []] \
        == content

    # greedy: the token is the most likely one, with the logprob of the whole distribution's maximum
    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=2)
    assert greedy.choices[0].logprobs is not None
    entries = greedy.choices[0].logprobs.content or []
    assert "".join(e.token for e in entries) == greedy.choices[0].message.content
    assert all(e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob for e in entries)
    prompt_ids = next(iter(grpc_client.generate(QUESTION, max_tokens=1))).prompt_token_ids
    logits = grpc_client.compute_logits(prompt_ids).astype(np.float64)
    reference = np.sort(logits - logits.max() - np.log(np.exp(logits - logits.max()).sum()))[::-1]
    assert [t.logprob for t in entries[0].top_logprobs] == pytest.approx(reference[:2], abs=1e-4)
    # gRPC's Generate gives the same tokens their same logprobs, and refuses what the HTTP API refuses
    chunks = list(grpc_client.generate(QUESTION, max_tokens=4, logprobs=True, top_logprobs=2))
    over_grpc = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in over_grpc] == [t for c in chunks for t in c.token_ids] and len(over_grpc) == 4
    assert [lp.logprob for lp in over_grpc] == [e.logprob for e in entries]
    assert [[t.logprob for t in lp.top] for lp in over_grpc] == [[t.logprob for t in e.top_logprobs] for e in entries]
    assert not [lp for c in grpc_client.generate(QUESTION, max_tokens=2) for lp in c.logprobs]
    for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(GraphmeshError) as refused:
            list(grpc_client.generate(QUESTION, max_tokens=1, **bad))  # type: ignore[arg-type]
        assert refused.value.reason == "BAD_LOGPROBS" and refused.value.code == grpc.StatusCode.INVALID_ARGUMENT

    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(max(top.values()) == chosen for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))


def test_bad_requests_are_refused_with_their_status_and_the_server_goes_on(mesh: LocalMesh,
                                                                          client: openai.OpenAI) -> None:
    user: Any = [{"role": "user", "content": QUESTION}]
    bad: list[dict[str, Any]] = [
        {"temperature": -1.0}, {"top_p": 1.5}, {"top_k": -3}, {"max_tokens": 0}, {"n": 0}, {"n": 1000},
        {"max_tokens": 10**9}, {"stop": [""]}, {"top_logprobs": 3}, {"frequency_penalty": 0.5},
        {"messages": []}, {"messages": [{"role": "wizard", "content": "hi"}]}, {"messages": "hi"},
        {"temperature": "hot"}, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"seed": "x"}, {"stream_options": 3}, {"logprobs": True, "top_logprobs": 21}]
    for extra in bad:
        status, body = post(mesh.http_url + "/chat/completions", {"model": MODEL, "messages": user, **extra})
        assert status == 400, (extra, body)
        assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error", (extra, body)
    for raw in (b"{not json", b"[]", b"", json.dumps({"model": MODEL}).encode()):
        status, body = post(mesh.http_url + "/chat/completions", raw)
        assert status == 400 and body["error"]["message"], (raw, body)
    status, body = post(mesh.http_url + "/completions", {"model": MODEL, "prompt": "x" * (1 << 20), "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "prompt_too_long", body
    prompts: list[Any] = [[], [[]], [10**9], [1, "a"]]
    for prompt in prompts:
        status, body = post(mesh.http_url + "/completions", {"model": MODEL, "prompt": prompt})
        assert status == 400, (prompt, body)

    host, port = mesh.http_url.removeprefix("http://").removesuffix("/v1").split(":")
    connection = HTTPConnection(host, int(port), timeout=30)  # a huge body is refused before it is read
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(1 << 40))
    connection.endheaders()
    reply = connection.getresponse()
    assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "body_too_large"
    connection.close()

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=user, max_tokens=1)
    assert missing.value.code == "model_not_found"
    for token in (None, "wrong"):
        status, body = post(mesh.http_url + "/chat/completions", {"model": MODEL, "messages": user}, token)
        assert status == 401 and body["error"]["type"] == "authentication_error", body
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=mesh.http_url, api_key="wrong", max_retries=0).models.list()
    assert get(mesh.http_url + "/no/such/path")[0] == 404

    after = client.chat.completions.create(model=MODEL, messages=user, max_tokens=2, temperature=0)
    assert after.usage is not None and after.usage.completion_tokens == 2


def test_a_client_that_leaves_mid_stream_ends_its_session(mesh: LocalMesh, client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # an extension: the client has no argument
    received = 0
    for chunk in stream:
        received += 1 if chunk.choices and chunk.choices[0].text else 0
        if received == 3:
            break
    assert metric(mesh.http_url, "graphmesh_active_sessions") == 1.0
    assert metric(mesh.http_url, "graphmesh_kv_blocks_used") > 0
    stream.close()
    deadline = time.monotonic() + 20
    while metric(mesh.http_url, "graphmesh_active_sessions") or metric(mesh.http_url, "graphmesh_kv_blocks_used"):
        assert time.monotonic() < deadline, "the session outlived its client"
        time.sleep(0.1)


def test_genai_metrics_are_exported(mesh: LocalMesh) -> None:
    _, text = get(mesh.http_url.removesuffix("/v1") + "/metrics")
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    labels = f'gen_ai_operation_name="chat",gen_ai_request_model="{MODEL}"'
    for name in ("gen_ai_server_time_to_first_token_seconds", "gen_ai_server_time_per_output_token_seconds"):
        assert samples[f"{name}_count{{{labels}}}"] > 0, name
    assert samples[f'gen_ai_server_request_duration_seconds_count{{error_type="",{labels}}}'] > 0
    for kind in ("input", "output"):
        assert samples[f'gen_ai_client_token_usage_count{{{labels},gen_ai_token_type="{kind}"}}'] > 0
    refused = f'gen_ai_server_request_duration_seconds_count{{error_type="bad_sampling",{labels}}}'
    assert samples[refused] >= 1  # temperature -1 above
    assert "graphmesh_kv_cache_usage_ratio" in samples and "graphmesh_waiting_sessions" in samples


@contextmanager
def coordinator_without_a_mesh(tmp_path: Path, *extra: str) -> Iterator[str]:
    """A coordinator whose executor never comes: its HTTP API is up, its mesh is not (as during a recovery).
    Yields the API's HOST:PORT once it answers; cheap, since no model is installed anywhere."""
    http = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "graphmesh_coordinator.server", "--listen", f"127.0.0.1:{free_port()}",
            "--executors", f"127.0.0.1:{free_port()}", "--model", MODEL, "--state-dir", str(tmp_path / "state"),
            "--http-listen", http, "--startup-timeout", "120", *extra]
    with open(tmp_path / "coordinator.log", "wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                host, port = http.split(":")
                with socket.create_connection((host, int(port)), timeout=1):
                    break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
                time.sleep(0.2)
        yield http
    finally:
        process.terminate()
        process.wait(10)


def test_a_mesh_that_cannot_serve_answers_503_a_full_one_429_and_tls_wants_a_client_certificate(
        tmp_path: Path) -> None:
    # One coordinator for all three: starting one costs seconds. Under mutual TLS the API is HTTPS and wants a
    # client certificate of the CA, as the gRPC port does.
    ca = pki.issue(tmp_path, "test-ca")
    server, client = pki.issue(tmp_path, "coordinator.graphmesh.internal", ca), pki.issue(tmp_path, "client", ca)
    tls = ("--tls-cert", server.cert, "--tls-key", server.key, "--tls-ca", ca.cert)
    context = ssl.create_default_context(cafile=ca.cert)
    context.load_cert_chain(client.cert, client.key)
    with coordinator_without_a_mesh(tmp_path, *tls, "--http-ready-wait", "2", "--max-waiting-requests", "1") as http:
        url = f"https://{http}/v1/chat/completions"
        assert get(f"https://{http}/health", context)[0] == 503
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        waiting: list[tuple[int, dict[str, Any]]] = []
        first = threading.Thread(target=lambda: waiting.append(post(url, body, None, context)))
        first.start()
        time.sleep(0.7)  # the first request now holds the one place in the queue, waiting for the mesh
        status, refused = post(url, body, None, context)
        assert status == 429 and refused["error"]["type"] == "rate_limit_error", refused
        first.join(30)
        assert waiting and waiting[0][0] == 503, waiting
        assert waiting[0][1]["error"]["code"] == "mesh_not_ready"
        with pytest.raises((OSError, HTTPException)):  # no client certificate: the handshake or first read fails
            get(f"https://{http}/health", ssl.create_default_context(cafile=ca.cert))
        with pytest.raises((OSError, HTTPException)):  # plain text to a TLS port
            get(f"http://{http}/health")
