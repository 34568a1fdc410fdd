"""The scheduler's view of the KV cache: prefix hits, slot allocation, freeing.

Ported in behaviour from vLLM V1 `vllm/v1/core/kv_cache_manager.py`
(`KVCacheBlocks`, `KVCacheManager.get_computed_blocks`, `allocate_slots`,
`free`, `reset_prefix_cache`, `get_num_common_prefix_blocks`).

Check and action are separate calls: `get_computed_blocks` only looks (it takes
no reference), and `allocate_slots` either does everything (touch hits, grow the
block list, publish full blocks) or nothing and returns None.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.runtime.core.kv_cache_coordinator import get_kv_cache_coordinator
from kiln.runtime.core.kv_cache_spec import KVCacheConfig
from kiln.runtime.core.kv_cache_utils import KVCacheBlock
from kiln.runtime.core.scheduler_stats import PrefixCacheStats
from kiln.runtime.core.single_type_kv_cache_manager import FullAttentionManager

if TYPE_CHECKING:
    from kiln.runtime.core.request import Request

__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]


@dataclass
class KVCacheBlocks:
    """Blocks per KV cache group: `blocks[group][i]` (the scheduler never looks inside)."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(itertools.chain(a, b)) for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """-> block ids per group; None instead of all-empty lists when allow_none."""
        if allow_none and not any(self.blocks):
            return None
        return tuple([b.block_id for b in g] for g in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1, "only one group is supported"
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.blocks)


class KVCacheManager:
    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool = True) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.coordinator = get_kv_cache_coordinator(kv_cache_config, max_model_len, enable_caching)
        self.block_pool = self.coordinator.block_pool
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.prefix_cache_stats = PrefixCacheStats()
        # Shared, immutable "no blocks" value (avoids allocating one per call).
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        # One full-attention group: a running request's step that needs no new block and fills
        # no block has nothing to do in allocate_slots (most decode steps), checked inline.
        managers = self.coordinator.single_type_managers
        self._one_full = managers[0] if len(managers) == 1 and type(managers[0]) is FullAttentionManager else None
        # One full-attention group only (else None): request id -> how many tokens its blocks take
        # with nothing to do, i.e. allocate_slots(request, n) of a running request with
        # num_computed_tokens + n <= room allocates no block, publishes no block and changes
        # nothing. Set where a request's blocks change (allocate_slots' full path), dropped by
        # free, so a scheduler can skip the call for most decode steps (read it with .get).
        self.slot_room: dict[str, int] | None = {} if self._one_full is not None else None

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0..1)."""
        return self.block_pool.get_usage()

    @property
    def state_usage(self) -> float:
        """A hybrid model's state slots held by requests (0..1); 0 without a state group."""
        pool = self.coordinator.state_pool
        return pool.get_usage() if pool is not None else 0.0

    @property
    def max_num_tokens_per_request(self) -> int:
        """The most tokens one request could ever hold, were it alone."""
        return self.coordinator.max_num_tokens_per_request()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """-> the stats since the previous call, and start new ones."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def record_prefix_cache_stats(self, request: Request, num_hit_tokens: int) -> None:
        """Count one lookup of a request that is being admitted (not mere peeks)."""
        if self.enable_caching:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens, request.num_preemptions > 0)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """-> (cached blocks of the request's longest cached prefix, their token count).

        Looks only; takes no reference. The hit never covers the whole request:
        the last token is always recomputed to get its logits, so the hit is
        capped at num_tokens - 1 (rounded down to whole blocks)."""
        if not self.enable_caching or getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            # prompt logprobs need the logits of every prompt position, so such a
            # request computes its whole prompt (vLLM: skip_reading_prefix_cache)
            return self.empty_kv_cache_blocks, 0
        max_cache_hit_length = request.num_tokens - 1
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes,
                                                                         max_cache_hit_length)
        return KVCacheBlocks(blocks), num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        """Make room for num_new_tokens more tokens of the request.

        Layout of the request's tokens:
            | computed | new_computed (prefix hits) | new | lookahead |
        `computed` is request.num_computed_tokens; `new_computed` are cache hits
        from get_computed_blocks (a waiting request only). Blocks are allocated
        for everything up to new + lookahead (capped at max_model_len); full
        blocks of final tokens (up to request.num_tokens) are published to the
        prefix cache now, before the step that writes them runs.

        -> the newly allocated blocks, or None (and no change at all) if the
        free pool cannot cover them."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        room = self.slot_room
        if (room is not None and new_computed_blocks is None and not num_new_computed_tokens
                and not num_lookahead_tokens
                and request.num_computed_tokens + num_new_tokens <= room.get(request.request_id, -1)):
            return self.empty_kv_cache_blocks  # the full path below would return no blocks too
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self.empty_kv_cache_blocks.blocks
        rid = request.request_id
        # Free blocks attention will not read again first (no-op for full
        # attention), so that fewer cached blocks get evicted.
        self.coordinator.remove_skipped_blocks(rid, request.num_computed_tokens)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                                   self.max_model_len)
        if self.coordinator.state_pool is None:
            num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(rid, num_tokens_need_slot, hits)
            if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
                return None
        elif not self.coordinator.can_allocate(rid, num_tokens_need_slot, hits):
            return None
        if any(hits):
            assert self.enable_caching, "prefix-cache hits while prefix caching is off"
            self.coordinator.touch(hits)
        self.coordinator.save_new_computed_blocks(rid, hits)
        new_blocks = self.coordinator.allocate_new_blocks(rid, num_tokens_need_slot)
        if self.enable_caching:
            # Speculative/lookahead tokens are not final: never publish them.
            self.coordinator.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
            if self.coordinator.state_pool is not None:
                self.coordinator.snapshot_states(request, num_computed_tokens, num_computed_tokens + num_new_tokens)
        if room is not None:
            self._set_room(rid)
        return KVCacheBlocks(new_blocks)

    def _set_room(self, rid: str) -> None:
        """slot_room[rid]: up to that many tokens, the full path of allocate_slots needs no new
        block (slots <= end <= held blocks' tokens) and publishes none (final <= end < the end
        of the first block not cached yet)."""
        m = self._one_full
        bs = m.block_size
        room = len(m.req_to_blocks.get(rid, ())) * bs
        if self.enable_caching:
            room = min(room, (m.num_cached_block.get(rid, 0) + 1) * bs - 1)
        self.slot_room[rid] = room

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release the request's blocks (tail first, so the tail is evicted first).

        num_valid_tokens: if given, blocks past that many tokens are un-published
        from the prefix cache first, because their contents were never written
        (a request preempted after being scheduled in the same step)."""
        if num_valid_tokens is not None and self.enable_caching:
            self.coordinator.uncache_blocks_after(request.request_id, num_valid_tokens)
        self.coordinator.free(request.request_id)
        if self.slot_room is not None:
            self.slot_room.pop(request.request_id, None)

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """A hybrid model's state-slot copies (source, destination) for the step being output:
        (prefix-cache snapshots restored before its forward, snapshots saved after it); empty
        for other models."""
        return self.coordinator.take_state_copies() if self.coordinator.state_pool is not None else ([], [])

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; fails (False) while any request holds blocks."""
        if not self.coordinator.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, leading blocks shared by every request holding blocks."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def create_empty_block_list(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in range(self.num_kv_cache_groups)))
