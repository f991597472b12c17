"""The tokenizer built from GGUF metadata (and from an HF directory) gives the ids, text and chat prompts that
transformers' AutoTokenizer gives for the same SmolLM2 GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tokenizers
from transformers import AutoTokenizer

from graphmesh.checkpoints import open_checkpoint
from graphmesh.tokenizer import Tokenizer
from graphmesh_coordinator.generation import Detokenizer
from tests import model_fixtures

PROMPTS = [
    "Hello world",
    "  leading spaces,   runs of spaces\t\ttabs\n\n\nand newlines  ",
    "digits 1234567890, 3.14159, -42 and 2025-01-31",
    "héllo wörld — naïve café, 日本語, Ελληνικά, 😀👍🏽",
    "don't you're I'll it's WE'VE",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "def f(x):\n    return x ** 2  # comment\n",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2? Answer in ünïcode 🙂."},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And   3+3?"}],
]


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    return model_fixtures.smollm2_hf_tokenizer()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_checkpoint(open_checkpoint(model_fixtures.smollm2_path()))


@pytest.mark.parametrize("text", PROMPTS)
def test_encode_decode_match_transformers(hf_tok: Any, tok: Tokenizer, text: str) -> None:
    ids = hf_tok(text).input_ids
    assert tok.encode(text) == ids
    assert tok.decode(ids) == hf_tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(hf_tok: Any, tok: Tokenizer, messages: list[dict[str, str]]) -> None:
    for gen in (True, False):
        text = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.encode(text) == hf_tok.apply_chat_template(messages, add_generation_prompt=gen)["input_ids"]


def test_special_ids(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and not tok.add_bos
    assert tok.encode("<|im_end|>") == [2]


def test_hf_directory_tokenizer(hf_tok: Any, tmp_path: Path) -> None:
    """tokenizer.json + tokenizer_config.json saved next to a model's weights, read through the checkpoint."""
    model_dir = model_fixtures.make_tiny_llama(tmp_path / "model")
    hf_tok.save_pretrained(model_dir)
    reloaded = AutoTokenizer.from_pretrained(model_dir)
    tok = Tokenizer.from_checkpoint(open_checkpoint(model_dir))
    for text in PROMPTS:
        assert tok.encode(text) == reloaded(text).input_ids
    for messages in CHATS:
        assert tok.apply_chat_template(messages) == reloaded.apply_chat_template(messages, tokenize=False,
                                                                                 add_generation_prompt=True)


def test_plain_format_without_a_template(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend, None, tok.special, tok.eos_token_ids)
    assert bare.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant: "


def _decode_everything_each_time(tok: Tokenizer, ids: list[int]) -> list[str]:
    """The reference: each token decodes the whole completion and emits what it adds (unless it ends inside a
    UTF-8 sequence)."""
    out, emitted = [], ""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        if text.endswith("\ufffd"):
            out.append("")
            continue
        out.append(text[len(emitted):])
        emitted = text
    return out


def _detokenizing_cases(tok: Tokenizer, rng: np.random.Generator) -> list[tuple[Tokenizer, list[int]]]:
    """SmolLM2's byte-level BPE and a small SentencePiece-style tokenizer, each over real text and random ids."""
    spm = tokenizers.SentencePieceBPETokenizer()
    spm.train_from_iterator(PROMPTS * 20, vocab_size=120, show_progress=False)
    spm_tok = Tokenizer(spm._tokenizer, None, {}, ())
    cases = [(tok, tok.encode("".join(PROMPTS)))]
    cases += [(tok, rng.integers(0, tok.backend.get_vocab_size(), 60).tolist()) for _ in range(20)]
    cases += [(spm_tok, spm_tok.encode(text)) for text in PROMPTS]
    cases += [(spm_tok, rng.integers(0, spm.get_vocab_size(), 40).tolist()) for _ in range(10)]
    return cases


def test_incremental_detokenizing_emits_what_decoding_everything_each_time_emits(tok: Tokenizer) -> None:
    """Per token, the same text as the reference, for SmolLM2's byte-level BPE (multi-byte characters split over
    tokens, random ids that make invalid UTF-8) and a SentencePiece-style tokenizer (a word's leading space depends
    on the token before)."""
    rng = np.random.default_rng(7)
    cases = _detokenizing_cases(tok, rng)
    for t, ids in cases:
        detok = Detokenizer(t)
        assert [detok.push(i) for i in ids] == _decode_everything_each_time(t, ids), ids


def test_detokenizing_a_decode_runs_tokens_together_emits_what_pushing_each_emits(tok: Tokenizer) -> None:
    """push_many (a decode run's tokens, two decodes for all of them) against a push per token, chunk by chunk, over
    the same cases: the same text for each chunk, also where a chunk ends inside a multi-byte character."""
    rng = np.random.default_rng(11)
    cases = _detokenizing_cases(tok, rng)
    for t, ids in cases:
        sizes = rng.integers(1, 9, len(ids)).tolist()
        chunks, i = [], 0
        for n in sizes:
            if i < len(ids):
                chunks.append(ids[i:i + n])
                i += n
        one, many = Detokenizer(t), Detokenizer(t)
        assert ["".join(one.push(i) for i in c) for c in chunks] == [many.push_many(c) for c in chunks], ids
        assert many.emitted == one.emitted
