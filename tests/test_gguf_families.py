"""Issue 38's checkpoints: sharded bf16/f16 Hugging Face folders, and GGUF files of the families served from HF
folders (Llama 3 with rope_freqs, Qwen2 with and without YaRN, Qwen3 with q/k norms, Phi-3 with fused projections
and longrope, Mistral and Qwen2 with sliding windows, Gemma 2 and Gemma 3 text with their soft-caps, sandwich norms
and local/global layers) written in the test as llama.cpp's converter writes them, F32, Q8_0 and in a Q4_K_M-style
K-quant mix, greedy-decoded through the stage graphs (numpy, torch) and real meshes against transformers.

Reference: transformers f32 holding the weights the GGUF file dequantizes to (for F32 files, the original ones).
The comparison is then exact up to float rounding: prompt logits within LOGIT_TOL (1e-4) and 20 greedy tokens
identical, for F32 and K-quant files alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

from graphmesh.checkpoints import PACKED_SCHEMES, Checkpoint, _GgufTensor, config_from_gguf, open_checkpoint
from graphmesh.errors import InvalidArgument
from tests import gguf_fixtures, model_fixtures
from tests.test_models import BUCKET, CACHE, LOGIT_TOL, NEW_TOKENS, PROMPT_LEN, SPLITS, generate, make_stages


def _halves(n_layers: int) -> list[range]:
    """Two stages over every layer (tests.test_models' SPLITS are for its 2-layer models)."""
    return [range(0, n_layers // 2), range(n_layers // 2, n_layers)]


def _prompt() -> list[int]:
    return np.random.default_rng(8).integers(3, model_fixtures.VOCAB, PROMPT_LEN).tolist()


def _reference(hf: Any, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = hf(ids).logits[0, -1].numpy()
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return logits, out[0, len(prompt):].tolist()


def _hf_with(hf_dir: Path, ckpt: Checkpoint) -> Any:
    """transformers' model of hf_dir holding the weights `ckpt` reads (a GGUF file's dequantized ones)."""
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    state = hf.state_dict()
    assert set(state) == set(ckpt.names()) - {"rope_freqs.weight", "rope_factors_long.weight",
                                              "rope_factors_short.weight"}
    hf.load_state_dict({name: torch.from_numpy(np.array(ckpt.tensor(name))) for name in state})
    return hf


# -- 1. sharded safetensors in bf16 / f16 -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_sharded_half_precision_hf_dir_matches_transformers(dtype: torch.dtype, tmp_path: Path) -> None:
    """save_pretrained in bf16/f16 across 20 KB shards with model.safetensors.index.json: every tensor read as
    transformers reads it (upcast to f32), and the served greedy tokens are transformers' on those weights."""
    src = model_fixtures.make_tiny_qwen3(tmp_path / "src")
    AutoModelForCausalLM.from_pretrained(src, dtype=dtype).save_pretrained(tmp_path / "half", max_shard_size="20KB")
    path = tmp_path / "half"
    assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 5
    ckpt = open_checkpoint(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    for name, v in hf.state_dict().items():
        np.testing.assert_array_equal(ckpt.tensor(name), v.numpy(), err_msg=name)
    config = ckpt.config
    assert config is not None and config.qk_norm
    prompt = _prompt()
    want_logits, want = _reference(hf, prompt)
    logits, tokens = generate(make_stages(ckpt, config, SPLITS[2], BUCKET, CACHE), config, prompt, NEW_TOKENS, BUCKET)
    assert np.abs(logits[0] - want_logits).max() < LOGIT_TOL
    assert tokens == want


# -- 2, 3. GGUF families, F32 and K-quants ------------------------------------------------------------------

def test_k_quantizers_make_blocks_gguf_dequantizes() -> None:
    """The fixture's Q4_K/Q5_K/Q6_K blocks, read back by gguf-py's dequantize: within half a quantization step of
    the input (what a correct layout gives; a wrong one is off by whole sub-blocks)."""
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 0.05, (8, 512)).astype(np.float32)
    x[0, :256] = 0.0
    x[1] = np.abs(x[1])
    for qtype, levels in ((Q.Q4_K, 15), (Q.Q5_K, 31), (Q.Q6_K, 62)):
        blocks = gguf_fixtures.quantize(x, qtype)
        assert blocks.shape == (8, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
        back = gguf.quants.dequantize(blocks, qtype)
        assert np.abs(back[0, :256]).max() == 0.0
        # step = range / levels, after rounding the 6/8-bit scales: allow 0.6 of one step of the whole row's range
        bound = 0.6 * (x.max(axis=1) - np.minimum(x.min(axis=1), 0)) / levels * (2 if qtype == Q.Q6_K else 1)
        assert (np.abs(back - x).max(axis=1) <= bound).all(), qtype.name


def test_low_bit_k_quantizers_make_blocks_gguf_dequantizes() -> None:
    """The fixture's Q2_K and Q3_K blocks (16-value sub-blocks), read back by gguf-py's dequantize: each sub-block
    within 0.6 of its step (Q2_K: its range over 3 levels) or one step (Q3_K: its peak magnitude over 4, which the
    opposite sign's clipping at +3 can cost); a wrong layout is off by whole sub-blocks."""
    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 0.05, (8, 512)).astype(np.float32)
    x[0, :256] = 0.0
    x[1] = np.abs(x[1])
    sub = x.reshape(8, -1, 16)
    steps = {Q.Q2_K: 0.6 * (sub.max(axis=-1) - np.minimum(sub.min(axis=-1), 0)) / 3,
             Q.Q3_K: 1.05 * np.abs(sub).max(axis=-1) / 4}
    for qtype, bound in steps.items():
        blocks = gguf_fixtures.quantize(x, qtype)
        assert blocks.shape == (8, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
        back = gguf.quants.dequantize(blocks, qtype)
        assert np.abs(back[0, :256]).max() == 0.0
        assert (np.abs(back - x).reshape(8, -1, 16).max(axis=-1) <= bound + 1e-7).all(), qtype.name


@dataclasses.dataclass
class GgufCase:
    name: str
    hf_dir: Path
    gguf: Path
    ckpt: Checkpoint
    prompt: list[int]
    logits: np.ndarray
    tokens: list[int]


_F32_FAMILIES: dict[str, tuple[Callable[[Path], Path], str]] = {  # each family with every tensor in f32
    "llama3": (model_fixtures.make_tiny_llama3_rope, "llama"),
    "qwen2": (model_fixtures.make_tiny_qwen2, "qwen2"),
    "qwen3": (model_fixtures.make_tiny_qwen3, "qwen3"),
    "phi3-longrope": (model_fixtures.make_tiny_phi3, "phi3"),
    "qwen2-yarn": (model_fixtures.make_tiny_qwen2_yarn, "qwen2"),
    "mistral-window": (gguf_fixtures.make_window_mistral, "llama"),
    "qwen2-window": (gguf_fixtures.make_window_qwen2, "qwen2"),
    "gemma2": (gguf_fixtures.make_gguf_gemma2, "gemma2"),
    "gemma3": (gguf_fixtures.make_gguf_gemma3, "gemma3"),
}
CASES: dict[str, tuple[Callable[[Path], Path], str, gguf_fixtures.TypePicker]] = {
    **{f"{name}-f32": (make, arch, gguf_fixtures.f32_only) for name, (make, arch) in _F32_FAMILIES.items()},
    "gemma2-q8_0": (gguf_fixtures.make_gguf_gemma2, "gemma2", gguf_fixtures.q8_0_2d),
    "llama3-q4_k_m": (gguf_fixtures.make_wide_llama3, "llama", gguf_fixtures.q4_k_m),
    "qwen3-q4_k_m": (gguf_fixtures.make_wide_qwen3, "qwen3", gguf_fixtures.q4_k_m),
    "llama3-q2_k_q3_k": (gguf_fixtures.make_wide_llama3, "llama", gguf_fixtures.q2_k_q3_k),
}


def _make_case(name: str, root: Path) -> GgufCase:
    make, arch, types = CASES[name]
    hf_dir = make(root / "hf")
    path = gguf_fixtures.write_gguf(hf_dir, root / f"{name}.gguf", arch, types)
    ckpt = open_checkpoint(path)
    hf = _hf_with(hf_dir, ckpt)
    if types is gguf_fixtures.f32_only:  # the file holds the very weights: transformers on the HF folder
        original = open_checkpoint(hf_dir)
        for n in original.names():  # Gemma's norms went through llama.cpp's 1 + w: back within its f32 rounding
            want = original.tensor(n)
            shifted = arch.startswith("gemma") and n.endswith("norm.weight")
            tol = float(np.spacing(np.float32(1) + np.abs(want)).max()) / 2 if shifted else 0.0
            np.testing.assert_allclose(ckpt.tensor(n), want, rtol=0, atol=tol, err_msg=n)
    prompt = _prompt()
    logits, tokens = _reference(hf, prompt)
    if types is not gguf_fixtures.f32_only:  # the quantization matters: the reference must be on its weights
        plain = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        assert np.abs(_reference(plain, prompt)[0] - logits).max() > 100 * LOGIT_TOL
    return GgufCase(name, hf_dir, path, ckpt, prompt, logits, tokens)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> GgufCase:
    return _make_case(request.param, tmp_path_factory.mktemp(request.param))


def test_gguf_config_is_the_hf_config(case: GgufCase) -> None:
    """What config_from_gguf reads is what the HF folder says (llama3's frequencies through rope_freqs, to f32)."""
    g, h = case.ckpt.config, open_checkpoint(case.hf_dir).config
    assert g is not None and h is not None
    same = ("arch", "vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
            "rope_theta", "rotary_dim", "max_position", "qkv_bias", "qk_norm", "fused_proj", "tie_word_embeddings",
            "bos_token_id", "eos_token_ids", "hidden_act", "windows", "gemma", "attn_softcap", "final_softcap")
    assert {f: getattr(g, f) for f in same} == {f: getattr(h, f) for f in same}
    assert g.norm_eps == pytest.approx(h.norm_eps) and g.rope_scale == pytest.approx(h.rope_scale, rel=1e-6)
    assert g.attn_scale == pytest.approx(h.attn_scale, rel=1e-12)
    assert len(g.rope_inv_freq) == len(h.rope_inv_freq)
    np.testing.assert_allclose(g.rope_inv_freq, h.rope_inv_freq, rtol=1e-6)
    assert (g.local_rope is None) == (h.local_rope is None)
    if g.local_rope is not None and h.local_rope is not None:  # Gemma 3's sliding layers
        assert (g.local_rope.theta, g.local_rope.inv_freq) == (h.local_rope.theta, h.local_rope.inv_freq)
    types = {t.tensor_type for t in gguf.GGUFReader(case.gguf).tensors}
    if case.name.endswith("q4_k_m"):
        assert {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.F32} <= types
    elif case.name.endswith("q2_k_q3_k"):
        assert {Q.Q2_K, Q.Q3_K, Q.Q6_K, Q.F32} <= types
    elif case.name.endswith("q8_0"):
        assert types == {Q.Q8_0, Q.F32}
    else:
        assert types == {Q.F32}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_gguf_greedy_matches_transformers(case: GgufCase, backend: str) -> None:
    """Prompt logits within 1e-4 and 20 greedy tokens identical to transformers on the file's weights, split
    two ways, with every weight read as f32 (--weights f32)."""
    config = case.ckpt.config
    assert config is not None
    stages = make_stages(case.ckpt, config, _halves(config.n_layers), BUCKET, CACHE, backend=backend)
    logits, tokens = generate(stages, config, case.prompt, NEW_TOKENS, BUCKET)
    assert np.abs(logits[0] - case.logits).max() < LOGIT_TOL
    assert tokens == case.tokens
    if backend == "numpy" and any(config.windows):  # and the window matters: without it the logits are others
        plain = dataclasses.replace(config, windows=())
        other, _ = generate(make_stages(case.ckpt, plain, [range(plain.n_layers)], BUCKET, CACHE), plain, case.prompt,
                            1, BUCKET)
        assert np.abs(other[0] - case.logits).max() > 100 * LOGIT_TOL


@pytest.mark.parametrize("name", ["llama3-q4_k_m", "qwen3-q4_k_m"])
def test_k_quant_served_packed_keeps_its_packed_blocks(name: str, tmp_path: Path) -> None:
    """--weights packed on a K-quant mix: the Q4_0/Q8_0, Q4_K and Q6_K tensors stay packed (dequant_matmul), Q5_K
    is dequantized to f32; same logits and tokens as transformers on the dequantized weights."""
    c = _make_case(name, tmp_path)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(c.gguf).tensors}
    packed = [t for t in types.values() if t in PACKED_SCHEMES]
    schemes = c.ckpt.packed_schemes()
    assert types["token_embd.weight"] == Q.Q4_K  # Qwen3's tied head: the embedding's blocks, packed
    tied = "output.weight" not in types
    assert len(schemes) == len(packed) + tied > 0 and set(schemes.values()) == {PACKED_SCHEMES[t] for t in packed}
    assert {"q4_k", "q6_k"} <= set(schemes.values()) and Q.Q5_K not in PACKED_SCHEMES
    config = c.ckpt.config
    assert config is not None
    logits, tokens = generate(make_stages(c.ckpt, config, SPLITS[2], BUCKET, CACHE, quantized=True), config,
                              c.prompt, NEW_TOKENS, BUCKET)
    assert np.abs(logits[0] - c.logits).max() < LOGIT_TOL
    assert tokens == c.tokens


@pytest.mark.parametrize("name", ["llama3-q4_k_m", "gemma3-f32", "gemma2-q8_0"])
def test_gguf_over_two_executors_matches_transformers(name: str, tmp_path: Path) -> None:
    """The real mesh (coordinator, 2 executor processes, paged engine, --weights packed) on the Llama 3 Q4_K_M-style
    file and on Gemma 3 / Gemma 2 files (sliding layers, soft-caps; Q8_0 kept packed): 24 greedy tokens, past the
    window, identical to transformers on the file's (dequantized) weights."""
    from graphmesh.coordinator_client import CoordinatorClient
    from graphmesh.launcher import LocalMesh

    c = _make_case(name, tmp_path)
    hf = _hf_with(c.hf_dir, c.ckpt)
    prompt = [5, 17, 99, 3, 250, 42, 7, 11, 600, 12, 1]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    with LocalMesh(2, "numpy", str(c.gguf), startup_timeout_s=120, weights="packed",
                   extra_executor_args=("--kv-cache-bytes", "4Mi")) as mesh:
        with CoordinatorClient(mesh.coordinator_address) as client:
            got = [t for chunk in client.generate(prompt_token_ids=prompt, max_tokens=24, ignore_eos=True)
                   for t in chunk.token_ids]
    assert got == want


def test_a_mesh_serving_packed_q8_gives_every_stream_its_solo_tokens(tmp_path: Path) -> None:
    """The real mesh (coordinator, 2 torch executor processes, --weights packed-q8) on a Llama 3 Q4_K_M-style file
    (its Q4_0 / Q8_0 tensors take int8 rows, its K-quants f32 ones): four concurrent streams each get the tokens
    they get alone, and the same tokens as numpy's float64 reference of the same arithmetic."""
    from concurrent.futures import ThreadPoolExecutor

    from graphmesh.coordinator_client import CoordinatorClient
    from graphmesh.launcher import LocalMesh

    c = _make_case("llama3-q4_k_m", tmp_path)
    prompts = [[5, 17, 99, 3, 250, 42, 7, 11], [600, 12, 1], [8, 9, 10, 11, 12, 13], [77]]

    def tokens(client: CoordinatorClient, prompt: list[int]) -> list[int]:
        return [t for chunk in client.generate(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True)
                for t in chunk.token_ids]

    runs: dict[str, list[list[int]]] = {}
    for backend in ("torch", "numpy"):
        with LocalMesh(2, backend, str(c.gguf), startup_timeout_s=120, weights="packed-q8",
                       extra_executor_args=("--kv-cache-bytes", "4Mi")) as mesh:
            with CoordinatorClient(mesh.coordinator_address) as client:
                runs[backend] = [tokens(client, p) for p in prompts]
                if backend == "torch":
                    with ThreadPoolExecutor(len(prompts)) as pool:
                        assert list(pool.map(lambda p: tokens(client, p), prompts)) == runs[backend]
    assert runs["torch"] == runs["numpy"]


# -- what is still refused, at open, by field and value ----------------------------------------------------

def _rewrite(src: Path, dst: Path, arch: str | None = None, extra: dict[str, int] | None = None,
             retype: tuple[str, Q] | None = None) -> Path:
    """src's tensors and metadata in a new file: another architecture name, extra integer keys, or one tensor
    given another type (its bytes replaced by zeros of that type's size)."""
    reader = gguf.GGUFReader(src)
    old_arch = str(reader.fields["general.architecture"].contents())
    new_arch = arch or old_arch
    w = gguf.GGUFWriter(str(dst), new_arch)
    replaced = {key.replace("{arch}", new_arch) for key in extra or {}}
    for key, field in reader.fields.items():
        name = key.replace(f"{old_arch}.", f"{new_arch}.", 1)
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment") or name in replaced:
            continue
        value = field.contents()
        if isinstance(value, int):
            w.add_uint32(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
    for key, v in (extra or {}).items():
        w.add_uint32(key.replace("{arch}", new_arch), v)
    for t in reader.tensors:
        if retype and t.name == retype[0]:
            block, size = gguf.GGML_QUANT_SIZES[retype[1]]
            rows, cols = int(t.shape[1]), int(t.shape[0])
            w.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8), raw_dtype=retype[1])
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def wide_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wide")
    return gguf_fixtures.write_gguf(gguf_fixtures.make_wide_qwen3(root / "hf"), root / "q.gguf", "qwen3",
                                    gguf_fixtures.q4_k_m)


def test_rewritten_file_still_opens(wide_q4_k_m: Path, tmp_path: Path) -> None:
    """_rewrite itself changes nothing else: the refusals below are the change they make."""
    same = open_checkpoint(_rewrite(wide_q4_k_m, tmp_path / "same.gguf"))
    assert same.config == open_checkpoint(wide_q4_k_m).config


@pytest.mark.parametrize("change,words", [
    ({"arch": "gemma"}, ["general.architecture", "'gemma'"]),  # Gemma 1
    ({"retype": ("blk.0.ffn_up.weight", Q.Q8_K)}, ["'blk.0.ffn_up.weight'", "Q8_K"]),
    ({"retype": ("blk.0.attn_q.weight", Q.IQ4_NL)}, ["'blk.0.attn_q.weight'", "IQ4_NL"]),
    ({"extra": {"{arch}.expert_count": 8}}, ["qwen3.expert_count", "8"]),
    ({"extra": {"{arch}.rope.dimension_count": 16}}, ["qwen3.rope.dimension_count", "16"]),
    ({"extra": {"{arch}.attention.value_length": 64}}, ["qwen3.attention.value_length", "64"]),
    ({"extra": {"{arch}.rope.scaling.type": 0}}, ["rope.scaling.type", "0"]),
])
def test_unsupported_gguf_is_refused_by_field_and_value(wide_q4_k_m: Path, tmp_path: Path, change: dict[str, object],
                                                        words: list[str]) -> None:
    path = _rewrite(wide_q4_k_m, tmp_path / "bad.gguf", **change)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as e:
        open_checkpoint(path)
    assert e.value.reason == "UNSUPPORTED_MODEL"
    assert all(w in str(e.value) for w in words), str(e.value)


# -- llama.cpp's rope-scaling and sliding-window keys, value by value -----------------------------------------------

def _meta(**extra: Any) -> dict[str, Any]:
    base = {"general.architecture": "qwen2", "qwen2.embedding_length": 64, "qwen2.attention.head_count": 4,
            "qwen2.block_count": 4, "qwen2.feed_forward_length": 128, "qwen2.context_length": 256,
            "qwen2.attention.layer_norm_rms_epsilon": 1e-6, "qwen2.rope.freq_base": 1e6}
    return {**base, **{f"qwen2.{k}": v for k, v in extra.items()}}


_EMBED = [_GgufTensor("token_embd.weight", (64, 100), Q.F32, np.zeros((100, 64), np.float32))]
_YARN = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64}


def test_gguf_yarn_keys_are_transformers_yarn() -> None:
    """rope.scaling.type yarn with .factor and .original_context_length, and the yarn_attn_factor / yarn_beta_fast /
    yarn_beta_slow that convert_hf_to_gguf copies from rope_parameters: transformers' YaRN frequencies and attention
    factor on those parameters, over the extended context."""
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for extra in ({}, {"attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0}):
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64, **extra}
        hf = Qwen2Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters=rope)
        want, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        keys = {"rope.scaling.yarn_attn_factor": extra.get("attention_factor"),
                "rope.scaling.yarn_beta_fast": extra.get("beta_fast"), "rope.scaling.yarn_beta_slow": extra.get("beta_slow")}
        c = config_from_gguf(_meta(**_YARN, **{k: v for k, v in keys.items() if v is not None}), _EMBED)
        np.testing.assert_allclose(c.rope_inv_freq, want.double().numpy(), rtol=1e-6)
        assert c.rope_scale == pytest.approx(scale, rel=1e-6) and c.max_position == 256
    assert config_from_gguf(_meta(**_YARN), _EMBED).rope_scale != pytest.approx(1.3)


@pytest.mark.parametrize("extra,words", [
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, ["qwen2.rope.scaling.type", "'yarn'",
                                                                 "original_context_length"]),
    ({**_YARN, "rope.scaling.yarn_ext_factor": 0.5}, ["qwen2.rope.scaling.yarn_ext_factor", "0.5"]),
    ({**_YARN, "rope.scaling.yarn_log_multiplier": 0.1}, ["qwen2.rope.scaling.yarn_log_multiplier", "0.1"]),
    ({"rope.scaling.type": "longrope"}, ["rope.scaling.type", "'longrope'"]),
    ({"attention.sliding_window": 6, "attention.sliding_window_pattern": [True, False]},
     ["qwen2.attention.sliding_window_pattern", "[True, False]", "4 layers"]),
    ({"attention.sliding_window": 6, "attention.sliding_window_pattern": "0101"},
     ["qwen2.attention.sliding_window_pattern", "'0101'"]),
    ({"attention.sliding_window": -6}, ["qwen2.attention.sliding_window", "-6"]),
])
def test_bad_gguf_rope_and_window_keys_are_refused(extra: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(InvalidArgument) as e:
        config_from_gguf(_meta(**extra), _EMBED)
    assert e.value.reason == "UNSUPPORTED_MODEL"
    assert all(w in str(e.value) for w in words), str(e.value)


def test_gguf_sliding_window_patterns() -> None:
    """attention.sliding_window on every layer by default (Mistral's, Phi-3's), or where the per-layer booleans or
    llama.cpp's integer period say; Gemma's fixed periods where the file has no pattern; 0 or absent: none."""
    def windows(extra: dict[str, Any], arch: str = "qwen2") -> tuple[int, ...]:
        meta = {k.replace("qwen2.", f"{arch}.", 1): v for k, v in _meta(**extra).items()}
        return config_from_gguf({**meta, "general.architecture": arch}, _EMBED).windows

    window = {"attention.sliding_window": 6}
    assert windows({}) == windows({"attention.sliding_window": 0}) == ()
    assert windows(window) == (6, 6, 6, 6)
    assert windows({**window, "attention.sliding_window_pattern": [False, True, True, False]}) == (0, 6, 6, 0)
    assert windows({**window, "attention.sliding_window_pattern": 3}) == (6, 6, 0, 6)
    assert windows({**window, "attention.sliding_window_pattern": 0}) == (6, 6, 6, 6)
    assert windows(window, "gemma2") == (6, 0, 6, 0)
    assert windows({**window, "block_count": 7}, "gemma3") == (6,) * 5 + (0, 6)


def test_gguf_gemma_attention_scale_is_llama_cpps() -> None:
    """A Gemma file carries no query_pre_attn_scalar: scores scale by 1/sqrt(head_dim), except in the 27B models
    (46 layers of Gemma 2, 62 of Gemma 3), by 1/sqrt(hidden / heads), as llama.cpp's loader fixes them."""
    for arch, big in (("gemma2", 46), ("gemma3", 62)):
        for layers, scalar in ((big, 64 / 4), (big - 1, 32)):
            meta = {k.replace("qwen2.", f"{arch}.", 1): v for k, v in _meta(**{"block_count": layers}).items()}
            c = config_from_gguf({**meta, "general.architecture": arch, f"{arch}.attention.key_length": 32}, _EMBED)
            assert c.gemma and c.attn_scale == pytest.approx(scalar ** -0.5, rel=1e-12), (arch, layers)
