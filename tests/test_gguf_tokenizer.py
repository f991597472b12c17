"""GGUF files whose tokenizer is SentencePiece (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma, Phi-3 files):
a tokenizer built from the file's tokens, scores and token types encodes and decodes as the model's own. The
vocabulary is trained here (tokenizers' BPE trainer over a small corpus, words marked with SentencePiece's "▁"),
laid out as llama.cpp's converter writes these files (unk, bos, eos, the 256 byte tokens, then the pieces best
first, scores falling), and written with gguf's writer into a tiny Llama and Gemma 2 checkpoint. The references:
transformers' tokenizer of the model's own shape (LlamaTokenizer, GemmaTokenizer) over the same vocabulary, and
transformers' own reading of the GGUF file; then a Llama GGUF served end to end."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GemmaTokenizer, LlamaTokenizer
from transformers.tokenization_utils_base import generate_merges

from graphmesh.checkpoints import open_checkpoint
from graphmesh.errors import InvalidArgument
from graphmesh.tokenizer import Tokenizer, _gguf_tokenizer
from tests import gguf_fixtures, model_fixtures

SPACE = "\u2581"
WORDS = ("the quick brown fox jumps over lazy dog while a small language model learns to split words into pieces "
         "that it merges again tokens spaces numbers 123 4567 and punctuation, like this: (yes) - or no? "
         "graphmesh serves decoder models across processes; every executor holds layers").split()
CORPUS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12)) for i in range(300)]
TEXTS = [
    "Hello world",
    "the quick brown fox jumps over the lazy dog",
    " a leading space",
    "   three leading spaces and  two   inside",
    "trailing spaces   ",
    "new\nlines\n\nand\ttabs\r\n",
    "unicode: café naïve Ωμέγα 日本語 and an emoji 🙂 (byte fallback)",
    "numbers 1234567890 and punctuation!?;:",
    "words</s>around the eos<s>and bos",
    "",
]


@dataclasses.dataclass
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos: int
    eos: int
    unk: int


def trained_pieces() -> list[str]:
    """Pieces of a BPE trained over CORPUS with SentencePiece's word marks: the merged ones in merge order (best
    first), then the single characters."""
    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, show_progress=False))
    ids = t.get_vocab()
    pieces = sorted(ids, key=ids.__getitem__)
    return [p for p in pieces if len(p) > 1] + [p for p in pieces if len(p) == 1]


def llama_vocab(size: int) -> Vocab:
    """As llama.cpp writes a Llama 2 / Mistral file: <unk> <s> </s>, the byte tokens, the pieces, unused fillers."""
    pieces = trained_pieces()
    specials, byte_tokens = ["<unk>", "<s>", "</s>"], [f"<0x{b:02X}>" for b in range(256)]
    fillers = [f"<unused{i}>" for i in range(size - len(specials) - len(byte_tokens) - len(pieces))]
    tokens = specials + byte_tokens + pieces + fillers
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [-1e9] * len(fillers)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [5] * len(fillers)
    return Vocab(tokens, scores, types, bos=1, eos=2, unk=0)


def gemma_vocab(size: int) -> Vocab:
    """As Gemma files are: <pad> <eos> <bos> <unk> <mask>, control turn markers, runs of spaces spelled as spaces
    (pieces in merge order, as Gemma's scores do not say), the byte tokens, fillers."""
    pieces = trained_pieces()
    head = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    spaces = [" " * n for n in range(2, 6)]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    body = head + spaces + pieces + byte_tokens
    fillers = [f"<unused{i}>" for i in range(size - len(body))]
    tokens = body + fillers
    types = [3, 3, 3, 2, 3, 3, 3] + [1] * (len(spaces) + len(pieces)) + [6] * 256 + [5] * len(fillers)
    return Vocab(tokens, [0.0] * len(tokens), types, bos=2, eos=1, unk=3)


def with_tokenizer(src: Path, dst: Path, v: Vocab, add_bos: bool = True) -> Path:
    """The GGUF file `src` with its tokenizer replaced by the SentencePiece vocabulary `v`."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue
        kind = field.types[0]
        w.add_key_value(key, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                        else None)
    w.add_tokenizer_model("llama")
    w.add_token_list(v.tokens)
    w.add_token_scores(v.scores)
    w.add_token_types(v.types)
    w.add_bos_token_id(v.bos)
    w.add_eos_token_id(v.eos)
    w.add_unk_token_id(v.unk)
    w.add_add_bos_token(add_bos)
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@dataclasses.dataclass
class Case:
    hf_dir: Path
    gguf: Path
    own: Any  # transformers' tokenizer of the model's shape over the same vocabulary
    read: Any  # transformers' AutoTokenizer of the GGUF file


def _case(root: Path, arch: str) -> Case:
    own: Any
    hf_dir = (gguf_fixtures.make_gguf_gemma2 if arch == "gemma2" else model_fixtures.make_tiny_llama)(root / "hf")
    plain = gguf_fixtures.write_gguf(hf_dir, root / "plain.gguf", arch)
    v = (gemma_vocab if arch == "gemma2" else llama_vocab)(model_fixtures.VOCAB)
    path = with_tokenizer(plain, root / "model.gguf", v)
    if arch == "gemma2":
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in v.tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        own = GemmaTokenizer(vocab=vocab, merges=generate_merges(vocab, {t: -i for i, t in enumerate(tokens)}),
                             add_bos_token=True)
    else:
        vocab = {t: i for i, t in enumerate(v.tokens)}
        own = LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab, dict(zip(v.tokens, v.scores))),
                             unk_token="<unk>", bos_token="<s>", eos_token="</s>", add_bos_token=True)
    read = AutoTokenizer.from_pretrained(root, gguf_file=path.name)
    return Case(hf_dir, path, own, read)


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return _case(tmp_path_factory.mktemp(request.param), request.param)


def test_encodes_and_decodes_as_the_models_own_tokenizer(case: Case) -> None:
    ckpt = open_checkpoint(case.gguf)
    tok = Tokenizer.from_checkpoint(ckpt)
    assert tok.add_bos and tok.bos_token_id == case.own.bos_token_id
    fallback = 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == case.own.encode(text) == case.read.encode(text), repr(text)
        assert tok.decode(ids) == case.own.decode(ids) == case.read.decode(ids), repr(text)
        assert tok.decode(ids, skip_special_tokens=True) == case.own.decode(ids, skip_special_tokens=True)
        fallback += sum(str(tok.backend.id_to_token(i)).startswith("<0x") for i in ids)
    assert fallback > 10  # the unicode text was spelled in byte tokens
    words = tok.encode(" quick brown fox")
    assert [tok.backend.id_to_token(i) for i in words[1:]] == [f"{SPACE}quick", f"{SPACE}brown", f"{SPACE}fox"]
    eos = ckpt.metadata["tokenizer.ggml.eos_token_id"]
    assert eos in tok.eos_token_ids


def test_merges_in_the_file_are_taken_as_given() -> None:
    """A file that lists merges: those, not ones recovered from the scores (here, none: each word stays split)."""
    v = llama_vocab(600)
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": v.tokens,
            "tokenizer.ggml.scores": v.scores, "tokenizer.ggml.token_type": v.types,
            "tokenizer.ggml.merges": [f"{SPACE} t"], "tokenizer.ggml.bos_token_id": 1}
    tok, add_bos = _gguf_tokenizer(meta)
    assert add_bos and [tok.id_to_token(i) for i in tok.encode("the").ids] == [f"{SPACE}t", "h", "e"]
    with pytest.raises(InvalidArgument) as e:
        _gguf_tokenizer({**meta, "tokenizer.ggml.model": "bert"})
    assert "'bert'" in e.value.message and e.value.reason == "UNSUPPORTED_TOKENIZER"


def test_a_sentencepiece_gguf_served_end_to_end(tmp_path: Path) -> None:
    """A Llama GGUF with the SentencePiece vocabulary behind the coordinator: the prompt's ids, the greedy tokens
    (transformers' on the checkpoint the file was written from) and their text are the model's own."""
    from graphmesh.coordinator_client import CoordinatorClient
    from graphmesh.launcher import LocalMesh

    c = _case(tmp_path, "llama")
    prompt = "the quick brown fox jumps over café"
    ids = c.own.encode(prompt)
    hf = AutoModelForCausalLM.from_pretrained(c.hf_dir, dtype=torch.float32)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(ids):]
    with LocalMesh(1, "numpy", str(c.gguf), startup_timeout_s=120) as mesh:
        with CoordinatorClient(mesh.coordinator_address) as client:
            chunks = list(client.generate(prompt, raw=True, max_tokens=12, ignore_eos=True))
    assert chunks[0].prompt_token_ids == ids
    got = [t for ch in chunks for t in ch.token_ids]
    assert got == want.tolist()
    assert "".join(ch.text for ch in chunks) == c.own.decode(got)
