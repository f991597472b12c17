"""OpenAI's structured outputs and tool choice as guided decoding (guided.py): `response_format` (text, json_object,
json_schema with or without strict) and `tool_choice` (none, auto, required, a named function) of a request, as the
GuidedSpec its completions follow, and the count of requests by the kind they asked for.

A json_schema answer follows its schema whether `strict` is true or false: a guided completion that would be allowed
to break the schema it was asked for helps no client, and vLLM does the same.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter

from graphmesh.errors import InvalidArgument
from graphmesh_coordinator.guided import GuidedSpec
from graphmesh_coordinator.tool_calls import Function

REQUESTS_BY_FORMAT = Counter("graphmesh_openai_requests_by_response_format",
                             "OpenAI API requests by what their output had to be (text, json_object, json_schema, "
                             "tool_call: a required or named tool call, tools: tools offered with auto)", ["kind"])
FORMAT_KINDS = ("text", "json_object", "json_schema", "tool_call", "tools")


def bad(message: str, parameter: str) -> InvalidArgument:
    return InvalidArgument(message, "BAD_RESPONSE_FORMAT", {"parameter": parameter})


def response_format(value: Any, parameter: str = "response_format") -> GuidedSpec | None:
    """The spec of chat/completions' response_format ({"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}) or of the Responses API's text.format ({"type": "json_schema", "name", "schema", "strict"})."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad(f"{parameter} must be an object with a type", parameter)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema", value)
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            schema = {"type": "object"}  # OpenAI lets a json_schema without a schema be any JSON object
        if not isinstance(schema, dict):
            raise bad(f"{parameter}.json_schema.schema must be a JSON Schema object", f"{parameter}.json_schema")
        return GuidedSpec.json_schema(schema)
    raise bad(f"{parameter}.type {kind!r} is not one of text, json_object, json_schema", f"{parameter}.type")


def tool_choice(choice: Any, tools: list[Function], fmt: str = "hermes",
                parameter: str = "tool_choice") -> tuple[str, GuidedSpec | None]:
    """("none" | "auto" | "required", the grammar of the call when one is required, in tool-call format `fmt`
    (tool_calls.format_of)): a named function is required with that function alone. OpenAI's default is auto with
    tools, none without."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise bad(f"{parameter} {choice!r} needs tools", parameter)
        if choice == "required":
            return "required", GuidedSpec.tool_call([{"name": f.name, "parameters": f.parameters} for f in tools], fmt)
        return str(choice), None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or choice).get("name")  # chat's nested form, or the Responses API's flat one
        picked = [f for f in tools if f.name == name]
        if not picked:
            raise bad(f"{parameter} names the function {name!r}, which is not among the tools", parameter)
        return "required", GuidedSpec.tool_call([{"name": picked[0].name, "parameters": picked[0].parameters}], fmt)
    raise bad(f"{parameter} must be none, auto, required or {{\"type\": \"function\", ...}}", parameter)


def count(kind: str) -> None:
    REQUESTS_BY_FORMAT.labels(kind if kind in FORMAT_KINDS else "text").inc()
