"""Guided decoding: a completion constrained to a JSON Schema, any JSON object, a regular expression, an EBNF grammar
or a tool call, by the allowed-token mask of a grammar matcher applied where each token is sampled.

The engine is xgrammar. Both maintained engines on PyPI were measured on the development VM (2 cores) with the bundled
SmolLM2-135M tokenizer (49,152 tokens) and a small object schema (a string with maxLength, an integer, an enum array,
a boolean), over the 24 tokens of a valid answer:

    xgrammar 0.2.9:    tokenizer info 315 ms once; compile 11 ms; mask 2 us median, 100 us-1.1 ms max
    llguidance 1.9.1:  tokenizer 650-740 ms once; compile 3-6 ms; mask 25-29 us median, 1.7-1.8 ms max

A schema compiles once (cached here by its text), but a mask is computed for every token of every guided row, on the
scheduler's thread: xgrammar's is ~10x cheaper where it counts. It also takes all five kinds from one compiler
(JSON Schema, its built-in JSON grammar, regex, EBNF, and grammars concatenated from those: the tool calls below).

Where the grammar state lives: here, on the coordinator, one matcher per session (a Guide on the scheduler's
Sequence). Each row that samples a token carries that token's mask (StepRow.allowed_tokens: ceil(vocab / 32) uint32
words, 6 KiB for SmolLM2) to the ranks; the last stage samples it on the host from the logits graph, every other token
at -inf, with the same seeded draw as in-graph sampling (executor logprobs.py). The matcher advances only on tokens
the scheduler delivers (committed outputs), so a replay after a fault asks again with the same mask and the same seed
and gets the same token, and a resumed stream first replays its delivered tokens into a fresh matcher. What it costs:
a guided row never takes a decode run (one token per step, or a verified pass of proposals the grammar allows:
the next mask needs the coordinator), and guided rows
share steps only with guided rows (as rows with logprobs do), so an unguided session's tokens always come from the
same graph as alone.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from prometheus_client import Counter, Histogram

from graphmesh.errors import InvalidArgument
from graphmesh.tokenizer import Tokenizer
from graphmesh.v1 import coordinator_pb2

log = logging.getLogger("graphmesh.coordinator.guided")

GRAMMAR_COMPILE_SECONDS = Histogram(
    "graphmesh_grammar_compile_seconds", "Time to compile a guided-decoding grammar (a cache miss)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
GRAMMAR_MASK_SECONDS = Histogram(
    "graphmesh_grammar_mask_seconds", "Time to compute one guided row's allowed-token mask (per token)",
    buckets=(1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01))
GRAMMAR_CACHE_HITS = Counter("graphmesh_grammar_cache_hits", "Guided requests whose grammar was already compiled")

Kind = Literal["json_schema", "json_object", "regex", "grammar", "tool_call"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar", "tool_call")
CACHE_SIZE = 256  # compiled grammars kept (by kind and source)
MAX_SOURCE_BYTES = 1 << 20  # a schema, regex or grammar longer than this is refused
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"  # the Hermes/Qwen format (tool_calls.py)
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")
# xgrammar (0.2.9) writes a string with minLength/maxLength as a run of [^"\\\r\n]: raw control characters other
# than CR and LF pass, and strict JSON (RFC 8259, json.loads(strict=True)) refuses them. Each of its string
# characters also admits a UTF-8-encoded surrogate (ED A0 80: no valid UTF-8, decoded as three U+FFFD, past a
# maxLength). json_schema_grammar and json_object_grammar make every string character one JSON allows unescaped.
_LOOSE_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]', r'[^\"\\\0-\x1f]')
_JSON_STRING_CHAR = r'[^\"\\\0-\x1f\uD800-\uDFFF]'


@dataclass(frozen=True)
class GuidedSpec:
    """What a completion must be. source: the JSON Schema's text (json_schema), the regex, the EBNF grammar, or for
    tool_call the format and the functions [{"name", "parameters"}] one of which the completion calls; "" for
    json_object."""

    kind: Kind
    source: str = ""  # tool_call: {"format": tool_calls' format, "functions": [...]}

    @staticmethod
    def json_schema(schema: Any) -> GuidedSpec:
        return GuidedSpec("json_schema", schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True))

    @staticmethod
    def tool_call(functions: list[dict[str, Any]], fmt: str = "hermes") -> GuidedSpec:
        return GuidedSpec("tool_call", json.dumps({"format": fmt, "functions": functions}, sort_keys=True))


def bad(message: str, parameter: str = "guided") -> InvalidArgument:
    return InvalidArgument(message, "BAD_GUIDED_DECODING", {"parameter": parameter})


class Grammars:
    """The compiler for one tokenizer, and its compiled grammars (LRU, by spec)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)  # type: ignore[no-untyped-call]
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=list(tokenizer.eos_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[GuidedSpec, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GuidedSpec) -> Any:
        """The compiled grammar of `spec` (INVALID_ARGUMENT when it does not compile)."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                GRAMMAR_CACHE_HITS.inc()
                return compiled
        if len(spec.source) > MAX_SOURCE_BYTES:
            raise bad(f"the {spec.kind} is {len(spec.source)} bytes; at most {MAX_SOURCE_BYTES}")
        t0 = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except InvalidArgument:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
            raise bad(f"the {spec.kind} does not compile: {str(e).strip()[:500]}") from None
        GRAMMAR_COMPILE_SECONDS.observe(time.perf_counter() - t0)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GuidedSpec) -> Any:
        c = self._compiler
        if spec.kind == "json_object":
            return c.compile_grammar(json_object_grammar())
        if spec.kind == "json_schema":
            _check_json(spec.source, "json_schema")
            return c.compile_grammar(json_schema_grammar(spec.source))
        if spec.kind == "regex":
            return c.compile_regex(spec.source)
        if spec.kind == "grammar":
            return c.compile_grammar(spec.source)
        if spec.kind == "tool_call":
            source = json.loads(spec.source)
            return c.compile_grammar(tool_call_grammar(source["functions"], source["format"]))
        raise bad(f"unknown guided decoding kind {spec.kind!r}")

    def guide(self, spec: GuidedSpec) -> Guide:
        return Guide(self.compile(spec), self.words)


def tool_call_grammar(functions: list[dict[str, Any]], fmt: str = "hermes") -> Any:
    """One tool call of one of `functions` in format `fmt`, N one of the names and the arguments valid for that
    function's parameters: hermes `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`, llama3_json
    `{"name": N, "parameters": {...}}` (bare, as Llama 3.1 writes calls to functions it was given), mistral
    ` [{"name": N, "arguments": {...}}]` (the list after the `[TOOL_CALLS]` that ends the prompt:
    tool_calls.encode)."""
    import xgrammar as xgr

    if fmt not in TOOL_CALL_FORMATS:
        raise bad(f"unknown tool call format {fmt!r}")
    key = "parameters" if fmt == "llama3_json" else "arguments"
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               key: f.get("parameters") or {"type": "object"}},
              "required": ["name", key], "additionalProperties": False} for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    call = json_schema_grammar(json.dumps(schema))
    opener, closer = {"hermes": (TOOL_CALL_OPEN, TOOL_CALL_CLOSE), "mistral": (" [", "]")}.get(fmt, ("", ""))
    if not opener:
        return call
    return xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(opener)}"), call,
                              xgr.Grammar.from_ebnf(f"root ::= {json.dumps(closer)}"))


def json_schema_grammar(schema: str) -> Any:
    """The grammar of compact JSON valid for `schema` (a sampled completion cannot spend its tokens on whitespace
    between values) whose strings hold no raw control character."""
    import xgrammar as xgr

    return _strict_strings(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))


def json_object_grammar() -> Any:
    """Any JSON object or array (xgrammar's built-in JSON grammar) whose strings hold only characters JSON allows
    unescaped."""
    import xgrammar as xgr

    return _strict_strings(xgr.Grammar.builtin_json_grammar())


def _strict_strings(grammar: Any) -> Any:
    import xgrammar as xgr

    text = str(grammar)
    for loose in _LOOSE_STRING_CHARS:
        text = text.replace(loose, _JSON_STRING_CHAR)
    return xgr.Grammar.from_ebnf(text)


def _check_json(text: str, what: str) -> None:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise bad(f"the {what} is not JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise bad(f"the {what} must be a JSON object")


class Guide:
    """One session's matcher: the mask of the token it samples next, advanced by each token it is given."""

    def __init__(self, compiled: Any, words: int) -> None:
        import torch
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = torch.zeros((1, words), dtype=torch.int32)
        self.mask_bytes = 4 * words
        self.tokens = 0  # tokens accepted

    def mask(self) -> bytes:
        """The allowed-token bitmask of the next token (little-endian uint32 words, bit i % 32 of word i // 32)."""
        t0 = time.perf_counter()
        self._matcher.fill_next_token_bitmask(self._bitmask)
        out = np.asarray(self._bitmask.numpy()[0], "<i4").tobytes()
        GRAMMAR_MASK_SECONDS.observe(time.perf_counter() - t0)
        return out

    def proposals(self, tokens: list[int]) -> tuple[list[int], bytes]:
        """Of a proposer's `tokens`, those the grammar allows one after another, up to the first it refuses or a stop
        token (a pass that samples one ends the session anyway), and the masks of the positions a verified pass of
        them samples, one after another: each the grammar's after the proposals before it (stage.proto
        StepRow.allowed_tokens). The matcher is left where it was."""
        import torch

        t0 = time.perf_counter()
        masks = torch.zeros((len(tokens) + 1, self._bitmask.shape[1]), dtype=torch.int32)
        stops = set(self._matcher.stop_token_ids)
        kept: list[int] = []
        for token in tokens:
            self._matcher.fill_next_token_bitmask(masks, len(kept))
            if token in stops or not self._matcher.accept_token(token):  # it refuses what the mask leaves out
                break
            kept.append(token)
        self._matcher.fill_next_token_bitmask(masks, len(kept))
        if kept:
            self._matcher.rollback(len(kept))
        GRAMMAR_MASK_SECONDS.observe(time.perf_counter() - t0)
        return kept, np.asarray(masks[:len(kept) + 1].numpy(), "<i4").tobytes()

    def accept(self, token: int) -> bool:
        """Advances past `token` (one the mask allowed). False: the grammar refused it (the matcher is unchanged)."""
        if self._matcher.is_terminated():
            return False
        ok = bool(self._matcher.accept_token(token))
        if ok:
            self.tokens += 1
        else:
            log.warning("the grammar refused a sampled token", extra={"token": token})
        return ok

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_terminated())


def from_fields(json_schema: str = "", json_object: bool = False, regex: str = "", grammar: str = "",
                names: tuple[str, str, str, str] = ("json_schema", "json_object", "regex", "grammar")) -> GuidedSpec | None:
    """The spec of at most one set field (GenerateRequest.guided, KServe's guided_* parameters); None when none is."""
    given = [(n, v) for n, v in zip(names, (json_schema, json_object, regex, grammar)) if v]
    if len(given) > 1:
        raise bad(f"at most one of {', '.join(names)} may be given, got {', '.join(n for n, _ in given)}",
                  given[1][0])
    if not given:
        return None
    if json_schema:
        _check_json(json_schema, names[0])
        return GuidedSpec("json_schema", json_schema)
    if json_object:
        return GuidedSpec("json_object")
    return GuidedSpec("regex", regex) if regex else GuidedSpec("grammar", grammar)


def from_proto(guided: coordinator_pb2.GuidedDecoding) -> GuidedSpec | None:
    """GenerateRequest.guided's spec; None when no field is set."""
    spec = from_fields(guided.json_schema, guided.json_object, guided.regex, guided.grammar)
    if not guided.HasField("tool_call"):
        return spec
    if spec is not None:
        raise bad(f"at most one of json_schema, json_object, regex, grammar and tool_call may be given, got "
                  f"{spec.kind} and tool_call", "tool_call")
    call = guided.tool_call
    if call.format not in TOOL_CALL_FORMATS:
        raise bad(f"tool_call.format must be one of {', '.join(TOOL_CALL_FORMATS)}, got {call.format!r}",
                  "tool_call.format")
    if not call.functions:
        raise bad("tool_call names no function", "tool_call.functions")
    functions = []
    for i, f in enumerate(call.functions):
        where = f"tool_call.functions[{i}]"
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", f.name):
            raise bad(f"{where}.name must be 1-64 letters, digits, '_', '.' or '-'", f"{where}.name")
        try:
            parameters = json.loads(f.parameters_json) if f.parameters_json else {"type": "object", "properties": {}}
        except ValueError as e:
            raise bad(f"{where}.parameters_json is not JSON: {e}", f"{where}.parameters_json") from None
        if not isinstance(parameters, dict):
            raise bad(f"{where}.parameters_json must be a JSON Schema object", f"{where}.parameters_json")
        functions.append({"name": f.name, "parameters": parameters})
    return GuidedSpec.tool_call(functions, call.format)


def to_proto(spec: GuidedSpec | None) -> coordinator_pb2.GuidedDecoding:
    """from_proto's inverse: what a front end sends for a request it parsed."""
    if spec is None:
        return coordinator_pb2.GuidedDecoding()
    if spec.kind == "tool_call":
        source = json.loads(spec.source)
        return coordinator_pb2.GuidedDecoding(tool_call=coordinator_pb2.GuidedToolCall(
            format=source["format"], functions=[coordinator_pb2.GuidedFunction(
                name=f["name"], parameters_json=json.dumps(f["parameters"], sort_keys=True))
                for f in source["functions"]]))
    if spec.kind == "json_object":
        return coordinator_pb2.GuidedDecoding(json_object=True)
    if spec.kind == "json_schema":
        return coordinator_pb2.GuidedDecoding(json_schema=spec.source)
    return coordinator_pb2.GuidedDecoding(regex=spec.source) if spec.kind == "regex" else \
        coordinator_pb2.GuidedDecoding(grammar=spec.source)
