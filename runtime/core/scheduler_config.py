"""Frozen scheduler and cache configs (vLLM: `SchedulerConfig`, `CacheConfig` in `vllm/config`).

Values found at run time stay out of here: the number of KV blocks comes from
free device memory and lives in `KVCacheConfig`, built once it is known.
"""
from __future__ import annotations

from dataclasses import dataclass

_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # most requests running at once
    max_model_len: int = 8192  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True
    # A prefill chunk of one request is capped at this many tokens (0: no cap),
    # so one long prompt cannot take a whole step from the decodes.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # Schedule step N+1 while step N executes (vLLM's --async-scheduling): a running request's
    # sampled-but-not-yet-returned tokens count as output placeholders (runtime/core/scheduler.py).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.policy not in _POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; expected one of {_POLICIES}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a prompt must fit in one step, or it never runs.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill off; raise it or enable chunked prefill")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
