"""The kvstore's shared tier on a real Redis-protocol server (valkey-server or redis-server, started on a free
loopback port): replicas share blocks, a bad value is a miss, an outage is misses and never a failed request,
and restores after a re-plan (a different layer split) are served from the store with identical tokens."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from graphmesh import kvkeys, security
from graphmesh.coordinator_client import CoordinatorClient
from graphmesh.kvstore_client import KvStoreClient
from graphmesh.launcher import LocalMesh, free_port
from graphmesh.v1 import kvstore_pb2
from graphmesh_kvstore.shared import DEFAULT_PREFIX, SharedTier
from graphmesh_kvstore.store import Store
from graphmesh_server import faults
from tests.conftest import start_process
from tests.model_fixtures import make_tiny_llama
from tests.streams import run_streams

BT, LAYERS, KV_DIM = 4, 2, 8
NS = kvkeys.namespace("sha256:redis-test", 0, LAYERS, KV_DIM, block_tokens=BT)


def _binary() -> str:
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        why = "neither valkey-server nor redis-server is installed (`make redis-server` installs one)"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI installs it through the Makefile: a missing server there is a broken setup
        pytest.skip(why)
    return found


class RedisServer:
    """One server process on a fixed loopback port, which can be stopped, frozen and started again there."""

    def __init__(self, directory: Path) -> None:
        self.binary = _binary()
        self.port = free_port()
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        # no persistence: a restart comes back empty, like a Redis that lost its data
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(self.directory)]
        with open(self.directory / "server.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        client = self.client()
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return self
            except redis.RedisError:
                assert self.process.poll() is None, (self.directory / "server.log").read_text()
                assert time.monotonic() < deadline, "the Redis server never answered PING"
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def freeze(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.thaw()
            self.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield s
    s.stop()


@pytest.fixture
def fresh(server: RedisServer) -> RedisServer:
    server.client().flushall()
    return server


def rows_for(tokens: list[int], layers: int = LAYERS, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((len(tokens), layers, 2, KV_DIM)).astype(np.float32) + \
        np.asarray(tokens, np.float32)[:, None, None, None]


def replica(url: str, **kwargs: Any) -> Store:
    """A kvstore's Store on the shared tier, with a memory tier of its own."""
    return Store(1 << 20, shared=SharedTier(url, **kwargs))


def entry_names(ns: kvstore_pb2.KvNamespace, tokens: list[int]) -> list[list[str]]:
    tier = SharedTier("redis://unused")
    space = kvkeys.root(ns)
    return [[tier.name(space, ns.layer_start + j, k) for j, k in enumerate(ks)] for ks in kvkeys.layer_keys(ns, tokens)]


# -- the store on the shared tier --------------------------------------------------------------------------------


def test_two_replicas_on_one_redis_share_blocks_under_any_layer_split(fresh: RedisServer) -> None:
    a, b = replica(fresh.url), replica(fresh.url)
    tokens = list(range(100, 110))  # 2 whole blocks and 2 tokens
    rows = rows_for(tokens)
    assert a.put_blocks(NS, tokens, 0, 2, rows[:8]) == (2, 0)
    assert b.lookup(NS, tokens) == 8
    np.testing.assert_array_equal(b.get_blocks(NS, tokens), rows[:8])
    s = b.stats()
    assert s.shared_configured and s.shared_up and s.shared_hit_blocks == 2 * LAYERS  # fetched once, then memory
    assert b.put_blocks(NS, tokens, 0, 2, rows[:8]) == (0, 2)  # B holds them now
    c = replica(fresh.url)
    assert c.put_blocks(NS, tokens, 0, 2, rows[:8] + 1) == (0, 2)  # only in Redis: still present, first rows kept
    np.testing.assert_array_equal(c.get_blocks(NS, tokens), rows[:8])
    one = kvkeys.namespace("sha256:redis-test", 1, 2, KV_DIM, block_tokens=BT)  # a stage of another split
    np.testing.assert_array_equal(replica(fresh.url).get_blocks(one, tokens), rows[:8, 1:2])
    assert replica(fresh.url).lookup(kvkeys.namespace("sha256:other", 0, LAYERS, KV_DIM, block_tokens=BT), tokens) == 0


@pytest.mark.parametrize("damage", ["flip", "torn", "misplaced", "foreign"])
def test_a_bad_value_in_redis_is_a_miss_and_is_dropped(fresh: RedisServer, damage: str) -> None:
    tokens = list(range(200, 212))  # 3 blocks
    rows = rows_for(tokens)
    replica(fresh.url).put_blocks(NS, tokens, 0, 3, rows)
    names = entry_names(NS, tokens)
    r = fresh.client()
    victim = names[1][1]  # layer 1 of block 1
    value = r.get(victim)
    assert isinstance(value, bytes)
    if damage == "flip":
        value = value[:-5] + bytes([value[-5] ^ 1]) + value[-4:]  # one bit of one float
    elif damage == "torn":
        value = value[: len(value) // 2]
    elif damage == "misplaced":  # a whole, checksummed entry, stored under another entry's name
        value = r.get(names[1][0])
        assert isinstance(value, bytes)
    else:  # a checksummed entry of another model, written under this name
        other = kvkeys.namespace("sha256:another-model", 0, LAYERS, KV_DIM, block_tokens=BT)
        replica(fresh.url).put_blocks(other, tokens, 0, 3, rows)
        value = r.get(entry_names(other, tokens)[1][1])
        assert isinstance(value, bytes)
    r.set(victim, value)
    b = replica(fresh.url)
    assert b.lookup(NS, tokens) == 4  # the prefix ends before the bad entry's block
    np.testing.assert_array_equal(b.get_blocks(NS, tokens), rows[:4])
    assert b.stats().corrupt_blocks == 1 and r.exists(victim) == 0
    replica(fresh.url).put_blocks(NS, tokens, 0, 3, rows)  # a later write-behind heals the hole
    np.testing.assert_array_equal(replica(fresh.url).get_blocks(NS, tokens), rows)


def test_a_ttl_or_redis_eviction_bounds_the_tier_and_is_a_miss(fresh: RedisServer) -> None:
    tokens = list(range(300, 308))
    replica(fresh.url, ttl_s=30).put_blocks(NS, tokens, 0, 2, rows_for(tokens))
    r = fresh.client()
    for name in (n for ns in entry_names(NS, tokens) for n in ns):
        assert 0 < int(r.pttl(name)) <= 30_000
    r.delete(entry_names(NS, tokens)[1][0])  # as maxmemory eviction would
    assert replica(fresh.url).lookup(NS, tokens) == 4


@pytest.mark.serial
def test_redis_down_or_frozen_is_misses_and_hits_resume_when_it_is_back(tmp_path: Path) -> None:
    own = RedisServer(tmp_path).start()
    try:
        tokens = list(range(400, 408))
        rows = rows_for(tokens)
        replica(own.url).put_blocks(NS, tokens, 0, 2, rows)
        for outage in (own.freeze, own.kill):
            outage()
            b = replica(own.url, timeout_s=0.2, retry_s=0.5)
            t0 = time.monotonic()
            assert b.lookup(NS, tokens) == 0
            assert b.put_blocks(NS, list(range(500, 504)), 0, 1, rows[:4]) == (1, 0)  # kept in memory
            assert b.lookup(NS, tokens) == 0  # down: skipped without another timeout
            assert time.monotonic() - t0 < 1.0
            s = b.stats()
            assert s.shared_configured and not s.shared_up and s.shared_errors >= 1
            if outage == own.freeze:
                own.thaw()
                time.sleep(0.6)  # past retry_s: the next call tries again
                assert b.lookup(NS, tokens) == 8 and b.stats().shared_up
        own.start()  # back on the same port, empty (no persistence)
        time.sleep(0.6)
        assert b.lookup(NS, tokens) == 0
        assert b.put_blocks(NS, tokens, 0, 2, rows) == (2, 0)
        assert replica(own.url).lookup(NS, tokens) == 8  # hits resume for every replica
    finally:
        own.stop()


# -- kvstore processes and meshes on the shared tier -------------------------------------------------------------


def kvstore_args(address: str, url: str) -> list[str]:
    return [sys.executable, "-m", "graphmesh_kvstore.server", "--listen", address, "--redis-url", url]


def test_two_kvstore_processes_share_a_prefix(fresh: RedisServer, tmp_path: Path) -> None:
    ns = kvkeys.namespace("sha256:replicas", 0, LAYERS, KV_DIM)
    tokens = list(range(40))
    rows = np.random.default_rng(1).standard_normal((32, LAYERS, 2, KV_DIM)).astype(np.float32)
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    with start_process(kvstore_args(a, fresh.url), a, log_path=tmp_path / "a.log"), \
         start_process(kvstore_args(b, fresh.url), b, log_path=tmp_path / "b.log"), \
         KvStoreClient(a) as client_a, KvStoreClient(b) as client_b:
        assert client_a.put_blocks(ns, tokens, 0, rows) == (2, 0)
        assert client_b.lookup(ns, tokens) == 32
        np.testing.assert_array_equal(client_b.get_blocks(ns, tokens), rows)
        s = client_b.stats()
        assert (s.shared_configured, s.shared_up, s.shared_hit_blocks) == (True, True, 2 * LAYERS)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 layers, so that 2 and 3 stages split them differently."""
    return make_tiny_llama(tmp_path_factory.mktemp("llama6"), seed=5, max_position=512, layers=6)


def _mesh(executors: int, model: Path, url: str) -> LocalMesh:
    return LocalMesh(executors, "numpy", str(model), extra_kvstore_args=("--redis-url", url),
                     extra_executor_args=("--kv-cache-bytes", "8Mi"))


@pytest.fixture(scope="module")
def mesh3(server: RedisServer, model: Path) -> Iterator[LocalMesh]:
    with _mesh(3, model, server.url) as m:
        yield m


def _store_stats(mesh: LocalMesh) -> kvstore_pb2.StatsResponse:
    with KvStoreClient(mesh.kvstore_address, metadata=security.mesh_metadata(mesh.mesh_token)) as kv:
        return kv.stats()


def _generate(mesh: LocalMesh, prompt: list[int], tokens: int = 8, seed: int = 0) -> tuple[list[int], int]:
    with CoordinatorClient(mesh.coordinator_address) as client:
        chunks = list(client.generate(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=True, temperature=0.8,
                                      top_k=50, seed=seed))
    return [t for c in chunks for t in c.token_ids], chunks[0].prefill_computed_tokens


def _wait_for_entries(r: redis.Redis, entries: int) -> None:
    deadline = time.monotonic() + 30
    while len(list(r.scan_iter(match=DEFAULT_PREFIX + "*", count=1000))) < entries:
        assert time.monotonic() < deadline, "the write-behind never reached Redis"
        time.sleep(0.05)


def test_a_prefix_written_under_two_stages_is_seeded_under_three_and_a_corrupt_one_is_recomputed(
        fresh: RedisServer, model: Path, mesh3: LocalMesh) -> None:
    prompt = [(11 * i + 7) % 1000 for i in range(51)]  # 3 whole blocks of 16 and 3 tokens
    other = [(13 * i + 5) % 1000 for i in range(51)]
    with _mesh(2, model, fresh.url) as two:
        first, computed = _generate(two, prompt)
        first_other, _ = _generate(two, other)
        assert computed == len(prompt)
        _wait_for_entries(fresh.client(), 2 * 3 * 6)  # 2 prompts, 3 blocks (at least), 6 layers
    r = fresh.client()
    # mesh3: another kvstore process, 3 stages splitting the 6 layers differently, on the same Redis
    again, computed = _generate(mesh3, prompt)
    assert again == first and computed == len(prompt) - 48
    for name in r.scan_iter(match=DEFAULT_PREFIX + "*", count=1000):  # every stored value, one bit each
        value = r.get(name)
        assert isinstance(value, bytes)
        r.set(name, value[:-1] + bytes([value[-1] ^ 0x10]))
    corrupt = _store_stats(mesh3).corrupt_blocks
    again_other, computed = _generate(mesh3, other)  # never read by mesh3's kvstore: only Redis has it
    assert again_other == first_other and computed == len(other)
    assert _store_stats(mesh3).corrupt_blocks > corrupt


SESSIONS, PROMPT_TOKENS, TOKENS = 4, 40, 120


def _run_all(mesh: LocalMesh, progress: list[int] | None = None) -> list[list[int]]:
    prompt = [(3 * i + 1) % 1000 for i in range(PROMPT_TOKENS)]

    return run_streams(mesh.coordinator_address, [
        {"prompt_token_ids": prompt, "max_tokens": TOKENS, "temperature": 0.8, "top_k": 50, "seed": seed,
         "ignore_eos": True} for seed in range(SESSIONS)], progress)


def test_kill9_of_an_executor_restores_the_sessions_from_the_store(server: RedisServer, mesh3: LocalMesh) -> None:
    baseline = _run_all(mesh3)
    progress = [0] * SESSIONS
    at_fault: dict[str, Any] = {}

    def trigger() -> None:
        while min(progress) < 60:  # half of each stream left: the kill falls mid-generation on a fast host too
            time.sleep(0.01)
        at_fault["stats"] = _store_stats(mesh3)
        faults.kill9(mesh3.executor_processes[1])
        at_fault["progress"] = list(progress)

    threading.Thread(target=trigger, daemon=True).start()
    assert _run_all(mesh3, progress) == baseline
    assert "progress" in at_fault and min(at_fault["progress"]) < TOKENS, \
        "the fault fired after generation ended: the test proved nothing"
    before, after = at_fault["stats"], _store_stats(mesh3)
    # Every restore after the re-plan (2 stages left) is one SeedStages: a read of the seeded prefix per stage. The
    # sessions were admitted before the fault, so these are restores only.
    seeded = (after.hit_tokens - before.hit_tokens) / 2
    recomputed = sum(PROMPT_TOKENS + n for n in at_fault["progress"]) - seeded
    print(f"restores seeded {seeded:.0f} tokens, recomputed {recomputed:.0f}")
    assert seeded > 0 and recomputed < 0.1 * SESSIONS * (PROMPT_TOKENS + TOKENS), (seeded, recomputed)


def test_a_redis_restart_mid_generation_is_no_client_error(server: RedisServer, mesh3: LocalMesh) -> None:
    """Redis killed while every stream generates and started again (empty) a moment later: no stream sees an error or
    other tokens, and the next request's KV reaches the restarted server. The kill is what must fall mid-generation;
    the restart may come after the streams end on a fast host (the check once waited for both and failed there)."""
    baseline = _run_all(mesh3)
    progress = [0] * SESSIONS
    at_kill: list[int] = []

    def trigger() -> None:
        while min(progress) < 10:
            time.sleep(0.01)
        server.kill()
        at_kill.extend(progress)
        time.sleep(0.2)
        server.start()

    restart = threading.Thread(target=trigger, daemon=True)
    restart.start()
    assert _run_all(mesh3, progress) == baseline
    assert at_kill and min(at_kill) < TOKENS, f"Redis was killed after every stream ended ({at_kill}): the test proved nothing"
    restart.join(timeout=30)
    assert not restart.is_alive(), "Redis did not come back"
    time.sleep(1.1)  # past the kvstore's retry interval, should generation have ended within it
    fresh_prompt = [(17 * i + 2) % 1000 for i in range(51)]
    _generate(mesh3, fresh_prompt)
    _wait_for_entries(server.client(), 3 * 6)  # the write-behind reaches the restarted Redis again
