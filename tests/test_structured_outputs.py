"""Guided decoding, structured outputs, tool calls and the Responses API (issue 40) on a real mesh on loopback:
SmolLM2-135M over 2 torch executors, driven by the official `openai` client (and Generate for the gRPC field)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import InvalidArgument
from graphmesh.launcher import LocalMesh, free_port
from graphmesh.v1 import coordinator_pb2

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"type": "string", "enum": ["cat", "dog", "fish"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def mesh() -> Iterator[LocalMesh]:
    with LocalMesh(2, "torch", MODEL, http_listen=f"127.0.0.1:{free_port()}") as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh: LocalMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.http_url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def grpc_client(mesh: LocalMesh) -> Iterator[CoordinatorClient]:
    with CoordinatorClient(mesh.coordinator_address) as c:
        yield c


def test_generate_guided_json_schema_and_regex(grpc_client: CoordinatorClient) -> None:
    """GenerateRequest.guided: the completion follows the schema (sampled at temperature 1) or the regex."""
    guided = coordinator_pb2.GuidedDecoding(json_schema=json.dumps(PERSON))
    chunks = list(grpc_client.generate("Describe a person as JSON.", max_tokens=48, temperature=1.0, seed=7,
                                       guided=guided))
    assert chunks[-1].finish_reason == "eos"
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), PERSON)
    guided = coordinator_pb2.GuidedDecoding(regex=r"[0-9]{3}-[a-z]{2,4}")
    text = "".join(c.text for c in grpc_client.generate("A code:", max_tokens=16, temperature=1.0, seed=3,
                                                         guided=guided))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    with pytest.raises(InvalidArgument, match="does not compile"):
        list(grpc_client.generate("x", max_tokens=4, guided=coordinator_pb2.GuidedDecoding(regex="(")))
    with pytest.raises(InvalidArgument, match="at most one"):
        list(grpc_client.generate("x", max_tokens=4, guided=coordinator_pb2.GuidedDecoding(regex="a", json_object=True)))


def test_host_sampling_applies_only_its_rows_mask() -> None:
    """A guided row samples only among its allowed tokens; the row beside it samples exactly what it would alone."""
    import numpy as np

    from graphmesh_executor.executable import RngOptions
    from graphmesh_executor.logprobs import RowSampling, allowed, sample_with_logprobs

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 100)).astype(np.float32)
    bits = np.zeros(128, np.uint8)
    bits[[3, 50, 97]] = 1
    mask = np.packbits(bits, bitorder="little").tobytes()
    assert allowed(mask, 100).nonzero()[0].tolist() == [3, 50, 97]
    free = RowSampling(1.0, 0, 1.0, 11, False, 0)
    for seed in range(20):
        guided = RowSampling(1.0, 0, 1.0, seed, True, 2, mask)
        tokens, lps = sample_with_logprobs(RngOptions(), logits, [guided, free])
        assert tokens[0] in (3, 50, 97) and lps[0] is not None and all(t in (3, 50, 97) for t, _ in lps[0].top)
        assert tokens[1] == sample_with_logprobs(RngOptions(), logits[1:], [free])[0][0]


def _person(client: openai.OpenAI, seed: int, max_tokens: int = 48) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person and their pet."}], temperature=1.0,
        seed=seed, max_tokens=max_tokens,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})


def test_json_schema_validates_for_20_seeds(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda seed: _person(client, seed), range(20)))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    assert len({r.choices[0].message.content for r in replies}) > 1  # sampled, not one forced answer


def test_json_object_on_completions_and_chat_stream(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=40,
                                     temperature=0.0, extra_body={"response_format": {"type": "json_object"}},
                                     ).choices[0]
    if text.finish_reason == "stop":
        assert isinstance(json.loads(text.text), dict)
    else:  # cut at max_tokens: still a JSON object's beginning
        assert text.text.lstrip().startswith("{")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                            temperature=1.0, seed=5, max_tokens=48, stream=True,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "p", "schema": PERSON}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), PERSON)


def test_bad_response_format_and_tool_choice_are_400(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       response_format={"type": "xml"})  # type: ignore[arg-type,typeddict-item]
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}})
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_constrained_rows_leave_batched_streams_token_identical(client: openai.OpenAI) -> None:
    """16 concurrent requests, half constrained: each unconstrained stream is exactly what it was alone."""
    def free(seed: int) -> str:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me a story about the number {seed}."}],
            temperature=1.0, seed=seed, max_tokens=24, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    solo = [free(seed) for seed in range(8)]
    with ThreadPoolExecutor(16) as pool:
        guided = [pool.submit(_person, client, 100 + seed) for seed in range(8)]
        batched = list(pool.map(free, range(8)))
        for reply in guided:
            jsonschema.validate(json.loads(reply.result().choices[0].message.content or ""), PERSON)
    assert batched == solo
