"""The KV block store without gRPC: keys, per-layer entries assembled for any layer split, longest prefix,
idempotent puts, LRU by bytes, the disk tier."""

from __future__ import annotations

import hashlib
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from graphmesh import kvkeys
from graphmesh.errors import InvalidArgument, ResourceExhausted
from graphmesh.v1 import kvstore_pb2
from graphmesh_kvstore.store import MAGIC, Store

BT, LAYERS, KV_DIM = 4, 2, 8
ENTRY_BYTES = BT * 2 * KV_DIM * 4  # one block of one layer: the unit every tier stores
BLOCK_BYTES = LAYERS * ENTRY_BYTES
NS = kvkeys.namespace("sha256:test-model", 0, LAYERS, KV_DIM, block_tokens=BT)


def rows_for(tokens: list[int], seed: int = 0) -> np.ndarray:
    """Rows that depend on the token and its position, so a misplaced or mixed-up block shows."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((len(tokens), LAYERS, 2, KV_DIM)).astype(np.float32)
    return base + np.asarray(tokens, np.float32)[:, None, None, None]


def put_all(store: Store, tokens: list[int], rows: np.ndarray, ns: kvstore_pb2.KvNamespace = NS) -> tuple[int, int]:
    n = len(tokens) // BT
    return store.put_blocks(ns, tokens, 0, n, rows[:n * BT])


def snapshot(store: Store) -> tuple[int, int, int]:
    s = store.stats()
    return s.blocks, s.memory_bytes, s.disk_bytes


def test_chain_keys_are_stable_across_processes() -> None:
    # computed once; a change here means every stored block of every deployment becomes unreachable
    keys = kvkeys.chain(NS, list(range(100, 112)))
    assert [k.hex() for k in keys] == [
        "26e8b98fcc3a9f694f2d42faee9b2faf17a8e48934e5d2f2138fea2704a98c6f",
        "b4dc9b8c01147391eead1eceb773cd7638007eb9710f3107118f146a10e59097",
        "1aca43a66e1a61aae4e56f8be2aa16be942c139b24236469b7c2b014e825bc9e",
    ]
    # and they follow the documented chain: h_i = SHA-256(h_{i-1} || tokens as little-endian int64), rooted
    # without the layer range, and layer l's entry is SHA-256(h_i || "layer" || l as little-endian uint32)
    h = hashlib.sha256(b"sha256:test-model|rows[tokens,layers,2,kv_dim]|f32|8|4").digest()
    h = hashlib.sha256(h + struct.pack("<4q", 100, 101, 102, 103)).digest()
    assert h == kvkeys.chain(NS, list(range(100, 112)))[0]
    assert kvkeys.layer_keys(NS, list(range(100, 104))) == [
        [hashlib.sha256(h + b"layer" + struct.pack("<I", layer)).digest() for layer in (0, 1)]]
    assert kvkeys.layer_keys(NS, list(range(100, 104)))[0][1].hex() == \
        "53f19a0e8a701541925851fbb35f44b9159085de39bff12446822fa1f4df21dd"


@pytest.mark.parametrize("other", [
    kvkeys.namespace("sha256:other-model", 0, LAYERS, KV_DIM, block_tokens=BT),
    kvkeys.namespace("sha256:test-model", 0, LAYERS, KV_DIM, dtype="f16", block_tokens=BT),
    kvkeys.namespace("sha256:test-model", 0, LAYERS, 2 * KV_DIM, block_tokens=BT),
    kvkeys.namespace("sha256:test-model", 0, LAYERS, KV_DIM, block_tokens=2 * BT),
])
def test_namespaces_never_alias(other: kvstore_pb2.KvNamespace) -> None:
    tokens = list(range(32))
    assert not set(kvkeys.chain(NS, tokens)) & set(kvkeys.chain(other, tokens))
    assert kvkeys.root(NS) != kvkeys.root(other)
    every = {k for ks in kvkeys.layer_keys(NS, tokens) for k in ks}
    assert not every & {k for ks in kvkeys.layer_keys(other, tokens) for k in ks}


def test_layers_key_alike_under_every_split_and_never_alias_each_other() -> None:
    tokens = list(range(32))
    whole = kvkeys.layer_keys(kvkeys.namespace("sha256:test-model", 0, 4, KV_DIM, block_tokens=BT), tokens)
    split = kvkeys.layer_keys(kvkeys.namespace("sha256:test-model", 1, 3, KV_DIM, block_tokens=BT), tokens)
    assert [ks[1:3] for ks in whole] == split  # layers 1 and 2 have one key whichever stage holds them
    assert len({k for ks in whole for k in ks}) == len(whole) * 4  # no two (block, layer) entries share a key


def test_rows_of_other_layers_are_not_found() -> None:
    store = Store(1 << 20)
    tokens = list(range(16))
    put_all(store, tokens, rows_for(tokens))
    assert store.lookup(kvkeys.namespace("sha256:test-model", 2, 2 + LAYERS, KV_DIM, block_tokens=BT), tokens) == 0
    # a range only partly stored is no hit either: every layer of it must have the block
    assert store.lookup(kvkeys.namespace("sha256:test-model", 1, 3, KV_DIM, block_tokens=BT), tokens) == 0
    assert store.lookup(NS, tokens) == 16


def test_a_new_layer_split_assembles_its_stages_from_the_old_ones_entries() -> None:
    store = Store(1 << 20)
    tokens = list(range(500, 512))  # 3 blocks
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((len(tokens), 4, 2, KV_DIM)).astype(np.float32)  # 4 layers of the model
    for start, end in ((0, 2), (2, 4)):  # written behind by the 2 stages of the old plan
        ns = kvkeys.namespace("sha256:test-model", start, end, KV_DIM, block_tokens=BT)
        assert store.put_blocks(ns, tokens, 0, 3, rows[:, start:end]) == (3, 0)
    for start, end in ((0, 1), (1, 3), (3, 4), (0, 4)):  # read by the stages of new plans
        ns = kvkeys.namespace("sha256:test-model", start, end, KV_DIM, block_tokens=BT)
        assert store.lookup(ns, tokens) == 12
        np.testing.assert_array_equal(store.get_blocks(ns, tokens), rows[:, start:end])
    # a prefix is as long as its shortest layer: without layer 2, layers [1, 3) find nothing; with 2 blocks of it, 2
    store.evict(kvkeys.namespace("sha256:test-model", 2, 3, KV_DIM, block_tokens=BT))
    assert store.lookup(kvkeys.namespace("sha256:test-model", 1, 3, KV_DIM, block_tokens=BT), tokens) == 0
    ns = kvkeys.namespace("sha256:test-model", 2, 4, KV_DIM, block_tokens=BT)
    assert store.put_blocks(ns, tokens[:8], 0, 2, rows[:8, 2:4]) == (2, 0)  # layer 2 is back for 2 blocks only
    assert store.lookup(kvkeys.namespace("sha256:test-model", 1, 3, KV_DIM, block_tokens=BT), tokens) == 8


def test_puts_are_idempotent() -> None:
    store = Store(1 << 20)
    tokens = list(range(12))
    rows = rows_for(tokens)
    assert put_all(store, tokens, rows) == (3, 0)
    before = snapshot(store)
    # same blocks again, with different rows and stamps: the first ones are kept
    assert store.put_blocks(NS, tokens, 0, 3, rows + 1, incarnation=9, epoch=9) == (0, 3)
    assert snapshot(store) == before
    np.testing.assert_array_equal(store.get_blocks(NS, tokens), rows)
    # overlapping put: blocks 1..3 of a longer sequence, block 3 is new
    longer = [*tokens, 50, 51, 52, 53]
    assert store.put_blocks(NS, longer, 1, 3, rows_for(longer)[4:16]) == (1, 2)


def test_longest_prefix_in_whole_blocks() -> None:
    store = Store(1 << 20)
    tokens = list(range(1000, 1014))  # 3 whole blocks and 2 tokens
    rows = rows_for(tokens)
    put_all(store, tokens, rows)
    assert store.lookup(NS, tokens) == 12
    assert store.lookup(NS, tokens[:11]) == 8  # a partial block never matches
    assert store.lookup(NS, tokens + [7] * 20) == 12
    assert store.lookup(NS, [1, *tokens]) == 0
    np.testing.assert_array_equal(store.get_blocks(NS, tokens), rows[:12])
    np.testing.assert_array_equal(store.get_blocks(NS, tokens, max_tokens=7), rows[:4])  # capped in whole blocks
    assert store.get_blocks(NS, [5, 5, 5, 5]).shape == (0, LAYERS, 2, KV_DIM)


def test_shared_prefix_with_different_continuations() -> None:
    store = Store(1 << 20)
    shared = list(range(200, 208))  # 2 blocks
    a, b = [*shared, 1, 2, 3, 4, 5, 6, 7, 8], [*shared, 9, 9, 9, 9, 9, 9, 9, 9]
    rows_a = rows_for(a, seed=1)
    put_all(store, a, rows_a)
    assert store.lookup(NS, b) == 8
    np.testing.assert_array_equal(store.get_blocks(NS, b), rows_a[:8])
    rows_b = rows_for(b, seed=2)
    assert put_all(store, b, rows_b) == (2, 2)  # the shared blocks were there already
    np.testing.assert_array_equal(store.get_blocks(NS, a), rows_a)
    np.testing.assert_array_equal(store.get_blocks(NS, b)[8:], rows_b[8:])


def test_one_changed_token_invalidates_the_blocks_from_it_on() -> None:
    store = Store(1 << 20)
    tokens = list(range(24))  # 6 blocks
    put_all(store, tokens, rows_for(tokens))
    for position in (0, 5, 13, 23):
        changed = list(tokens)
        changed[position] = 999
        assert store.lookup(NS, changed) == position // BT * BT


def test_lru_by_bytes_and_a_lookup_refreshes() -> None:
    store = Store(capacity_bytes=3 * BLOCK_BYTES)
    seqs = [[s * 100 + i for i in range(BT)] for s in range(4)]  # 4 one-block sequences
    for seq in seqs[:3]:
        put_all(store, seq, rows_for(seq))
    assert store.stats().memory_bytes == 3 * BLOCK_BYTES
    assert store.lookup(NS, seqs[0]) == BT  # seqs[0] becomes the most recently used
    put_all(store, seqs[3], rows_for(seqs[3]))  # past capacity: the least recently used (seqs[1]) goes
    assert [store.lookup(NS, seq) for seq in seqs] == [BT, 0, BT, BT]
    s = store.stats()
    assert (s.blocks, s.memory_bytes, s.evictions) == (3 * LAYERS, 3 * BLOCK_BYTES, LAYERS)  # entries per layer


def test_stats_count_hits_and_misses() -> None:
    store = Store(1 << 20)
    tokens = list(range(8))
    put_all(store, tokens, rows_for(tokens))
    store.lookup(NS, [*tokens, 1, 2, 3, 4, 5])  # 8 hit, 5 miss
    store.get_blocks(NS, [9] * 4)  # 4 miss
    s = store.stats()
    assert (s.lookups, s.hit_tokens, s.miss_tokens) == (2, 8, 9)
    assert s.hit_ratio == pytest.approx(8 / 17)


def test_evict_a_namespace_or_everything() -> None:
    store = Store(1 << 20)
    other = kvkeys.namespace("sha256:other-model", 0, LAYERS, KV_DIM, block_tokens=BT)
    tokens = list(range(8))
    put_all(store, tokens, rows_for(tokens))
    put_all(store, tokens, rows_for(tokens), ns=other)
    assert store.evict(other) == 2 * LAYERS
    assert (store.lookup(NS, tokens), store.lookup(other, tokens)) == (8, 0)
    assert store.evict() == 2 * LAYERS
    assert snapshot(store) == (0, 0, 0)


def test_disk_tier_survives_a_new_instance(tmp_path: Path) -> None:
    tokens = list(range(300, 316))
    rows = rows_for(tokens)
    first = Store(1 << 20, tmp_path)
    put_all(first, tokens, rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(k.hex() for ks in kvkeys.layer_keys(NS, tokens)
                                                                 for k in ks)
    again = Store(1 << 20, tmp_path)
    s = again.stats()
    assert (s.blocks, s.memory_bytes, s.disk_bytes) == (4 * LAYERS, 0, first.stats().disk_bytes)
    assert again.lookup(NS, tokens) == 16
    np.testing.assert_array_equal(again.get_blocks(NS, tokens), rows)
    assert again.stats().memory_bytes == 4 * BLOCK_BYTES  # read blocks were promoted to memory


def test_blocks_evicted_from_memory_stay_on_disk(tmp_path: Path) -> None:
    store = Store(capacity_bytes=BLOCK_BYTES, directory=tmp_path)
    tokens = list(range(12))
    rows = rows_for(tokens)
    put_all(store, tokens, rows)
    s = store.stats()
    assert (s.blocks, s.memory_bytes, s.evictions) == (3 * LAYERS, BLOCK_BYTES, 2 * LAYERS)
    np.testing.assert_array_equal(store.get_blocks(NS, tokens), rows)


def test_disk_tier_is_bounded(tmp_path: Path) -> None:
    probe = Store(1 << 20, tmp_path / "probe")
    put_all(probe, list(range(4)), rows_for(list(range(4))))
    file_bytes = probe.stats().disk_bytes
    store = Store(capacity_bytes=0, directory=tmp_path / "bounded", disk_capacity_bytes=2 * file_bytes)
    seqs = [[s * 10 + i for i in range(BT)] for s in range(3)]
    for s in seqs:
        put_all(store, s, rows_for(s))
    assert [store.lookup(NS, s) for s in seqs] == [0, BT, BT]
    assert store.stats().disk_bytes == 2 * file_bytes
    assert len(list((tmp_path / "bounded").iterdir())) == 2 * LAYERS


def test_a_corrupted_file_is_dropped_and_never_served(tmp_path: Path) -> None:
    tokens = list(range(400, 412))
    rows = rows_for(tokens)
    put_all(Store(1 << 20, tmp_path), tokens, rows)
    middle = tmp_path / kvkeys.layer_keys(NS, tokens)[1][0].hex()  # layer 0 of block 1
    data = bytearray(middle.read_bytes())
    data[-5] ^= 0x01  # one bit of one float of the payload
    middle.write_bytes(bytes(data))
    store = Store(1 << 20, tmp_path)
    assert store.lookup(NS, tokens) == 4  # the prefix stops before the corrupt block
    np.testing.assert_array_equal(store.get_blocks(NS, tokens), rows[:4])
    assert not middle.exists()
    s = store.stats()
    assert (s.corrupt_blocks, s.blocks) == (1, 3 * LAYERS - 1)
    # a fresh put heals the hole
    assert put_all(store, tokens, rows) == (1, 2)
    np.testing.assert_array_equal(store.get_blocks(NS, tokens), rows)


def test_a_file_with_a_broken_header_is_dropped_at_startup(tmp_path: Path) -> None:
    tokens = list(range(4))
    put_all(Store(1 << 20, tmp_path), tokens, rows_for(tokens))
    path = next(tmp_path.iterdir())
    path.write_bytes(MAGIC + b"\0" * 10)
    store = Store(1 << 20, tmp_path)
    assert (store.stats().corrupt_blocks, store.lookup(NS, tokens)) == (1, 0)
    assert not path.exists()


def test_files_of_the_per_stage_format_are_dropped_at_startup_without_counting_as_corrupt(tmp_path: Path) -> None:
    old = tmp_path / ("ab" * 32)
    old.write_bytes(b"GMKVBLK1" + b"\0" * 40)  # format 1: whole-stage blocks, keyed by layer range
    store = Store(1 << 20, tmp_path)
    assert (store.stats().corrupt_blocks, store.stats().blocks) == (0, 0)
    assert not old.exists()


def test_a_file_renamed_to_another_key_is_not_served(tmp_path: Path) -> None:
    tokens = list(range(600, 608))
    rows = rows_for(tokens)
    put_all(Store(1 << 20, tmp_path), tokens, rows)
    first, second = (tmp_path / ks[0].hex() for ks in kvkeys.layer_keys(NS, tokens))
    second.write_bytes(first.read_bytes())  # a checksummed entry, under the wrong key
    store = Store(1 << 20, tmp_path)
    assert store.lookup(NS, tokens) == 4
    assert store.stats().corrupt_blocks == 1


def _bad(**changes: object) -> dict[str, object]:
    tokens = list(range(8))
    args: dict[str, object] = {"ns": NS, "token_ids": tokens, "first_block": 0, "block_count": 2, "rows": rows_for(tokens)}
    args.update(changes)
    return args


@pytest.mark.parametrize(("args", "error", "words"), [
    (_bad(rows=rows_for(list(range(8)))[:, :1]), InvalidArgument, "should be f32[8, 2, 2, 8]"),
    (_bad(rows=rows_for(list(range(8))).astype(np.float64)), InvalidArgument, "rows f64[8, 2, 2, 8] should be f32"),
    (_bad(rows=rows_for(list(range(4)))), InvalidArgument, "should be f32[8"),
    (_bad(token_ids=list(range(7))), InvalidArgument, "token_ids has 7 tokens"),
    (_bad(first_block=1), InvalidArgument, "need 12"),
    (_bad(block_count=0), InvalidArgument, "block_count is 0"),
    (_bad(ns=kvkeys.namespace("m", 0, LAYERS, KV_DIM, block_tokens=0)), InvalidArgument, "block_tokens 0"),
    (_bad(ns=kvkeys.namespace("m", 3, 3, KV_DIM, block_tokens=BT)), InvalidArgument, "layers [3, 3)"),
    (_bad(ns=kvkeys.namespace("m", 0, LAYERS, 0, block_tokens=BT)), InvalidArgument, "kv_dim 0"),
    (_bad(ns=kvkeys.namespace("", 0, LAYERS, KV_DIM, block_tokens=BT)), InvalidArgument, "model_identity"),
    (_bad(ns=kvkeys.namespace("m", 0, LAYERS, KV_DIM, dtype="f16", block_tokens=BT)), InvalidArgument, "f32"),
    (_bad(ns=kvkeys.namespace("m", 0, LAYERS, 1 << 30, block_tokens=BT)), InvalidArgument, "kv_dim"),
    (_bad(ns=kvkeys.namespace("m", 0, 5000, KV_DIM, block_tokens=BT)), InvalidArgument, "more than 1024"),
    (_bad(ns=kvkeys.namespace("m", 0, LAYERS, KV_DIM, block_tokens=1 << 20)), InvalidArgument, "block_tokens 1048576"),
])
def test_bad_puts_raise_and_change_nothing(args: dict[str, object], error: type[Exception], words: str) -> None:
    store = Store(1 << 20)
    put_all(store, list(range(100, 104)), rows_for(list(range(100, 104))))
    before = snapshot(store)
    with pytest.raises(error, match=re.escape(words)):
        store.put_blocks(**args)  # type: ignore[arg-type]
    assert snapshot(store) == before


def test_sizes_past_the_limits_are_resource_exhausted(tmp_path: Path) -> None:
    tokens = list(range(8))
    small = Store(capacity_bytes=ENTRY_BYTES - 1)  # no disk tier: a block of one layer fits nowhere
    with pytest.raises(ResourceExhausted, match="exceeds the store's capacity"):
        small.put_blocks(NS, tokens, 0, 2, rows_for(tokens))
    capped = Store(1 << 20, max_put_bytes=BLOCK_BYTES)
    with pytest.raises(ResourceExhausted, match="exceeds the limit"):
        capped.put_blocks(NS, tokens, 0, 2, rows_for(tokens))
    assert snapshot(small) == snapshot(capped) == (0, 0, 0)
    # with a disk tier a block bigger than memory still has a home
    assert Store(capacity_bytes=ENTRY_BYTES - 1, directory=tmp_path).put_blocks(NS, tokens, 0, 2, rows_for(tokens)) == (2, 0)


def test_the_configured_block_size_is_the_only_one_accepted() -> None:
    store = Store(1 << 20, block_tokens=16)
    with pytest.raises(InvalidArgument, match="differs from this store's 16"):
        store.lookup(NS, list(range(8)))


def test_concurrent_puts_and_lookups_keep_the_accounting(tmp_path: Path) -> None:
    store = Store(capacity_bytes=10 * BLOCK_BYTES, directory=tmp_path)
    shared = list(range(8))  # every thread stores these 2 blocks: exactly one put may store each

    def work(t: int) -> tuple[int, int]:
        stored = present = 0
        for i in range(10):
            tokens = [*shared, *[t * 1000 + i * 10 + j for j in range(BT)]]
            s, p = put_all(store, tokens, rows_for(tokens, seed=t))
            stored, present = stored + s, present + p
            assert store.lookup(NS, tokens) == 12
        return stored, present

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(4)))
    assert sum(s for s, _ in results) == 2 + 4 * 10
    s = store.stats()
    assert s.blocks == 42 * LAYERS and s.memory_bytes == 10 * BLOCK_BYTES
    assert s.disk_bytes == sum(p.stat().st_size for p in tmp_path.iterdir())
