"""A required function call asked of the OpenAI Responses API, whole and streamed, and checked: what the structured
output and the tool-format tests both ask of it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai


def check_required_call(client: openai.OpenAI, model: str, name: str, parameters: dict[str, Any], seed: int,
                        max_output_tokens: int) -> list[Any]:
    """Asks for a required call of the function `name` ("Weather in Oslo?"), whole and then streamed, and checks that
    each answer holds that one call, with arguments valid against `parameters`. The streamed events."""
    tool: Any = {"type": "function", "name": name, "parameters": parameters}
    ask: dict[str, Any] = {"model": model, "input": "Weather in Oslo?", "tools": [tool], "tool_choice": "required",
                           "temperature": 1.0, "extra_body": {"seed": seed}, "max_output_tokens": max_output_tokens}
    whole = client.responses.create(**ask).output
    events = list(client.responses.create(**ask, stream=True))
    done = [e for e in events if e.type == "response.completed"]
    assert len(done) == 1, [e.type for e in events]
    for output in (whole, done[0].response.output):
        calls = [o for o in output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == name, output
        jsonschema.validate(json.loads(calls[0].arguments), parameters)
    return events
