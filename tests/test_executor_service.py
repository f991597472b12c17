"""Every ExecutorService RPC through ExecutorClient against a real executor process of every backend here.

References are independent of the executor: plain numpy for the small graphs, and transformers'
own decoder layer modules for the Llama and GPT-2 blocks.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from graphmesh import ExecutorClient, GraphBuilder, RemoteExecutable, errors
from graphmesh.graph import Value
from graphmesh.launcher import free_port
from graphmesh.v1 import executor_pb2, graph_pb2
from graphmesh_executor.backends import executable_class
from graphmesh_executor.backends.numpy_backend import KERNELS
from tests.conftest import backend_targets, executor_args, health_status, start_process

RNG = np.random.default_rng(0)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@contextmanager
def executor_of(target: str, model_root: Path, logs: Path) -> Iterator[str]:
    """An executor process of `target` ("numpy", "torch", "torch:cuda", "mlx"), one thread, on a free port."""
    backend, _, device = target.partition(":")
    address = f"127.0.0.1:{free_port()}"
    args = executor_args(address, "--threads", "1", "--model-root", str(model_root),
                         *(("--device", device) if device else ()), backend=backend)
    with start_process(args, address, log_path=logs / f"{target.replace(':', '_')}_executor.log",
                       env={"OMP_NUM_THREADS": "1"}):
        yield address


@pytest.fixture(scope="module", params=backend_targets())
def client(request: pytest.FixtureRequest, numpy_executor: str, model_root: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExecutorClient]:
    """Every RPC below runs against an executor of every backend here (numpy: the session's shared one)."""
    with ExitStack() as stack:
        address = numpy_executor if request.param == "numpy" else \
            stack.enter_context(executor_of(str(request.param), model_root, tmp_path_factory.mktemp("logs")))
        yield stack.enter_context(ExecutorClient(address, timeout=60.0))


def mlp_graph(name: str = "mlp") -> graph_pb2.Graph:
    """x[4,8] -> relu(x @ w1) @ w2 + b; outputs: y [4,3] f32 and argmax(y) [4] i64."""
    g = GraphBuilder(name)
    x = g.input("x", (4, 8))
    h = g.relu(g.matmul(x, g.param("w1", (8, 16))))
    y = g.add(g.matmul(h, g.param("w2", (16, 3))), g.param("b", (3,)))
    g.output(y, g.argmax(y))
    return g.build()


def mlp_ref(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(x.astype(np.float64) @ w1, 0) @ w2 + b


@pytest.fixture(scope="module")
def mlp(client: ExecutorClient) -> tuple[RemoteExecutable, dict[str, np.ndarray]]:
    exe = client.compile(mlp_graph())
    params = {"w1": randn(8, 16), "w2": randn(16, 3), "b": randn(3)}
    assert exe.set_params({"w1": params["w1"], "w2": params["w2"]}) == ["w1", "w2"]  # one stream, two tensors
    exe.set_param_typed("b", params["b"].astype(np.float64))  # f64 in, cast to the declared f32
    assert exe.finalize_params() == []
    return exe, params


def test_health_and_reflection(numpy_executor: str) -> None:
    assert health_status(numpy_executor) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(numpy_executor, "graphmesh.v1.ExecutorService") == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(numpy_executor) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"graphmesh.v1.ExecutorService", "grpc.health.v1.Health"} <= services


def test_free_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    """A port from the kernel's ephemeral range can be taken by any bind to 0 or outgoing connection before the
    child binds it (a CI run lost an executor so); free_port stays below that range."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port < low for port in ports), [p for p in ports if not 1024 <= p < low]


def test_an_executor_whose_port_is_taken_exits_saying_so(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))
        taken.listen()
        with pytest.raises(RuntimeError, match="exited with status 1 before serving") as failure:
            with start_process(executor_args(address), address, log_path=tmp_path / "executor.log"):
                pass
    assert f"graphmesh-executor: cannot listen on {address}: port {address.rsplit(':', 1)[1]} is in use" in str(failure.value)
    assert "Traceback" not in str(failure.value)


def test_capabilities(client: ExecutorClient) -> None:
    caps = client.capabilities()
    name = executor_pb2.Backend.Name(caps.backend).removeprefix("BACKEND_").lower()
    assert list(caps.ops) == sorted(executable_class(name).kernels) == sorted(KERNELS)  # one op set everywhere
    assert caps.capabilities == executor_pb2.Capabilities(**asdict(executable_class(name).capabilities_on(caps.device)))
    assert caps.max_message_bytes == 64 << 20
    assert caps.capabilities.clone and caps.capabilities.typed_io


def test_compile_reports_io(client: ExecutorClient, mlp: tuple[RemoteExecutable, dict[str, np.ndarray]]) -> None:
    exe, _ = mlp
    assert [(s.name, s.dtype, s.shape) for s in exe.inputs] == [("x", "f32", (4, 8))]
    assert [(s.name, s.shape) for s in exe.params] == [("w1", (8, 16)), ("w2", (16, 3)), ("b", (3,))]
    assert [(s.dtype, s.shape) for s in exe.outputs] == [("f32", (4, 3)), ("i64", (4,))]
    named = client.compile(mlp_graph("named"), executable_id="my-mlp")
    assert named.id == "my-mlp"
    with pytest.raises(errors.AlreadyExists, match="my-mlp"):
        client.compile(mlp_graph("again"), executable_id="my-mlp")
    assert named.finalize_params() == ["w1", "w2", "b"]
    assert named.release() and not named.release()


def test_run_variants(mlp: tuple[RemoteExecutable, dict[str, np.ndarray]]) -> None:
    exe, p = mlp
    x = randn(4, 8)
    want = mlp_ref(x, p["w1"], p["w2"], p["b"])
    y, best = exe.run({"x": x})
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert best.dtype == np.float32 and np.array_equal(best, want.argmax(-1))  # run widens every output to f32
    typed = exe.run_typed({"x": x})
    assert typed[1].dtype == np.int64 and np.array_equal(typed[1], want.argmax(-1))
    (only,) = exe.run_read_outputs({"x": x}, [1])
    assert np.array_equal(only, want.argmax(-1))
    np.testing.assert_allclose(exe.run_slots([x])[0], want, rtol=1e-5, atol=1e-5)
    row = exe.read_output_row(0, 2, 3)
    assert row is not None
    np.testing.assert_allclose(row, want[2], rtol=1e-5, atol=1e-5)
    xs = [randn(4, 8) for _ in range(3)]
    for got, xi in zip(exe.run_pipelined([{"x": xi} for xi in xs]), xs):
        np.testing.assert_allclose(got[0], mlp_ref(xi, p["w1"], p["w2"], p["b"]), rtol=1e-5, atol=1e-5)
    exe.commit_no_wait({"x": x})
    exe.commit_no_wait({"x": x})
    assert exe.sync_pending() == 2 and exe.sync_pending() == 0
    with pytest.raises(errors.OutOfRange, match="output index 5"):
        exe.run({"x": x}, read_indices=[5])


def test_extent_and_rng(client: ExecutorClient, mlp: tuple[RemoteExecutable, dict[str, np.ndarray]]) -> None:
    exe, _ = mlp
    honored = client.capabilities().capabilities.active_extent
    assert exe.set_active_extent((2, 4)) is honored
    assert exe.set_active_extent(None) is honored
    with pytest.raises(errors.InvalidArgument, match=r"1 <= actual <= upper"):
        exe.set_active_extent((5, 4))
    exe.set_rng(7, "zero")
    assert exe.rng() == (7, "zero")
    exe.set_rng(123)
    assert exe.rng() == (123, "splitmix")


def test_sampling_follows_rng_policy(client: ExecutorClient) -> None:
    g = GraphBuilder("sampler")
    logits = g.input("logits", (3, 50))
    scalars = [g.input("temperature", (), "f32"), g.input("top_k", (), "i64"), g.input("top_p", (), "f32"),
               g.input("seed", (), "i64")]
    g.output(g.sample(logits, *scalars))
    exe = client.compile(g.build())
    x = randn(3, 50) * 3
    feed: dict[str, npt.ArrayLike] = {"logits": x, "temperature": np.float32(1.0), "top_k": np.int64(0), "top_p": np.float32(1.0),
            "seed": np.int64(5)}
    exe.set_rng(0, "zero")  # every draw is 0: the most likely token of each row
    assert np.array_equal(exe.run_typed(feed)[0], x.argmax(-1))
    exe.set_rng(99)
    draws = {tuple(exe.run_typed(feed)[0]) for _ in range(2)}
    assert len(draws) == 1  # the same policy, seed and row give the same tokens
    exe.release()


def test_clone_copy_release(client: ExecutorClient, mlp: tuple[RemoteExecutable, dict[str, np.ndarray]]) -> None:
    exe, _ = mlp
    x = randn(4, 8)
    want = exe.run({"x": x})[0]
    twin = exe.clone()
    assert twin is not None and twin.id != exe.id
    np.testing.assert_array_equal(twin.run({"x": x})[0], want)
    other = client.compile(mlp_graph("other"))
    assert sorted(other.copy_params_from(exe) or []) == ["b", "w1", "w2"]
    assert other.finalize_params() == []
    np.testing.assert_array_equal(other.run({"x": x})[0], want)
    again = client.executable(twin.id)
    assert twin.release()
    with pytest.raises(errors.NotFound, match=twin.id):
        again.run({"x": x})
    assert other.release()
    elsewhere = ExecutorClient(client.address.replace("127.0.0.1", "localhost"))
    assert elsewhere.executable("exe-x").copy_params_from(exe) is None  # another executor: not supported
    elsewhere.close()


def test_large_param_in_and_large_output_out(client: ExecutorClient) -> None:
    g = GraphBuilder("big")
    x = g.input("x", (2, 4096))
    g.input("h", (1100, 1024))  # a 4.4 MB handle
    w = g.param("w", (4096, 4352))  # 71 MB: over the 64 MiB message cap, so it must stream
    g.output(g.matmul(x, w), g.slice(w, 0, 0, 300))  # the slice is 5.2 MB: fetched with ReadOutput
    exe = client.compile(g.build())
    weight = randn(4096, 4352)
    exe.set_param("w", weight)
    xv = randn(2, 4096)
    y, head = exe.run({"x": xv})
    np.testing.assert_allclose(y, xv.astype(np.float64) @ weight, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(head, weight[:300])
    state = randn(1100, 1024)
    assert exe.bind_handle("h", state)
    np.testing.assert_array_equal(exe.read_handle("h"), state)
    np.testing.assert_array_equal(exe.read_handle("h", (1000, 1100)), state[1000:])
    assert exe.release()


def test_handles_and_prefix_feed(client: ExecutorClient) -> None:
    g = GraphBuilder("accumulate")
    state, x = g.input("state", (4, 8)), g.input("x", (4, 8))
    g.output(g.add(state, x))
    exe = client.compile(g.build())
    assert exe.has_handle("state") == (False, False)
    assert exe.bind_handle("state", np.zeros((4, 8), np.float32))
    assert exe.has_handle("state") == (True, False)
    assert exe.set_handle_feed("state", 0)
    xs = [randn(4, 8) for _ in range(3)]
    for xi in xs:
        exe.run({"x": xi})
    np.testing.assert_allclose(exe.read_handle("state"), sum(xs), rtol=1e-6, atol=1e-6)
    assert exe.has_handle("state") == (True, client.capabilities().capabilities.resident_handles)  # fed: the device's
    rows = randn(2, 8)
    assert exe.write_handle_rows("state", 1, rows)
    np.testing.assert_array_equal(exe.read_handle("state", (1, 3)), rows)
    with pytest.raises(errors.OutOfRange, match="rows"):
        exe.write_handle_rows("state", 3, rows)
    with pytest.raises(errors.NotFound, match="nope"):
        exe.read_handle("nope")
    exe.release()


def kv_graph(upper: int, dim: int) -> graph_pb2.Graph:
    """A decode step of one layer: outputs (summary, [past_k; k_row], [past_v; v_row]), as the trait expects."""
    g = GraphBuilder(f"kv{upper}")
    past_k, past_v = g.input("past_k_0", (upper, dim)), g.input("past_v_0", (upper, dim))
    k_row, v_row = g.input("k_row", (1, dim)), g.input("v_row", (1, dim))
    new_k, new_v = g.concat([past_k, k_row], 0), g.concat([past_v, v_row], 0)
    g.output(g.sum(new_k), new_k, new_v)
    return g.build()


def test_kv_row_feeds_and_row_copies(client: ExecutorClient) -> None:
    dim = 6
    keys, values = randn(5, dim), randn(5, dim)
    small = client.compile(kv_graph(4, dim))
    device = client.capabilities().capabilities.resident_handles  # numpy has none apart from the host: it says so
    for name in ("past_k_0", "past_v_0"):
        assert small.bind_handle(name, np.zeros((4, dim), np.float32), resident=True) is device
    assert small.register_kv_row_feed("past_k_0", 1) and small.register_kv_row_feed("past_v_0", 2)
    for t in range(4):
        step = {"k_row": keys[t:t + 1], "v_row": values[t:t + 1]}
        if t % 2:
            small.run(step)
            assert small.feed_kv_row(4, t, dim)  # the new row sits at index `upper` of the concat outputs
        else:
            small.run(step, kv_row_feed=(4, t, dim))
    np.testing.assert_array_equal(small.read_handle("past_k_0"), keys[:4])
    np.testing.assert_array_equal(small.read_handle("past_v_0"), values[:4])
    assert small.has_handle("past_k_0") == (True, device)
    small.run({"k_row": keys[4:5], "v_row": values[4:5]})  # the bucket is full: row 4 exists only in the outputs

    big = client.compile(kv_graph(8, dim))
    assert big.copy_resident_kv_rows_from(small, 0, 5, 4, dim, 1)  # rollover into the next bucket
    want_k = np.zeros((8, dim), np.float32)
    want_k[:5] = keys
    np.testing.assert_array_equal(big.read_handle("past_k_0"), want_k)
    np.testing.assert_array_equal(big.read_handle("past_v_0", (0, 5)), values)

    seeded = client.compile(kv_graph(8, dim))
    assert seeded.seed_resident_kv_prefix_from(small, 3, 4, dim, 1)
    np.testing.assert_array_equal(seeded.read_handle("past_k_0", (0, 3)), keys[:3])
    np.testing.assert_array_equal(seeded.read_handle("past_k_0", (3, 8)), np.zeros((5, dim), np.float32))
    with pytest.raises(errors.OutOfRange, match="row"):
        seeded.copy_resident_kv_rows_from(small, 0, 6, 4, dim, 1)
    for exe in (small, big, seeded):
        exe.release()


def test_moe(client: ExecutorClient) -> None:
    tokens, k, n, experts = 6, 8, 16, 4
    g = GraphBuilder("moe")
    x = g.input("x", (tokens, k))
    ids = g.reshape(g.top_k(g.matmul(x, g.param("router", (k, experts))), 1), (tokens,))
    gate = g.grouped_matmul(x, g.param("w_gate", (experts, k, n)), ids)
    up = g.grouped_matmul(x, g.param("w_up", (experts, k, n)), ids)
    g.output(g.grouped_matmul(g.mul(g.silu(gate), up), g.param("w_down", (experts, n, k)), ids))
    exe = client.compile(g.build())
    p = {"router": randn(k, experts), "w_gate": randn(experts, k, n), "w_up": randn(experts, k, n),
         "w_down": randn(experts, n, k)}
    exe.set_params(p)
    xv = randn(tokens, k)
    chosen = (xv.astype(np.float64) @ p["router"]).argmax(-1)
    gate_ref = np.einsum("tk,tkn->tn", xv, p["w_gate"][chosen])
    up_ref = np.einsum("tk,tkn->tn", xv, p["w_up"][chosen])
    h = gate_ref / (1 + np.exp(-gate_ref)) * up_ref
    want = np.einsum("tn,tnk->tk", h, p["w_down"][chosen])

    assert exe.enable_moe_topk_capture(experts)
    assert exe.take_moe_topk_capture() is None
    np.testing.assert_allclose(exe.run({"x": xv})[0], want, rtol=1e-4, atol=1e-4)
    assert exe.take_moe_topk_capture() == [chosen.tolist()]
    assert exe.take_moe_topk_capture() is None

    exe.take_moe_residency_stats()
    mask = [True, False, True, False]
    assert exe.set_moe_resident_experts(mask)
    exe.run({"x": xv})
    stats = exe.take_moe_residency_stats()
    resident = [e for e in set(chosen.tolist()) if mask[e]]
    resident_tokens = sum(int((chosen == e).sum()) for e in resident)
    assert stats is not None
    assert (stats.resident_expert_calls, stats.resident_tokens) == (3 * len(resident), 3 * resident_tokens)
    assert stats.offloaded_tokens == 3 * (tokens - resident_tokens)
    assert exe.set_moe_resident_experts_per_layer([[True] * experts])
    exe.run({"x": xv})
    stats = exe.take_moe_residency_stats()
    assert stats is not None and stats.offloaded_expert_calls == 0 and stats.resident_tokens == 3 * tokens
    with pytest.raises(errors.InvalidArgument, match="2 entries"):
        exe.set_moe_resident_experts([True, False])
    exe.release()


# -- transformer blocks: weights loaded by the executor from a transformers checkpoint ------------------

SEQ = 7


def _linear(g: GraphBuilder, x: Value, name: str, n: int, k: int) -> Value:
    """x @ W^T with W in nn.Linear layout [out, in]."""
    return g.matmul(x, g.param(name, (n, k)), transpose_b=True)


def llama_block_graph(hidden: int, heads: int, kv_heads: int, ffn: int, eps: float, theta: float) -> graph_pb2.Graph:
    head_dim = hidden // heads
    g = GraphBuilder("llama_block")
    x, pos = g.input("x", (SEQ, hidden)), g.input("positions", (SEQ,), "i64")
    h = g.rms_norm(x, g.param("ln1", (hidden,)), eps)
    q = g.rope(g.reshape(_linear(g, h, "wq", heads * head_dim, hidden), (SEQ, heads, head_dim)), pos, theta)
    k = g.rope(g.reshape(_linear(g, h, "wk", kv_heads * head_dim, hidden), (SEQ, kv_heads, head_dim)), pos, theta)
    v = g.reshape(_linear(g, h, "wv", kv_heads * head_dim, hidden), (SEQ, kv_heads, head_dim))
    a = g.reshape(g.attention(q, k, v, pos), (SEQ, heads * head_dim))
    x = g.add(x, _linear(g, a, "wo", hidden, heads * head_dim))
    h = g.rms_norm(x, g.param("ln2", (hidden,)), eps)
    m = g.mul(g.silu(_linear(g, h, "w_gate", ffn, hidden)), _linear(g, h, "w_up", ffn, hidden))
    g.output(g.add(x, _linear(g, m, "w_down", hidden, ffn)))
    return g.build()


LLAMA_NAMES = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "wq": "self_attn.q_proj",
               "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj",
               "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def gpt2_block_graph(hidden: int, heads: int, eps: float) -> graph_pb2.Graph:
    """GPT-2's Conv1D weights are [in, out]: x @ W + b. Params are named as in the checkpoint (no name_map)."""
    head_dim = hidden // heads
    g = GraphBuilder("gpt2_block")
    x, pos = g.input("x", (SEQ, hidden)), g.input("positions", (SEQ,), "i64")

    def conv1d(v: Value, prefix: str, n: int) -> Value:
        k = v.shape[-1]
        return g.add(g.matmul(v, g.param(f"{prefix}.weight", (k, n))), g.param(f"{prefix}.bias", (n,)))

    def norm(v: Value, prefix: str) -> Value:
        return g.layer_norm(v, g.param(f"{prefix}.weight", (hidden,)), g.param(f"{prefix}.bias", (hidden,)), eps)

    p = "transformer.h.0"
    qkv = conv1d(norm(x, f"{p}.ln_1"), f"{p}.attn.c_attn", 3 * hidden)
    q, k, v = (g.reshape(g.slice(qkv, 1, i * hidden, (i + 1) * hidden), (SEQ, heads, head_dim)) for i in range(3))
    a = g.reshape(g.attention(q, k, v, pos), (SEQ, hidden))
    x = g.add(x, conv1d(a, f"{p}.attn.c_proj", hidden))
    m = g.gelu(conv1d(norm(x, f"{p}.ln_2"), f"{p}.mlp.c_fc", 4 * hidden), approximate="tanh")
    g.output(g.add(x, conv1d(m, f"{p}.mlp.c_proj", hidden)))
    return g.build()


def _causal_mask(torch: Any) -> Any:
    return torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]


def test_llama_block_matches_transformers(client: ExecutorClient, model_root: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=100, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(model_root / "llama")
    theta = float(cfg.rope_parameters["rope_theta"])
    exe = client.compile(llama_block_graph(64, 4, 2, 96, cfg.rms_norm_eps, theta))
    layer = 1
    name_map = {name: f"model.layers.{layer}.{hf}.weight" for name, hf in LLAMA_NAMES.items()}
    assert sorted(exe.load_params("llama/model.safetensors", name_map, fmt="safetensors")) == sorted(LLAMA_NAMES)
    assert exe.finalize_params() == []

    x = torch.randn(1, SEQ, 64)
    positions = torch.arange(SEQ)[None]  # positions double as KV rows in `attention`, so a block without a cache starts at 0
    with torch.no_grad():
        cos_sin = model.model.rotary_emb(x, positions)
        mask = _causal_mask(torch)
        want = model.model.layers[layer](x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        want = (want[0] if isinstance(want, tuple) else want)[0].numpy()
    got = exe.run({"x": x[0].numpy(), "positions": positions[0].numpy()})[0]
    # f32 on both sides; the numpy backend computes rope in f64, so only rounding order differs
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    exe.release()


def test_gpt2_block_matches_transformers(client: ExecutorClient, model_root: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(n_layer=1, n_head=4, n_embd=64, vocab_size=100, n_positions=32,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(model_root / "gpt2")
    exe = client.compile(gpt2_block_graph(64, 4, cfg.layer_norm_epsilon))
    assert len(exe.load_params("gpt2")) == 12  # the HF directory; names as stored, no name_map
    assert exe.finalize_params() == []
    x = torch.randn(1, SEQ, 64)
    with torch.no_grad():
        want = model.transformer.h[0](x, attention_mask=_causal_mask(torch))
        want = (want[0] if isinstance(want, tuple) else want)[0].numpy()
    got = exe.run({"x": x[0].numpy(), "positions": np.arange(SEQ, dtype=np.int64)})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    exe.release()


# -- the trait's device methods ------------------------------------------------------------------------------
def test_reading_no_outputs_and_the_active_extent(client: ExecutorClient) -> None:
    """outputs set and empty reads none (the run still happens); an extent computes its rows alone: rows past it
    come back zero where the whole run has values."""
    g = GraphBuilder("bucketed")
    x, w = g.input("x", (8, 4)), g.param("w", (4, 4))
    g.output(g.reshape(g.reshape(g.matmul(x, w), (8, 2, 2)), (8, 4)))
    exe = client.compile(g.build())
    exe.set_param("w", randn(4, 4))
    xs = randn(8, 4)
    whole = exe.run({"x": xs})[0]
    assert exe.run({"x": xs * 2}, read_indices=[]) == []
    np.testing.assert_allclose(exe.read_output(0), whole * 2, rtol=1e-5, atol=1e-5)
    assert exe.set_active_extent((3, 8))
    cut = exe.run({"x": xs})[0]
    np.testing.assert_array_equal(cut[:3], whole[:3])
    assert not cut[3:].any() and np.abs(whole[3:]).min() > 0
    exe.release()


def test_resident_handles_staging_and_run_feed_handle(client: ExecutorClient) -> None:
    """PrepareResidentHandle and StageBoundHandles say no, changing nothing, where the backend has no device
    (numpy), and make handles the device's elsewhere; RunFeedHandle stores the output it returns, so runs
    accumulate through it."""
    device = client.capabilities().capabilities.resident_handles
    g = GraphBuilder("accumulate")
    state, other, x = g.input("state", (4, 8)), g.input("other", (4, 8)), g.input("x", (4, 8))
    g.output(g.add(g.add(state, x), other))
    exe = client.compile(g.build())
    assert exe.prepare_resident_handle("state") is device
    assert exe.has_handle("state") == ((True, True) if device else (False, False))
    if device:
        np.testing.assert_array_equal(exe.read_handle("state"), np.zeros((4, 8), np.float32))
    exe.bind_handle("other", np.zeros((4, 8), np.float32))
    assert exe.stage_bound_handles() == (["other"] if device else None)
    assert exe.has_handle("other") == (True, device)
    xs = [randn(4, 8) for _ in range(3)]
    for k, xi in enumerate(xs):
        got = exe.run_feed_handle({"x": xi}, "state", 0)
        np.testing.assert_allclose(got, sum(xs[:k + 1]), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(exe.read_handle("state"), got)
    assert exe.has_handle("state") == (True, device)
    with pytest.raises(errors.OutOfRange):
        exe.run_feed_handle({"x": xs[0]}, "state", 1)
    with pytest.raises(errors.NotFound):
        exe.prepare_resident_handle("nope")
    exe.release()


def test_an_executor_serves_with_the_fastest_installed_backend_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults hide no speed: torch where it is installed (it is here), numpy (the reference) only where nothing
    else is, and --backend still chooses."""
    import importlib.util

    from graphmesh_executor.server import parse_args

    assert parse_args(["--listen", "127.0.0.1:0"]).backend == "torch"
    assert parse_args(["--listen", "127.0.0.1:0", "--backend", "numpy"]).backend == "numpy"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # neither torch nor mlx is found
    assert parse_args(["--listen", "127.0.0.1:0"]).backend == "numpy"
