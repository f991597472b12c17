"""Guided decoding, structured outputs, tool calls and the Responses API (issue 40) on a real mesh on loopback:
SmolLM2-135M over 2 torch executors, driven by the official `openai` client (and Generate for the gRPC field)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest

from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.errors import InvalidArgument
from graphmesh.launcher import LocalMesh, free_port
from graphmesh.v1 import coordinator_pb2
from tests.model_fixtures import make_tiny_llama, write_tiny_tokenizer
from tests.responses_calls import check_required_call

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pet": {"type": "string", "enum": ["cat", "dog", "fish"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME: Any = {"type": "function", "function": {
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
    xml: Any = {"type": "xml"}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, response_format=xml)
    broken: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}}
    with pytest.raises(openai.BadRequestError, match="does not compile"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, response_format=broken)
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


def _params(name: str) -> Any:
    return next(t["function"]["parameters"] for t in (WEATHER, TIME) if t["function"]["name"] == name)


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    """A required call is one of the tools with valid arguments; a named one is that function, streamed as OpenAI
    streams tool-call deltas."""
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                               tool_choice="required", temperature=1.0, seed=seed, max_tokens=64)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), _params(call.function.name))
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            temperature=1.0, seed=1, max_tokens=64)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_time"
    jsonschema.validate(json.loads(calls[0]["arguments"]), _params("get_time"))


def test_tool_choice_auto_ends_well_formed_and_tool_results_render(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], stream=True,
                                                         temperature=0.0, max_tokens=48))
            finish = chunks[-1].choices[0].finish_reason
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            names = [d.function.name for c in chunks for d in c.choices[0].delta.tool_calls or [] if d.function]
        else:
            choice = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                    temperature=0.0, max_tokens=48).choices[0]
            finish, content = choice.finish_reason, choice.message.content or ""
            names = [c.function.name for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
        assert finish in ("stop", "length", "tool_calls")
        assert (finish == "tool_calls") == bool(names) and all(n == "get_weather" for n in names)
        assert "<tool_call>" not in content or finish != "tool_calls"
    # the call and its result go back through the template, and the answer is an assistant message
    messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21})}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           temperature=0.0, max_tokens=24)
    assert reply.choices[0].message.role == "assistant" and not reply.choices[0].message.tool_calls
    assert reply.usage is not None and reply.usage.prompt_tokens > 100  # the tools' description and the turns


def test_tool_call_parsing() -> None:
    from graphmesh_coordinator import tool_calls

    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", ' \
           '"arguments": "{\\"b\\": 2}"}\n</tool_call>'
    content, calls = tool_calls.parse(text)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"b": 2}
    assert tool_calls.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    parser, out = tool_calls.StreamParser(), ""
    got: list[dict[str, Any]] = []
    for piece in [text[i:i + 3] for i in range(0, len(text), 3)]:
        more, new = parser.feed(piece)
        out, got = out + more, got + new
    assert (out + parser.finish()).strip() == "Sure." and [c["function"]["name"] for c in got] == ["f", "g"]
    parser = tool_calls.StreamParser()
    assert parser.feed("a <tool") == ("a ", []) and parser.feed("box>") == ("<toolbox>", [])


def test_responses_api_text_stream_and_chain(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, instructions="Answer in one short sentence.",
                                    input="What is the capital of France?", temperature=0.0, max_output_tokens=24)
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete") and first.output_text
    assert first.usage is not None and first.usage.output_tokens > 0
    # chained: the previous turns come from the store, so the prompt is longer than this input alone
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And of Italy?",
                                     temperature=0.0, max_output_tokens=16)
    assert second.previous_response_id == first.id and second.output_text
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    events = list(client.responses.create(model=MODEL, previous_response_id=first.id, input="And of Italy?",
                                          temperature=0.0, max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                       "response.incomplete")
    assert "".join(getattr(e, "delta", "") for e in events if e.type == "response.output_text.delta") == \
        second.output_text  # greedy: the same text streamed
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_api_function_call_and_refusals(client: openai.OpenAI) -> None:
    check_required_call(client, MODEL, "get_weather", WEATHER["function"]["parameters"], seed=2, max_output_tokens=64)
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        client.responses.create(model=MODEL, input="hi", reasoning={"effort": "high"})
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_missing")


def test_metrics(mesh: LocalMesh, client: openai.OpenAI) -> None:
    """Grammar compile time, mask time per token, and requests by response_format kind."""
    import urllib.request

    _person(client, 0, max_tokens=8)
    with urllib.request.urlopen(mesh.http_url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    counts = {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if not line.startswith("#")}
    assert counts["graphmesh_grammar_compile_seconds_count"] >= 1
    assert counts["graphmesh_grammar_mask_seconds_count"] >= 8
    assert counts['graphmesh_openai_requests_by_response_format_total{kind="json_schema"}'] >= 1


def test_kill9_of_an_executor_changes_no_constrained_token() -> None:
    """Guided streams over 3 executors, one killed (-9) mid-run: the recovery replays each session with the mask the
    matcher (advanced only by delivered tokens) gives again, so every stream's tokens are those of a fault-free run."""
    import threading
    import time

    from graphmesh_server import faults

    guided = coordinator_pb2.GuidedDecoding(json_schema=json.dumps(PERSON))
    with LocalMesh(3, "torch", MODEL) as mesh:
        def run(progress: list[int] | None = None) -> list[list[int]]:
            def one(seed: int) -> list[int]:
                out: list[int] = []
                with CoordinatorClient(mesh.coordinator_address) as c:
                    for chunk in c.generate("Describe a person as JSON.", max_tokens=48, temperature=1.0,
                                            seed=seed, guided=guided):
                        out += chunk.token_ids
                        if progress is not None:
                            progress[seed] = len(out)
                return out

            with ThreadPoolExecutor(4) as pool:
                return list(pool.map(one, range(4)))

        baseline = run()
        progress, fired = [0] * 4, threading.Event()

        def trigger() -> None:
            while min(progress) < 5:
                time.sleep(0.005)
            faults.kill9(mesh.executor_processes[1])
            fired.set()

        threading.Thread(target=trigger, daemon=True).start()
        assert run(progress) == baseline
        assert fired.is_set(), "the kill came after generation ended: the test proved nothing"
    assert all(baseline)


# Strings of every kind xgrammar writes differently: bounded (minLength/maxLength), a pattern, bounded array items
# and bounded property names; bounded so that a random model's completion ends within max_tokens. The pattern has
# ASCII classes only: xgrammar's regex `.` and negated classes admit overlong and surrogate UTF-8, which no
# rewriting of its grammar text reaches.
TEXTS = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "note": {"type": "string", "minLength": 1, "maxLength": 8},
    "code": {"type": "string", "pattern": "^[a-z][a-z0-9 ~]{0,5}$"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "extra": {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "integer"},
              "maxProperties": 1},
    "pet": {"type": "string", "enum": ["cat", "dog", "fish"]}},
    "required": ["name", "note", "code", "tags", "extra", "pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama with a byte-level tokenizer: every control byte is a token of its own, which a random
    model samples often at temperature 1."""
    return write_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("byte-llama"), max_position=512))


def test_schema_strings_refuse_raw_control_characters(byte_model: Path) -> None:
    """The grammars themselves: a raw U+0000-U+001F in any string of a schema, of json_object or of a tool call's
    arguments is refused where its escape is (or would be) fine, and so is a UTF-8-encoded surrogate (no UTF-8 at
    all); JSON's own characters still pass."""
    from graphmesh.tokenizer import Tokenizer
    from graphmesh_coordinator.guided import Grammars, GuidedSpec

    tokenizer = Tokenizer.from_hf_dir(byte_model)
    grammars = Grammars(tokenizer, 1000)

    def accepts(spec: GuidedSpec, text: str | bytes) -> bool:
        guide = grammars.guide(spec)
        data = text.encode() if isinstance(text, str) else text
        return all(guide.accept(t) for t in data)  # write_tiny_tokenizer's token i is byte i

    schema = GuidedSpec.json_schema(TEXTS)  # its properties in sorted order, as GuidedSpec writes the schema
    good = {"name": "Ann \u00e9\u4e2d", "note": "x", "code": "ab~", "tags": ["a b"], "extra": {"k": 1}, "pet": "cat"}
    assert accepts(schema, json.dumps(good, ensure_ascii=False, separators=(", ", ": "), sort_keys=True))
    for field, bad in (("name", "A\tn"), ("note", "\x01"), ("code", "a\x1f"), ("tags", ["\x00"]),
                       ("extra", {"\x0b": 1})):
        text = json.dumps({**good, field: bad}, ensure_ascii=False, separators=(", ", ": "), sort_keys=True)
        raw = text.replace("\\t", "\t").replace("\\u0001", "\x01").replace("\\u001f", "\x1f") \
            .replace("\\u0000", "\x00").replace("\\u000b", "\x0b")
        assert raw != text and not accepts(schema, raw), field
    plain = GuidedSpec.json_schema({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    assert accepts(plain, '{"s": "a\\tb"}') and not accepts(plain, '{"s": "a\tb"}')
    assert accepts(plain, '{"s": "\ud7ff\ue000"}') and not accepts(plain, b'{"s": "\xed\xa0\x80"}')
    assert not accepts(schema, json.dumps({**good, "name": "A"}, sort_keys=True, separators=(", ", ": "))
                       .replace('"A"', '"A\x0c"'))
    anything = GuidedSpec("json_object")
    assert accepts(anything, '{"s": ["a\\n", 1]}') and not accepts(anything, '{"s": ["a\n", 1]}')
    assert accepts(anything, '{\n  "s": 1\n}')  # whitespace between values stays free
    call = GuidedSpec.tool_call([{"name": "f", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}])
    assert accepts(call, '<tool_call>\n{"name": "f", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not accepts(call, '<tool_call>\n{"name": "f", "arguments": {"city": "Os\x07lo"}}\n</tool_call>')


def test_a_guided_sessions_proposals_stop_where_its_grammar_refuses(byte_model: Path) -> None:
    """Speculative decoding with a grammar: of a proposer's tokens the guide keeps those its grammar allows one after
    another, with the mask of each position a verified pass samples (the grammar's after the proposals before it),
    and is left where it was."""
    from graphmesh.tokenizer import Tokenizer
    from graphmesh_coordinator.guided import Grammars, GuidedSpec

    tokenizer = Tokenizer.from_hf_dir(byte_model)
    grammars = Grammars(tokenizer, 1000)
    guide = grammars.guide(GuidedSpec("regex", "(ab)+c"))
    a, b, c, x = b"abcx"

    def allows(masks: bytes, position: int) -> set[int]:
        words = np.frombuffer(masks, "<u4")[position * guide.mask_bytes // 4:(position + 1) * guide.mask_bytes // 4]
        return {t for t in range(1000) if (int(words[t >> 5]) >> (t & 31)) & 1}

    before = guide.mask()
    kept, masks = guide.proposals([a, b, a, x, b])
    assert kept == [a, b, a] and len(masks) == 4 * guide.mask_bytes  # cut at x; a mask for each sampled position
    assert [allows(masks, i) for i in range(4)] == [{a}, {b}, {a, c}, {b}]
    assert guide.mask() == before and guide.tokens == 0  # the matcher is where it was
    assert guide.accept(a) and guide.accept(b) and guide.accept(c)
    stop = sorted(tokenizer.eos_token_ids)[0]
    assert stop in allows(guide.proposals([])[1], 0)  # the grammar is complete: its stop token may end it
    kept, masks = guide.proposals([stop])  # but it ends the session: never proposed
    assert kept == [] and len(masks) == guide.mask_bytes


def test_sampled_json_schema_output_is_strict_json(byte_model: Path) -> None:
    """A random model at temperature 1 over many seeds: every completion parses with json.loads(strict=True) (no raw
    control character in a string) and validates, through Generate and through response_format."""
    seeds = range(40)
    guided = coordinator_pb2.GuidedDecoding(json_schema=json.dumps(TEXTS))
    with LocalMesh(2, "torch", str(byte_model), kvstore=False, http_listen=f"127.0.0.1:{free_port()}") as mesh:
        def one(seed: int) -> tuple[str, str]:
            with CoordinatorClient(mesh.coordinator_address) as c:
                chunks = list(c.generate("JSON:", max_tokens=400, temperature=1.0, seed=seed, guided=guided))
            return "".join(ch.text for ch in chunks), chunks[-1].finish_reason

        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(one, seeds))
        http = openai.OpenAI(base_url=mesh.http_url, api_key="none", max_retries=0, timeout=300)
        reply = http.chat.completions.create(
            model=http.models.list().data[0].id, messages=[{"role": "user", "content": "JSON:"}], max_tokens=400, temperature=1.0,
            seed=1, response_format={"type": "json_schema", "json_schema": {"name": "texts", "schema": TEXTS,
                                                                            "strict": True}})
        outputs.append((reply.choices[0].message.content or "", "eos"))
    for seed, (text, finish) in enumerate(outputs):
        assert finish == "eos", (seed, text)
        jsonschema.validate(json.loads(text, strict=True), TEXTS)
    # the random model does write what a loose grammar allows: characters outside ASCII in the strings
    assert any(not text.isascii() for text, _ in outputs)
