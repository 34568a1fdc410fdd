"""Per-group block bookkeeping: which blocks each request holds in one KV cache group.

Ported in behaviour from vLLM V1 `vllm/v1/core/single_type_kv_cache_manager.py`
(`SingleTypeKVCacheManager`, `FullAttentionManager`, `spec_manager_map`).
A new state type (sliding window, Mamba/GDN) subclasses the base, overrides
`find_longest_cache_hit` and `remove_skipped_blocks`, and registers itself in
`_MANAGER_FOR_SPEC`.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kiln.runtime.core.block_pool import BlockPool
from kiln.runtime.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MambaSpec
from kiln.runtime.core.kv_cache_utils import BlockHash, KVCacheBlock, cdiv

if TYPE_CHECKING:
    from kiln.runtime.core.request import Request


class SingleTypeKVCacheManager:
    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        # request id -> its blocks, one per block_size tokens, in order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks are cached (hashed). Only
        # full blocks of final (non-speculative) tokens are ever cached.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Free-pool blocks needed to hold num_tokens, counting prefix hits that
        are currently free (touching them takes them out of the free queue)."""
        num_required = cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks.get(request_id, ()))
        num_new = max(num_required - len(new_computed_blocks) - held, 0)
        if new_computed_blocks:
            num_new += sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Record prefix-cache hits as the request's first blocks (already touched)."""
        if request_id not in self.num_cached_block:
            # First allocation of this request (prefix hits or not).
            blocks = self.req_to_blocks.setdefault(request_id, [])
            assert not blocks, f"request {request_id} already holds blocks"
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        else:
            # A running request never gets new prefix hits.
            assert not new_computed_blocks, f"running request {request_id} got prefix-cache hits"

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's blocks to hold num_tokens; -> the new blocks."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and publish the request's full blocks among its first num_tokens."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full,
                                          self.block_size, self.kv_cache_group_id)
        self.num_cached_block[rid] = num_full

    def uncache_blocks_after(self, request_id: str, num_computed_tokens: int) -> None:
        """Un-publish the request's blocks past its computed tokens: their
        contents were never written (it is being preempted before the step that
        would have written them ran). Those blocks are private to the request:
        a block is shared only once it is full and computed."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        first = num_computed_tokens // self.block_size
        self.block_pool.uncache_blocks(blocks[first:])
        if self.num_cached_block.get(request_id, 0) > first:
            self.num_cached_block[request_id] = first

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first, so the tail is evicted first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of this request shared by every request holding blocks
        (a hint for cascade attention)."""
        num_reqs = len(self.req_to_blocks)
        n = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block.ref_cnt != num_reqs:
                break
            n += 1
        return n

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Swap blocks attention will never read again for the null block and free them."""
        raise NotImplementedError

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec) -> tuple[list[KVCacheBlock], ...]:
        """-> per group, the cached blocks of the longest prefix of at most max_length tokens."""
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec) -> tuple[list[KVCacheBlock], ...]:
        # Hashes are chained, so the first miss ends the prefix: scan left to right.
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        max_num_blocks = max_length // kv_cache_spec.block_size
        for block_hash in itertools.islice(block_hashes, max_num_blocks):
            hit = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if hit is None:
                break
            for group_blocks, block in zip(computed, hit):
                group_blocks.append(block)
        return computed

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        # Full attention reads every earlier token: nothing is ever skipped.
        pass


class MambaManager(SingleTypeKVCacheManager):
    """A hybrid model's state group (vLLM's MambaManager, prefix caching off): every request
    holds exactly one block of its own pool, its state slot, from its first step to its
    finish, abort or preemption (a preempted request recomputes, so it starts a new slot)."""

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        assert not new_computed_blocks, "a state slot is never a prefix-cache hit (prefix caching is off)"
        self.req_to_blocks.setdefault(request_id, [])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if blocks:
            return []
        blocks.extend(self.block_pool.get_new_blocks(1))
        return list(blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        pass  # a slot's state changes every step: nothing to publish

    def uncache_blocks_after(self, request_id: str, num_computed_tokens: int) -> None:
        pass

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        pass

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec) -> tuple[list[KVCacheBlock], ...]:
        raise NotImplementedError("prefix caching of a hybrid model's state is not supported yet")


_MANAGER_FOR_SPEC: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MambaSpec: MambaManager,
}


def get_manager_class(kv_cache_spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    try:
        return _MANAGER_FOR_SPEC[type(kv_cache_spec)]
    except KeyError:
        raise NotImplementedError(f"no KV cache manager for {type(kv_cache_spec).__name__}") from None


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, block_pool: BlockPool,
                                  kv_cache_group_id: int) -> SingleTypeKVCacheManager:
    return get_manager_class(kv_cache_spec)(kv_cache_spec, block_pool, kv_cache_group_id)
