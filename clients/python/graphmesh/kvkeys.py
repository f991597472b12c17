"""KV block keys: a SHA-256 chain over fixed-size token blocks, rooted in what the rows mean.

h_0 = SHA-256(namespace), h_i = SHA-256(h_{i-1} || tokens of block i as little-endian int64). Never
Python's hash(): keys must be equal across processes, restarts and machines.
"""

from __future__ import annotations

import hashlib
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
    fields = (ns.model_identity, ns.layout, dtypes.from_proto(ns.dtype), ns.layer_start, ns.layer_end, ns.kv_dim,
              ns.block_tokens)
    return hashlib.sha256("|".join(str(f) for f in fields).encode()).digest()


def chain(ns: kvstore_pb2.KvNamespace, token_ids: Sequence[int]) -> list[bytes]:
    """The key of every whole block of `token_ids`, in order."""
    block = ns.block_tokens or DEFAULT_BLOCK_TOKENS
    tokens = np.asarray(token_ids, dtype="<i8")
    keys, h = [], root(ns)
    for start in range(0, len(tokens) - block + 1, block):
        h = hashlib.sha256(h + tokens[start:start + block].tobytes()).digest()
        keys.append(h)
    return keys
