"""bench_gpu_mesh.py's random checkpoints and gpu_peer.py's plain model code, on the CPU in f32: the writer's tiny
Llama and Qwen3-MoE (`--shape small`, `moe-small`, in several shards) as transformers decodes them, and as the peer
(eager) and graphmesh (one StageRuntime, torch backend) do, token for token; and the peer's decode step traced whole
by torch.compile, as the GPU run compiles it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import gpu_peer
from bench.bench_gpu import decode
from bench.bench_gpu_mesh import SHAPES, hf_config, hf_tensors, write_random_model
from graphmesh_executor.stage import StageRuntime
from graphmesh_executor.stage_types import StageSpec
from tests.model_fixtures import INIT
from tests.test_models import LOGIT_TOL, NEW_TOKENS, PROMPT_LEN, hf_reference


@pytest.fixture(scope="module", params=["small", "moe-small"])
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    # The tests' wider init (model_fixtures.INIT) spreads the logits, so greedy tokens hinge on no near-tie.
    path = tmp_path_factory.mktemp(request.param)
    write_random_model({**SHAPES[request.param], "initializer_range": INIT}, "cpu", path, shard_bytes=1 << 18,
                       piece_bytes=4096)
    return request.param, path


@pytest.mark.parametrize("shape", ["small", "moe-small"])
def test_writer_writes_what_transformers_saves(tmp_path: Path, shape: str) -> None:
    """The writer's config is the shape's family, its tensors what transformers' own save_pretrained writes for that
    config, and the full `moe` shape has the parameter count bench_gpu_mesh.py's docstring states."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_utils import PreTrainedModel

    write_random_model(SHAPES[shape], "cpu", tmp_path / "ours", piece_bytes=4096)
    config = AutoConfig.from_pretrained(tmp_path / "ours")
    if shape == "moe-small":
        assert config.model_type == "qwen3_moe" and config.num_experts == 8 and config.norm_topk_prob
    else:
        assert config.model_type == "llama"
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(tmp_path / "hf")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert dict(hf_tensors(config)) == saved
    total = sum(int(np.prod(dims)) for _, dims in hf_tensors(hf_config(SHAPES["moe"])))
    assert 2.6e9 < total < 2.7e9


def test_peer_and_graphmesh_decode_as_transformers(written: tuple[str, Path]) -> None:
    """transformers' f32 greedy tokens (generate) for the written checkpoint are the peer's, for one sequence
    (a MoE decode step gathers its chosen experts) and for four together (every expert, masked), with the prompt's
    logits within LOGIT_TOL; and graphmesh's, the whole model in one StageRuntime on the torch backend."""
    shape, path = written
    _, prompt, logits, tokens = hf_reference(path, seed=5)
    max_seq = 1 << (PROMPT_LEN + NEW_TOKENS).bit_length()
    for batch in (1, 4):
        peer = gpu_peer.load(path, batch, max_seq, torch.float32, "cpu")
        ids = torch.tensor([prompt] * batch)
        if batch == 1:
            with torch.inference_mode():
                ours = peer(ids, torch.arange(PROMPT_LEN))[0, -1].numpy()
            assert np.abs(ours - logits).max() < LOGIT_TOL
        assert gpu_peer.greedy(peer, ids, NEW_TOKENS).tolist() == [tokens] * batch, (shape, batch)

    stage = StageRuntime("torch", "cpu", kv_cache_bytes=8 << 20)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    stage.install(1, 0, 1, StageSpec(str(path), 0, layers, True, True, kv_block_tokens=16, dtype="f32"))
    ours_tokens, _ = decode(stage, "s", prompt, NEW_TOKENS, "cpu")
    assert ours_tokens == tokens, shape


def test_moe_block_paths_match_transformers() -> None:
    """The peer's MoE block against transformers' Qwen3MoeSparseMoeBlock (the same weights, float64), on both of
    its paths: one token (the chosen experts gathered) and 16 tokens (every expert, masked)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    c = {**SHAPES["moe-small"]}
    torch.manual_seed(3)
    hf_block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**{k: v for k, v in c.items() if k != "model_type"})).double()
    ours = gpu_peer.MoE(c).double()
    with torch.no_grad():
        for p in hf_block.parameters():
            p.normal_(0.0, INIT)
        gate, up = hf_block.experts.gate_up_proj.chunk(2, dim=1)
        ours.gate.weight.copy_(hf_block.gate.weight)
        ours.gate_proj.copy_(gate)
        ours.up_proj.copy_(up)
        ours.down_proj.copy_(hf_block.experts.down_proj)
        for tokens in (1, 16):
            x = torch.randn(1, tokens, c["hidden_size"], dtype=torch.float64)
            torch.testing.assert_close(ours(x), hf_block(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_step_traces_whole(written: tuple[str, Path], batch: int) -> None:
    """The decode step is one graph for torch.compile (fullgraph: no routing-dependent Python, no graph break) on
    either MoE path, and decodes the eager step's tokens. Dynamo's trace alone (backend "eager"): the CUDA run adds
    Inductor and CUDA graphs over the same graph."""
    _, path = written
    peer = gpu_peer.load(path, batch, 64, torch.float32, "cpu")
    ids = torch.randint(3, 1000, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(batch))
    eager = gpu_peer.greedy(peer, ids, 4)
    torch._dynamo.reset()
    step = torch.compile(peer, fullgraph=True, dynamic=False, backend="eager")
    with torch.inference_mode():
        nxt = eager[:, :1]
        for i in range(3):
            nxt = step(nxt, torch.tensor([PROMPT_LEN + i]))[:, -1:].argmax(-1)
            assert torch.equal(nxt, eager[:, i + 1:i + 2])
