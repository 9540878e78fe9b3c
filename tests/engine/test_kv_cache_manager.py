from __future__ import annotations

import pytest

from tokentape.engine.core.kv_cache_manager import KVCacheManager
from tokentape.events.schema import SamplingParams
from tokentape.events.state import RequestState


def req(req_id: str, tokens: list[int]) -> RequestState:
    return RequestState(req_id, tokens, SamplingParams(), 0)


def test_allocate_and_free_counts_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    blocks = kv.allocate(0, 9)
    assert blocks == [0, 1, 2] and kv.num_free_blocks == 1
    assert kv.allocate(3, 13) == [3]
    assert kv.allocate(4, 17) is None  # nothing left, nothing taken
    assert kv.num_free_blocks == 0
    kv.free("r", [0, 1, 2, 3])
    assert kv.num_free_blocks == 4


def test_double_free_is_detected() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    blocks = kv.allocate(0, 4)
    kv.free("r", blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        kv.free("r", blocks)


def test_prefix_cache_hits_only_full_confirmed_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(10)))  # two full blocks and a partial one
    blocks = kv.allocate(0, 10)
    kv.cache_full_blocks(a, [], blocks, 10)
    kv.free("a", blocks)
    b = req("b", list(range(8)) + [99, 98, 97])
    hits = kv.get_computed_blocks(b)
    assert hits == blocks[:2]
    c = req("c", [1] + list(range(1, 10)))
    assert kv.get_computed_blocks(c) == []  # the chain breaks at the first block


def test_a_hit_always_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(8)))
    blocks = kv.allocate(0, 8)
    kv.cache_full_blocks(a, [], blocks, 8)
    kv.free("a", blocks)
    assert len(kv.get_computed_blocks(req("b", list(range(8))))) == 1


def test_placeholders_are_never_hashed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(6)))
    blocks = kv.allocate(0, 9)  # 6 confirmed tokens, 3 computed positions not confirmed yet
    kv.cache_full_blocks(a, [], blocks, 9)
    assert sum(h is not None for h in kv.block_hash) == 1


def test_lru_eviction_prefers_least_recently_freed_and_tails_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4])
    blocks = kv.allocate(0, 4)
    kv.cache_full_blocks(a, [], blocks, 4)
    kv.free("a", blocks)
    # Free blocks: the two never-used ones, then a's tail block, then a's head block.
    assert kv.allocate(0, 6) == [2, 3, blocks[1]]
    assert kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == [blocks[0]]


def test_reset_prefix_cache_refused_while_blocks_are_in_use() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    blocks = kv.allocate(0, 3)
    kv.cache_full_blocks(a, [], blocks, 3)
    assert kv.reset_prefix_cache() is False
    kv.free("a", blocks)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(req("b", [1, 2, 3])) == []


def test_taking_a_free_cached_block_counts_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = req("a", [1, 2, 3])
    blocks = kv.allocate(0, 3)
    kv.cache_full_blocks(a, [], blocks, 3)
    kv.free("a", blocks)
    b = req("b", [1, 2, 9, 9, 9, 9, 9])
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 1
    assert kv.allocate(0, 8, hits) is None  # 1 hit + 3 new > 3 blocks
    got = kv.allocate(0, 6, hits)
    assert got is not None and got[0] == hits[0] and kv.num_free_blocks == 0


def test_a_preempted_request_never_hits_its_last_tokens_block() -> None:
    # Its hash chain covers every full block, the last one included when its length is a
    # multiple of the block size; a hit there would leave no token to compute (and sample).
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("r", list(range(8)))
    blocks = kv.allocate(0, 8)
    kv.cache_full_blocks(r, [], blocks, 8)
    kv.free("r", blocks)  # preempted: the blocks stay cached
    assert kv.get_computed_blocks(r) == blocks[:1]
