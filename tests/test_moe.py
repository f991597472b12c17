"""A Mixtral sparse-MoE block as a graph (router -> top-k -> grouped expert matmuls), on every backend,
against transformers' MixtralSparseMoeBlock with random weights; residency accounting on the real routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from graphmesh.graph import GraphBuilder, parse
from graphmesh_executor.backends import available, compile_graph

T, H, F, E, K = 7, 32, 48, 8, 2


def moe_block_graph() -> GraphBuilder:
    g = GraphBuilder("mixtral_moe")
    x = g.input("x", (T, H))
    probs = g.softmax(g.matmul(x, g.param("router", (E, H)), transpose_b=True))
    top = g.top_k(probs, K)  # [T, K] expert ids, most likely first
    weights = g.take_along_axis(probs, top)
    weights = g.div(weights, g.sum(weights, axes=(-1,), keepdims=True))
    ids = g.reshape(top, (T * K,))
    rows = g.gather(x, g.constant(np.repeat(np.arange(T), K)))  # token of each of the T*K expert slots
    gate = g.grouped_matmul(rows, g.param("w_gate", (E, H, F)), ids)
    up = g.grouped_matmul(rows, g.param("w_up", (E, H, F)), ids)
    down = g.grouped_matmul(g.mul(g.silu(gate), up), g.param("w_down", (E, F, H)), ids)
    weighted = g.mul(down, g.reshape(weights, (T * K, 1)))
    g.output(g.sum(g.reshape(weighted, (T, K, H)), axes=(1,)), top)
    return g


@pytest.mark.parametrize("backend", available())
def test_mixtral_block_matches_transformers(backend: str) -> None:
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K)
    block = MixtralSparseMoeBlock(config).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
        x = torch.randn(1, T, H)
        expected = block(x)[0].numpy()
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2F, H]: gate rows then up rows
    exe = compile_graph(parse(moe_block_graph().build()), backend)
    exe.set_param("router", block.gate.weight.detach().numpy())
    exe.set_param("w_gate", np.ascontiguousarray(gate_up[:, :F].transpose(0, 2, 1)))
    exe.set_param("w_up", np.ascontiguousarray(gate_up[:, F:].transpose(0, 2, 1)))
    exe.set_param("w_down", np.ascontiguousarray(block.experts.down_proj.detach().numpy().transpose(0, 2, 1)))
    exe.enable_moe_topk_capture(E)
    mask = [e % 2 == 0 for e in range(E)]
    exe.set_moe_resident_experts(mask)
    out, top = exe.run({"x": x[0].numpy()}, typed=True)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
    # residency accounting follows the routing the block actually took
    chosen = top.reshape(-1)
    captured = exe.take_moe_topk_capture()
    assert captured == [chosen.tolist()]
    stats = exe.take_moe_residency_stats()
    resident_tokens = sum(1 for e in chosen if mask[e])
    assert stats.resident_tokens == 3 * resident_tokens  # gate, up and down each count the rows
    assert stats.offloaded_tokens == 3 * (len(chosen) - resident_tokens)
    assert stats.resident_expert_calls + stats.offloaded_expert_calls == 3 * len(set(chosen.tolist()))
