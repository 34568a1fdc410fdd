"""KVCacheManager: prefix hits, allocation, ref counts, eviction order, usage, reset
(the spirit of vLLM's tests/v1/core/test_prefix_caching.py)."""
from __future__ import annotations

import pytest
from kiln.runtime.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from kiln.runtime.core.kv_cache_manager import KVCacheManager
from kiln.runtime.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, full_attention_config
from kiln.runtime.core.kv_cache_utils import get_request_block_hasher
from kiln.runtime.core.request import Request, RequestStatus

from tests.sched_fakes import FakeSamplingParams, create_scheduler, make_request

BS = 16


def _manager(num_blocks: int = 11, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(full_attention_config(num_blocks, BS), max_model_len=4096, enable_caching=caching)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, FakeSamplingParams(), block_hasher=get_request_block_hasher(BS))


def _admit(m: KVCacheManager, req: Request) -> tuple[int, list[int]]:
    """What the scheduler does for a waiting request computed in one step."""
    hits, n = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - n, n, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return n, m.get_block_ids(req.request_id)[0]


def test_prefill_then_prefix_hit():
    m = _manager()
    common = list(range(1, 65))  # 4 full blocks
    a = _req("a", common + [100, 101, 102])
    hits, n = m.get_computed_blocks(a)
    assert n == 0 and hits.get_block_ids() == ([],)
    new = m.allocate_slots(a, a.num_tokens, 0, hits)
    assert new.get_block_ids() == ([1, 2, 3, 4, 5],)
    a.num_computed_tokens = a.num_tokens
    # Only the full blocks are published.
    assert [b.block_hash is not None for b in m.get_blocks("a").blocks[0]] == [True] * 4 + [False]
    m.free(a)
    assert m.block_pool.get_num_free_blocks() == 10
    b = _req("b", common + [200, 201])
    n, ids = _admit(m, b)
    assert n == 64 and ids[:4] == [1, 2, 3, 4]  # shares a's prefix blocks
    assert all(blk.ref_cnt == 1 for blk in m.get_blocks("b").blocks[0])


def test_hit_never_covers_the_last_token():
    m = _manager()
    prompt = list(range(1, 33))  # exactly 2 blocks
    a = _req("a", prompt)
    _admit(m, a)
    b = _req("b", prompt)
    hits, n = m.get_computed_blocks(b)
    assert n == 16 and len(hits.blocks[0]) == 1  # the last block is recomputed for logits


def test_ref_counts_with_shared_prefix():
    m = _manager()
    common = list(range(1, 33))
    a, b = _req("a", common + [7]), _req("b", common + [8])
    _admit(m, a)
    n, _ = _admit(m, b)
    assert n == 32
    shared = m.get_blocks("a").blocks[0][:2]
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    assert m.get_num_common_prefix_blocks("a") == [2]
    m.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    m.free(b)
    assert [blk.ref_cnt for blk in shared] == [0, 0]
    assert m.block_pool.get_num_free_blocks() == 10 and m.usage == 0.0


def test_get_computed_blocks_takes_no_reference():
    m = _manager()
    a = _req("a", list(range(1, 40)))
    _admit(m, a)
    m.free(a)
    free = m.block_pool.get_num_free_blocks()
    b = _req("b", list(range(1, 40)))
    hits, n = m.get_computed_blocks(b)
    assert n == 32
    assert m.block_pool.get_num_free_blocks() == free and all(blk.ref_cnt == 0 for blk in hits.blocks[0])


def test_allocation_fails_cleanly():
    m = _manager(num_blocks=5)  # 4 usable blocks
    a = _req("a", list(range(1, 50)))  # needs 4 blocks
    _admit(m, a)
    b = _req("b", list(range(1000, 1010)))
    hits, n = m.get_computed_blocks(b)
    assert m.allocate_slots(b, b.num_tokens, n, hits) is None
    assert m.get_block_ids("b") == ([],) and m.block_pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError):
        m.allocate_slots(b, 0)


def test_decode_grows_one_block_at_a_time_and_caches_full_blocks():
    m = _manager()
    a = _req("a", list(range(1, 16)))  # 15 tokens: 1 block
    _admit(m, a)
    a.append_output_token_ids(99)  # token 16: fills block 0
    assert m.allocate_slots(a, 1).get_block_ids() == ([],)
    a.num_computed_tokens += 1
    assert m.get_blocks("a").blocks[0][0].block_hash is not None
    a.append_output_token_ids(98)  # token 17 needs block 1
    assert len(m.allocate_slots(a, 1).blocks[0]) == 1


def test_eviction_order_lru_and_tail_first():
    m = _manager(num_blocks=9)  # 8 usable
    a = _req("a", list(range(1, 50)))  # blocks 1-4 (3 full + 1 partial)
    b = _req("b", list(range(100, 149)))  # blocks 5-8
    _admit(m, a)
    _admit(m, b)
    m.free(a)  # freed first -> evicted first; within a, tail first
    m.free(b)
    order = [blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert order == [4, 3, 2, 1, 8, 7, 6, 5]
    c = _req("c", list(range(1000, 1017)))  # 2 blocks: evicts a's tail, then a's 3rd block
    _, ids = _admit(m, c)
    assert ids == [4, 3]
    # a's first two blocks survive: a request sharing a's first 32 tokens hits them.
    d = _req("d", list(range(1, 40)))
    assert m.get_computed_blocks(d)[1] == 32


def test_hit_counts_evictable_blocks_against_free_space():
    m = _manager(num_blocks=5)  # 4 usable
    a = _req("a", list(range(1, 50)))  # 4 blocks, 3 full
    _admit(m, a)
    m.free(a)
    # b hits a's 3 cached-but-free blocks; they count as used once touched, so
    # b (4 blocks total) fits exactly, and a 5th block would not.
    b = _req("b", list(range(1, 49)) + [500, 501])
    hits, n = m.get_computed_blocks(b)
    assert n == 48
    assert m.allocate_slots(b, b.num_tokens - n, n, hits, num_lookahead_tokens=16) is None
    assert m.allocate_slots(b, b.num_tokens - n, n, hits) is not None
    assert m.block_pool.get_num_free_blocks() == 0


def test_no_caching_means_no_hits():
    m = _manager(caching=False)
    a = _req("a", list(range(1, 40)))
    _admit(m, a)
    m.free(a)
    assert m.get_computed_blocks(_req("b", list(range(1, 40))))[1] == 0
    assert all(blk.block_hash is None for blk in m.block_pool.blocks)
    assert isinstance(m.coordinator, KVCacheCoordinatorNoPrefixCache)


def test_reset_prefix_cache_and_stats():
    m = _manager()
    a = _req("a", list(range(1, 40)))
    _admit(m, a)
    assert not m.reset_prefix_cache()  # a still holds blocks
    m.free(a)
    b = _req("b", list(range(1, 40)))
    m.record_prefix_cache_stats(b, m.get_computed_blocks(b)[1])
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 39, 32)
    assert m.make_prefix_cache_stats().requests == 0  # a delta: reset on take
    assert m.reset_prefix_cache()
    assert m.get_computed_blocks(b)[1] == 0 and m.prefix_cache_stats.reset


def test_uncache_blocks_after_unwritten_step():
    m = _manager()
    a = _req("a", list(range(1, 50)))
    hits, n = m.get_computed_blocks(a)
    m.allocate_slots(a, a.num_tokens, n, hits)  # publishes 3 full blocks before the step runs
    m.free(a, num_valid_tokens=0)  # ... which never ran
    assert m.get_computed_blocks(_req("b", list(range(1, 50))))[1] == 0


def test_coordinator_selection():
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype="f16")
    assert spec.page_size_bytes == 2 * BS * 2 * 8 * 2
    one = KVCacheConfig(10, (KVCacheGroupSpec(("l0",), spec),))
    two = KVCacheConfig(10, (KVCacheGroupSpec(("l0",), spec), KVCacheGroupSpec(("l1",), spec)))
    assert isinstance(get_kv_cache_coordinator(one, 100, True), UnitaryKVCacheCoordinator)
    assert isinstance(get_kv_cache_coordinator(two, 100, False), KVCacheCoordinatorNoPrefixCache)
    with pytest.raises(NotImplementedError):
        get_kv_cache_coordinator(two, 100, True)
    assert HybridKVCacheCoordinator.__doc__


def test_scheduler_64_token_prefix_hit_schedules_only_the_rest():
    s = create_scheduler(num_blocks=50)
    common = list(range(1, 65))
    first = make_request("first", common + list(range(500, 510)), max_tokens=1)
    s.add_request(first)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"first": 74}
    s.update_from_output(out, _sample(out))
    assert not s.has_unfinished_requests()  # max_tokens=1: finished, blocks freed (still cached)
    second = make_request("second", common + list(range(900, 930)))
    s.add_request(second)
    out = s.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 64
    assert out.num_scheduled_tokens == {"second": 30}
    assert second.num_cached_tokens == 64
    stats = s.make_stats().prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 74 + 94, 64)
    assert second.status == RequestStatus.RUNNING


def _sample(out):
    from kiln.runtime.core.sched_output import ModelRunnerOutput
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(ids, [[5] for _ in ids])
