"""What a caller gets back for a request (vLLM: vllm/outputs.py RequestOutput,
CompletionOutput, and the per-request metrics of vllm/v1/metrics/stats.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional


class OutputKind(str, Enum):
    CUMULATIVE = "cumulative"  # every output carries everything so far
    DELTA = "delta"  # every output carries what is new since the last one
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    token_times: list[float] = field(default_factory=list, repr=False)

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, Any]]] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort", "error" (stop_reason says why)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: Optional[list[Optional[dict[int, Any]]]] = None
    metrics: Optional[RequestMetrics] = None
    num_cached_tokens: int = 0
