"""EngineCore: schedule -> execute -> update, one step at a time.

vLLM's EngineCore.step (vllm/v1/engine/core.py) without the process and
socket plumbing: a caller (LLM, AsyncLLM) owns it and calls step().
"""
from __future__ import annotations

from typing import Iterable

from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.sched_output import EngineCoreOutput
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.scheduler_stats import SchedulerStats


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps = 0
        self.last_step_tokens = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        return self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """One engine step; -> per-request news in scheduling order."""
        if not self.scheduler.has_unfinished_requests():
            return []
        so = self.scheduler.schedule()
        runner_out = self.runner.execute_model(so)
        outputs = self.scheduler.update_from_output(so, runner_out)
        self.num_steps += 1
        self.last_step_tokens = so.total_num_scheduled_tokens
        for rid, lps in runner_out.prompt_logprobs.items():
            if lps is None:
                continue
            if rid in outputs:
                outputs[rid].new_prompt_logprobs = lps
            elif rid in self.scheduler.requests:  # a partial prefill chunk: no token yet
                outputs[rid] = EngineCoreOutput(rid, [], new_prompt_logprobs=lps)
        return list(outputs.values())

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    @property
    def max_model_len(self) -> int:
        """The longest request the scheduler accepts (capped by what the KV cache holds)."""
        return self.scheduler.max_model_len

    def snapshot(self) -> dict:
        """Gauges an operator reads, without resetting any counter."""
        s = self.scheduler
        return {"num_running_reqs": len(s.running), "num_waiting_reqs": len(s.waiting),
                "kv_cache_usage": s.kv_cache_manager.usage,
                "num_free_blocks": s.kv_cache_manager.block_pool.get_num_free_blocks(),
                "num_total_blocks": s.kv_cache_config.num_blocks}
