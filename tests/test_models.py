"""Stage graphs of tiny Llama / Qwen2 / GPT-2 models, split 1-3 ways and run on the numpy backend, against
transformers: prompt logits (max abs diff 1e-4) and 20 greedy tokens (identical), plus one decoder block
against the HF block's output. The slow tests do the same on the bundled SmolLM2-135M GGUF."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from graphmesh import models
from graphmesh.checkpoints import Checkpoint, open_checkpoint
from graphmesh.errors import InvalidArgument
from graphmesh.graph import parse
from graphmesh.models import ModelConfig
from graphmesh.models.moe import read_param
from graphmesh.tokenizer import Tokenizer
from graphmesh_executor.backends import compile_graph
from graphmesh_executor.executable import Executable
from tests import model_fixtures

PROMPT_LEN, BUCKET, CACHE, NEW_TOKENS = 11, 16, 32, 20
LOGIT_TOL = 1e-4  # float32 graph vs float32 torch on a tiny model
SPLITS = {1: [range(0, 2)], 2: [range(0, 1), range(1, 2)], 3: [range(0, 1), range(1, 2), range(2, 2)]}


def load_params(exe: Executable[Any], ckpt: Checkpoint) -> None:
    for name, t in exe.graph.params.items():
        if t.dtype == "u8":
            packed = ckpt.packed(name)
            assert packed is not None, name
            exe.set_param_typed(name, packed[1])
        else:
            exe.set_param(name, read_param(ckpt, name))  # MoE experts: stacked from the checkpoint's
    assert exe.finalize_params() == []


@dataclass
class Stage:
    layers: range
    first: bool
    last: bool
    prefill: Executable[Any]
    decode: Executable[Any]


def make_stages(ckpt: Checkpoint, config: ModelConfig, split: list[range], bucket: int, cache: int,
                sample: bool = False, quantized: bool = False, backend: str = "numpy", device: str = "cpu",
                ) -> list[Stage]:
    stages = []
    schemes = ckpt.packed_schemes() if quantized else None
    for n, layers in enumerate(split):
        first, last = n == 0, n == len(split) - 1
        exes = []
        for seq_len in (bucket, 1):
            proto = models.build_stage(config, layers, seq_len, cache, first, last, sample=sample, quantized=quantized,
                                       packed_schemes=schemes)
            exe = compile_graph(parse(proto), backend, device)
            for i in range(len(layers)):
                for j, kind in enumerate("kv"):
                    exe.bind_handle(f"past_{kind}_{i}", np.zeros((cache, config.kv_dim), np.float32))
                    exe.set_handle_feed(f"past_{kind}_{i}", 1 + 2 * i + j)
            exes.append(exe)
        load_params(exes[0], ckpt)
        assert len(exes[1].copy_params_from(exes[0])) == len(exes[0].graph.params)
        stages.append(Stage(layers, first, last, exes[0], exes[1]))
    return stages


def run_chain(stages: list[Stage], ids: np.ndarray, start: int, last_index: int, decode: bool,
              extra: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """One forward through every stage; returns the last stage's output 0 (logits or token)."""
    x: np.ndarray = ids
    positions = np.arange(start, start + len(ids), dtype=np.int64)
    for s in stages:
        exe = s.decode if decode else s.prefill
        inputs = {"input_ids" if s.first else "hidden_in": x, "positions": positions}
        if s.last:
            inputs |= {"last_index": np.array([last_index], np.int64), **(extra or {})}
        x = exe.run(inputs, read_indices=[0], typed=True)[0]
    return x


def generate(stages: list[Stage], config: ModelConfig, prompt: list[int], n_new: int, bucket: int,
             sample: bool = False) -> tuple[np.ndarray, list[int]]:
    """Padded prefill, KV seeded into the decode executables, then greedy decode: (prompt logits, tokens)."""
    n = len(prompt)
    padded = np.zeros(bucket, np.int64)
    padded[:n] = prompt
    extra: dict[str, np.ndarray] | None = {
        "temperature": np.zeros(1, np.float32), "top_k": np.zeros(1, np.int64), "top_p": np.ones(1, np.float32),
        "seed": np.array([7], np.int64)} if sample else None
    out = run_chain(stages, padded, 0, n - 1, decode=False, extra=extra)
    logits = out if not sample else np.zeros(0)
    for s in stages:
        assert s.decode.seed_resident_kv_prefix_from(s.prefill, n, n, config.kv_dim, len(s.layers))
    tokens = [int(out[0]) if sample else int(np.argmax(out[0]))]
    for step in range(n_new - 1):
        out = run_chain(stages, np.array(tokens[-1:], np.int64), n + step, 0, decode=True, extra=extra)
        tokens.append(int(out[0]) if sample else int(np.argmax(out[0])))
    return logits, tokens


@dataclass
class Reference:
    name: str
    path: Path
    ckpt: Checkpoint
    hf: PreTrainedModel
    prompt: list[int]
    logits: np.ndarray  # [V] of the prompt's last token
    tokens: list[int]  # NEW_TOKENS greedy tokens


def hf_reference(path: Path, seed: int) -> tuple[PreTrainedModel, list[int], np.ndarray, list[int]]:
    """transformers' f32 model of the checkpoint at `path`, a random prompt of PROMPT_LEN tokens (seeded), its
    last position's logits and NEW_TOKENS greedy tokens: what every family's test compares against."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    prompt = np.random.default_rng(seed).integers(3, model_fixtures.VOCAB, PROMPT_LEN).tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = hf(ids).logits[0, -1].numpy()
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return hf, prompt, logits, out[0, PROMPT_LEN:].tolist()


def reference(name: str, make: Callable[[Path], Path], root: Path, seed: int) -> Reference:
    """The checkpoint that `make` writes under `root`, and transformers' answers for it (hf_reference)."""
    path = make(root)
    hf, prompt, logits, tokens = hf_reference(path, seed)
    return Reference(name, path, open_checkpoint(path), hf, prompt, logits, tokens)


@pytest.fixture(scope="module", params=list(model_fixtures.TINY_MODELS))
def ref(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return reference(request.param, model_fixtures.TINY_MODELS[request.param], tmp_path_factory.mktemp(request.param), 5)


@pytest.mark.parametrize("ways", sorted(SPLITS))
def test_split_generation_matches_transformers(ref: Reference, ways: int) -> None:
    config = ref.ckpt.config
    assert config is not None
    stages = make_stages(ref.ckpt, config, SPLITS[ways], BUCKET, CACHE)
    logits, tokens = generate(stages, config, ref.prompt, NEW_TOKENS, BUCKET)
    assert np.abs(logits[0] - ref.logits).max() < LOGIT_TOL
    assert tokens == ref.tokens


def test_in_graph_greedy_sampling_matches(ref: Reference) -> None:
    config = ref.ckpt.config
    assert config is not None
    stages = make_stages(ref.ckpt, config, SPLITS[2], BUCKET, CACHE, sample=True)
    assert stages[-1].decode.output_types[0].dtype == "i64"
    _, tokens = generate(stages, config, ref.prompt, NEW_TOKENS, BUCKET, sample=True)
    assert tokens == ref.tokens


def test_decoder_block_matches_hf_block(ref: Reference) -> None:
    """Layer 0 as a middle stage, fed HF's embedding output, against HF's hidden state after block 0."""
    config = ref.ckpt.config
    assert config is not None
    with torch.no_grad():
        hidden = ref.hf(torch.tensor([ref.prompt]), output_hidden_states=True).hidden_states
    exe = compile_graph(parse(models.build_stage(config, range(0, 1), PROMPT_LEN, BUCKET, first=False, last=False)))
    load_params(exe, ref.ckpt)
    out = exe.run({"hidden_in": hidden[0][0].numpy(), "positions": np.arange(PROMPT_LEN, dtype=np.int64)})
    assert np.abs(out[0] - hidden[1][0].numpy()).max() < LOGIT_TOL
    assert out[1].shape == (BUCKET, config.kv_dim) and not out[1][PROMPT_LEN:].any()  # rows past the prompt untouched


def test_quantized_stages_match_dequantized(tmp_path: Path) -> None:
    """A llama.cpp-style GGUF (Q4_0 attention, Q8_0 MLP, Q4_1 head) run packed through dequant_matmul, split two
    ways, against the same file dequantized to f32 params."""
    ckpt = open_checkpoint(model_fixtures.write_llama_gguf(model_fixtures.make_tiny_llama(tmp_path), tmp_path / "q.gguf"))
    assert ckpt.config is not None
    prompt = list(range(3, 3 + PROMPT_LEN))
    runs = [generate(make_stages(ckpt, ckpt.config, SPLITS[2], BUCKET, CACHE, quantized=q), ckpt.config, prompt,
                     NEW_TOKENS, BUCKET) for q in (False, True)]
    packed = [t for t in make_stages(ckpt, ckpt.config, SPLITS[2], BUCKET, CACHE, quantized=True)[1].prefill.graph
              .params.values() if t.dtype == "u8"]
    assert len(packed) == 7 + 1  # layer 1's seven Linear weights and the head
    assert np.abs(runs[0][0] - runs[1][0]).max() < LOGIT_TOL
    assert runs[0][1] == runs[1][1]


def test_stage_contract() -> None:
    """Input and output names and order the coordinator and executor rely on."""
    c = ModelConfig(arch="llama", vocab_size=100, hidden_size=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
                    intermediate_size=64, norm_eps=1e-5)
    mid = models.build_stage(c, range(1, 3), 8, 32, first=False, last=False)
    assert [i.name for i in mid.inputs] == ["hidden_in", "positions", "past_k_0", "past_v_0", "past_k_1", "past_v_1"]
    assert [list(i.type.shape) for i in mid.inputs] == [[8, 32], [8], [32, 16], [32, 16], [32, 16], [32, 16]]
    g = parse(mid)
    assert [g.type_of(o).shape for o in g.outputs] == [(8, 32)] + [(32, 16)] * 4
    assert {p for p in g.params if ".layers." in p} == {p for p in g.params if ".layers.1." in p or ".layers.2." in p}
    last = parse(models.build_stage(c, range(3, 4), 1, 32, first=False, last=True, sample=True))
    assert list(last.inputs)[-5:] == ["last_index", "temperature", "top_k", "top_p", "seed"]
    assert last.type_of(last.outputs[0]).dtype == "i64" and "lm_head.weight" in last.params
    first = parse(models.build_stage(c, range(0, 1), 4, 8, first=True, last=False))
    assert list(first.inputs)[:2] == ["input_ids", "positions"] and first.inputs["input_ids"].dtype == "i64"
    with pytest.raises(InvalidArgument):
        models.build_stage(c, range(3, 5), 1, 8, first=False, last=True)


@pytest.mark.parametrize("name", list(model_fixtures.TINY_MODELS))
def test_param_bytes_and_stage_params_agree(name: str) -> None:
    c = ModelConfig.from_hf_config({"llama": {"model_type": "llama", "vocab_size": 50, "hidden_size": 16,
                                              "num_hidden_layers": 3, "num_attention_heads": 4,
                                              "num_key_value_heads": 2, "intermediate_size": 24},
                                    "qwen2": {"model_type": "qwen2", "vocab_size": 50, "hidden_size": 16,
                                              "num_hidden_layers": 3, "num_attention_heads": 4,
                                              "num_key_value_heads": 1, "intermediate_size": 24},
                                    "gpt2": {"model_type": "gpt2", "vocab_size": 50, "n_embd": 16, "n_layer": 3,
                                             "n_head": 4, "n_positions": 20}}[name])
    for layers in (range(0, 3), range(0, 1), range(1, 2), range(1, 3)):
        params = models.stage_params(c, layers, layers.start == 0, layers.stop == c.n_layers)
        assert c.param_bytes(layers) == sum(4 * int(np.prod(t.shape)) for t in params.values())


# -- the real model ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_whole_model_greedy_matches_transformers() -> None:
    ckpt = open_checkpoint(model_fixtures.smollm2_path())
    assert ckpt.config is not None
    tok = Tokenizer.from_checkpoint(ckpt)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    hf = model_fixtures.smollm2_hf()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    bucket = 64
    assert len(prompt) <= bucket
    stages = make_stages(ckpt, ckpt.config, [range(0, ckpt.config.n_layers)], bucket, bucket + 16)
    _, tokens = generate(stages, ckpt.config, prompt, 16, bucket)
    assert tokens == ref, (tok.decode(tokens), tok.decode(ref))


@pytest.mark.slow
def test_smollm2_quantized_stage_matches_dequantized() -> None:
    """Packed Q4_1/Q8_0 weights through dequant_matmul give the f32 path's logits (same dequantized values)."""
    ckpt = open_checkpoint(model_fixtures.smollm2_path())
    assert ckpt.config is not None
    ids = np.array([1, 4093, 198, 6004, 2, 198, 1, 520], np.int64)
    out = []
    for quantized in (False, True):
        proto = models.build_stage(ckpt.config, range(0, 2), len(ids), len(ids), first=True, last=True,
                                   quantized=quantized, packed_schemes=ckpt.packed_schemes())
        exe = compile_graph(parse(proto), "numpy")
        load_params(exe, ckpt)
        out.append(exe.run({"input_ids": ids, "positions": np.arange(len(ids), dtype=np.int64),
                            "last_index": np.array([len(ids) - 1], np.int64)})[0])
        if quantized:
            assert sum(t.dtype == "u8" for t in exe.graph.params.values()) == 2 * 7 + 1  # 2 layers x 7 + lm_head
    assert np.abs(out[0] - out[1]).max() < 1e-3
