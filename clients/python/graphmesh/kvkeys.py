"""KV block keys: a SHA-256 chain over fixed-size token blocks, rooted in what the rows mean, one key per layer.

h_0 = SHA-256(model identity | layout | dtype | kv_dim | block size), h_i = SHA-256(h_{i-1} || tokens of block i
as little-endian int64), and the entry of layer l for block i is SHA-256(h_i || "layer" || l as little-endian
uint32). The root leaves out which layers a stage holds: a layer's rows depend only on the model and the
tokens, so keying them per layer lets a stage of any later layer split (after a re-plan) find the rows that
stages of the old split wrote. Never Python's hash(): keys must be equal across processes, restarts and machines.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from graphmesh import dtypes
from graphmesh.v1 import kvstore_pb2

ROW_LAYOUT = "rows[tokens,layers,2,kv_dim]"
DEFAULT_BLOCK_TOKENS = 16


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks a session of `tokens` tokens holds: the one count that the coordinator's admission and every rank's
    KV pool must agree on."""
    return -(-tokens // block_tokens)


def namespace(model_identity: str, layer_start: int, layer_end: int, kv_dim: int, dtype: str = "f32",
              block_tokens: int = DEFAULT_BLOCK_TOKENS) -> kvstore_pb2.KvNamespace:
    return kvstore_pb2.KvNamespace(model_identity=model_identity, layout=ROW_LAYOUT, dtype=dtypes.to_proto(dtype),
                                   layer_start=layer_start, layer_end=layer_end, kv_dim=kv_dim,
                                   block_tokens=block_tokens)


def root(ns: kvstore_pb2.KvNamespace) -> bytes:
    """The chain's root: everything the rows' meaning depends on except the layer range (see the module doc)."""
    fields = (ns.model_identity, ns.layout, dtypes.from_proto(ns.dtype), ns.kv_dim, ns.block_tokens)
    return hashlib.sha256("|".join(str(f) for f in fields).encode()).digest()


def link(previous: bytes, block_token_ids: Sequence[int]) -> bytes:
    """h_i from h_{i-1} and the tokens of block i."""
    return hashlib.sha256(previous + np.asarray(block_token_ids, dtype="<i8").tobytes()).digest()


def chain(ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int]) -> list[bytes]:
    """The key of every whole block of `token_ids`, in order."""
    block = ns.block_tokens or DEFAULT_BLOCK_TOKENS
    keys, h = [], root(ns)
    for start in range(0, len(token_ids) - block + 1, block):
        h = link(h, token_ids[start:start + block])
        keys.append(h)
    return keys


def layer_key(link: bytes, layer: int) -> bytes:
    """The key of layer `layer`'s entry for the block whose chain link is `link`."""
    return hashlib.sha256(link + b"layer" + struct.pack("<I", layer)).digest()


def layer_keys(ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int]) -> list[list[bytes]]:
    """Per whole block of `token_ids`, the keys of the namespace's layers [layer_start, layer_end), in order."""
    layers = range(ns.layer_start, ns.layer_end)
    return [[layer_key(h, layer) for layer in layers] for h in chain(ns, token_ids)]
