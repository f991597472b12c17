"""A Mixtral sparse-MoE block as a graph (router -> top-k -> grouped expert matmuls), on every backend,
against transformers' MixtralSparseMoeBlock with random weights; residency accounting on the real routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from graphmesh.graph import GraphBuilder, parse
from graphmesh_executor.backends import available, compile_graph, cuda_kernels

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


@pytest.mark.parametrize("backend", available())
def test_residency_stats_follow_each_runs_mask(backend: str) -> None:
    """Without top-k capture the torch backend runs its plan and tallies experts on its device (on CUDA nothing is
    read back in the step); every backend's stats equal the routing's, each run's experts split by the mask in
    force when it ran."""
    exe = compile_graph(parse(moe_block_graph().build()), backend)
    rng = np.random.default_rng(5)
    for name, shape in (("router", (E, H)), ("w_gate", (E, H, F)), ("w_up", (E, H, F)), ("w_down", (E, F, H))):
        exe.set_param(name, rng.standard_normal(shape).astype(np.float32))
    want = {"resident_tokens": 0, "offloaded_tokens": 0, "resident_expert_calls": 0, "offloaded_expert_calls": 0}
    for run, mask in enumerate(([e % 2 == 0 for e in range(E)], [e < 3 for e in range(E)], [True] * E)):
        exe.set_moe_resident_experts(mask)
        _, top = exe.run({"x": rng.standard_normal((T, H)).astype(np.float32)}, typed=True)
        chosen = top.reshape(-1).tolist()
        want["resident_tokens"] += 3 * sum(1 for e in chosen if mask[e])
        want["offloaded_tokens"] += 3 * sum(1 for e in chosen if not mask[e])
        want["resident_expert_calls"] += 3 * sum(1 for e in set(chosen) if mask[e])
        want["offloaded_expert_calls"] += 3 * sum(1 for e in set(chosen) if not mask[e])
        if run == 1:
            stats = exe.take_moe_residency_stats()
            assert {k: getattr(stats, k) for k in want} == want
            want = dict.fromkeys(want, 0)
    stats = exe.take_moe_residency_stats()
    assert {k: getattr(stats, k) for k in want} == want
    assert exe.take_moe_residency_stats().resident_tokens == 0  # taken: the tally starts again


def test_a_moe_graph_needs_no_host_read_to_run_static(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expert ids come from top_k and the row gather from a constant: in range by construction, so the CUDA
    path may run the graph static and capture it (cuda_graphs._static_checks; checked here on the host, with the
    Triton kernels taken as usable, as on a GPU)."""
    monkeypatch.setattr(cuda_kernels, "usable", lambda *xs: True)
    exe = compile_graph(parse(moe_block_graph().build()), "torch")
    assert exe._static_checks(exe.graph) == []  # type: ignore[attr-defined]
    g = GraphBuilder("ids_from_input")  # ids a caller sends: checked on the host, so never static
    x, w, ids = g.input("x", (4, H)), g.input("w", (E, H, F)), g.input("ids", (4,), "i64")
    g.output(g.grouped_matmul(x, w, ids))
    assert compile_graph(parse(g.build()), "torch")._static_checks(parse(g.build())) is None  # type: ignore[attr-defined]
