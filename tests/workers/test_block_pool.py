"""BlockPool and KVCacheManager: exact block ids, ref counts, prefix hits and eviction order."""

from __future__ import annotations

import pytest

from kvrelay.core.page_keys import page_keys
from kvrelay.core.sampling import SamplingParams
from kvrelay.workers.engine.block_pool import BlockPool, NoFreeBlocksError
from kvrelay.workers.engine.kv_cache_manager import KVCacheManager
from kvrelay.workers.engine.sequence import Sequence

K = [bytes([i]) * 16 for i in range(10)]


def test_allocate_in_order_and_release_tail_first():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.free_block_ids() == [3, 4, 5]
    pool.release([0, 1, 2])
    # keyless blocks go to the front, the sequence's last block first
    assert pool.free_block_ids() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(7)
    with pytest.raises(ValueError, match="released more often"):
        pool.release([0])


def test_cached_blocks_hit_then_evict_lru_tail_first():
    pool = BlockPool(5)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    for blk, key in zip(a + b, K[:4], strict=True):
        assert pool.cache_block(blk, key)
    pool.release(a)  # freed first: evicted first
    pool.release(b)
    # free queue: keyless 4, then a tail-first (1, 0), then b tail-first (3, 2)
    assert pool.free_block_ids() == [4, 1, 0, 3, 2]
    assert pool.lookup([K[0], K[1], K[5]]) == [0, 1]
    assert pool.lookup([K[1]]) == [1]
    assert pool.lookup([K[5], K[0]]) == []
    assert pool.allocate(2) == [4, 1]  # 1 evicted: key K[1] gone
    assert pool.num_evictions == 1
    assert pool.lookup([K[0], K[1]]) == [0]
    pool.acquire([2])  # a hit on a free block takes it out of the queue
    assert pool.blocks[2].ref_count == 1
    assert pool.free_block_ids() == [0, 3]
    assert pool.allocate(1) == [0]
    assert pool.lookup([K[0]]) == []
    assert pool.lookup([K[2]]) == [2]


def test_duplicate_key_is_not_registered_twice():
    pool = BlockPool(3)
    x, y = pool.allocate(2)
    assert pool.cache_block(x, K[0])
    assert not pool.cache_block(y, K[0])
    assert pool.lookup([K[0]]) == [x]
    pool.release([x, y])
    assert pool.free_block_ids() == [y, 2, x]
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup([K[0]]) == []


def test_prefix_caching_disabled():
    pool = BlockPool(2, enable_prefix_caching=False)
    (b,) = pool.allocate(1)
    assert not pool.cache_block(b, K[0])
    assert pool.lookup([K[0]]) == []


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(), seed=0)


def test_kv_cache_manager_prefix_hits_and_commit():
    kv = KVCacheManager(BlockPool(8), page_size=4, fingerprint="fp")
    a = seq("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.match_prefix(a) == 0
    assert kv.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.commit(a)
    assert a.block_keys == page_keys(list(range(10)), 4, "fp")
    assert a.num_registered_blocks == 2
    # same first 8 tokens + different tail; salt isolates
    b = seq("b", list(range(8)) + [50, 51, 52])
    assert kv.match_prefix(b) == 8
    assert b.block_table == [0, 1] and b.num_cached_tokens == 8
    salted = seq("c", list(range(10)))
    salted.cache_salt = "tenant"
    assert kv.match_prefix(salted) == 0
    # an exact 8-token prompt reuses only one block: the last token must be computed
    d = seq("d", list(range(8)))
    assert kv.match_prefix(d) == 4
    assert kv.pool.blocks[0].ref_count == 3 and kv.pool.blocks[1].ref_count == 2
    assert kv.allocate_slots(b, 3)
    assert b.block_table == [0, 1, 3]
    for s in (a, b, salted, d):
        kv.free(s)
    assert kv.pool.num_free_blocks == 8
    assert kv.allocate_slots(a, 0) and a.block_table == []


def test_allocate_slots_fails_without_change():
    kv = KVCacheManager(BlockPool(2), page_size=4, fingerprint="fp")
    s = seq("s", list(range(12)))
    kv.match_prefix(s)
    assert not kv.allocate_slots(s, 12)
    assert s.block_table == [] and kv.pool.num_free_blocks == 2
    assert kv.allocate_slots(s, 8)
    assert s.block_table == [0, 1]
