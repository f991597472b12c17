"""The KV store as a real process on loopback: blocks through the client, bad input, restarts with --dir, and
seeding / copying KV rows between two real executor processes that hold a tiny Llama."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from graphmesh import kvkeys, tensors
from graphmesh.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted, Unavailable
from graphmesh.kvstore_client import KvStoreClient
from graphmesh.launcher import free_port
from graphmesh.v1 import kvstore_pb2, kvstore_pb2_grpc, stage_pb2, stage_pb2_grpc, tensor_pb2
from tests.conftest import executor_args, start_process
from tests.model_fixtures import make_tiny_llama

LAYERS, KV_DIM, BT = 2, 8, 16
NS = kvkeys.namespace("sha256:service-test", 0, LAYERS, KV_DIM)


def kvstore_args(address: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "graphmesh_kvstore.server", "--listen", address, *extra]


@pytest.fixture(scope="module")
def kvstore(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    directory = tmp_path_factory.mktemp("kvstore")
    with start_process(kvstore_args(address, "--dir", str(directory / "blocks"), "--max-put-bytes", "1Mi"), address,
                       log_path=directory / "kvstore.log"):
        yield address


def rows_for(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, LAYERS, 2, KV_DIM)).astype(np.float32)


def test_blocks_through_the_client(kvstore: str) -> None:
    tokens = list(range(5000, 5040))  # 2 whole blocks and 8 tokens
    rows = rows_for(32)
    with KvStoreClient(kvstore) as client:
        assert client.put_blocks(NS, tokens, 0, rows, incarnation=3, epoch=1) == (2, 0)
        assert client.put_blocks(NS, tokens, 0, rows) == (0, 2)
        assert client.lookup(NS, tokens) == 32
        assert client.lookup(NS, tokens[:16] + [1] * 16) == 16
        np.testing.assert_array_equal(client.get_blocks(NS, tokens), rows)
        np.testing.assert_array_equal(client.get_blocks(NS, tokens, max_tokens=20), rows[:16])
        assert client.get_blocks(NS, [7] * 16).shape == (0, LAYERS, 2, KV_DIM)
        s = client.stats()
        assert s.blocks >= 2 and s.disk_bytes > 0 and s.memory_bytes >= rows.nbytes
        assert s.lookups >= 5 and s.hit_tokens >= 32 + 16 + 32 + 16 and s.miss_tokens >= 8
        other = kvkeys.namespace("sha256:other", 0, LAYERS, KV_DIM)
        client.put_blocks(other, tokens, 0, rows)
        assert client.evict(other) == 2 * LAYERS  # entries: one per block and layer
        assert (client.lookup(other, tokens), client.lookup(NS, tokens)) == (0, 32)


def test_bad_inputs_get_status_codes_and_the_server_keeps_serving(kvstore: str) -> None:
    tokens = list(range(32))
    with KvStoreClient(kvstore) as client:
        before = client.stats().blocks
        with pytest.raises(InvalidArgument, match=r"should be f32\[32, 2, 2, 8\]"):
            client.put_blocks(NS, tokens, 0, rows_for(32)[:, :, :1])
        with pytest.raises(InvalidArgument, match=r"rows f64\[32, 2, 2, 8\] should be f32"):
            client.put_blocks(NS, tokens, 0, rows_for(32).astype(np.float64))
        with pytest.raises(InvalidArgument, match="token_ids has 20 tokens"):
            client.put_blocks(NS, tokens[:20], 0, rows_for(32))
        with pytest.raises(InvalidArgument, match="block_count is 0"):
            client.put_blocks(NS, tokens, 0, rows_for(8))
        with pytest.raises(InvalidArgument, match="differs from this store's 16"):
            client.lookup(kvkeys.namespace("m", 0, LAYERS, KV_DIM, block_tokens=8), tokens)
        with pytest.raises(InvalidArgument, match="model_identity is empty"):
            client.get_blocks(kvstore_pb2.KvNamespace(), tokens)
        wide = kvkeys.namespace("m", 0, LAYERS, 1 << 14)  # 4 MiB per block, over --max-put-bytes 1Mi
        with pytest.raises(ResourceExhausted, match="exceeds the limit"):
            client.put_blocks(wide, tokens[:16], 0, np.zeros((16, LAYERS, 2, 1 << 14), np.float32))
        assert client.stats().blocks == before
    # a stream that breaks the chunk protocol, straight through the stub
    with grpc.insecure_channel(kvstore) as channel:
        stub = kvstore_pb2_grpc.KvStoreServiceStub(channel)
        first = kvstore_pb2.PutBlocksRequest(namespace=NS, token_ids=tokens[:16], block_count=1,
                                             rows=tensor_pb2.TensorChunk(name="rows", dtype=tensor_pb2.DTYPE_F32,
                                                                         shape=[16, LAYERS, 2, KV_DIM], data=b"\0" * 8))
        gap = kvstore_pb2.PutBlocksRequest(rows=tensor_pb2.TensorChunk(offset_bytes=64, data=b"\0" * 8))
        with pytest.raises(grpc.RpcError) as e:
            stub.PutBlocks(iter([first, gap]), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "offset 64, expected 8" in (e.value.details() or "")
        with pytest.raises(grpc.RpcError) as e:
            stub.PutBlocks(iter([]), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with KvStoreClient(kvstore) as client:
        assert client.stats().blocks == before
        assert client.put_blocks(NS, list(range(900, 916)), 0, rows_for(16)) == (1, 0)


def test_a_restarted_store_keeps_its_blocks(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    args = kvstore_args(address, "--dir", str(tmp_path / "blocks"), "--capacity-bytes", "64Ki")
    tokens, rows = list(range(64)), rows_for(64, seed=5)
    with start_process(args, address, log_path=tmp_path / "first.log"), KvStoreClient(address) as client:
        assert client.put_blocks(NS, tokens, 0, rows) == (4, 0)
    with start_process(args, address, log_path=tmp_path / "second.log"), KvStoreClient(address) as client:
        s = client.stats()
        assert (s.blocks, s.memory_bytes) == (4 * LAYERS, 0)  # an entry per block and layer
        assert client.lookup(NS, tokens) == 64
        np.testing.assert_array_equal(client.get_blocks(NS, tokens), rows)


# -- seeding and copying between two executors ----------------------------------------------------------------

PROMPT = [(7 * i + 3) % 1000 for i in range(40)]  # 2 whole blocks of 16 and 8 more tokens
INCARNATION = 1


class Stage:
    def __init__(self, address: str, log: Path) -> None:
        self.address = address
        self.log = log  # the executor process's log
        self.channel = grpc.insecure_channel(address)
        self.stub = stage_pb2_grpc.StageServiceStub(self.channel)

    def header(self, session: str, epoch: int = 0, incarnation: int = INCARNATION) -> stage_pb2.FencingHeader:
        return stage_pb2.FencingHeader(incarnation=incarnation, session_id=session, epoch=epoch)

    def prefill(self, session: str, epoch: int, start: int, token_ids: list[int]) -> int:
        row = stage_pb2.StepRow(session_id=session, epoch=epoch, start_position=start, token_ids=token_ids,
                                sampling=stage_pb2.SamplingParams(temperature=0))
        response = self.stub.ExecuteStep(stage_pb2.ExecuteStepRequest(
            incarnation=INCARNATION, step_id=epoch, rows=[row], output=stage_pb2.OUTPUT_KIND_TOKEN), timeout=60)
        self.stub.Commit(stage_pb2.CommitRequest(header=self.header(session, epoch)), timeout=10)
        return int(response.rows[0].token)

    def read(self, session: str, from_row: int, to_row: int) -> np.ndarray:
        chunks = self.stub.ReadSessionKv(stage_pb2.ReadSessionKvRequest(header=self.header(session), from_row=from_row,
                                                                        to_row=to_row), timeout=30)
        return tensors.assemble(c.chunk for c in chunks)[0][1]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The executors' --model-root, holding the tiny Llama."""
    root = tmp_path_factory.mktemp("executor-models")
    make_tiny_llama(root / "tiny-llama")
    return root


def install(stage: Stage, kvstore: str) -> str:
    """Installs the whole tiny Llama as the executor's one stage; returns its model identity."""
    spec = stage_pb2.StageSpec(model="tiny-llama", layer_start=0, layer_end=2, first=True, last=True,
                               kvstore_address=kvstore)
    return stage.stub.Install(stage_pb2.InstallRequest(incarnation=INCARNATION, rank=0, world_size=1, stage=spec),
                              timeout=60).model_identity


@pytest.fixture(scope="module")
def executors(tmp_path_factory: pytest.TempPathFactory, kvstore: str,
              tiny_llama: Path) -> Iterator[tuple[Stage, Stage, str]]:
    """Two executor processes with the same 1-stage tiny Llama, writing committed blocks behind to `kvstore`;
    yields both and the model identity."""
    logs = tmp_path_factory.mktemp("executor-logs")
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    env = {"OMP_NUM_THREADS": "1"}
    with start_process(executor_args(addresses[0], "--model-root", str(tiny_llama)), addresses[0],
                       log_path=logs / "a.log", env=env), \
         start_process(executor_args(addresses[1], "--model-root", str(tiny_llama)), addresses[1],
                       log_path=logs / "b.log", env=env):
        stages = [Stage(a, logs / f"{name}.log") for a, name in zip(addresses, "ab")]
        identities = {install(stage, kvstore) for stage in stages}
        assert len(identities) == 1
        with KvStoreClient(kvstore) as client:  # the coordinator's part: the store moves rows only between these
            client.register_executors(addresses)
        yield stages[0], stages[1], identities.pop()
        for stage in stages:
            stage.channel.close()


def wait_for_blocks(client: KvStoreClient, ns: kvstore_pb2.KvNamespace, token_ids: list[int], tokens: int) -> None:
    """Write-behind is asynchronous: polls until the store has the prefix."""
    deadline = time.monotonic() + 30
    while client.lookup(ns, token_ids) < tokens:
        assert time.monotonic() < deadline, f"the executor never wrote {tokens} tokens of blocks behind"
        time.sleep(0.05)


def test_copy_rows_and_seed_between_executors(kvstore: str, executors: tuple[Stage, Stage, str]) -> None:
    a, b, identity = executors
    token = a.prefill("s", 1, 0, PROMPT)
    rows_a = a.read("s", 0, len(PROMPT))
    assert rows_a.shape == (40, 2, 2, 32)
    with KvStoreClient(kvstore) as client:
        nbytes, ms = client.copy_rows(a.address, "s", INCARNATION, b.address, "copied", INCARNATION, 0, len(PROMPT))
        assert nbytes == rows_a.nbytes and ms > 0
        np.testing.assert_array_equal(b.read("copied", 0, len(PROMPT)), rows_a)
        # straight into B's buffer over a link (boundary_link.KvLink), not a WriteSessionKv stream
        assert "row copy taken over a link" in b.log.read_text()
        # a copy lands at the same rows: the next rows continue the session on the destination
        np.testing.assert_array_equal(b.read("copied", 8, 24), rows_a[8:24])

        ns = kvkeys.namespace(identity, 0, 2, 32)
        # The copy went executor -> executor with the token ids: the migrated session goes on writing its blocks
        # behind, including block 2, whose rows 32..40 were copied and 40..48 computed on B.
        more = [(5 * i + 1) % 1000 for i in range(24)]
        b.prefill("copied", 1, len(PROMPT), more)
        wait_for_blocks(client, ns, PROMPT + more, 64)
        np.testing.assert_array_equal(client.get_blocks(ns, PROMPT + more)[32:], b.read("copied", 32, 64))
        wait_for_blocks(client, ns, PROMPT, 32)
        seeded, nbytes, ms = client.seed_executor(ns, PROMPT, b.address, INCARNATION, "seeded")
        assert (seeded, nbytes) == (32, rows_a[:32].nbytes)
        np.testing.assert_array_equal(b.read("seeded", 0, 32), rows_a[:32])
        # remote equals local: B prefills only the rest and reaches A's rows and next token
        assert b.prefill("seeded", 1, 32, PROMPT[32:]) == token
        np.testing.assert_allclose(b.read("seeded", 32, 40), rows_a[32:], rtol=1e-5, atol=1e-6)

        seeded, _, _ = client.seed_executor(ns, PROMPT, b.address, INCARNATION, "capped", max_tokens=20)
        assert seeded == 16

        # every stage of a session in one call, written in parallel, to the prefix all of them have
        seeded, nbytes, ms = client.seed_stages([(ns, a.address), (ns, b.address)], PROMPT, INCARNATION, "both")
        assert (seeded, nbytes) == (32, 2 * rows_a[:32].nbytes) and ms > 0
        for stage in (a, b):
            np.testing.assert_array_equal(stage.read("both", 0, 32), rows_a[:32])
        unknown = kvkeys.namespace("sha256:nothing-stored", 0, 2, 32)
        assert client.seed_stages([(ns, a.address), (unknown, b.address)], PROMPT, INCARNATION, "none")[0] == 0
        for stage in (a, b):  # nothing was written anywhere
            with pytest.raises(grpc.RpcError) as missing:
                stage.read("none", 0, 16)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        s = client.stats()
        assert s.copy_bytes_per_s > 0 and s.seed_bytes_per_s > 0


def test_executor_failures_name_the_executor(kvstore: str, executors: tuple[Stage, Stage, str]) -> None:
    a, b, identity = executors
    a.prefill("f", 1, 0, PROMPT[:20])
    with KvStoreClient(kvstore) as client:
        with pytest.raises(FailedPrecondition, match=f"executor {a.address} failed PushSessionKv") as e:
            client.copy_rows(a.address, "f", INCARNATION + 5, b.address, "f-copy", INCARNATION, 0, 20)
        assert e.value.reason == "STALE_INCARNATION" and e.value.metadata["executor"] == a.address
        with pytest.raises(FailedPrecondition, match=f"executor {b.address} failed WriteSessionKv"):
            client.copy_rows(a.address, "f", INCARNATION, b.address, "f-copy", INCARNATION + 5, 0, 20)
        # the failed copies left nothing behind: a good copy into the same session starts at row 0
        assert client.copy_rows(a.address, "f", INCARNATION, b.address, "f-copy", INCARNATION, 0, 20)[0] > 0
        gone = f"127.0.0.1:{free_port()}"
        with pytest.raises(PermissionDenied, match=f"{gone} is not a registered executor") as denied:
            client.copy_rows(a.address, "f", INCARNATION, gone, "x", INCARNATION, 0, 20)
        assert denied.value.reason == "UNREGISTERED_EXECUTOR"
        client.register_executors([a.address, b.address, gone])
        try:
            with pytest.raises(Unavailable, match=f"executor {gone} failed WriteSessionKv"):
                client.copy_rows(a.address, "f", INCARNATION, gone, "x", INCARNATION, 0, 20)
        finally:
            client.register_executors([a.address, b.address])
        ns = kvkeys.namespace(identity, 0, 2, 32)
        wait_for_blocks(client, ns, PROMPT, 16)
        # seeding writes at row 0: a session that already has rows refuses it
        with pytest.raises(FailedPrecondition, match=f"executor {b.address} failed WriteSessionKv"):
            client.seed_executor(ns, PROMPT, b.address, INCARNATION, "f-copy")
        with pytest.raises(InvalidArgument, match="reversed"):
            client.copy_rows(a.address, "f", INCARNATION, b.address, "y", INCARNATION, 10, 5)


LINKED = "row copy taken over a link"  # what an executor logs for every copy or seed it takes over a link


def test_a_seed_goes_over_a_link_where_the_executor_has_one_else_as_a_stream(
        tmp_path: Path, kvstore: str, tiny_llama: Path, executors: tuple[Stage, Stage, str]) -> None:
    a, b, identity = executors
    ns = kvkeys.namespace(identity, 0, 2, 32)
    prompt = [(11 * i + 5) % 1000 for i in range(40)]
    cold = a.prefill("cold", 1, 0, prompt)  # computes all 40 rows and writes its 2 whole blocks behind
    rows = a.read("cold", 0, 32)
    c = Stage(f"127.0.0.1:{free_port()}", tmp_path / "c.log")
    with KvStoreClient(kvstore) as client, \
         start_process(executor_args(c.address, "--model-root", str(tiny_llama), "--boundary-link-port", "off"),
                       c.address, log_path=c.log, env={"OMP_NUM_THREADS": "1"}):
        assert install(c, kvstore) == identity
        client.register_executors([a.address, b.address, c.address])
        try:
            wait_for_blocks(client, ns, prompt, 32)
            before = {s.address: s.log.read_text().count(LINKED) for s in (a, b)}
            # a and b take their rows over links, c (no listener) as a WriteSessionKv stream, in one call
            seeded, nbytes, _ = client.seed_stages([(ns, a.address), (ns, b.address), (ns, c.address)], prompt,
                                                   INCARNATION, "warm")
            assert (seeded, nbytes) == (32, 3 * rows.nbytes)
            for s in (a, b):
                assert s.log.read_text().count(LINKED) == before[s.address] + 1, s.address
            assert LINKED not in c.log.read_text()
            for s in (a, b, c):
                np.testing.assert_array_equal(s.read("warm", 0, 32), rows)  # exact: the stored bits, every row
                # and the rest of the prompt computed on the seeded rows gives the cold run's token
                assert s.prefill("warm", 1, 32, prompt[32:]) == cold, s.address
            # SeedExecutor takes the same ways, one stage at a time
            for s in (b, c):
                assert client.seed_executor(ns, prompt, s.address, INCARNATION, "warm-one")[0] == 32
                np.testing.assert_array_equal(s.read("warm-one", 0, 32), rows)
            assert b.log.read_text().count(LINKED) == before[b.address] + 2
            assert LINKED not in c.log.read_text()
        finally:
            client.register_executors([a.address, b.address])
            c.channel.close()
