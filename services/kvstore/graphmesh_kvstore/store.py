"""KV blocks by chain key, one entry per layer: a memory tier (LRU by bytes) over an optional disk tier that
survives restarts and an optional shared tier (Redis or Valkey) that several kvstore replicas see.

A stage's block is the rows of `block_tokens` consecutive tokens of its layers: f32 [block_tokens, layers, 2,
kv_dim]. It is kept as one entry per layer, f32 [block_tokens, 2, kv_dim], keyed by kvkeys.layer_key of the
block's link in the SHA-256 chain of graphmesh.kvkeys: a key names the model, layout, dtype, kv_dim, block size,
the layer and the whole token prefix up to and including the block. A put splits a stage's blocks into their
layers; a lookup or get assembles them again for whatever layer range it asks about, so the rows written by
the stages of one layer split are found by those of any other (a re-plan after a failure changes the split).

Disk files and shared-tier values are encoded alike: MAGIC | sha256 | header length | JSON header | payload,
where the checksum covers the header and the payload and the header names the key, model identity, layout,
dtype, layer, kv_dim, block size and token count. A value that fails the checksum or whose header does not
match what was asked for is deleted, counted and treated as a miss: a wrong hit would change tokens, a miss
only costs a recompute. Puts write through to every tier; a hit in a lower tier is promoted to memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphmesh import dtypes, kvkeys
from graphmesh.errors import InvalidArgument, ResourceExhausted
from graphmesh.v1 import kvstore_pb2
from graphmesh_kvstore.shared import SharedTier

log = logging.getLogger("graphmesh.kvstore")

MAGIC = b"GMKVBLK2"  # 2: per-layer entries; files of the per-stage format 1 are never found by a key, so dropped
_OLD_MAGIC = b"GMKVBLK1"
_PREAMBLE = struct.Struct("<8s32sI")  # magic, sha256(header + payload), header length
MAX_BLOCK_TOKENS = 1 << 12
MAX_LAYERS = 1 << 10
MAX_KV_DIM = 1 << 16
DEFAULT_MAX_PUT_BYTES = 1 << 30
_SHARED_BATCH_BYTES = 4 << 20  # entries fetched from the shared tier per round trip of a walk


@dataclass(frozen=True)
class Block:
    """One layer's rows of one block."""

    space: bytes  # the chain root (kvkeys.root): which namespace, whatever its layer range
    layer: int
    rows: np.ndarray  # f32 [block_tokens, 2, kv_dim], read-only
    incarnation: int
    epoch: int


@dataclass(frozen=True)
class _DiskEntry:
    space: bytes
    layer: int
    size: int  # bytes of the file


@dataclass(frozen=True)
class StoreStats:
    blocks: int  # entries (one block of one layer) in the memory and disk tiers
    memory_bytes: int
    disk_bytes: int
    capacity_bytes: int
    lookups: int
    hit_tokens: int
    miss_tokens: int
    hit_ratio: float
    evictions: int  # capacity evictions of either tier: memory -> disk counts once, dropped from disk once more
    corrupt_blocks: int  # entries of the disk or shared tier dropped for a bad checksum or header
    seed_bytes_per_s: float
    copy_bytes_per_s: float
    shared_configured: bool = False
    shared_up: bool = False
    shared_hit_blocks: int = 0  # entries served from the shared tier
    shared_errors: int = 0  # calls to the shared tier that failed (each one a miss, never a failed request)


@dataclass(frozen=True)
class Layout:
    """What a namespace's rows look like."""

    block_tokens: int
    layers: int
    kv_dim: int

    def rows_shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (tokens, self.layers, 2, self.kv_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of every layer of the namespace."""
        return self.layers * self.entry_bytes

    @property
    def entry_bytes(self) -> int:
        """Bytes of one block of one layer: what each tier stores as a unit."""
        return self.block_tokens * 2 * self.kv_dim * 4


@dataclass(frozen=True)
class _Slot:
    """Where one entry of a walk or put lives: block index i (tokens [i*bt, (i+1)*bt)) and layer."""

    block: int
    layer: int
    key: bytes


class Store:
    """Thread-safe: one lock around the index, the local tiers and the counters; the shared tier is called
    without it, so a slow Redis never holds up lookups served from memory."""

    def __init__(self, capacity_bytes: int, directory: str | Path | None = None, disk_capacity_bytes: int = 0,
                 block_tokens: int = 0, max_put_bytes: int = DEFAULT_MAX_PUT_BYTES,
                 shared: SharedTier | None = None) -> None:
        """capacity_bytes bounds the memory tier; disk_capacity_bytes bounds the disk tier (0: unbounded);
        block_tokens, when not 0, is the only block size accepted (a stage configured with another one
        fails loudly instead of filling the store with blocks no reader finds); shared: the Redis/Valkey tier,
        bounded by its own maxmemory policy or TTL."""
        self.capacity_bytes = capacity_bytes
        self.disk_capacity_bytes = disk_capacity_bytes
        self.block_tokens = block_tokens
        self.max_put_bytes = max_put_bytes
        self.shared = shared
        self._dir = Path(directory) if directory is not None else None
        self._lock = threading.Lock()
        self._memory: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._disk: OrderedDict[bytes, _DiskEntry] = OrderedDict()
        self._memory_bytes = 0
        self._disk_bytes = 0
        self._lookups = self._hit_tokens = self._miss_tokens = 0
        self._evictions = self._corrupt = self._shared_hits = 0
        self._transfers = {"seed": [0, 0.0], "copy": [0, 0.0]}  # bytes, seconds
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._scan()

    # -- validation ---------------------------------------------------------------------------------------------

    def layout(self, ns: kvstore_pb2.KvNamespace) -> Layout:
        """The namespace's row layout; raises InvalidArgument naming the first field that is wrong."""
        if not ns.model_identity:
            raise InvalidArgument("namespace.model_identity is empty", "BAD_NAMESPACE")
        if ns.layout != kvkeys.ROW_LAYOUT:
            raise InvalidArgument(f"namespace.layout {ns.layout!r} is not {kvkeys.ROW_LAYOUT!r}", "BAD_NAMESPACE")
        if ns.dtype != dtypes.to_proto("f32"):
            raise InvalidArgument(f"namespace.dtype {ns.dtype} is not f32 (the only stored dtype)", "BAD_NAMESPACE")
        if not 0 < ns.block_tokens <= MAX_BLOCK_TOKENS:
            raise InvalidArgument(f"namespace.block_tokens {ns.block_tokens} is not in [1, {MAX_BLOCK_TOKENS}]",
                                  "BAD_NAMESPACE")
        if self.block_tokens and ns.block_tokens != self.block_tokens:
            raise InvalidArgument(f"namespace.block_tokens {ns.block_tokens} differs from this store's "
                                  f"{self.block_tokens}", "BAD_NAMESPACE")
        if not ns.layer_start < ns.layer_end <= ns.layer_start + MAX_LAYERS:
            raise InvalidArgument(f"namespace layers [{ns.layer_start}, {ns.layer_end}) are empty or more than "
                                  f"{MAX_LAYERS}", "BAD_NAMESPACE")
        if not 0 < ns.kv_dim <= MAX_KV_DIM:
            raise InvalidArgument(f"namespace.kv_dim {ns.kv_dim} is not in [1, {MAX_KV_DIM}]", "BAD_NAMESPACE")
        return Layout(ns.block_tokens, ns.layer_end - ns.layer_start, ns.kv_dim)

    def check_put(self, ns: kvstore_pb2.KvNamespace, token_count: int, first_block: int, block_count: int,
                  dtype: str, shape: Sequence[int]) -> Layout:
        """Everything about a put that can be checked before its rows arrive."""
        layout = self.layout(ns)
        if block_count == 0:
            raise InvalidArgument("block_count is 0", "BAD_PUT")
        needed = (first_block + block_count) * layout.block_tokens
        if token_count < needed:
            raise InvalidArgument(f"token_ids has {token_count} tokens; blocks [{first_block}, "
                                  f"{first_block + block_count}) of {layout.block_tokens} tokens need {needed}", "BAD_PUT")
        expected = layout.rows_shape(block_count * layout.block_tokens)
        if dtype != "f32" or tuple(shape) != expected:
            raise InvalidArgument(f"rows {dtype}{list(shape)} should be f32{list(expected)}", "BAD_PUT")
        if block_count * layout.block_bytes > self.max_put_bytes:
            raise ResourceExhausted(f"a put of {block_count * layout.block_bytes} bytes exceeds the limit of "
                                    f"{self.max_put_bytes}", "PUT_TOO_LARGE")
        fits_disk = self._dir is not None and (not self.disk_capacity_bytes or
                                               layout.entry_bytes <= self.disk_capacity_bytes)
        if layout.entry_bytes > self.capacity_bytes and not fits_disk and self.shared is None:
            raise ResourceExhausted(f"a block of {layout.entry_bytes} bytes per layer exceeds the store's capacity "
                                    f"of {self.capacity_bytes}", "BLOCK_TOO_LARGE")
        return layout

    # -- operations ---------------------------------------------------------------------------------------------

    def put_blocks(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], first_block: int, block_count: int,
                   rows: np.ndarray, incarnation: int = 0, epoch: int = 0) -> tuple[int, int]:
        """Stores blocks [first_block, first_block + block_count); returns (stored, already_present), counting a
        block present when every one of its layers was (in any tier this store reaches).

        rows: f32 [block_count * block_tokens, layers, 2, kv_dim]. An entry already stored is kept with its
        first stamps. Raises (and changes nothing) when anything is wrong."""
        try:
            dtype = dtypes.from_numpy(rows.dtype)
        except dtypes.DTypeError:
            dtype = str(rows.dtype)
        layout = self.check_put(ns, len(token_ids), first_block, block_count, dtype, rows.shape)
        bt = layout.block_tokens
        keys = kvkeys.layer_keys(ns, token_ids[:(first_block + block_count) * bt])[first_block:]
        space = kvkeys.root(ns)
        present = np.zeros((block_count, layout.layers), bool)
        outgoing: list[tuple[str, bytes]] = []
        created: list[bytes | None] = []  # per outgoing entry: its key when this put created it locally
        with self._lock:
            for i, block_keys in enumerate(keys):
                for j, key in enumerate(block_keys):
                    layer = ns.layer_start + j
                    if key in self._memory or key in self._disk:
                        self._touch(key)
                        present[i, j] = True
                        if self.shared is None:
                            continue
                        block = self._memory.get(key) or self._read_file(key, ns, layer, first_block + i)
                        if block is None:
                            present[i, j] = False  # a corrupt file: stored afresh below
                    if not present[i, j]:
                        entry_rows = np.array(rows[i * bt:(i + 1) * bt, j], dtype=np.float32, order="C")
                        entry_rows.setflags(write=False)
                        block = Block(space, layer, entry_rows, incarnation, epoch)
                        if self._dir is not None:
                            self._write_file(key, ns, first_block + i, block)
                        self._remember(key, block)
                    if self.shared is not None and block is not None:
                        # every entry goes out, even one held here: the shared tier may have evicted or lost it
                        outgoing.append((self.shared.name(space, layer, key),
                                         _encode(key, ns, layer, (first_block + i + 1) * bt, block)))
                        created.append(None if present[i, j] else key)
        if self.shared is not None and outgoing:
            results = self.shared.put(outgoing)
            if results is not None:
                # an entry the shared tier already held counts as present: another replica stored it first, and its
                # rows are the ones every replica serves, so this replica's fresh copy gives way to them
                was_there = np.array([r is False for r in results], bool).reshape(present.shape)
                present |= was_there
                with self._lock:
                    for key_or_none, there in zip(created, was_there.reshape(-1)):
                        if there and key_or_none is not None:
                            self._drop_memory(key_or_none)
                            self._drop_disk(key_or_none)
        stored = int((~present.all(axis=1)).sum())
        return stored, block_count - stored

    def lookup(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int]) -> int:
        """The longest stored prefix of token_ids for every layer of ns, in tokens (a multiple of block_tokens)."""
        return len(self._walk(ns, token_ids, 0)) * self.layout(ns).block_tokens

    def get_blocks(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], max_tokens: int = 0) -> np.ndarray:
        """The rows of the longest stored prefix, at most max_tokens of them (0: no cap), in whole blocks, each
        assembled from its layers' entries: f32 [tokens, layers, 2, kv_dim]."""
        layout = self.layout(ns)
        blocks = self._walk(ns, token_ids, max_tokens)
        bt = layout.block_tokens
        rows = np.empty(layout.rows_shape(len(blocks) * bt), np.float32)
        for i, layers in enumerate(blocks):
            for j, block in enumerate(layers):
                rows[i * bt:(i + 1) * bt, j] = block.rows
        return rows

    def get_layers(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], max_tokens: int = 0) -> np.ndarray:
        """The rows get_blocks returns, layer-major: f32 [layers, 2, tokens, kv_dim], so that each layer's K and V
        are contiguous, as a seed over a link sends them (graphmesh.links.KvLink). Assembling this layout costs what
        get_blocks' does; gathering each piece out of get_blocks' layout would be a second copy of every row."""
        layout = self.layout(ns)
        blocks = self._walk(ns, token_ids, max_tokens)
        bt = layout.block_tokens
        rows = np.empty((layout.layers, 2, len(blocks) * bt, layout.kv_dim), np.float32)
        for i, layers in enumerate(blocks):
            for j, block in enumerate(layers):
                rows[j, :, i * bt:(i + 1) * bt] = block.rows.transpose(1, 0, 2)
        return rows

    def evict(self, ns: kvstore_pb2.KvNamespace | None = None) -> int:
        """Drops every entry of `ns`'s layers, or every entry, from every tier (the shared tier too: other
        replicas keep what their memory holds until it ages out); returns how many this store held locally."""
        space = kvkeys.root(ns) if ns is not None else None
        layers = range(ns.layer_start, ns.layer_end) if ns is not None else range(0)

        def mine(entry: Block | _DiskEntry) -> bool:
            return space is None or (entry.space == space and entry.layer in layers)

        with self._lock:
            keys = {k for k, b in self._memory.items() if mine(b)}
            keys |= {k for k, e in self._disk.items() if mine(e)}
            for key in keys:
                self._drop_memory(key)
                self._drop_disk(key)
        if self.shared is not None:
            patterns = ["*"] if space is None else [f"{space.hex()}:{layer}:*" for layer in layers]
            self.shared.delete_matching(patterns)
        return len(keys)

    def record_transfer(self, kind: str, nbytes: int, seconds: float) -> None:
        """Accounts a finished seed or copy ("seed" | "copy") for the mean throughput in stats()."""
        with self._lock:
            total = self._transfers[kind]
            total[0] += nbytes
            total[1] += seconds

    def stats(self) -> StoreStats:
        with self._lock:
            looked = self._hit_tokens + self._miss_tokens
            rates = {k: (b / s if s > 0 else 0.0) for k, (b, s) in self._transfers.items()}
            shared = self.shared
            return StoreStats(blocks=len(self._memory.keys() | self._disk.keys()), memory_bytes=self._memory_bytes,
                              disk_bytes=self._disk_bytes, capacity_bytes=self.capacity_bytes, lookups=self._lookups,
                              hit_tokens=self._hit_tokens, miss_tokens=self._miss_tokens,
                              hit_ratio=self._hit_tokens / looked if looked else 0.0, evictions=self._evictions,
                              corrupt_blocks=self._corrupt, seed_bytes_per_s=float(rates["seed"]),
                              copy_bytes_per_s=float(rates["copy"]), shared_configured=shared is not None,
                              shared_up=shared is not None and shared.up, shared_hit_blocks=self._shared_hits,
                              shared_errors=shared.errors if shared is not None else 0)

    # -- internals ----------------------------------------------------------------------------------------------

    def _walk(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], max_tokens: int) -> list[list[Block]]:
        """Per block of the longest prefix stored for every layer of ns, its layers' entries; counts the lookup.

        Local tiers first (under the lock); entries they lack come from the shared tier in batches (without the
        lock), and the walk stops at the first block that some layer lacks everywhere."""
        layout = self.layout(ns)
        bt = layout.block_tokens
        looked = min(len(token_ids), max_tokens) if max_tokens else len(token_ids)
        keys = kvkeys.layer_keys(ns, token_ids[:looked // bt * bt])
        space = kvkeys.root(ns)
        batch = max(1, _SHARED_BATCH_BYTES // layout.block_bytes) if self.shared is not None else len(keys) or 1
        found: list[list[Block]] = []
        for start in range(0, len(keys), batch):
            blocks: list[list[Block | None]] = []
            missing: list[_Slot] = []
            with self._lock:
                for i in range(start, min(start + batch, len(keys))):
                    entries = [self._fetch(key, ns, ns.layer_start + j, i) for j, key in enumerate(keys[i])]
                    blocks.append(entries)
                    gaps = [_Slot(i, ns.layer_start + j, keys[i][j]) for j, e in enumerate(entries) if e is None]
                    if gaps and self.shared is None:
                        break  # nowhere else to look: the prefix ends here
                    missing += gaps
            if missing:
                self._fetch_shared(ns, space, missing, blocks, start)
            for entries in blocks:
                if any(e is None for e in entries):
                    break
                found.append([e for e in entries if e is not None])
            if len(found) < start + len(blocks) or len(blocks) < batch:
                break
        with self._lock:
            self._lookups += 1
            self._hit_tokens += len(found) * bt
            self._miss_tokens += looked - len(found) * bt
        return found

    def _fetch_shared(self, ns: kvstore_pb2.KvNamespace, space: bytes, missing: list[_Slot],
                      blocks: list[list[Block | None]], start: int) -> None:
        """Fills the `missing` entries of `blocks` from the shared tier where it holds valid ones, and promotes
        those to memory; a value that fails its checks is dropped there and counted."""
        assert self.shared is not None
        names = [self.shared.name(space, s.layer, s.key) for s in missing]
        values = self.shared.get(names)
        if values is None:
            return  # unavailable: logged by the tier, served as a miss
        corrupt: list[str] = []
        fetched: list[tuple[bytes, Block]] = []
        for slot, name, value in zip(missing, names, values):
            if value is None:
                continue
            try:
                block = _decode(value, slot.key, ns, space, slot.layer, slot.block)
            except ValueError as e:
                log.warning("corrupt shared KV entry dropped", extra={"key": name, "error": str(e)})
                corrupt.append(name)
                continue
            blocks[slot.block - start][slot.layer - ns.layer_start] = block
            fetched.append((slot.key, block))
        if corrupt:
            self.shared.delete(corrupt)
        with self._lock:
            self._corrupt += len(corrupt)
            self._shared_hits += len(fetched)
            for key, block in fetched:
                if key not in self._memory:
                    self._remember(key, block)  # the seed that usually follows a lookup is served from memory

    # -- local tiers (the lock is held) -------------------------------------------------------------------------

    def _fetch(self, key: bytes, ns: kvstore_pb2.KvNamespace, layer: int, index: int) -> Block | None:
        block = self._memory.get(key)
        if block is not None:
            self._touch(key)
            return block
        if key not in self._disk:
            return None
        block = self._read_file(key, ns, layer, index)
        if block is None:
            return None
        self._disk.move_to_end(key)
        self._remember(key, block)  # promoted: the next read of this prefix is served from memory
        return block

    def _touch(self, key: bytes) -> None:
        if key in self._memory:
            self._memory.move_to_end(key)
        if key in self._disk:
            self._disk.move_to_end(key)

    def _remember(self, key: bytes, block: Block) -> None:
        """Puts an entry in the memory tier and evicts least recently used entries down to capacity."""
        self._memory[key] = block
        self._memory_bytes += block.rows.nbytes
        while self._memory_bytes > self.capacity_bytes and self._memory:
            self._drop_memory(next(iter(self._memory)))
            self._evictions += 1

    def _drop_memory(self, key: bytes) -> None:
        block = self._memory.pop(key, None)
        if block is not None:
            self._memory_bytes -= block.rows.nbytes

    def _drop_disk(self, key: bytes) -> None:
        entry = self._disk.pop(key, None)
        if entry is None or self._dir is None:
            return
        self._disk_bytes -= entry.size
        (self._dir / key.hex()).unlink(missing_ok=True)

    def _write_file(self, key: bytes, ns: kvstore_pb2.KvNamespace, index: int, block: Block) -> None:
        assert self._dir is not None
        data = _encode(key, ns, block.layer, (index + 1) * ns.block_tokens, block)
        path = self._dir / key.hex()
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # a crash mid-write leaves a .tmp, never a torn entry under the key's name
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("disk tier write failed; the block stays in memory only", extra={"error": str(e)})
            return
        self._disk[key] = _DiskEntry(block.space, block.layer, len(data))
        self._disk_bytes += len(data)
        while self.disk_capacity_bytes and self._disk_bytes > self.disk_capacity_bytes and self._disk:
            self._drop_disk(next(iter(self._disk)))
            self._evictions += 1

    def _read_file(self, key: bytes, ns: kvstore_pb2.KvNamespace, layer: int, index: int) -> Block | None:
        """The entry from disk, or None (and the file deleted, counted) when it fails its checks."""
        assert self._dir is not None
        try:
            return _decode((self._dir / key.hex()).read_bytes(), key, ns, kvkeys.root(ns), layer, index)
        except (OSError, ValueError) as e:
            self._corrupt_file(key, str(e))
            return None

    def _corrupt_file(self, key: bytes, why: str) -> None:
        log.warning("corrupt block dropped", extra={"key": key.hex(), "error": why})
        self._corrupt += 1
        if key in self._disk:
            self._drop_disk(key)
        elif self._dir is not None:
            (self._dir / key.hex()).unlink(missing_ok=True)

    def _scan(self) -> None:
        """Indexes the disk tier from the files' headers, oldest first; payload checksums are checked on read."""
        assert self._dir is not None
        started = time.monotonic()
        found: list[tuple[float, bytes, _DiskEntry]] = []
        stale = 0
        for path in self._dir.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)  # an interrupted write
                continue
            try:
                key = bytes.fromhex(path.name)
            except ValueError:
                continue  # not ours
            if len(key) != 32:
                continue
            try:
                with open(path, "rb") as f:
                    magic, _, header_len = _PREAMBLE.unpack(f.read(_PREAMBLE.size))
                    if magic == _OLD_MAGIC:
                        stale += 1
                        path.unlink(missing_ok=True)
                        continue
                    if magic != MAGIC:
                        raise ValueError("bad magic")
                    header = json.loads(f.read(header_len))
                stat = path.stat()
                found.append((stat.st_mtime, key, _DiskEntry(bytes.fromhex(header["space"]), int(header["layer"]),
                                                             stat.st_size)))
            except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
                self._corrupt_file(key, str(e))
        for _, key, entry in sorted(found, key=lambda f: f[0]):
            self._disk[key] = entry
            self._disk_bytes += entry.size
        while self.disk_capacity_bytes and self._disk_bytes > self.disk_capacity_bytes and self._disk:
            self._drop_disk(next(iter(self._disk)))
            self._evictions += 1
        log.info("disk tier indexed", extra={"dir": str(self._dir), "blocks": len(self._disk),
                                             "disk_bytes": self._disk_bytes, "corrupt_blocks": self._corrupt,
                                             "old_format_dropped": stale,
                                             "scan_ms": round((time.monotonic() - started) * 1e3, 1)})


# -- the encoding of one entry, on disk and in the shared tier ------------------------------------------------


def _header(key: bytes, ns: kvstore_pb2.KvNamespace, space: bytes, layer: int, tokens: int) -> dict[str, Any]:
    """What an entry must say about itself to be served for (key, ns, layer, tokens); space: kvkeys.root(ns),
    passed in because a seed checks hundreds of entries of one namespace."""
    return {"key": key.hex(), "space": space.hex(), "model_identity": ns.model_identity,
            "layout": ns.layout, "dtype": "f32", "layer": layer, "kv_dim": ns.kv_dim,
            "block_tokens": ns.block_tokens, "tokens": tokens}


def _encode(key: bytes, ns: kvstore_pb2.KvNamespace, layer: int, tokens: int, block: Block) -> bytes:
    """MAGIC | sha256(header + payload) | header length | header | payload. tokens: of the prefix through this
    block."""
    header = json.dumps({**_header(key, ns, block.space, layer, tokens), "shape": list(block.rows.shape),
                         "incarnation": block.incarnation, "epoch": block.epoch}).encode()
    payload = block.rows.astype("<f4", copy=False).tobytes()
    return _PREAMBLE.pack(MAGIC, hashlib.sha256(header + payload).digest(), len(header)) + header + payload


def _decode(data: bytes, key: bytes, ns: kvstore_pb2.KvNamespace, space: bytes, layer: int, index: int) -> Block:
    """The entry of block `index` of layer `layer` of ns under `key`; raises ValueError when the bytes are torn,
    fail their checksum, or describe anything else than what was asked for."""
    if len(data) < _PREAMBLE.size:
        raise ValueError(f"{len(data)} bytes is shorter than the preamble")
    magic, digest, header_len = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("bad magic")
    body = memoryview(data)[_PREAMBLE.size:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch")
    try:
        header = json.loads(bytes(body[:header_len]))
        expected = _header(key, ns, space, layer, (index + 1) * ns.block_tokens)
        wrong = [f for f, v in expected.items() if header.get(f) != v]
        if wrong:
            raise ValueError(f"entry header differs in {', '.join(wrong)}")
        shape = (ns.block_tokens, 2, ns.kv_dim)
        if tuple(header["shape"]) != shape:
            raise ValueError(f"entry shape {header['shape']} is not {list(shape)}")
        payload = body[header_len:]
        if len(payload) != 4 * math.prod(shape):
            raise ValueError(f"payload of {len(payload)} bytes does not match f32{list(shape)}")
        rows = np.frombuffer(payload, dtype="<f4").reshape(shape)  # read-only: bytes are immutable
        return Block(bytes.fromhex(header["space"]), layer, rows, int(header["incarnation"]), int(header["epoch"]))
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed entry header: {e}") from None
