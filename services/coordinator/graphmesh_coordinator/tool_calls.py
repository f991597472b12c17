"""Tool calls in the format of the model's family: the tools rendered into the prompt, a conversation's tool calls
and tool results rendered back, and a completion's calls parsed (whole, or while it streams) into OpenAI's
`tool_calls`. The chat template says which format (format_of):

- hermes (Hermes, Qwen 2.5/3, SmolLM2): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- llama3_json (Llama 3.1-3.3): `{"name": ..., "parameters": {...}}`, bare or after `<|python_tag|>`, calls
  separated by `;`;
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, each call's id 9 letters and digits.

A template that renders the `tools` variable gets the tools, the assistant's calls (arguments as objects, as
transformers' templates expect) and the `tool` messages as they are, and writes them its own way. One that does not
(SmolLM2's, plain ChatML) gets the Hermes system prompt describing the functions, put first or appended to the
conversation's own system message, the calls as `<tool_call>` text and each result a `<tool_response>` turn.

Requiring a call (tool_choice "required" or a named function) is enforced by the grammar (guided.tool_call_grammar):
one call in the format. Mistral's calls open with a control token no grammar writes, so a required call's prompt
ends with `[TOOL_CALLS]` and the completion is its list. With "auto" the model may answer with text, calls, or both:
whatever parses as a call is one.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
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


HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
PYTHON_TAG, MISTRAL_OPEN = "<|python_tag|>", "[TOOL_CALLS]"
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
# A call's JSON may hold control characters inside its strings: xgrammar's JSON strings let a sampled call write
# them raw, and the arguments are written out again escaped.
_JSON = json.JSONDecoder(strict=False)


def format_of(tokenizer: Tokenizer) -> str:
    """The tool-call format the model's chat template writes (hermes when it writes none of the others)."""
    template = tokenizer.chat_template or ""
    if MISTRAL_OPEN in template and tokenizer.backend.token_to_id(MISTRAL_OPEN) is not None:
        return MISTRAL
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return LLAMA3_JSON
    return HERMES


def renders_tools(tokenizer: Tokenizer) -> bool:
    return "tools" in (tokenizer.chat_template or "")


def encode(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[Function], fmt: str,
           forced: bool) -> tuple[list[int], str]:
    """The prompt's token ids for a conversation with tools offered (or tool turns in it), and the text its
    completion continues (the parsers' prefix): "[TOOL_CALLS]" when a Mistral call is forced, else ""."""
    if not renders_tools(tokenizer):
        return tokenizer.encode_chat(render(tokenizer, messages, tools)), ""
    ids = tokenizer.encode_chat(_template_messages(messages, fmt), tools=[f.tool() for f in tools] or None)
    if fmt == MISTRAL and forced:
        opener = tokenizer.backend.token_to_id(MISTRAL_OPEN)
        assert opener is not None  # format_of chose mistral for a vocabulary that has it
        return [*ids, opener], MISTRAL_OPEN
    return ids, ""


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


def _template_messages(messages: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template that renders tools: calls with their arguments as objects,
    results with the id of their call (Mistral's in its 9-character form, the one its template accepts)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = [{"id": _call_id(c.get("id"), fmt), "type": "function",
                                      "function": {"name": c["function"]["name"],
                                                   "arguments": _arguments(c["function"].get("arguments", {}))}}
                                     for c in m["tool_calls"]]
        if m["role"] == "tool":
            message["tool_call_id"] = _call_id(m.get("tool_call_id"), fmt)
        out.append(message)
    return out


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _call_id(call_id: Any, fmt: str) -> str:
    """A call's id as the format writes it: Mistral's are 9 letters and digits, so another id (call_...) becomes a
    digest of itself, the same for the call and for its result."""
    text = str(call_id or "")
    if fmt != MISTRAL or _MISTRAL_ID.fullmatch(text):
        return text
    return hashlib.sha256(text.encode()).hexdigest()[:9]


def new_call_id(fmt: str = HERMES) -> str:
    if fmt == MISTRAL:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


def _parse_call(body: str) -> dict[str, Any] | None:
    """An OpenAI tool call from the JSON inside <tool_call> tags, or None when it is not one."""
    try:
        value = _JSON.decode(body)
    except ValueError:
        return None
    return _call(value, HERMES)


def _call(value: Any, fmt: str) -> dict[str, Any] | None:
    """An OpenAI tool call from a decoded {"name", "arguments" (or Llama's "parameters")}, or None when it is not
    one. A Mistral call keeps the id it was written with when it is one of Mistral's."""
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
    given = value.get("id")
    call_id = given if fmt == MISTRAL and isinstance(given, str) and _MISTRAL_ID.fullmatch(given) else new_call_id(fmt)
    return {"id": call_id, "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse(text: str, fmt: str = HERMES, prefix: str = "") -> tuple[str | None, list[dict[str, Any]]]:
    """A completion's text (None when it held only calls) and its tool calls, in order, in format `fmt`; `prefix`
    is the text the prompt ended with that the completion continues (encode's). What does not parse as a call
    stays text."""
    if fmt != HERMES:
        stream = parser(fmt, prefix)
        streamed, found = stream.feed(text)
        streamed += stream.finish()
        return (streamed.strip() or None) if found else streamed, found
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


class JsonCallsParser:
    """Llama 3.1's and Mistral's calls, streamed: JSON after an opener (`<|python_tag|>`, `[TOOL_CALLS]`) or, for
    Llama, a completion that starts with `{`. Text that may be the start of an opener waits until it is known not
    to be; JSON is held until it closes, then each call in it comes out whole. JSON that is not a call (or calls)
    is text, opener included."""

    def __init__(self, fmt: str, opener: str, bare: bool) -> None:
        self.fmt, self.opener, self.bare = fmt, opener, bare  # bare: a completion's first `{` opens calls too
        self.calls: list[dict[str, Any]] = []
        self.buffer = ""  # text not yet given out
        self.body = False  # the buffer is JSON after an opener (or a bare start): calls, when it closes
        self.started = False  # some non-blank text came before: `{` is text now
        self._closers = -1  # closing brackets in the body when it last failed to decode

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content now final and the calls now complete, from the text that came."""
        self.buffer += text
        content, new = "", list[dict[str, Any]]()
        while self.buffer:
            if not self.body:
                head = self.buffer.lstrip()
                if self.fmt == LLAMA3_JSON and (self.calls or new) and head.startswith(";"):  # Llama's next call
                    rest = head[1:].lstrip()
                    if not rest:
                        break
                    if rest.startswith("{"):
                        self.buffer, self.body = rest, True
                        continue
                if self.bare and not self.started:
                    if not head:
                        break  # blank so far: calls may still start
                    if head.startswith("{"):  # Llama's bare call (the blank before it is not content)
                        self.buffer, self.body = head, True
                        continue
                start = self.buffer.find(self.opener)
                if start < 0:
                    keep = _partial_suffix(self.buffer, self.opener)  # may be the start of an opener
                    content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    self.started = self.started or bool(content.strip())
                    break
                content += self.buffer[:start]
                self.buffer, self.body, self.started = self.buffer[start:], True, True
                continue
            calls, used = self._decode(self.buffer)
            if used < 0:
                break  # the JSON has not closed yet
            if calls is None:  # not calls: the opener and the JSON are text
                content += self.buffer[:used]
            else:
                new += calls
            self.buffer, self.body, self.started = self.buffer[used:], False, True
        if self.calls or new:  # between and after calls, whitespace is the format's, not content
            content = content.strip()
        self.calls += new
        return content, new

    def _decode(self, text: str) -> tuple[list[dict[str, Any]] | None, int]:
        """(the calls, or None when the JSON is not calls; the characters they took) of the opener and JSON at
        the start of `text`, or (None, -1) while the JSON is incomplete."""
        at = len(self.opener) if text.startswith(self.opener) else 0
        body = text[at:]
        skipped = len(body) - len(body.lstrip())
        closers = body.count("}") + body.count("]")
        if not body.strip() or closers == self._closers:  # calls end on a bracket: no new one, no new answer
            return None, -1
        try:
            value, end = _JSON.raw_decode(body.lstrip())
        except ValueError:
            self._closers = closers
            return None, -1  # incomplete, or never JSON: finish() gives it back as text
        self._closers = -1
        used = at + skipped + end
        values = value if isinstance(value, list) else [value]
        calls = [_call(v, self.fmt) for v in values]
        if not values or any(c is None for c in calls):
            return None, used
        return [c for c in calls if c is not None], used

    def finish(self) -> str:
        """What is left at the end (an unclosed call stays text)."""
        rest, self.buffer, self.body = self.buffer, "", False
        if self.calls and self.fmt == LLAMA3_JSON and rest.strip() == ";":  # a separator with no call after it
            return ""
        return rest.strip() if self.calls else rest


def parser(fmt: str, prefix: str = "") -> StreamParser | JsonCallsParser:
    """The streaming parser of format `fmt`, already past `prefix` (encode's)."""
    if fmt == HERMES:
        out: StreamParser | JsonCallsParser = StreamParser()
    else:
        out = JsonCallsParser(fmt, MISTRAL_OPEN if fmt == MISTRAL else PYTHON_TAG, bare=fmt == LLAMA3_JSON)
    if prefix:
        out.feed(prefix)
    return out


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
