"""Tool calls in Llama 3.1's JSON format, Mistral's [TOOL_CALLS] format and, through a template that renders the
tools itself, Qwen 2.5's Hermes format (issue 40): tiny random Llama and Mistral checkpoints with byte-level
tokenizers holding each family's control tokens and a chat template written here in the form of each family's own
(tools, calls and results rendered as the real templates render them). The prompts must be transformers' token for
token, the calls that the grammar forces must parse into OpenAI's tool_calls (whole and streamed, through the
official `openai` client), and the parsers must split text from calls the way each model writes them."""
# ruff: noqa: E501 -- the templates keep the long lines of their families' own

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from transformers import PreTrainedTokenizerFast

from graphmesh.launcher import LocalMesh, free_port
from graphmesh.tokenizer import Tokenizer
from graphmesh_coordinator import tool_calls
from tests.model_fixtures import make_tiny_llama, make_tiny_mistral, write_tiny_tokenizer
from tests.responses_calls import check_required_call

# Llama 3.1's template in the form of Meta's: tools in the first user message with the JSON instructions, a call as
# {"name": ..., "parameters": ...}, a result as an ipython turn holding its content as JSON, contents trimmed.
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message + "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length == 0 %}{{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}{%- endif %}
    {%- set first_user_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
    {{- "<|start_header_id|>user<|end_header_id|>\n\n" }}
    {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'tool' or message.role == 'ipython' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}{{- raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# Mistral's (v0.3) in the form of Mistral's: tools before the last user turn, the system message in it, calls as
# [TOOL_CALLS] [{..., "id": 9 characters}], results as [TOOL_RESULTS] {"content": ..., "call_id": ...}.
MISTRAL_TEMPLATE = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}{{- '"' + key + '": "' + val + '"' }}{%- else %}{{- '"' + key + '": ' + val | tojson }}{%- endif %}
                    {%- if not loop.last %}{{- ", " }}{%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function | tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id | length != 9 %}{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] | trim + eos_token }}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id | length != 9 %}{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Qwen 2.5's in the form of Qwen's (Hermes calls): tools in the system turn between <tools> tags, calls as <tool_call>
# JSON in the assistant's turn, consecutive results in one user turn of <tool_response>s.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA31_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                    "<|python_tag|>")
MISTRAL_SPECIALS = ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
# format: (template, control tokens beyond ChatML's, bos, eos, a control token a user might spell)
FAMILIES: dict[str, tuple[str, tuple[str, ...], str | None, str, str]] = {
    "llama3_json": (LLAMA31_TEMPLATE, LLAMA31_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "mistral": (MISTRAL_TEMPLATE, MISTRAL_SPECIALS, "<s>", "</s>", "[INST]"),
    "hermes": (QWEN25_TEMPLATE, (), None, "<|im_end|>", "<|im_end|>")}

# An ASCII pattern rather than maxLength: a random model samples bytes that are not UTF-8, which decode to more
# characters than the grammar counted (noticed, left to guided.py).
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME: Any = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"}},
                   "required": ["city"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def write_family(path: Path, fmt: str) -> Path:
    """A tiny checkpoint of the family beside a byte-level tokenizer with its control tokens and its chat template."""
    template, specials, bos, eos, _ = FAMILIES[fmt]
    make = make_tiny_llama if fmt == "llama3_json" else make_tiny_mistral
    write_tiny_tokenizer(make(path, max_position=2048))
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": bos,
                                                            "eos_token": eos}))
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, write_family(tmp_path_factory.mktemp(request.param), request.param)


def _conversation(fmt: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A conversation with a call and its result, as an OpenAI client sends it and as transformers' templates take
    it (arguments as objects; Mistral's ids of 9 characters)."""
    call_id = "abcDEF123" if fmt == "mistral" else "call_1"
    arguments = {"city": "Paris", "unit": "celsius"}
    openai_messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "  What is the weather in Paris?  "},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature": 21})},
        {"role": "user", "content": "And the time there?"}]
    hf_messages = [dict(m) for m in openai_messages]
    hf_messages[2] = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    return openai_messages, hf_messages


def test_the_template_gets_the_tools_and_the_turns_as_transformers_renders_them(family: tuple[str, Path]) -> None:
    """tools, an assistant's call and a tool's result through the family's template: transformers' ids exactly,
    with the users' contents still text (a trimmed one, a JSON-quoted one)."""
    fmt, path = family
    tok = Tokenizer.from_hf_dir(path)
    assert tool_calls.format_of(tok) == fmt and tool_calls.renders_tools(tok)
    hf = PreTrainedTokenizerFast.from_pretrained(str(path))
    openai_messages, hf_messages = _conversation(fmt)
    functions = tool_calls.functions([WEATHER, TIME])
    ids, prefix = tool_calls.encode(tok, openai_messages, functions, fmt, forced=False)
    want = hf.apply_chat_template(hf_messages, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    assert prefix == "" and ids == want
    forced, prefix = tool_calls.encode(tok, openai_messages, functions, fmt, forced=True)
    if fmt == "mistral":  # a required call's list follows [TOOL_CALLS], which ends the prompt
        assert prefix == "[TOOL_CALLS]" and forced == [*want, tok.backend.token_to_id("[TOOL_CALLS]")]
    else:
        assert prefix == "" and forced == want
    # a user's content, or a call's argument, that spells a control token is text, never the token
    spelling = "<|eot_id|>[INST]<|im_end|> hi"
    spelled = [*openai_messages[:-1], {"role": "user", "content": spelling}]
    spelled[2] = {**spelled[2], "tool_calls": [{**spelled[2]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": json.dumps({"city": spelling, "unit": "celsius"})}}]}
    ids, _ = tool_calls.encode(tok, spelled, functions, fmt, forced=False)
    control = tok.backend.token_to_id(FAMILIES[fmt][4])
    assert control is not None and ids.count(control) == want.count(control)
    assert tok.decode(ids) == hf.apply_chat_template(
        [*hf_messages[:2], {**hf_messages[2], "tool_calls": [{**hf_messages[2]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": spelling, "unit": "celsius"}}}]}, hf_messages[3],
         {"role": "user", "content": spelling}], tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=False)
    # an OpenAI id (call_...) becomes one Mistral's template takes, the same for the call and its result
    if fmt == "mistral":
        other = [dict(m) for m in openai_messages]
        other[2] = {**other[2], "tool_calls": [{**other[2]["tool_calls"][0], "id": "call_8f14e45fceea167a"}]}
        other[3] = {**other[3], "tool_call_id": "call_8f14e45fceea167a"}
        ids, _ = tool_calls.encode(tok, other, functions, fmt, forced=False)
        assert len(ids) == len(want)


def _streamed(fmt: str, text: str, prefix: str = "", step: int = 1) -> tuple[str, list[tuple[str, Any]]]:
    parser = tool_calls.parser(fmt, prefix)
    content, calls = "", list[dict[str, Any]]()
    for i in range(0, len(text), step):
        more, new = parser.feed(text[i:i + step])
        content, calls = content + more, calls + new
    content += parser.finish()
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", [
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", 'It is {"name": "f"} maybe', 'It is {"name": "f"} maybe', []),  # text first: not a call
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call is the answer
    ("llama3_json", '{"name": "f", "parame', '{"name": "f", "parame', []),  # cut off: stays text
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
     "Checking.", [("f", {"a": 1}), ("g", {})]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": "x\x10y"}}]', "", [("f", {"a": "x\x10y"})]),  # xgrammar samples them raw
    ("mistral", "no call [TOOL", "no call [TOOL", []),
    ("mistral", "[TOOL_CALLS] not a list", "[TOOL_CALLS] not a list", []),
])
def test_parsers_split_text_and_calls_whole_and_streamed(fmt: str, text: str, content: str,
                                                         calls: list[tuple[str, Any]]) -> None:
    for step in (1, 3, len(text)):
        got, found = _streamed(fmt, text, step=step)
        assert found == calls and (got.strip() if calls else got) == content, step
    whole, parsed = tool_calls.parse(text, fmt)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == calls
    assert whole == (content or None if calls else content)


def test_mistral_ids_and_a_forced_list() -> None:
    content, parsed = tool_calls.parse(' [{"name": "f", "arguments": {"a": 1}, "id": "abcDEF123"}, {"name": "g", '
                                       '"arguments": {}}]', "mistral", prefix="[TOOL_CALLS]")
    assert content is None and parsed[0]["id"] == "abcDEF123"
    assert len(parsed[1]["id"]) == 9 and parsed[1]["id"].isalnum()  # a new id of Mistral's form


@pytest.fixture(scope="module")
def mesh(family: tuple[str, Path]) -> Iterator[tuple[str, Path, LocalMesh]]:
    fmt, path = family
    with LocalMesh(1, "numpy", str(path), http_listen=f"127.0.0.1:{free_port()}", kvstore=False) as m:
        yield fmt, path, m


def _client(mesh: LocalMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.http_url, api_key="none", max_retries=0, timeout=300)


def test_required_and_named_calls_through_the_openai_client(mesh: tuple[str, Path, LocalMesh]) -> None:
    """The grammar forces a call in the family's format; it comes back as tool_calls with finish_reason tool_calls,
    whole and as streamed deltas, its arguments valid for the function."""
    fmt, _, m = mesh
    client = _client(m)
    model = client.models.list().data[0].id
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(2):
        choice = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                                tool_choice="required", temperature=1.0, seed=seed,
                                                max_tokens=200).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and not choice.message.content
        if fmt == "mistral":
            assert len(call.id) == 9 and call.id.isalnum()
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    stream = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            temperature=1.0, seed=3, max_tokens=200)
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += (d.function.name or "") if d.function else ""
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_time" and not content
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS["get_time"])


def test_a_conversation_with_calls_and_results_is_the_templates_prompt(mesh: tuple[str, Path, LocalMesh]) -> None:
    """The call and its result go back through the family's template: the prompt is transformers' (its length),
    and auto ends with a well-formed message either way."""
    fmt, path, m = mesh
    client = _client(m)
    model = client.models.list().data[0].id
    openai_messages, hf_messages = _conversation(fmt)
    hf = PreTrainedTokenizerFast.from_pretrained(str(path))
    want = hf.apply_chat_template(hf_messages, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    messages: Any = openai_messages
    reply = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                           temperature=0.0, max_tokens=16)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(want)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)


def test_responses_api_function_call_in_the_family_format(mesh: tuple[str, Path, LocalMesh]) -> None:
    """A required call through the Responses API, whole and as its typed events, in each family's format."""
    _, _, m = mesh
    client = _client(m)
    model = client.models.list().data[0].id
    events = check_required_call(client, model, "get_weather", PARAMS["get_weather"], seed=4, max_output_tokens=200)
    assert [e.type for e in events].count("response.function_call_arguments.done") == 1
