"""Tokenizer: byte-level BPE or SentencePiece from GGUF metadata, or tokenizer.json from a Hugging Face directory,
plus the model's chat template.

Built to give the same ids as transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)`: the same
vocabulary respelling, merges, special tokens and pre-tokenizer choice. No transformers import here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Encoding, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from graphmesh.checkpoints import Checkpoint
from graphmesh.errors import InvalidArgument, NotFound

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _encode(tokenizer: HFTokenizer, text: str, add_special_tokens: bool = True) -> Encoding:
    """tokenizer.encode(text), through encode_batch: the Rust tokenizer releases the GIL there (and holds it for the
    whole of encode), so a long prompt being tokenized never stops the process's other threads (health answers,
    the executors' health probes, the scheduler). A 1 MiB prompt held the GIL ~1 s through encode."""
    encodings: list[Encoding] = tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
    return encodings[0]

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split regex. Any other value (gpt2, smollm, ...) keeps ByteLevel's own GPT-2 regex,
# as transformers does.
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the spelling of byte-level BPE vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def _gguf_tokenizer(meta: dict[str, Any]) -> tuple[HFTokenizer, bool]:
    """(tokenizer, add_bos) from llama.cpp tokenizer.ggml.* metadata."""
    model = meta.get("tokenizer.ggml.model")
    if model == "llama":
        return _sentencepiece_tokenizer(meta)
    if model != "gpt2":
        raise InvalidArgument(f"GGUF tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2') and "
                              "SentencePiece ('llama')", "UNSUPPORTED_TOKENIZER")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    # A token outside the byte alphabet (a llama.cpp export quirk) is respelled from its UTF-8 bytes.
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix")))
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # a control token outside the byte alphabet is a llama.cpp mislabel: never one the model reads
    _add_gguf_specials(tok, meta, tokens, lambda i: set(tokens[i]) <= spelled)
    return tok, bool(meta.get("tokenizer.ggml.add_bos_token", False))


def _add_gguf_specials(tok: HFTokenizer, meta: dict[str, Any], tokens: list[str], control: Any) -> None:
    """The control tokens (where control(id)) and the named ones (bos, eos, unk, pad) as special tokens, the
    user-defined ones as added tokens: each matched whole in text, never cut into pieces."""
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    named = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")]
    special = [i for i, t in enumerate(types) if t == _CONTROL and control(i)]
    special += [int(i) for i in named if i is not None]
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in dict.fromkeys(special)])
    user = [AddedToken(tokens[i], normalized=False, special=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    if user:
        tok.add_tokens(user)


_SPACE = "\u2581"  # SentencePiece's spelling of a space


def _sentencepiece_tokenizer(meta: dict[str, Any]) -> tuple[HFTokenizer, bool]:
    """A SentencePiece vocabulary (tokenizer.ggml.model "llama": Llama 1/2, Mistral, Gemma, Phi-3 files) as the BPE
    with byte fallback that transformers builds from the same metadata (integrations/gguf), so ids match its
    AutoTokenizer(gguf_file=...) and the model's own tokenizer.json. Such files carry scores, not merges: the merges
    are recovered from the vocabulary, every split of a token into two tokens, the best-scored token's first.
    Gemma's files store a token of spaces as spaces and their scores do not follow the merge order (their order in
    the file does); Phi-3 prepends its space with a normalizer, which differs from Metaspace only on text that starts
    with a space. add_bos: the file's flag, else on (llama.cpp's default for these vocabularies)."""
    arch = meta.get("general.architecture", "")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    gemma = arch in ("gemma", "gemma2", "gemma3")
    if gemma:
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores: list[float] = [-float(i) for i in range(len(tokens))]
    else:
        scores = list(meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))])
    vocab = {t: i for i, t in enumerate(tokens)}
    given = meta.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ")) for m in given] if given else _recovered_merges(vocab, dict(zip(tokens, scores)))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if gemma and unk_id is not None else None  # transformers' LlamaTokenizer sets none
    tok = HFTokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    strip = [decoders.Strip(content=" ", left=1)]  # the space the pre-tokenizer put before the first word
    if gemma:
        tok.normalizer = normalizers.Replace(" ", _SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        strip = []
    elif arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    _add_gguf_specials(tok, meta, tokens, lambda i: True)
    return tok, bool(meta.get("tokenizer.ggml.add_bos_token", True))


def _recovered_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: each split of a token into two tokens, the best-scored
    token's first (ties: shorter left, then right piece), a token's own splits in vocabulary order (transformers'
    generate_merges, which its slow-to-fast conversion of these models uses too)."""
    merges: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


# End-of-turn markers that chat templates write after each turn: Llama 3 (<|eot_id|>, and <|eom_id|> after a tool
# call), ChatML (<|im_end|>: Qwen, SmolLM), Gemma (<end_of_turn>), Phi-3 (<|end|>). A chat model ends its reply
# with one, and checkpoints often list it only in generation_config.json, or nowhere (GGUF keeps one eos and eot).
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>")


def _ids(value: Any) -> list[int]:
    """eos_token_id as config files write it: an id, a list of ids, or null."""
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def stop_token_ids(tokenizer: HFTokenizer, chat_template: str | None, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """eos_token_ids, then each end-of-turn marker that the chat template writes and the vocabulary holds as a
    special token: the ids that end a generation."""
    specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    implied = [specials[m] for m in END_OF_TURN if chat_template and m in chat_template and m in specials]
    return tuple(dict.fromkeys([*eos_token_ids, *implied]))


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None, special: dict[str, str | None],
                 eos_token_ids: tuple[int, ...], add_bos: bool = False) -> None:
        self.backend = tokenizer
        self.chat_template = chat_template
        self.special = special  # bos_token, eos_token, unk_token, pad_token -> text; the chat template sees these
        self.eos_token_ids = eos_token_ids
        bos = special.get("bos_token")
        self.bos_token_id = tokenizer.token_to_id(bos) if bos else None
        self.add_bos = add_bos and self.bos_token_id is not None
        # The same tokenizer with special tokens matched as plain text, for what users typed: a second
        # instance rather than a flag flipped per call, because requests are tokenized concurrently.
        self.literal = HFTokenizer.from_str(tokenizer.to_str())
        self.literal.encode_special_tokens = True
        specials = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)  # longest first, as the tokenizer matches them
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        # The most UTF-8 bytes of text one call tokenizes (0: no limit): the coordinator sets it from the model's
        # context (--max-prompt-bytes), so an oversized prompt is refused before any work is done for it.
        self.max_input_bytes = 0

    def check_text(self, *texts: str) -> None:
        """Refuses text that is not valid Unicode (a lone surrogate, which JSON's \\udfff escapes can spell) or,
        all together, longer than max_input_bytes: INVALID_ARGUMENT before any tokenizing."""
        limit, total = self.max_input_bytes, 0
        for text in texts:
            if limit and len(text) > limit:  # characters never outnumber UTF-8 bytes: refused without encoding
                total = len(text)
                break
            try:
                total += len(text.encode("utf-8"))
            except UnicodeEncodeError as e:
                raise InvalidArgument(f"the text is not valid Unicode: {e.reason} at character {e.start}",
                                      "INVALID_UNICODE") from None
        if limit and total > limit:
            raise InvalidArgument(f"the prompt's text is {total} bytes or more; this server tokenizes at most {limit} "
                                  "(--max-prompt-bytes)", "PROMPT_TOO_LARGE",
                                  {"limit_bytes": str(limit)})

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> Tokenizer:
        if ckpt.format == "gguf":
            meta = ckpt.metadata
            tok, add_bos = _gguf_tokenizer(meta)
            tokens = meta["tokenizer.ggml.tokens"]
            ids = {k: meta.get(f"tokenizer.ggml.{v}_token_id") for k, v in (
                ("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))}
            special = {k: tokens[i] if i is not None else None for k, i in ids.items()}
            eos = ckpt.config.eos_token_ids if ckpt.config else ()
            template = meta.get("tokenizer.chat_template")
            return cls(tok, template, special, stop_token_ids(tok, template, eos), add_bos)
        if ckpt.format == "hf":
            return cls.from_hf_dir(ckpt.path, ckpt.config.eos_token_ids if ckpt.config else ())
        raise NotFound(f"{ckpt.path}: a bare .safetensors file carries no tokenizer", "TOKENIZER_NOT_FOUND")

    @classmethod
    def from_hf_dir(cls, path: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) of a Hugging Face directory."""
        if not (path / "tokenizer.json").exists():
            raise NotFound(f"{path} has no tokenizer.json", "TOKENIZER_NOT_FOUND")
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else config.get("chat_template")
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        # Every source of eos the checkpoint has: config.json's (given), generation_config.json's (what transformers'
        # generate stops on; Llama 3 and Qwen2.5 instruct list their end-of-turn token there), the tokenizer's.
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
        eos_id = tok.token_to_id(special["eos_token"]) if special["eos_token"] is not None else None
        eos = [*eos_token_ids, *_ids(generation.get("eos_token_id")), *_ids(eos_id)]
        template = template if isinstance(template, str) else None
        # tokenizer.json's own post-processor already adds BOS where the model wants it.
        return cls(tok, template, special, stop_token_ids(tok, template, eos))

    def encode(self, text: str) -> list[int]:
        self.check_text(text)
        ids: list[int] = _encode(self.backend, text).ids
        return [self.bos_token_id, *ids] if self.add_bos and self.bos_token_id is not None else ids

    def encode_text(self, text: str) -> list[int]:
        """User text: special-token spellings in it ("<|im_start|>") are text, never control tokens."""
        self.check_text(text)
        return self._encode_pieces([(text, True)])

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    parse_special: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A conversation (and the tools offered, which the template renders) through the chat template. Unless
        parse_special, the control tokens come from the template alone: the messages' contents are tokenized as
        text (the same ids as encode() would give when they hold no special-token spelling), and a role that
        spells one is refused."""
        self.check_text(*(str(m.get(k, "")) for m in messages for k in ("role", "content")))
        if parse_special:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools))
        for m in messages:
            if self._special_text is not None and self._special_text.search(str(m.get("role", ""))):
                raise InvalidArgument(f"message role {m.get('role')!r} contains a special token", "BAD_ROLE")
        # Each content is rendered as a marker the template cannot produce by itself, so that the rendered
        # text can be split into what the template wrote and what the user wrote. An empty or missing content
        # stays as it is: templates test it ("if message.content"). The strings in tool calls' arguments are
        # marked too: they are often text a tool or a web page put in the model's mouth.
        contents: list[str] = []

        def mark(value: Any) -> Any:
            if isinstance(value, str) and value:
                contents.append(value)
                return f"\ue000{len(contents) - 1}\ue001"
            if isinstance(value, dict):
                return {k: mark(v) for k, v in value.items()}
            return [mark(v) for v in value] if isinstance(value, list) else value

        marked = []
        for m in messages:
            copy = {**m, "content": mark(m["content"])} if isinstance(m.get("content"), str) else dict(m)
            if isinstance(m.get("tool_calls"), list):
                copy["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": mark(c["function"].get("arguments"))}}
                    if isinstance(c, dict) and isinstance(c.get("function"), dict) else c for c in m["tool_calls"]]
            marked.append(copy)
        rendered = self.apply_chat_template(marked, add_generation_prompt, tools)
        parts = re.split("\ue000(\\d+)\ue001", rendered)
        if any("\ue000" in p or "\ue001" in p for p in parts[::2]):  # a marker the template took apart
            raise InvalidArgument("the chat template rewrites the messages' contents; send parse_special_tokens "
                                  "or prompt token ids", "UNSUPPORTED_CHAT_TEMPLATE")
        if len(parts) == 1:
            return self._encode_pieces([(rendered, False)])
        plain = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self._encode_pieces(_align(parts, contents, plain))

    def _encode_pieces(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Ids of the concatenated pieces, with special tokens recognised only in pieces not marked literal.
        The text between two recognised special tokens is tokenized as one string, exactly as encode()
        splits at special tokens, so pre-tokenization never sees a piece boundary that encode() would not."""
        text, cuts = "", []  # (start, end) of each special token to keep
        for piece, literal in pieces:
            if not literal and self._special_text is not None:
                for m in self._special_text.finditer(piece):
                    cuts.append((len(text) + m.start(), len(text) + m.end()))
            text += piece
        encodings: list[Encoding] = []
        at = 0
        for start, end in cuts:
            if start > at:
                encodings.append(_encode(self.literal, text[at:start], add_special_tokens=False))
            encodings.append(_encode(self.backend, text[start:end], add_special_tokens=False))
            at = end
        if at < len(text) or not encodings:
            encodings.append(_encode(self.literal, text[at:], add_special_tokens=False))
        # the post-processor (a Hugging Face tokenizer's BOS template) applies once, to the whole
        ids: list[int] = self.backend.post_process(Encoding.merge(encodings, growing_offsets=True)).ids
        return [self.bos_token_id, *ids] if self.add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for a conversation, rendered the way transformers renders chat templates: `tools`
        (OpenAI's [{"type": "function", "function": {...}}]) is the template's `tools` variable, None when no tool
        is offered, as transformers passes it."""
        if self.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        try:
            return _compile(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                       tools=tools,
                                                       **{k: v for k, v in self.special.items() if v is not None})
        except jinja2.TemplateError as e:
            raise InvalidArgument(f"chat template failed: {e}", "BAD_CHAT_TEMPLATE") from e


def _align(parts: list[str], contents: list[str], plain: str) -> list[tuple[str, bool]]:
    """The pieces of `plain` (the conversation rendered with its contents) as (text, literal): `parts` is the render
    with markers split at them (template text, a message's index, template text, ...). A template may write a
    content as it is, trimmed (Llama 3's `| trim`) or as a JSON string (`| tojson`, the marker then sits between the
    template's quotes); the form that makes the template text around it line up is the one taken, and the pieces
    must make up `plain` exactly, else the template is refused rather than guessed at."""
    if not plain.startswith(parts[0]):
        raise InvalidArgument("the chat template renders the messages' contents differently each time; send "
                              "parse_special_tokens or prompt token ids", "UNSUPPORTED_CHAT_TEMPLATE")
    pieces, at = [(parts[0], False)], len(parts[0])
    for j in range(1, len(parts), 2):
        content, after, last = contents[int(parts[j])], parts[j + 1], j + 2 >= len(parts)
        trimmed = content.strip()
        forms = dict.fromkeys((content, trimmed, json.dumps(content, ensure_ascii=False)[1:-1],
                               json.dumps(trimmed, ensure_ascii=False)[1:-1]))
        for form in forms:
            end = at + len(form)
            if plain.startswith(form, at) and plain.startswith(after, end) and \
                    (not last or end + len(after) == len(plain)):
                break
        else:
            raise InvalidArgument("the chat template writes a message's content in a form this server cannot "
                                  "keep apart from the template's own text; send parse_special_tokens or prompt "
                                  "token ids", "UNSUPPORTED_CHAT_TEMPLATE")
        pieces += [(form, True), (after, False)]
        at = end + len(after)
    return pieces


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@cache
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    # transformers' tojson: no HTML escaping, non-ASCII kept
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
