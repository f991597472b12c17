"""KV blocks by chain key: a memory tier (LRU by bytes) over an optional disk tier that survives restarts.

A block is the rows of `block_tokens` consecutive tokens of one stage: f32 [block_tokens, layers, 2, kv_dim],
stamped with the incarnation and epoch of the commit that produced it. Its key is the block's link in the
SHA-256 chain of graphmesh.kvkeys, so a key names the whole prefix up to and including the block, in one
namespace (model, layout, dtype, layers, kv_dim, block size).

Disk files are named by the hex key and hold MAGIC | sha256 | header length | JSON header | payload, where
the checksum covers the header and the payload; a file that fails it is deleted, counted and treated as a
miss. Puts write through to disk, so a block evicted from memory is still found on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
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

log = logging.getLogger("graphmesh.kvstore")

MAGIC = b"GMKVBLK1"
_PREAMBLE = struct.Struct("<8s32sI")  # magic, sha256(header + payload), header length
MAX_BLOCK_TOKENS = 1 << 12
MAX_LAYERS = 1 << 10
MAX_KV_DIM = 1 << 16
DEFAULT_MAX_PUT_BYTES = 1 << 30


@dataclass(frozen=True)
class Block:
    namespace: bytes  # the chain root (kvkeys.root): which namespace the block belongs to
    rows: np.ndarray  # f32 [block_tokens, layers, 2, kv_dim], read-only
    incarnation: int
    epoch: int


@dataclass(frozen=True)
class _DiskEntry:
    namespace: bytes
    size: int  # bytes of the file


@dataclass(frozen=True)
class StoreStats:
    blocks: int
    memory_bytes: int
    disk_bytes: int
    capacity_bytes: int
    lookups: int
    hit_tokens: int
    miss_tokens: int
    hit_ratio: float
    evictions: int  # capacity evictions of either tier: memory -> disk counts once, dropped from disk once more
    corrupt_blocks: int
    seed_bytes_per_s: float
    copy_bytes_per_s: float


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
        return self.block_tokens * self.layers * 2 * self.kv_dim * 4


class Store:
    """Thread-safe: one lock around the index, both tiers and the counters."""

    def __init__(self, capacity_bytes: int, directory: str | Path | None = None, disk_capacity_bytes: int = 0,
                 block_tokens: int = 0, max_put_bytes: int = DEFAULT_MAX_PUT_BYTES) -> None:
        """capacity_bytes bounds the memory tier; disk_capacity_bytes bounds the disk tier (0: unbounded);
        block_tokens, when not 0, is the only block size accepted (a stage configured with another one
        fails loudly instead of filling the store with blocks no reader finds)."""
        self.capacity_bytes = capacity_bytes
        self.disk_capacity_bytes = disk_capacity_bytes
        self.block_tokens = block_tokens
        self.max_put_bytes = max_put_bytes
        self._dir = Path(directory) if directory is not None else None
        self._lock = threading.Lock()
        self._memory: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._disk: OrderedDict[bytes, _DiskEntry] = OrderedDict()
        self._memory_bytes = 0
        self._disk_bytes = 0
        self._lookups = self._hit_tokens = self._miss_tokens = 0
        self._evictions = self._corrupt = 0
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
        fits_disk = self._dir is not None and (not self.disk_capacity_bytes or layout.block_bytes <= self.disk_capacity_bytes)
        if layout.block_bytes > self.capacity_bytes and not fits_disk:
            raise ResourceExhausted(f"a block of {layout.block_bytes} bytes exceeds the store's capacity of "
                                    f"{self.capacity_bytes}", "BLOCK_TOO_LARGE")
        return layout

    # -- operations ---------------------------------------------------------------------------------------------

    def put_blocks(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], first_block: int, block_count: int,
                   rows: np.ndarray, incarnation: int = 0, epoch: int = 0) -> tuple[int, int]:
        """Stores blocks [first_block, first_block + block_count); returns (stored, already_present).

        rows: f32 [block_count * block_tokens, layers, 2, kv_dim]. A block already stored is kept with its
        first stamps. Raises (and changes nothing) when anything is wrong."""
        try:
            dtype = dtypes.from_numpy(rows.dtype)
        except dtypes.DTypeError:
            dtype = str(rows.dtype)
        layout = self.check_put(ns, len(token_ids), first_block, block_count, dtype, rows.shape)
        bt = layout.block_tokens
        keys = kvkeys.chain(ns, token_ids[:(first_block + block_count) * bt])[first_block:]
        root = kvkeys.root(ns)
        stored = present = 0
        with self._lock:
            for i, key in enumerate(keys):
                if key in self._memory or key in self._disk:
                    self._touch(key)
                    present += 1
                    continue
                block_rows = np.array(rows[i * bt:(i + 1) * bt], dtype=np.float32, order="C")
                block_rows.setflags(write=False)
                block = Block(root, block_rows, incarnation, epoch)
                if self._dir is not None:
                    self._write_file(key, block)
                self._remember(key, block)
                stored += 1
        return stored, present

    def lookup(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int]) -> int:
        """The longest stored prefix of token_ids, in tokens (a multiple of block_tokens)."""
        return len(self._walk(ns, token_ids, 0)) * self.layout(ns).block_tokens

    def get_blocks(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], max_tokens: int = 0) -> np.ndarray:
        """The rows of the longest stored prefix, at most max_tokens of them (0: no cap), in whole blocks:
        f32 [tokens, layers, 2, kv_dim]."""
        layout = self.layout(ns)
        blocks = self._walk(ns, token_ids, max_tokens)
        if not blocks:
            return np.zeros(layout.rows_shape(0), np.float32)
        return np.concatenate([b.rows for b in blocks])

    def evict(self, ns: kvstore_pb2.KvNamespace | None = None) -> int:
        """Drops every block of `ns`, or every block; returns how many."""
        root = kvkeys.root(ns) if ns is not None else None
        with self._lock:
            keys = {k for k, b in self._memory.items() if root is None or b.namespace == root}
            keys |= {k for k, e in self._disk.items() if root is None or e.namespace == root}
            for key in keys:
                self._drop_memory(key)
                self._drop_disk(key)
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
            return StoreStats(blocks=len(self._memory.keys() | self._disk.keys()), memory_bytes=self._memory_bytes,
                              disk_bytes=self._disk_bytes, capacity_bytes=self.capacity_bytes, lookups=self._lookups,
                              hit_tokens=self._hit_tokens, miss_tokens=self._miss_tokens,
                              hit_ratio=self._hit_tokens / looked if looked else 0.0, evictions=self._evictions,
                              corrupt_blocks=self._corrupt, seed_bytes_per_s=float(rates["seed"]),
                              copy_bytes_per_s=float(rates["copy"]))

    # -- internals (the lock is held) ---------------------------------------------------------------------------

    def _walk(self, ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int], max_tokens: int) -> list[Block]:
        """The blocks of the longest stored prefix, block by block along the chain; counts the lookup."""
        bt = self.layout(ns).block_tokens
        looked = min(len(token_ids), max_tokens) if max_tokens else len(token_ids)
        keys = kvkeys.chain(ns, token_ids[:looked // bt * bt])
        blocks: list[Block] = []
        with self._lock:
            for key in keys:
                block = self._fetch(key)
                if block is None:
                    break
                blocks.append(block)
            self._lookups += 1
            self._hit_tokens += len(blocks) * bt
            self._miss_tokens += looked - len(blocks) * bt
        return blocks

    def _fetch(self, key: bytes) -> Block | None:
        block = self._memory.get(key)
        if block is not None:
            self._touch(key)
            return block
        if key not in self._disk:
            return None
        block = self._read_file(key)
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
        """Puts a block in the memory tier and evicts least recently used blocks down to capacity."""
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

    def _write_file(self, key: bytes, block: Block) -> None:
        assert self._dir is not None
        header = json.dumps({"key": key.hex(), "namespace": block.namespace.hex(), "dtype": "f32",
                             "shape": list(block.rows.shape), "incarnation": block.incarnation,
                             "epoch": block.epoch}).encode()
        payload = block.rows.astype("<f4", copy=False).tobytes()
        digest = hashlib.sha256(header + payload).digest()
        path = self._dir / key.hex()
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_PREAMBLE.pack(MAGIC, digest, len(header)) + header + payload)
            os.replace(tmp, path)  # a crash mid-write leaves a .tmp, never a torn block under the key's name
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("disk tier write failed; the block stays in memory only", extra={"error": str(e)})
            return
        size = _PREAMBLE.size + len(header) + len(payload)
        self._disk[key] = _DiskEntry(block.namespace, size)
        self._disk_bytes += size
        while self.disk_capacity_bytes and self._disk_bytes > self.disk_capacity_bytes and self._disk:
            self._drop_disk(next(iter(self._disk)))
            self._evictions += 1

    def _read_file(self, key: bytes) -> Block | None:
        """The block from disk, or None (and the file deleted, counted) when it fails its checksum."""
        assert self._dir is not None
        try:
            data = (self._dir / key.hex()).read_bytes()
            header, payload = _split(data)
            if header["key"] != key.hex():
                raise ValueError(f"file holds block {header['key']}")
            shape = tuple(int(d) for d in header["shape"])
            rows = np.frombuffer(payload, dtype="<f4").reshape(shape)  # read-only: bytes are immutable
            return Block(bytes.fromhex(header["namespace"]), rows, int(header["incarnation"]), int(header["epoch"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
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
                    if magic != MAGIC:
                        raise ValueError("bad magic")
                    header = json.loads(f.read(header_len))
                stat = path.stat()
                found.append((stat.st_mtime, key, _DiskEntry(bytes.fromhex(header["namespace"]), stat.st_size)))
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
                                             "scan_ms": round((time.monotonic() - started) * 1e3, 1)})


def _split(data: bytes) -> tuple[dict[str, Any], memoryview]:
    """(header, payload) of a block file; raises ValueError when the checksum or the sizes disagree."""
    if len(data) < _PREAMBLE.size:
        raise ValueError(f"{len(data)} bytes is shorter than the preamble")
    magic, digest, header_len = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("bad magic")
    body = memoryview(data)[_PREAMBLE.size:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch")
    header = json.loads(bytes(body[:header_len]))
    payload = body[header_len:]
    if header.get("dtype") != "f32" or len(payload) != 4 * int(np.prod(header["shape"])):
        raise ValueError(f"payload of {len(payload)} bytes does not match f32{header.get('shape')}")
    return header, payload
