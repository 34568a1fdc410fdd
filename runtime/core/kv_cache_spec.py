"""What one KV cache group stores per block, and the whole cache's layout.

Ported in behaviour from vLLM V1 `vllm/v1/kv_cache_interface.py` (`KVCacheSpec`,
`FullAttentionSpec`, `KVCacheGroupSpec`, `KVCacheConfig`).

A group is a set of layers that share one block table (all full-attention
layers of a model, say). Each spec type has a manager in
`single_type_kv_cache_manager.py`; a new kind of state (`SlidingWindowSpec`,
`MambaSpec` for Gated-DeltaNet conv + recurrent state) is a new frozen subclass
here plus a manager registered for it there. Configs are frozen; the block
count is found at run time (from free device memory) and only then is a
`KVCacheConfig` built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.runtime.core.kv_cache_utils import cdiv

# Bytes per element of the cache dtypes, named as kiln.graph.dtype.DType names
# them. Kept here so the scheduler's import stays pure Python (kiln.graph
# pulls in numpy, ml_dtypes and networkx).
# The Gated DeltaNet chunked form's chunk (graph/gdn_ops.py CHUNK): hybrid prefill chunks end on
# its multiples (runtime/core/scheduler.py), and prefix-cache state snapshots sit on them.
GDN_CHUNK_ALIGN = 64

_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "fp8e4m3": 1, "u8": 1}


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer cache shape of one group. `block_size` is in tokens."""

    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        """Bytes one layer needs for one sequence of max_model_len tokens."""
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """K and V for every token: [2, block_size, num_kv_heads, head_size] per block."""

    num_kv_heads: int = 1
    head_size: int = 1
    dtype: str = "bf16"  # a kiln.graph.dtype.DType name (a DType works too: it is a str)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "dtype", str(self.dtype))
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"unsupported KV cache dtype {self.dtype!r}; expected one of {sorted(_ITEMSIZE)}")
        if self.num_kv_heads <= 0 or self.head_size <= 0:
            raise ValueError(f"num_kv_heads and head_size must be positive, got "
                             f"{self.num_kv_heads} and {self.head_size}")

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * _ITEMSIZE[self.dtype]

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A hybrid model's per-request recurrent state (vLLM's MambaSpec, mamba_type gdn): one
    slot per request whatever its length, holding every Gated DeltaNet layer's conv state
    `conv_shape` and recurrent state `ssm_shape`. The slots are their own pool
    (KVCacheConfig.num_state_slots), not pages of the attention blocks' pool."""

    conv_shape: tuple[int, ...] = ()
    ssm_shape: tuple[int, ...] = ()
    conv_dtype: str = "bf16"
    ssm_dtype: str = "f32"
    num_layers: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        for d in (self.conv_dtype, self.ssm_dtype):
            if str(d) not in _ITEMSIZE:
                raise ValueError(f"unsupported state dtype {d!r}; expected one of {sorted(_ITEMSIZE)}")
        object.__setattr__(self, "conv_dtype", str(self.conv_dtype))
        object.__setattr__(self, "ssm_dtype", str(self.ssm_dtype))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one slot in one layer."""
        return (math.prod(self.conv_shape) * _ITEMSIZE[self.conv_dtype]
                + math.prod(self.ssm_shape) * _ITEMSIZE[self.ssm_dtype])

    def max_memory_usage_bytes(self, max_model_len: int) -> int:
        return self.page_size_bytes


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """The layers (by name) that share one block table, and what they store."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole cache: `num_blocks` blocks (block 0 is the null block), shared
    by all groups through one block pool. Built at run time."""

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    num_state_slots: int = 0  # a MambaSpec group's pool: slots 1..num_state_slots (0 is the null slot)
    # of those, how many are there for prefix-cache snapshots (the others: one per running request)
    num_state_snapshots: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        if any(isinstance(g.kv_cache_spec, MambaSpec) for g in self.kv_cache_groups) and self.num_state_slots < 1:
            raise ValueError("a config with a state (MambaSpec) group needs num_state_slots >= 1")
        if not 0 <= self.num_state_snapshots < max(self.num_state_slots, 1):
            raise ValueError(f"num_state_snapshots ({self.num_state_snapshots}) must leave running slots "
                             f"out of num_state_slots ({self.num_state_slots})")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is the null block), got {self.num_blocks}")
        if not self.kv_cache_groups:
            raise ValueError("a KV cache config needs at least one group")

    @property
    def block_size(self) -> int:
        """The block size shared by every group (hybrid groups with different
        block sizes are not supported yet)."""
        sizes = {g.kv_cache_spec.block_size for g in self.kv_cache_groups}
        if len(sizes) != 1:
            raise NotImplementedError(f"KV cache groups with different block sizes: {sorted(sizes)}")
        return sizes.pop()

    @property
    def state_snapshot_interval(self) -> int:
        """Tokens between a hybrid model's state snapshots (prefix caching): the least multiple
        of the block size and of the Gated DeltaNet chunk (GDN_CHUNK_ALIGN), so a hit resumes on
        a whole block and at a chunk boundary of absolute positions. 0 without a state group."""
        if not any(isinstance(g.kv_cache_spec, MambaSpec) for g in self.kv_cache_groups):
            return 0
        return math.lcm(GDN_CHUNK_ALIGN, self.block_size)


def hybrid_config(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: str,
                  num_state_slots: int, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...],
                  conv_dtype: str, ssm_dtype: str = "f32", num_gdn_layers: int = 1,
                  num_state_snapshots: int = 0) -> KVCacheConfig:
    """Two groups: the full-attention layers' blocks, and the Gated DeltaNet layers' state
    slots (one per running request, plus num_state_snapshots for prefix-cache snapshots)."""
    attn = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    state = MambaSpec(block_size=block_size, conv_shape=tuple(conv_shape), ssm_shape=tuple(ssm_shape),
                      conv_dtype=conv_dtype, ssm_dtype=ssm_dtype, num_layers=num_gdn_layers)
    return KVCacheConfig(num_blocks=num_blocks, num_state_slots=num_state_slots,
                         num_state_snapshots=num_state_snapshots, kv_cache_groups=(KVCacheGroupSpec((), attn), KVCacheGroupSpec((), state)))


def full_attention_config(num_blocks: int, block_size: int, num_kv_heads: int = 1, head_size: int = 1,
                          dtype: str = "bf16", layer_names: tuple[str, ...] = ()) -> KVCacheConfig:
    """A one-group config for a model whose layers are all full attention."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=dtype)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=(KVCacheGroupSpec(tuple(layer_names), spec),))
