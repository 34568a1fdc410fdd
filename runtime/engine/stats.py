"""Per-step statistics the engine hands to stat loggers (vLLM: IterationStats,
FinishedRequestStats in vllm/v1/metrics/stats.py). Loggers (the server's
Prometheus exporter, the offline summary) subscribe; the engine keeps no
global counters of its own."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

from kiln.runtime.engine.outputs import RequestOutput
from kiln.runtime.core.scheduler_stats import SchedulerStats


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    ttft: Optional[float]
    tpot: Optional[float]
    queue_time: Optional[float] = None
    max_tokens: Optional[int] = None
    n: int = 1


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0  # prompt tokens of the requests that got their first token this step
    num_generation_tokens: int = 0  # tokens sampled this step
    num_scheduled_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...


def finished_stats(ro: RequestOutput, max_tokens: Optional[int]) -> list[FinishedRequestStats]:
    m = ro.metrics
    out = []
    for c in ro.outputs:
        out.append(FinishedRequestStats(
            finish_reason=c.finish_reason or "abort", e2e_latency=m.e2e_latency or 0.0,
            num_prompt_tokens=len(ro.prompt_token_ids), num_generation_tokens=m.num_generation_tokens,
            ttft=m.ttft, tpot=m.tpot, max_tokens=max_tokens, n=len(ro.outputs)))
    return out


@dataclass
class EngineTotals:
    """Counters since the engine started: the numbers an operator reads from LLM.stats()."""
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0

    def record(self, scheduler_stats: SchedulerStats, it: IterationStats) -> None:
        self.prefix_cache_queries += scheduler_stats.prefix_cache_stats.queries
        self.prefix_cache_hits += scheduler_stats.prefix_cache_stats.hits
        self.num_preemptions += scheduler_stats.num_preemptions
        self.prompt_tokens += it.num_prompt_tokens
        self.generation_tokens += it.num_generation_tokens
        self.finished_requests += len(it.finished_requests)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
