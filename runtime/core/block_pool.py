"""The pool of KV cache blocks and the prefix cache's hash -> block map.

Ported in behaviour from vLLM V1 `vllm/v1/core/block_pool.py` (`BlockPool`,
`BlockHashToBlockMap`). Block 0 is the null block: never handed out, it pads
block tables (and, later, marks skipped sliding-window blocks).

A freed block keeps its hash and stays findable by a prefix-cache lookup until
the free queue hands it out again: eviction is lazy, at `get_new_blocks` time.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.runtime.core.kv_cache_utils import (
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_block_hash_with_group_id,
)

if TYPE_CHECKING:
    from kiln.runtime.core.request import Request


class BlockHashToBlockMap:
    """hash-with-group -> cached blocks. Two requests may compute the same block
    in the same step, so one hash can name several blocks; any of them serves a
    hit (vLLM keeps the same multimap)."""

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def insert_all(self, keyed: Iterable[tuple[BlockHashWithGroupId, KVCacheBlock]]) -> None:
        """Make each (key, block) findable, in one loop (a 2,048-token prompt caches 128 blocks)."""
        cache = self._cache
        for key, block in keyed:
            entry = cache.get(key)
            if entry is None:
                cache[key] = {block.block_id: block}
            else:
                entry[block.block_id] = block

    def evict(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Forget the hash of each block that has one (pop() and the block's reset_hash, in one
        loop: with fresh prompts every block handed out still names an old prefix). -> how many."""
        cache, evicted = self._cache, 0
        for block in blocks:
            key = block._block_hash
            if key is None:
                continue
            entry = cache.get(key)
            if entry is not None:
                entry.pop(block.block_id, None)
                if not entry:
                    del cache[key]
            block._block_hash = None
            evicted += 1
        return evicted

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[key]
        return block

    def __len__(self) -> int:
        return len(self._cache)


@dataclass
class BlockPoolStats:
    """Block-level prefix-cache counters (the token-level ones live in
    PrefixCacheStats): lookups/hits of single block hashes and evictions of
    cached-but-free blocks. Cumulative since construction."""

    block_lookups: int = 0
    block_hits: int = 0
    evictions: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (1 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.stats = BlockPoolStats()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash: BlockHash,
                         kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """-> the cached block of this hash for every group, or None if any group misses."""
        out = []
        self.stats.block_lookups += 1
        for gid in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, gid))
            if block is None:
                return None
            out.append(block)
        self.stats.block_hits += 1
        return out

    def cache_full_blocks(self, request: Request, blocks: Sequence[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int) -> None:
        """Give blocks[num_cached_blocks:num_full_blocks] the request's hashes and
        make them findable. The request's block hashes must cover num_full_blocks."""
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        assert len(hashes) >= num_full_blocks, (
            f"request {request.request_id}: {len(hashes)} block hashes, {num_full_blocks} full blocks")
        # make_block_hash_with_group_id's suffix made once (a 2,048-token prompt caches 128 blocks)
        gid = make_block_hash_with_group_id(BlockHash(b""), kv_cache_group_id)
        keyed = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:  # skipped (e.g. out of a sliding window): nothing to cache
                continue
            key = hashes[i] + gid
            block.block_hash = key
            keyed.append((key, block))
        self.cached_block_hash_to_block.insert_all(keyed)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, kv_cache_group_id: int) -> None:
        """Give one block a hash and make it findable (a hybrid's state snapshot)."""
        key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
        block.block_hash = key
        self.cached_block_hash_to_block.insert_all(((key, block),))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop num_blocks free blocks (LRU first), evicting their cached hashes.
        The caller checks `get_num_free_blocks()` first; asking for more raises."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool "
                             f"({self.get_num_free_blocks()} free)")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            self.stats.evictions += self.cached_block_hash_to_block.evict(blocks)
        for block in blocks:
            assert block.ref_cnt == 0
            block.ref_cnt = 1
        return blocks

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop the hashes of blocks whose contents will never be written (a
        request preempted after it was scheduled in the same step)."""
        for block in blocks:
            if block.block_hash is not None and not block.is_null:
                self.cached_block_hash_to_block.pop(block.block_hash, block.block_id)
                block.reset_hash()

    def touch(self, blocks: Iterable[Sequence[KVCacheBlock]]) -> None:
        """Take a reference on prefix-cache hits (per group); a hit that was free
        leaves the free queue so it cannot be evicted."""
        for group_blocks in blocks:
            for block in group_blocks:
                if block.is_null:  # the null block is never counted (nor freed)
                    continue
                if block.ref_cnt == 0:
                    self.free_block_queue.remove(block)
                block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free
        queue's tail in the given order (callers pass a request's blocks in
        reverse, so its tail blocks are evicted before its shared prefix)."""
        to_free = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"negative ref count on {block}"
            if block.ref_cnt == 0:
                to_free.append(block)
        self.free_block_queue.append_n(to_free)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible when no request holds a block."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        total = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total else 0.0
