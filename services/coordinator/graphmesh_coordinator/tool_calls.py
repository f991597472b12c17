"""Tool calls in the Hermes/Qwen format, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`: the
tools rendered into the prompt, a conversation's tool calls and tool results rendered back, and a completion's calls
parsed (whole, or while it streams) into OpenAI's `tool_calls`.

The tools are described in the Hermes system prompt (the functions and the format), put first, or appended to the
conversation's own system message; the assistant's calls become `<tool_call>` text in its message and a tool's result
a `tool` turn holding `<tool_response>...</tool_response>`, each rendered by the chat template like any other turn.
That is how SmolLM2's template (which has no `tools` variable) and the Hermes/Qwen families read them. Handing the
tools to a template that renders a `tools` variable itself (Qwen 2.5/3) is not done yet (supports_tools tells it).
Requiring a call (tool_choice "required" or a named function) is enforced by the grammar (guided.tool_call_grammar):
one call. With "auto" the model may answer with text, calls, or both: whatever parses as a call is one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from graphmesh.errors import InvalidArgument
from graphmesh.tokenizer import Tokenizer

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function "
    "call return a json object with function name and arguments within <tool_call></tool_call> XML tags as "
    "follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def bad(message: str, parameter: str) -> InvalidArgument:
    return InvalidArgument(message, "BAD_TOOLS", {"parameter": parameter})


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def tool(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def functions(tools: list[Any] | None, parameter: str = "tools") -> list[Function]:
    """The functions of an OpenAI `tools` list (chat's nested {"type", "function": {...}} form, or the Responses
    API's flat {"type", "name", ...} form), checked."""
    out: list[Function] = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad(f"{parameter}[{i}] must be a tool of type 'function'", f"{parameter}[{i}].type")
        spec = tool.get("function", tool)
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise bad(f"{parameter}[{i}] needs a name of 1-64 letters, digits, '_', '.' or '-'", f"{parameter}[{i}]")
        params = spec.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad(f"{parameter}[{i}].parameters must be a JSON Schema object", f"{parameter}[{i}]")
        out.append(Function(name, str(spec.get("description") or ""), params))
    if len({f.name for f in out}) != len(out):
        raise bad("two tools have the same name", parameter)
    return out


def _call_text(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def supports_tools(tokenizer: Tokenizer) -> bool:
    return bool(tokenizer.chat_template) and "tools" in (tokenizer.chat_template or "")


def render(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[Function]) -> list[dict[str, Any]]:
    """The conversation as the chat template gets it: tool calls and results as text turns, and (when the template
    cannot render `tools` itself) the Hermes system prompt describing the functions first."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c["function"]["name"], c["function"].get("arguments", {})) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools:
        described = HERMES_SYSTEM.format(tools="\n".join(json.dumps(f.tool(), ensure_ascii=False) for f in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parse_call(body: str) -> dict[str, Any] | None:
    """An OpenAI tool call from the JSON inside <tool_call> tags, or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A completion's text (None when it held only calls) and its tool calls, in order. A `<tool_call>` whose body
    is not a call stays text."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    at = 0
    for m in _CALL.finditer(text):
        call = _parse_call(m.group(1))
        if call is None:
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls


@dataclass
class StreamParser:
    """Splits streamed text into content and whole tool calls: text that may be the start of `<tool_call>` waits
    until it is known not to be, a call is held until `</tool_call>` closes it, then comes out as one call."""

    buffer: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content now final and the calls now complete, from the text that came."""
        self.buffer += text
        content, new = "", []
        while self.buffer:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, OPEN)  # may be the start of a call
                content += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                content += self.buffer[:start]
                self.buffer = self.buffer[start:]
                break
            call = _parse_call(self.buffer[start + len(OPEN):end].strip())
            if call is None:
                content += self.buffer[: end + len(CLOSE)]
            else:
                content += self.buffer[:start]
                new.append(call)
            self.buffer = self.buffer[end + len(CLOSE):]
        if self.calls or new:  # between and after calls, whitespace is the format's, not content
            content = content.strip()
        self.calls += new
        return content, new

    def finish(self) -> str:
        """What is left at the end (an unclosed call stays text)."""
        rest, self.buffer = self.buffer, ""
        return rest.strip() if self.calls else rest


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def call_deltas(calls: list[dict[str, Any]], first_index: int) -> list[dict[str, Any]]:
    """Chat streaming deltas for whole calls, as OpenAI streams them (index, id, type, function name and arguments)."""
    return [{"index": first_index + i, "id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
            for i, c in enumerate(calls)]
