"""Counters the scheduler and KV cache manager report (vLLM: `vllm/v1/metrics/stats.py`).

Both are deltas: a `make_*_stats()` call hands back what accumulated since the
previous call and starts a fresh one, so a metrics logger adds them to its
counters (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`,
`vllm:num_preemptions_total`) and sets its gauges from the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens, for requests admitted to run.

    A request is counted once per admission (a preempted request that is
    readmitted counts again, in the `preempted_*` fields as well)."""

    reset: bool = False  # the prefix cache was reset since the previous report
    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found cached
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable blocks held by requests, 0..1
    state_usage: float = 0.0  # a hybrid model's state slots held by requests, 0..1 (0 without)
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_preemptions: int = 0  # preemptions since the previous report
