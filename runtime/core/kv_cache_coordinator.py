"""One block pool shared by the managers of every KV cache group.

Ported in behaviour from vLLM V1 `vllm/v1/core/kv_cache_coordinator.py`
(`KVCacheCoordinator`, `KVCacheCoordinatorNoPrefixCache`,
`UnitaryKVCacheCoordinator`, `get_kv_cache_coordinator`). The coordinator's
job with several groups is to agree on one prefix-hit length that every group
can serve (attention blocks and GDN state); that is `HybridKVCacheCoordinator`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kiln.runtime.core.block_pool import BlockPool
from kiln.runtime.core.kv_cache_spec import KVCacheConfig, MambaSpec
from kiln.runtime.core.kv_cache_utils import BlockHash, KVCacheBlock
from kiln.runtime.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec

if TYPE_CHECKING:
    from kiln.runtime.core.request import Request


class KVCacheCoordinator:
    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        # A hybrid model's state slots are a pool of their own (slot 0 is its null slot); with
        # prefix caching some of them hold snapshots, hashed like blocks.
        self.state_pool = BlockPool(kv_cache_config.num_state_slots + 1, enable_caching) \
            if kv_cache_config.num_state_slots else None
        state_kw = {"snapshot_interval": kv_cache_config.state_snapshot_interval if enable_caching else 0,
                    "num_reserved": kv_cache_config.num_state_slots - kv_cache_config.num_state_snapshots}
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(g.kv_cache_spec, self.state_pool, gid, **state_kw)
            if isinstance(g.kv_cache_spec, MambaSpec) else
            get_manager_for_kv_cache_spec(g.kv_cache_spec, self.block_pool, gid)
            for gid, g in enumerate(kv_cache_config.kv_cache_groups))
        self._state_managers = [m for m in self.single_type_managers if m.block_pool is self.state_pool]
        self._block_managers = [m for m in self.single_type_managers if m.block_pool is self.block_pool]

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]) -> int:
        """Blocks of the attention blocks' pool the request needs (state slots: can_allocate)."""
        return sum(m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i])
                   for i, m in enumerate(self.single_type_managers) if m.block_pool is self.block_pool)

    def can_allocate(self, request_id: str, num_tokens: int,
                     new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]) -> bool:
        """Whether every pool can cover what the request needs: the attention blocks and,
        for a hybrid model, a state slot (the scheduler admits a request only with both)."""
        if self.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks) > \
                self.block_pool.get_num_free_blocks():
            return False
        if self.state_pool is None:
            return True
        need = sum(m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i])
                   for i, m in enumerate(self.single_type_managers) if m.block_pool is self.state_pool)
        return need <= self.state_pool.get_num_free_blocks()

    def save_new_computed_blocks(self, request_id: str,
                                 new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]) -> None:
        for i, m in enumerate(self.single_type_managers):
            m.save_new_computed_blocks(request_id, new_computed_blocks[i])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for m in self.single_type_managers:
            m.cache_blocks(request, num_computed_tokens)

    def uncache_blocks_after(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.single_type_managers:
            m.uncache_blocks_after(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.single_type_managers:
            m.free(request_id)

    def snapshot_states(self, request: Request, start: int, end: int) -> None:
        """A hybrid's state snapshot at `end` after the chunk [start, end), where one is due."""
        for m in self._state_managers:
            m.snapshot(request, start, end)

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """-> (restores, saves): the state-slot copies the step being output makes before and
        after its forward (MambaManager)."""
        restores, saves = [], []
        for m in self._state_managers:
            r, s = m.take_state_copies()
            restores += r
            saves += s
        return restores, saves

    def touch(self, hits: tuple[Sequence[KVCacheBlock], ...]) -> None:
        """Take a reference on each group's prefix-cache hits, in that group's pool."""
        for m, group_hits in zip(self.single_type_managers, hits):
            if group_hits:
                m.block_pool.touch((group_hits,))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, blocks and state snapshots; False while any request
        holds blocks."""
        pools = [self.block_pool] + ([self.state_pool] if self.state_pool is not None else [])
        if any(p.get_num_free_blocks() != p.num_blocks - 1 for p in pools):
            return False
        return all([p.reset_prefix_cache() for p in pools])

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        return [m.get_num_common_prefix_blocks(request_id) for m in self.single_type_managers]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def max_num_tokens_per_request(self) -> int:
        """The most tokens one request can ever hold, with every usable block its own."""
        num_usable = self.kv_cache_config.num_blocks - 1
        return (num_usable // len(self._block_managers)) * self.kv_cache_config.block_size

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """-> (per-group hit blocks, number of hit tokens)."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: never a hit, blocks never hashed."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one group (every layer full attention, say)."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool) -> None:
        super().__init__(kv_cache_config, max_model_len, enable_caching)
        assert len(self.single_type_managers) == 1
        self.manager = self.single_type_managers[0]
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = self.kv_cache_spec.block_size

    # Direct calls on the one manager: these run per request per step.
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]) -> int:
        return self.manager.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[0])

    def save_new_computed_blocks(self, request_id: str,
                                 new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]) -> None:
        self.manager.save_new_computed_blocks(request_id, new_computed_blocks[0])

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        return (self.manager.allocate_new_blocks(request_id, num_tokens),)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(request, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        self.manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        manager = self.single_type_managers[0]
        hit = type(manager).find_longest_cache_hit(block_hashes, max_cache_hit_length, [0],
                                                   self.block_pool, self.kv_cache_spec)
        return hit, len(hit[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Full-attention blocks plus a hybrid model's Gated DeltaNet state (vLLM's
    HybridKVCacheCoordinator, for that pair of groups): a hit is the longest prefix whose
    attention blocks are all cached and whose state was snapshotted at its end. Attention
    hits are prefix-closed, so the attention search bounds the snapshot search and is cut
    back to the snapshot's end: one pass each, no fixed-point iteration needed."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool) -> None:
        super().__init__(kv_cache_config, max_model_len, enable_caching)
        kinds = [type(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
        if sorted(k.__name__ for k in kinds) != ["FullAttentionSpec", "MambaSpec"]:
            raise NotImplementedError(f"prefix caching over the KV cache groups {[k.__name__ for k in kinds]}: "
                                      f"only full attention + Gated DeltaNet state is supported")
        self.attn_gid = next(i for i, k in enumerate(kinds) if k is not MambaSpec)
        self.state_gid = next(i for i, k in enumerate(kinds) if k is MambaSpec)
        self.block_size = kv_cache_config.block_size
        self.snapshot_interval = kv_cache_config.state_snapshot_interval

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        groups = self.kv_cache_config.kv_cache_groups
        attn_mgr, state_mgr = self.single_type_managers[self.attn_gid], self.single_type_managers[self.state_gid]
        (attn,) = type(attn_mgr).find_longest_cache_hit(block_hashes, max_cache_hit_length, [self.attn_gid],
                                                         self.block_pool, groups[self.attn_gid].kv_cache_spec)
        (state,) = type(state_mgr).find_longest_cache_hit(
            block_hashes, len(attn) * self.block_size, [self.state_gid], self.state_pool,
            groups[self.state_gid].kv_cache_spec, snapshot_interval=self.snapshot_interval)
        hit = [[], []]
        hit[self.attn_gid], hit[self.state_gid] = attn[:len(state)], state
        return tuple(hit), len(state) * self.block_size


def get_kv_cache_coordinator(kv_cache_config: KVCacheConfig, max_model_len: int,
                             enable_caching: bool) -> KVCacheCoordinator:
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(kv_cache_config, max_model_len, enable_caching)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, max_model_len, enable_caching)
    return HybridKVCacheCoordinator(kv_cache_config, max_model_len, enable_caching)
