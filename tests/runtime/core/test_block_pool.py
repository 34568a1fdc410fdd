"""Free queue, block pool and block hashing (the spirit of vLLM's tests/v1/core/test_kv_cache_utils.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from kiln.runtime.core.block_pool import BlockPool
from kiln.runtime.core.kv_cache_utils import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    hash_block_tokens,
    make_block_hash_with_group_id,
)
from kiln.runtime.core.request import Request

from tests.sched_fakes import FakeSamplingParams


def _ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_ops():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 6 and _ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    assert q.popleft().block_id == 0
    q.remove(blocks[3])  # O(1) from the middle
    assert _ids(q.get_all_free_blocks()) == [1, 2, 4, 5] and q.num_free_blocks == 4
    assert _ids(q.popleft_n(2)) == [1, 2]
    assert blocks[1].prev_free_block is None and blocks[1].next_free_block is None
    q.append(blocks[0])
    q.append_n([blocks[3], blocks[1]])
    assert _ids(q.get_all_free_blocks()) == [4, 5, 0, 3, 1] and q.num_free_blocks == 5
    assert _ids(q.popleft_n(5)) == [4, 5, 0, 3, 1]
    assert q.num_free_blocks == 0 and q.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft_n(1)
    q.append(blocks[2])
    assert _ids(q.popleft_n(1)) == [2]
    with pytest.raises(RuntimeError):
        q.remove(blocks[2])  # not in the queue


def test_hashes_are_chained_and_stable():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert len(a) == 32
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(None, [5, 6])  # parent matters
    assert hash_block_tokens(None, [1, 2], ("salt",)) != hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [2**40, -1]) != hash_block_tokens(None, [2**40, 1])
    key = make_block_hash_with_group_id(a, 3)
    assert get_block_hash(key) == a and get_group_id(key) == 3
    # Same value in another interpreter with another PYTHONHASHSEED.
    code = ("from kiln.runtime.core.kv_cache_utils import hash_block_tokens as h;"
            "print(h(h(None,[1,2,3,4]),[5,6],('x',1)).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip() for seed in ("0", "123")}
    assert outs == {hash_block_tokens(a, [5, 6], ("x", 1)).hex()}


def test_request_block_hasher_follows_appended_tokens():
    hasher = get_request_block_hasher(4)
    req = Request("r", [1, 2, 3, 4, 5, 6], FakeSamplingParams(), block_hasher=hasher)
    assert len(req.block_hashes) == 1
    assert req.block_hashes[0] == hash_block_tokens(None, [1, 2, 3, 4])
    req.append_output_token_ids(7)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([8, 9])
    assert req.block_hashes == [hash_block_tokens(None, [1, 2, 3, 4]),
                                hash_block_tokens(req.block_hashes[0], [5, 6, 7, 8])]
    salted = Request("s", [1, 2, 3, 4], FakeSamplingParams(), block_hasher=hasher, cache_salt="u1")
    assert salted.block_hashes[0] != req.block_hashes[0]
    # a prompt of several full blocks (packed in one go): the chain hash_block_tokens gives, the
    # salt in the first block only
    long = Request("l", list(range(11)), FakeSamplingParams(), block_hasher=hasher, cache_salt="u1")
    first = hash_block_tokens(None, [0, 1, 2, 3], ("u1",))
    assert long.block_hashes == [first, hash_block_tokens(first, [4, 5, 6, 7])]


def test_pool_reserves_null_block_and_counts_usage():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert _ids(blocks) == [1, 2, 3] and all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 4 and all(b.ref_cnt == 0 for b in blocks)
    # Freed in reverse: the tail block (3) is handed out first after the never-used 4.
    assert _ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 2, 1]


def _cached_request(pool: BlockPool, rid: str, tokens: list[int], block_size: int):
    req = Request(rid, tokens, FakeSamplingParams(), block_hasher=get_request_block_hasher(block_size))
    blocks = pool.get_new_blocks(len(tokens) // block_size)
    pool.cache_full_blocks(req, blocks, 0, len(blocks), block_size, kv_cache_group_id=0)
    return req, blocks


def test_cache_touch_and_lazy_eviction():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    req, blocks = _cached_request(pool, "a", [1, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    h0, h1 = req.block_hashes
    assert pool.get_cached_block(h0, [0]) == [blocks[0]]
    assert pool.get_cached_block(h0, [1]) is None  # another group's cache
    pool.free_blocks(reversed(blocks))
    # Free but still cached: findable until the free queue hands it out.
    assert pool.get_cached_block(h1, [0]) == [blocks[1]]
    pool.touch(([blocks[0]],))  # a prefix hit takes it out of the free queue
    assert blocks[0].ref_cnt == 1 and pool.get_num_free_blocks() == 2
    new = pool.get_new_blocks(2)  # block 3 (never used), then block 2 = blocks[1] (evicted)
    assert _ids(new) == [3, blocks[1].block_id]
    assert blocks[1].block_hash is None and pool.get_cached_block(h1, [0]) is None
    assert pool.get_cached_block(h0, [0]) == [blocks[0]]
    assert pool.stats.evictions == 1


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    req, blocks = _cached_request(pool, "a", [1, 2, 3, 4], block_size=4)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.get_cached_block(req.block_hashes[0], [0]) is not None
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None and blocks[0].block_hash is None


def test_duplicate_hashes_share_one_entry_until_both_evicted():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    ra, ba = _cached_request(pool, "a", [1, 2, 3, 4], block_size=4)
    rb, bb = _cached_request(pool, "b", [1, 2, 3, 4], block_size=4)
    assert ra.block_hashes == rb.block_hashes and ba[0] is not bb[0]
    pool.free_blocks(ba + bb)
    pool.get_new_blocks(2)  # block 3, then ba[0]: evicted, bb[0] still serves the hash
    assert pool.get_cached_block(ra.block_hashes[0], [0]) == [bb[0]]
