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
from kiln.runtime.core.kv_cache_utils import BlockHash, KVCacheBlock, cdiv, make_block_hash_with_group_id

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
    """A hybrid model's state group (vLLM's MambaManager): every request holds exactly one
    block of its own pool, its state slot, from its first step to its finish, abort or
    preemption (a preempted request recomputes, so it starts a new slot).

    With prefix caching (vLLM's mamba_cache_mode "align"; the bookkeeping is kiln's): the
    other blocks of the pool hold snapshots. A prefill chunk that ends on a multiple of
    `snapshot_interval` tokens (the block size and GDN_CHUNK_ALIGN both divide it) gets a
    snapshot block, hashed with the prefix up to that token; the runner copies the slot into
    it. A request whose prefix hits a snapshot gets a fresh slot with the snapshot copied in,
    and computes on from there beside the attention blocks of the same prefix. Only prefill
    chunks (two tokens or more: the chunked form, at absolute 64-token chunks) are
    snapshotted, never a decode step: the recurrent form rounds differently, and a hit must
    give the cold run's bits.

    Timing. The copies travel in the SchedulerOutput of the step that needs them: restores
    (snapshot -> slot) run before that step's forward, saves (slot -> snapshot) after it, when
    the slot holds the state at the chunk's end; later steps run after both. A snapshot saved
    in a step is not served in the schedule that made it (`_pending`: the request that hits it
    waits a step). Blocks are referenced until their copies are sent, then join the free queue,
    still findable, until the pool hands them out again (LRU, as blocks).
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int,
                 snapshot_interval: int = 0, num_reserved: int = 0) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.snapshot_interval = snapshot_interval  # 0: prefix caching off
        # Free blocks a snapshot may never take: one per request that may still be admitted.
        self.num_reserved = num_reserved
        self._hit: dict[str, KVCacheBlock] = {}  # request -> the snapshot it resumes from (touched)
        self._saves: list[tuple[str, KVCacheBlock, KVCacheBlock, int]] = []  # this schedule: (req, slot, snap, end)
        self._restores: list[tuple[KVCacheBlock, KVCacheBlock]] = []  # this schedule: (snap, slot)
        self._pending: set[int] = set()  # block ids of this schedule's snapshots (written after its step)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        if new_computed_blocks and new_computed_blocks[-1].block_id in self._pending:
            return self.block_pool.num_blocks + 1  # its state is written after this step: wait
        need = 0 if self.req_to_blocks.get(request_id) else 1
        if new_computed_blocks and new_computed_blocks[-1].ref_cnt == 0:
            need += 1  # the snapshot leaves the free queue while its copy is in flight
        return need

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        self.req_to_blocks.setdefault(request_id, [])
        if new_computed_blocks:  # a prefix hit: null blocks, then one snapshot (touched by the caller)
            assert self.snapshot_interval and not new_computed_blocks[-1].is_null
            assert request_id not in self._hit, f"request {request_id} got two state hits"
            self._hit[request_id] = new_computed_blocks[-1]

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if blocks:
            return []
        blocks.extend(self.block_pool.get_new_blocks(1))
        hit = self._hit.pop(request_id, None)
        if hit is not None:
            self._restores.append((hit, blocks[0]))
        return list(blocks)

    def snapshot(self, request: Request, start: int, end: int) -> None:
        """The request's chunk [start, end) was just scheduled: keep the state at `end` if that is
        a snapshot boundary of a prefill chunk, not cached yet, and a block is to spare."""
        s = self.snapshot_interval
        if not s or end % s or end - start < 2 or end // self.block_size > len(request.block_hashes):
            return
        pool = self.block_pool
        key = request.block_hashes[end // self.block_size - 1]
        if pool.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(key, self.kv_cache_group_id)) is not None:
            return
        if pool.get_num_free_blocks() <= max(self.num_reserved - len(self.req_to_blocks), 0):
            return  # the free blocks are the slots of requests still to be admitted
        snap = pool.get_new_blocks(1)[0]
        pool.cache_block(snap, key, self.kv_cache_group_id)
        self._saves.append((request.request_id, self.req_to_blocks[request.request_id][0], snap, end))
        self._pending.add(snap.block_id)

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """-> (restores, saves) as (source, destination) slot copies of the step being output:
        restores run before its forward, saves after it. The blocks they name are let go
        (anything later runs after these copies, so handing them out again is safe)."""
        restores = [(snap.block_id, slot.block_id) for snap, slot in self._restores]
        saves = [(slot.block_id, snap.block_id) for _, slot, snap, _ in self._saves]
        self.block_pool.free_blocks([snap for snap, _ in self._restores] + [snap for _, _, snap, _ in self._saves])
        self._saves, self._restores = [], []
        self._pending.clear()
        return restores, saves

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        pass  # snapshots are published by snapshot(); a slot's state changes every step

    def uncache_blocks_after(self, request_id: str, num_computed_tokens: int) -> None:
        """The request is preempted in the step that scheduled it: a snapshot past what it
        computed would never be written."""
        keep = []
        for save in self._saves:
            rid, _, snap, end = save
            if rid == request_id and end > num_computed_tokens:
                self.block_pool.uncache_blocks([snap])
                self.block_pool.free_blocks([snap])
                self._pending.discard(snap.block_id)
            else:
                keep.append(save)
        self._saves = keep

    def free(self, request_id: str) -> None:
        hit = self._hit.pop(request_id, None)
        if hit is not None:  # touched, never allocated for
            self.block_pool.free_blocks([hit])
        # a restore already recorded still runs, into the freed slot, before any later forward
        super().free(request_id)

    def get_num_common_prefix_blocks(self, request_id: str) -> int:
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        pass

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, snapshot_interval: int = 0,
                               ) -> tuple[list[KVCacheBlock], ...]:
        """-> per group, the snapshot at the longest boundary <= max_length, searched from the
        right (vLLM's MambaManager.find_longest_cache_hit), after null blocks for the tokens
        before it (vLLM's convention: the list's length in blocks is the hit's length);
        empty lists for none."""
        bs = kv_cache_spec.block_size
        if snapshot_interval:
            for end in range(max_length - max_length % snapshot_interval, 0, -snapshot_interval):
                if end // bs <= len(block_hashes):
                    hit = block_pool.get_cached_block(block_hashes[end // bs - 1], kv_cache_group_ids)
                    if hit is not None:
                        return tuple([block_pool.null_block] * (end // bs - 1) + [b] for b in hit)
        return tuple([] for _ in kv_cache_group_ids)


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
                                  kv_cache_group_id: int, **kwargs) -> SingleTypeKVCacheManager:
    """kwargs go to the manager's constructor (MambaManager: snapshot_interval, num_reserved)."""
    return get_manager_class(kv_cache_spec)(kv_cache_spec, block_pool, kv_cache_group_id, **kwargs)
