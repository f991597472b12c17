"""KvPool: blocks lent all or nothing, never the scratch block, and slots that match the block tables."""

from __future__ import annotations

import numpy as np
import pytest

from graphmesh.errors import FailedPrecondition, ResourceExhausted
from graphmesh_executor.kv_pool import SCRATCH_BLOCK, KvPool


def test_tables_grow_all_or_nothing_and_never_lend_the_scratch_block() -> None:
    pool = KvPool(8, 16)
    pool.reserve("a", 50)  # 4 blocks
    pool.reserve("b", 16)  # 1 block
    assert len(pool.table("a")) == 4 and len(pool.table("b")) == 1 and pool.free == 2
    with pytest.raises(ResourceExhausted) as e:
        pool.reserve("b", 16 * 4)  # 3 more blocks: only 2 free
    assert e.value.reason == "KV_POOL_EXHAUSTED" and len(pool.table("b")) == 1 and pool.free == 2
    lent = pool.table("a") + pool.table("b")
    assert SCRATCH_BLOCK not in lent and len(set(lent)) == len(lent)
    pool.release("a")
    assert pool.free == 6
    pool.clear()
    assert pool.free == pool.lendable == 7 and pool.table("b") == []


def test_slots_of_one_position_match_the_slots_of_a_range() -> None:
    pool = KvPool(64, 16)
    pool.reserve("a", 40)
    pool.reserve("b", 40)
    pool.reserve("a", 130)  # a's table interleaves with b's blocks
    every = pool.slots("a", 0, 130)
    table = np.asarray(pool.table("a"))
    assert (every == table[np.arange(130) // 16] * 16 + np.arange(130) % 16).all()
    for position in range(130):
        assert pool.slots("a", position, position + 1).tolist() == [every[position]]
    assert pool.slots("a", 33, 45).tolist() == every[33:45].tolist()


def test_shared_blocks_are_free_again_only_when_the_last_holder_lets_go() -> None:
    pool = KvPool(16, 16)
    pool.reserve("donor", 16 * 3 + 5)  # 4 blocks, the last one partial
    pool.share("a", "donor", 3)
    pool.share("b", "donor", 2)
    assert pool.table("a") == pool.table("donor")[:3] and pool.table("b") == pool.table("donor")[:2]
    assert pool.free == 15 - 4
    pool.reserve("a", 16 * 3 + 1)  # a grows into a block of its own, past the shared ones
    assert pool.table("a")[3] not in pool.table("donor") and pool.free == 10
    pool.release("donor")  # blocks 0-2 still held: only the donor's last block comes back
    assert pool.free == 11
    pool.release("a")  # the third shared block and a's own one
    assert pool.free == 13
    pool.release("b")
    assert pool.free == 15 and pool.lendable == 15
    with pytest.raises(FailedPrecondition):
        pool.share("c", "nobody", 1)
    pool.reserve("d", 1)
    with pytest.raises(FailedPrecondition):
        pool.share("d", "d", 1)  # only a new session starts from a shared prefix
