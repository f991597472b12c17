"""The encoder group (graphmesh.models.encoder) and first stages built with encoded=True.

The encoder graph against a float64 reference on every backend; a tiny Llama whose prompt holds three
placeholder tokens, run as one stage with the encoder's rows in place of their embeddings, against
transformers fed the same inputs_embeds (identical greedy tokens); the selection itself bit for bit; the
paged form; and the config and builder errors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from graphmesh import dtypes, models
from graphmesh.checkpoints import Checkpoint, open_checkpoint
from graphmesh.errors import InvalidArgument
from graphmesh.graph import parse
from graphmesh.models import ModelConfig, PagedLayout
from graphmesh.models.encoder import EncoderConfig, build_encoder, encoder_config, encoder_params
from graphmesh.v1 import graph_pb2
from graphmesh_executor.backends import compile_graph
from graphmesh_executor.executable import Executable
from tests import model_fixtures
from tests.conftest import backend_targets
from tests.test_models import load_params

BACKENDS = backend_targets()
STAGE_BACKENDS = ("numpy", "torch")
TOKEN = 999  # the fixture's placeholder token id
PROMPT = [1, 17, TOKEN, TOKEN, TOKEN, 250, 33, 8, 421, 5, 64]  # three placeholders, filled in order
PLAIN = [1, 17, 40, 41, 42, 250, 33, 8, 421, 5, 64]  # the same prompt with ordinary tokens in their place
BUCKET, CACHE, NEW_TOKENS = 16, 32, 12
# Max abs difference of the encoder's output (values of order 0.5) from the float64 reference: f32 sums of 24
# and 48 products; bf16 rounds params, input and every intermediate to 8 bits of mantissa (2**-9 relative).
ENCODER_TOL = {"f32": 1e-5, "bf16": 3e-2}


@dataclass
class Tiny:
    path: Path
    ckpt: Checkpoint
    config: ModelConfig
    enc: EncoderConfig
    features: np.ndarray  # [3, input_dim]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    path = model_fixtures.add_tiny_encoder(model_fixtures.make_tiny_llama(tmp_path_factory.mktemp("llava")))
    ckpt = open_checkpoint(path)
    assert ckpt.config is not None and ckpt.config.encoder is not None
    features = np.random.default_rng(11).normal(size=(3, ckpt.config.encoder.input_dim)).astype(np.float32)
    return Tiny(path, ckpt, ckpt.config, ckpt.config.encoder, features)


def compile_on(target: str, proto: graph_pb2.Graph) -> Executable[Any]:
    name, _, device = target.partition(":")
    return compile_graph(parse(proto), name, device or "cpu")


def run_encoder(t: Tiny, backend: str, features: np.ndarray, dtype: str = "f32") -> np.ndarray:
    exe = compile_on(backend, build_encoder(t.enc, len(features), dtype))
    load_params(exe, t.ckpt)
    return exe.run({"features": features})[0]


def encoder_f64(t: Tiny, features: np.ndarray, dtype: str) -> np.ndarray:
    """fc2(gelu(fc1(x))) in float64 from params and input rounded to `dtype`, GELU by math.erf."""
    def rounded(a: np.ndarray) -> np.ndarray:
        return a.astype(dtypes.to_numpy(dtype)).astype(np.float64)

    w = {name: rounded(t.ckpt.tensor(name)) for name in encoder_params(t.enc)}
    h = rounded(features) @ w["encoder.fc1.weight"].T + w["encoder.fc1.bias"]
    h = 0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0)))
    return h @ w["encoder.fc2.weight"].T + w["encoder.fc2.bias"]


# -- the encoder graph ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", sorted(ENCODER_TOL))
@pytest.mark.parametrize("backend", BACKENDS)
def test_encoder_matches_float64_reference(tiny: Tiny, backend: str, dtype: str) -> None:
    features = np.random.default_rng(4).normal(size=(5, tiny.enc.input_dim)).astype(np.float32)
    got = run_encoder(tiny, backend, features, dtype)
    assert got.dtype == np.float32 and got.shape == (5, tiny.enc.output_dim)
    assert np.abs(got - encoder_f64(tiny, features, dtype)).max() < ENCODER_TOL[dtype]


def test_encoder_graph_contract(tiny: Tiny) -> None:
    g = parse(build_encoder(tiny.enc, 3, "bf16"))
    assert g.inputs == {"features": g.inputs["features"]} and g.inputs["features"].shape == (3, 24)
    assert g.outputs == ("encoded",) and g.type_of("encoded").dtype == "f32"
    assert {name: t.dtype for name, t in g.params.items()} == dict.fromkeys(encoder_params(tiny.enc), "bf16")
    assert any(n.op == "gelu" and n.attrs["approximate"] == "none" for n in g.nodes)
    assert {name: t.shape for name, t in encoder_params(tiny.enc).items()} == {
        name: tiny.ckpt.shape(name) for name in encoder_params(tiny.enc)}


# -- a first stage fed the encoder's rows -----------------------------------------------------------------

def encoded_inputs(t: Tiny, prompt: list[int], rows: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """encoded and encoded_mask for `prompt` padded to seq_len: `rows` at the placeholders, in order."""
    at = [i for i, tok in enumerate(prompt) if tok == t.enc.token_id]
    assert len(at) == len(rows)
    encoded = np.zeros((seq_len, t.config.hidden_size), np.float32)
    mask = np.zeros(seq_len, np.float32)
    encoded[at], mask[at] = rows, 1.0
    return {"encoded": encoded, "encoded_mask": mask}


def prefill_inputs(prompt: list[int], seq_len: int) -> dict[str, np.ndarray]:
    ids = np.zeros(seq_len, np.int64)
    ids[:len(prompt)] = prompt
    return {"input_ids": ids, "positions": np.arange(seq_len, dtype=np.int64),
            "last_index": np.array([len(prompt) - 1], np.int64)}


def whole_model(t: Tiny, backend: str, seq_len: int, encoded: bool, dtype: str = "f32",
                kv_handles: bool = True) -> Executable[Any]:
    layers = range(0, t.config.n_layers)
    exe = compile_on(backend, models.build_stage(t.config, layers, seq_len, CACHE, first=True, last=True, dtype=dtype,
                                                 encoded=encoded))
    if kv_handles:  # the caches stay in the executable between runs, as the executor keeps them
        for i in range(len(layers)):
            for j, kind in enumerate("kv"):
                exe.bind_handle(f"past_{kind}_{i}", np.zeros((CACHE, t.config.kv_dim), np.float32))
                exe.set_handle_feed(f"past_{kind}_{i}", 1 + 2 * i + j)
    return exe


@pytest.mark.parametrize("backend", STAGE_BACKENDS)
def test_encoded_prompt_greedy_matches_transformers(tiny: Tiny, backend: str) -> None:
    """Encoder rows from the encoder graph into an encoded=True prefill (cut to the prompt's rows, as the executor
    runs it), then the ordinary decode graph on the prefill's KV: HF's greedy tokens for the same inputs_embeds."""
    want = model_fixtures.hf_greedy_with_encoder(tiny.path, PROMPT, tiny.features, NEW_TOKENS)
    prefill = whole_model(tiny, backend, BUCKET, encoded=True)
    decode = whole_model(tiny, backend, 1, encoded=False)
    load_params(prefill, tiny.ckpt)
    assert len(decode.copy_params_from(prefill)) == len(prefill.graph.params)
    n = len(PROMPT)
    assert prefill.set_active_extent((n, BUCKET))  # the encoded inputs cut along the row axis like the rest
    rows = run_encoder(tiny, backend, tiny.features)
    out = prefill.run(prefill_inputs(PROMPT, BUCKET) | encoded_inputs(tiny, PROMPT, rows, BUCKET), read_indices=[0])
    assert decode.seed_resident_kv_prefix_from(prefill, n, n, tiny.config.kv_dim, tiny.config.n_layers)
    tokens = [int(np.argmax(out[0][0]))]
    for step in range(NEW_TOKENS - 1):
        out = decode.run({"input_ids": np.array(tokens[-1:], np.int64), "positions": np.array([n + step], np.int64),
                          "last_index": np.zeros(1, np.int64)}, read_indices=[0])
        tokens.append(int(np.argmax(out[0][0])))
    assert tokens == want


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("backend", STAGE_BACKENDS)
def test_selection_is_bit_exact(tiny: Tiny, backend: str, dtype: str) -> None:
    """Every output (logits and KV caches) of the encoded graph equals the ordinary graph's bit for bit: with
    an all-zero mask (whatever finite rows `encoded` holds), and with the placeholders' rows set to the
    embeddings of the tokens PLAIN has there (exact on mask rows too, including a bf16 stage's rounding)."""
    plain = whole_model(tiny, backend, BUCKET, encoded=False, dtype=dtype, kv_handles=False)
    enc = whole_model(tiny, backend, BUCKET, encoded=True, dtype=dtype, kv_handles=False)
    load_params(plain, tiny.ckpt)
    enc.copy_params_from(plain)
    want = plain.run(prefill_inputs(PLAIN, BUCKET), typed=True)
    noise = np.random.default_rng(2).normal(size=(BUCKET, tiny.config.hidden_size)).astype(np.float32)
    unmasked = {"encoded": noise, "encoded_mask": np.zeros(BUCKET, np.float32)}
    table = tiny.ckpt.tensor("model.embed_tokens.weight")
    embedded = encoded_inputs(tiny, PROMPT, table[[p for p, q in zip(PLAIN, PROMPT, strict=True) if q == TOKEN]], BUCKET)
    for prompt, extra in ((PLAIN, unmasked), (PROMPT, embedded)):
        got = enc.run(prefill_inputs(prompt, BUCKET) | extra, typed=True)
        assert len(got) == len(want) == 1 + 2 * tiny.config.n_layers
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_paged_form(tiny: Tiny) -> None:
    """The paged prefill of one sequence with encoded rows: the contiguous form's logits, and with an all-zero
    mask the ordinary paged graph's, bit for bit."""
    n, c = len(PROMPT), tiny.config
    layout = PagedLayout(seqs=1, blocks=4, block_size=4, pool_blocks=6)
    paged = {"slots": np.arange(n, dtype=np.int64), "block_table": np.arange(4, dtype=np.int64)[None],
             "token_seq": np.zeros(n, np.int64)}
    exes = [compile_on("numpy", models.build_stage(c, range(0, c.n_layers), n, 0, first=True, last=True, paged=layout,
                                                   encoded=encoded)) for encoded in (True, False)]
    assert list(exes[0].graph.inputs)[-5:] == ["slots", "block_table", "token_seq", "encoded", "encoded_mask"]
    contiguous = whole_model(tiny, "numpy", n, encoded=True, kv_handles=False)
    load_params(contiguous, tiny.ckpt)
    for exe in exes:
        exe.copy_params_from(contiguous)
    rows = encoded_inputs(tiny, PROMPT, run_encoder(tiny, "numpy", tiny.features), n)
    want = contiguous.run(prefill_inputs(PROMPT, n) | rows, read_indices=[0])[0]
    got = exes[0].run(prefill_inputs(PROMPT, n) | paged | rows, read_indices=[0])[0]
    assert np.abs(got - want).max() < 1e-5
    zero = {"encoded": rows["encoded"], "encoded_mask": np.zeros(n, np.float32)}
    masked_off = exes[0].run(prefill_inputs(PLAIN, n) | paged | zero, typed=True)
    plain = exes[1].run(prefill_inputs(PLAIN, n) | paged, typed=True)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(masked_off, plain, strict=True))


def test_stage_contract(tiny: Tiny) -> None:
    g = parse(models.build_stage(tiny.config, range(0, 1), 8, 16, first=True, last=False, encoded=True))
    assert list(g.inputs) == ["input_ids", "positions", "past_k_0", "past_v_0", "encoded", "encoded_mask"]
    assert g.inputs["encoded"].shape == (8, 64) and g.inputs["encoded_mask"].shape == (8,)
    assert all(t.dtype == "f32" for name, t in g.inputs.items() if name.startswith("encoded"))
    # the same params as the ordinary stage: encoded adds inputs, not weights
    assert g.params == parse(models.build_stage(tiny.config, range(0, 1), 8, 16, first=True, last=False)).params


# -- config and builder errors ----------------------------------------------------------------------------

LLAMA_CFG: dict[str, Any] = {"model_type": "llama", "vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24}
ENC = {"input_dim": 8, "intermediate_size": 12, "token_id": 49}


def test_config_reads_the_encoder(tiny: Tiny) -> None:
    assert encoder_config(LLAMA_CFG) is None and ModelConfig.from_hf_config(LLAMA_CFG).encoder is None
    for model_type in ("llama", "qwen2", "mistral"):
        c = ModelConfig.from_hf_config({**LLAMA_CFG, "model_type": model_type, "graphmesh_encoder": ENC})
        assert c.encoder == EncoderConfig(input_dim=8, intermediate_size=12, output_dim=16, token_id=49)
        assert hash(c) == hash(ModelConfig.from_hf_config({**LLAMA_CFG, "model_type": model_type,
                                                           "graphmesh_encoder": dict(ENC)}))
    assert tiny.config.encoder == EncoderConfig(24, 48, 64, TOKEN)


@pytest.mark.parametrize("enc", [
    [8, 12, 49], {"intermediate_size": 12, "token_id": 49}, {**ENC, "input_dim": 0}, {**ENC, "intermediate_size": -3},
    {**ENC, "token_id": -1}, {**ENC, "token_id": None}, {**ENC, "input_dim": 8.0}, {**ENC, "input_dim": True},
    {**ENC, "token_id": 50},  # outside the vocabulary
], ids=["list", "missing", "zero", "negative", "negative_token", "null_token", "float", "bool", "token_past_vocab"])
def test_bad_encoder_configs(enc: Any) -> None:
    with pytest.raises(InvalidArgument) as e:
        ModelConfig.from_hf_config({**LLAMA_CFG, "graphmesh_encoder": enc})
    assert e.value.reason == "BAD_CONFIG"


def test_unsupported_encoders(tiny: Tiny) -> None:
    with pytest.raises(InvalidArgument) as e:
        encoder_config({"graphmesh_encoder": ENC})  # no hidden_size to project to
    assert e.value.reason == "BAD_CONFIG"
    gpt2 = {"model_type": "gpt2", "vocab_size": 50, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 20}
    with pytest.raises(InvalidArgument) as e:
        ModelConfig.from_hf_config({**gpt2, "graphmesh_encoder": ENC})
    assert e.value.reason == "UNSUPPORTED_MODEL"
    checks = [(ModelConfig.from_hf_config(gpt2), True, "UNSUPPORTED_MODEL"),
              (ModelConfig.from_hf_config(LLAMA_CFG), True, "UNSUPPORTED_MODEL"),  # no encoder
              (tiny.config, False, "BAD_SHAPE")]  # not the first stage
    for config, first, reason in checks:
        with pytest.raises(InvalidArgument) as e:
            models.build_stage(config, range(0, 1), 4, 8, first=first, last=False, encoded=True)
        assert e.value.reason == reason, e.value.message
    for rows, dtype, reason in ((0, "f32", "BAD_SHAPE"), (2, "f64", "UNSUPPORTED_DTYPE")):
        with pytest.raises(InvalidArgument) as e:
            build_encoder(tiny.enc, rows, dtype)
        assert e.value.reason == reason


def test_sharded_checkpoint_reads_the_encoder(tmp_path: Path) -> None:
    """Qwen2 saved in shards with an index: the fixture lists encoder.safetensors in the index, which is what
    the reader opens (a file the index does not name is not read)."""
    ckpt = open_checkpoint(model_fixtures.add_tiny_encoder(model_fixtures.make_tiny_qwen2(tmp_path)))
    assert ckpt.config is not None and ckpt.config.encoder == EncoderConfig(24, 48, 64, TOKEN)
    assert ckpt.tensor("encoder.fc2.weight").shape == (64, 48)
