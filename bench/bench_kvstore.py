"""KV store CopyRows throughput between two executors on loopback, against bare grpcio streams of the same bytes.

CopyRows asks executor A to push a session's rows, with their token ids, straight into executor B
(StageService.PushSessionKv): one hop, the kvstore only orchestrates. A sends them over a link to B's boundary
link listener (graphmesh_executor/boundary_link.py: each layer's K and V sent from A's pool blocks in place, read
into B's), or into B's WriteSessionKv where B has no listener. The rows have
SmolLM2-135M's KV layout (30 layers x 2 x 192 f32 = 45 KiB per row) but come from a tiny random Llama with that
layout (hidden 192, 3 heads of 64, 30 layers), so nothing big is loaded; the session is filled with
WriteSessionKv, not a prefill. The bare references are three grpcio processes on raw bytes in the same 1 MiB
chunks: one hop (sink pulls from source: the topology of CopyRows) and two hops (source -> relay -> sink: the
topology CopyRows had when the kvstore relayed the rows). Every process is separate; prints a table and writes
bench/results/kvstore.json.

    .venv/bin/python bench/bench_kvstore.py [--rows 4000] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, `bench` is still importable

from bench.common import (
    MIB,
    args_or_bare_server,
    cpu_seconds,
    free_address,
    interleaved_medians,
    machine,
    progress,
    spawn,
    write_results,
)
from graphmesh import tensors
from graphmesh.channels import MESSAGE_OPTIONS
from graphmesh.kvstore_client import KvStoreClient
from graphmesh.v1 import stage_pb2, stage_pb2_grpc

LAYERS, HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M: 30 layers, 3 kv heads of 64
GOAL_MIB_S = 1024.0


# -- the bare grpcio processes -----------------------------------------------------------------------------
def _download(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    total = int.from_bytes(request, "little")
    data = bytes(total)
    for offset in range(0, total, tensors.CHUNK_BYTES):
        yield data[offset:offset + tensors.CHUNK_BYTES]


def _upload(chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    buf = np.empty(0, np.uint8)  # the sink keeps the bytes, as WriteSessionKv does
    parts = [np.frombuffer(c, np.uint8) for c in chunks]
    buf = np.concatenate(parts) if parts else buf
    return len(buf).to_bytes(8, "little")


def _pull(request: bytes, context: grpc.ServicerContext) -> bytes:
    """One hop: this process streams `total` bytes from the source."""
    source, total = request[8:].decode(), request[:8]
    with grpc.insecure_channel(source, MESSAGE_OPTIONS) as channel:
        download: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream("/bench.Bare/Download")
        received = sum(len(c) for c in download(total, timeout=600))
    return received.to_bytes(8, "little")


def _relay(request: bytes, context: grpc.ServicerContext) -> bytes:
    """Two hops: this process forwards the source's chunks into the sink as they arrive."""
    source, sink = request[8:].decode().split(",")
    with grpc.insecure_channel(source, MESSAGE_OPTIONS) as src, grpc.insecure_channel(sink, MESSAGE_OPTIONS) as dst:
        download: grpc.UnaryStreamMultiCallable[bytes, bytes] = src.unary_stream("/bench.Bare/Download")
        upload: grpc.StreamUnaryMultiCallable[bytes, bytes] = dst.stream_unary("/bench.Bare/Upload")
        return upload(download(request[:8], timeout=600), timeout=600)


BARE: dict[str, grpc.RpcMethodHandler[Any, Any]] = {  # the bare server's methods (args_or_bare_server)
    "Download": grpc.unary_stream_rpc_method_handler(_download),
    "Upload": grpc.stream_unary_rpc_method_handler(_upload),
    "Pull": grpc.unary_unary_rpc_method_handler(_pull),
    "Relay": grpc.unary_unary_rpc_method_handler(_relay),
}


# -- helpers ----------------------------------------------------------------------------------------------
def write_model(path: Path, max_rows: int) -> Path:
    """A random Llama with SmolLM2-135M's KV layout and nothing else of its size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=HEADS * HEAD_DIM, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=64,
                         max_position_embeddings=max_rows, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


# -- the measurement ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4000, help="rows of the copied session")
    p.add_argument("--runs", type=int, default=5, help="runs of each measurement (median)")
    p.add_argument("--backend", default="torch", help="the executors' backend (the rows live in its KV pool)")
    a = args_or_bare_server(p, argv, "bench.Bare", BARE)
    load = os.getloadavg()  # other processes on a small machine move these numbers: recorded with them
    kv_dim = HEADS * HEAD_DIM
    rows = np.random.default_rng(0).standard_normal((a.rows, LAYERS, 2, kv_dim)).astype(np.float32)
    size_mib = rows.nbytes / MIB
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_model(root / "kv-smollm2-layout", 2 * a.rows)
        addresses = {name: free_address() for name in ("a", "b", "kvstore", "source", "relay", "sink")}
        progress(f"starting 2 executors, the kvstore and 3 bare grpcio servers; load average {load}")
        processes = {n: spawn([sys.executable, "-m", "graphmesh_executor.server", "--listen", addresses[n], "--backend",
                               a.backend, "--model-root", str(root), "--kv-cache-bytes", str(3 * rows.nbytes),
                               # as LocalMesh starts them: executors sharing a machine must not oversubscribe it
                               "--threads", str(max(1, (os.cpu_count() or 2) // 2))],
                              addresses[n]) for n in ("a", "b")}
        processes["kvstore"] = spawn([sys.executable, "-m", "graphmesh_kvstore.server", "--listen", addresses["kvstore"]],
                                     addresses["kvstore"])
        processes |= {n: spawn([sys.executable, __file__, "--bare-server", addresses[n]], addresses[n])
                      for n in ("source", "relay", "sink")}
        try:
            result, cpu = measure(a, addresses, rows, {n: processes[n].pid for n in ("a", "b", "kvstore")})
        finally:
            for process in processes.values():
                process.terminate()
                process.wait(timeout=10)

    ours, one_hop, two_hops = (size_mib / s for s in result)
    print(f"\nCopyRows of {a.rows} rows x {LAYERS} layers x 2 x {kv_dim} f32 = {size_mib:.1f} MiB "
          f"(median of {a.runs}; MiB/s):")
    print(f"  {'graphmesh CopyRows (A -> B, asked by the kvstore)':<48} {ours:>8.0f}   goal >= {GOAL_MIB_S:.0f}")
    print(f"  {'bare grpcio, one hop (source -> sink)':<48} {one_hop:>8.0f}   ours / bare = {ours / one_hop:.2f}")
    print(f"  {'bare grpcio, two hops (source -> relay -> sink)':<48} {two_hops:>8.0f}   ours / bare = "
          f"{ours / two_hops:.2f}")
    print(f"\nCPU seconds of one copy (the machine's cores bound the sum): executor A {cpu['a']:.2f}, "
          f"kvstore {cpu['kvstore']:.2f}, executor B {cpu['b']:.2f}")
    write_results("kvstore.json", {
        "machine": machine(load),
        "what": "a tiny random Llama with SmolLM2-135M's KV layout; session filled by WriteSessionKv",
        "rows": a.rows, "layers": LAYERS, "kv_dim": kv_dim, "bytes": rows.nbytes, "runs": a.runs,
        "chunk_bytes": tensors.CHUNK_BYTES, "goal_mib_per_s": GOAL_MIB_S,
        "copy_rows_mib_per_s": ours, "bare_one_hop_mib_per_s": one_hop, "bare_two_hops_mib_per_s": two_hops,
        "copy_rows_s": result[0], "bare_one_hop_s": result[1], "bare_two_hops_s": result[2],
        "cpu_s_of_one_copy": {"executor_a": cpu["a"], "kvstore": cpu["kvstore"], "executor_b": cpu["b"]}})


def measure(a: argparse.Namespace, addresses: dict[str, str], rows: np.ndarray,
            pids: dict[str, int]) -> tuple[list[float], dict[str, float]]:
    """Median seconds of CopyRows and of the bare one-hop and two-hop streams, and the CPU seconds each of our
    processes spent on one copy."""
    channels = {n: grpc.insecure_channel(addresses[n], MESSAGE_OPTIONS) for n in ("a", "b", "relay", "sink")}
    stages = {n: stage_pb2_grpc.StageServiceStub(channels[n]) for n in ("a", "b")}
    for stub in stages.values():
        spec = stage_pb2.StageSpec(model="kv-smollm2-layout", layer_start=0, layer_end=LAYERS, first=True, last=True)
        stub.Install(stage_pb2.InstallRequest(incarnation=1, rank=0, world_size=1, stage=spec), timeout=300)

    def header(session: str) -> stage_pb2.FencingHeader:
        return stage_pb2.FencingHeader(incarnation=1, session_id=session)

    def fill() -> Iterator[stage_pb2.WriteSessionKvRequest]:
        for i, chunk in enumerate(tensors.to_chunks("kv", rows)):
            request = stage_pb2.WriteSessionKvRequest()
            if i == 0:
                request.header.CopyFrom(header("source"))
            request.rows.CopyFrom(chunk)
            yield request

    stages["a"].WriteSessionKv(fill(), timeout=600)
    progress(f"session of {a.rows} rows ({rows.nbytes / MIB:.1f} MiB) on executor A; {a.runs} runs each")
    total = rows.nbytes.to_bytes(8, "little")
    pull: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channels["sink"].unary_unary("/bench.Bare/Pull")
    relay: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channels["relay"].unary_unary("/bench.Bare/Relay")
    copies = [0]
    with KvStoreClient(addresses["kvstore"], timeout=600) as client:
        client.register_executors([addresses["a"], addresses["b"]])  # as a coordinator does at install

        def copy_rows() -> None:
            session = f"copy-{copies[0]}"
            copies[0] += 1
            nbytes, _ = client.copy_rows(addresses["a"], "source", 1, addresses["b"], session, 1, 0, len(rows))
            assert nbytes == rows.nbytes
            stages["b"].ReleaseSession(stage_pb2.ReleaseSessionRequest(header=header(session)), timeout=60)

        def bare_one_hop() -> None:
            assert pull(total + addresses["source"].encode(), timeout=600) == total

        def bare_two_hops() -> None:
            assert relay(total + f"{addresses['source']},{addresses['sink']}".encode(), timeout=600) == total

        result = interleaved_medians([copy_rows, bare_one_hop, bare_two_hops], a.runs)
        # the copy must be exact, not only fast
        last = f"copy-{copies[0]}"
        before = {n: cpu_seconds(pid) for n, pid in pids.items()}
        client.copy_rows(addresses["a"], "source", 1, addresses["b"], last, 1, 0, len(rows))
        cpu = {n: cpu_seconds(pid) - before[n] for n, pid in pids.items()}
        got = tensors.assemble(c.chunk for c in stages["b"].ReadSessionKv(stage_pb2.ReadSessionKvRequest(
            header=header(last), from_row=0, to_row=len(rows)), timeout=600))[0][1]
        np.testing.assert_array_equal(got, rows)
    for channel in channels.values():
        channel.close()
    return result, cpu


if __name__ == "__main__":
    main()
