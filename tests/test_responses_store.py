"""The Responses API's store in Redis (issue 40): a coordinator started with --redis-url keeps stored responses
there, so a conversation continues (previous_response_id) and a response reads back after the coordinator
restarts; a Redis that does not answer is a 503 naming the store, never a chain silently cut. A real redis-server
(or valkey-server) on a free loopback port, a tiny random Llama on one numpy executor, the official `openai`
client."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from graphmesh.errors import Unavailable
from graphmesh.launcher import LocalMesh, free_port
from graphmesh_coordinator.responses import RedisStore
from tests.model_fixtures import make_tiny_llama, write_tiny_tokenizer
from tests.test_kvstore_redis import RedisServer, _binary

KEY = "graphmesh:response:"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mesh(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    model = write_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("llama"), max_position=1024))
    with LocalMesh(1, "numpy", str(model), http_listen=f"127.0.0.1:{free_port()}", kvstore=False,
                   extra_coordinator_args=["--redis-url", redis_server.url]) as m:
        yield m


def _client(mesh: LocalMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.http_url, api_key="none", max_retries=0, timeout=120)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_a_conversation_lives_in_redis_and_outlives_the_coordinator(mesh: LocalMesh,
                                                                    redis_server: RedisServer) -> None:
    client = _client(mesh)
    model = _model(client)
    first = client.responses.create(model=model, input="Hello there.", temperature=0.0, max_output_tokens=8)
    r = redis_server.client()
    assert r.exists(KEY + first.id) and 0 < r.ttl(KEY + first.id) <= 24 * 3600
    second = client.responses.create(model=model, input="And then?", previous_response_id=first.id,
                                     temperature=0.0, max_output_tokens=8)
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turns came back from Redis
    unstored = client.responses.create(model=model, input="Forget this.", store=False, max_output_tokens=4)
    assert not r.exists(KEY + unstored.id)

    assert mesh.coordinator_process is not None
    mesh.coordinator_process.terminate()
    mesh.coordinator_process.wait(timeout=30)
    mesh.start_coordinator()  # a new process: nothing of the conversation in its memory
    client = _client(mesh)
    assert client.responses.retrieve(second.id).output_text == second.output_text
    third = client.responses.create(model=model, input="Go on.", previous_response_id=second.id, temperature=0.0,
                                    max_output_tokens=8)
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens


def test_a_redis_that_does_not_answer_is_a_503_naming_the_store(mesh: LocalMesh, redis_server: RedisServer) -> None:
    client = _client(mesh)
    model = _model(client)
    kept = client.responses.create(model=model, input="Hi.", max_output_tokens=4)
    redis_server.kill()
    try:
        with pytest.raises(openai.APIStatusError) as refused:
            client.responses.create(model=model, input="Again?", previous_response_id=kept.id, max_output_tokens=4)
        assert refused.value.status_code == 503 and "store" in refused.value.message.lower()
        assert isinstance(refused.value.body, dict) and refused.value.body.get("code") == "store_unavailable"
        with pytest.raises(openai.APIStatusError) as unstored:  # generated, but not answered as if it were kept
            client.responses.create(model=model, input="Hi.", max_output_tokens=4)
        assert unstored.value.status_code == 503
    finally:
        redis_server.start()  # empty again (no persistence)
    # back: new responses are kept again
    again = client.responses.create(model=model, input="Hi.", max_output_tokens=4)
    assert client.responses.retrieve(again.id).id == again.id


def test_a_bad_redis_url_fails_the_start_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "graphmesh_coordinator.server", "--listen", f"127.0.0.1:{free_port()}",
                           "--executors", "127.0.0.1:1", "--model", str(tmp_path), "--redis-url", "http://x:1/0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "redis" in (proc.stdout + proc.stderr).lower()


def test_a_password_protected_redis_takes_the_password_file(tmp_path: Path) -> None:
    """--redis-password-file: the store authenticates with the file's password; without it Redis refuses, a 503."""
    port = free_port()
    server = subprocess.Popen([_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                               "no", "--requirepass", "s3cret-pass", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        secret = tmp_path / "password"
        secret.write_text("s3cret-pass\n")
        url = f"redis://127.0.0.1:{port}/0"
        store = RedisStore(url, secret)
        for _ in range(100):  # until the server listens
            try:
                store.put("resp_1", {"response": {"id": "resp_1"}, "conversation": []})
                break
            except Unavailable:
                time.sleep(0.05)
        assert store.get("resp_1") == {"response": {"id": "resp_1"}, "conversation": []}
        with pytest.raises(Unavailable, match=r"Redis at redis://127\.0\.0\.1:\d+/0\) failed: AuthenticationError") as refused:
            RedisStore(url).get("resp_1")
        assert refused.value.reason == "STORE_UNAVAILABLE"
    finally:
        server.kill()
        server.wait()
