"""LLMEngine: requests in (text or token ids), RequestOutputs out.

Shared by the offline LLM and the server's AsyncLLM: input processing
(tokenise, validate, fan out n > 1), the EngineCore, and the OutputProcessor
(detokenise, stop strings, logprobs). vLLM splits these across processes; one
engine here is one object, and two engines in one process do not share state.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Optional, Sequence

from kiln.runtime.engine.core import EngineCore
from kiln.runtime.engine.output_processor import OutputProcessor, ParentRequest
from kiln.runtime.engine.outputs import OutputKind, RequestOutput
from kiln.runtime.core.request import Request
from kiln.runtime.sample.sampling_params import SamplingParams
from kiln.runtime.engine.stats import EngineTotals, FinishedRequestStats, IterationStats, StatLogger, finished_stats


class PromptTooLongError(ValueError):
    """A prompt longer than the model's context (a user error, reported with both numbers)."""


class LLMEngine:
    def __init__(self, core: EngineCore, tokenizer, *, max_model_len: int, vocab_size: int,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.max_model_len = min(max_model_len, core.max_model_len)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer)
        self.totals = EngineTotals()
        self.stat_loggers: list[StatLogger] = [self.totals]
        self._ids = itertools.count()
        self._max_tokens: dict[str, Optional[int]] = {}
        # requests aborted by their caller since the last stats record: counted as finished with
        # reason "abort" (issue 42 #2: request_success_total{finished_reason="abort"} stayed 0)
        self._aborted: list[FinishedRequestStats] = []
        self.engine_args: Any = None  # what it was built from, the model's defaults filled in (entrypoints)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize_prompt(self, prompt: str | Sequence[int]) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine was loaded without a tokenizer; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(map(int, prompt))
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        return None, ids

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: Optional[SamplingParams] = None,
                    *, output_kind: OutputKind = OutputKind.FINAL_ONLY, priority: int = 0,
                    arrival_time: Optional[float] = None) -> list[int]:
        """Queue a request; -> its prompt token ids. Raises ValueError for a bad request."""
        params = params or SamplingParams()
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, more than the maximum context length of "
                f"{self.max_model_len} tokens")
        params.verify(self.vocab_size)
        room = self.max_model_len - len(ids)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(room, 1))
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._max_tokens[request_id] = params.max_tokens
        if params.n == 1:
            self._add_one(request_id, text, ids, params, output_kind, arrival_time, priority, 0, None)
            return ids
        parent = ParentRequest(request_id, params.n, output_kind)
        for i in range(params.n):
            child = dataclasses.replace(params, n=1, seed=params.child_seed(i))
            self._add_one(ParentRequest.child_id(request_id, i), text, ids, child, output_kind, arrival_time,
                          priority, i, parent)
        return ids

    def _add_one(self, rid, text, ids, params, kind, arrival, priority, index, parent) -> None:
        self.output_processor.add_request(rid, text, ids, params, output_kind=kind, arrival_time=arrival,
                                          index=index, parent=parent)
        try:
            self.core.add_request(Request(rid, ids, params, eos_token_id=self.eos_token_ids,
                                          arrival_time=arrival, priority=priority))
        except ValueError:
            self.output_processor.abort_requests([rid])
            raise

    def abort_request(self, request_ids: Sequence[str]) -> None:
        """Abort requests (parent ids abort every child); their blocks return to the pool."""
        states = self.output_processor.states
        aborted = [states[r] for r in self.output_processor.child_ids(request_ids) if r in states]
        engine_ids = self.output_processor.abort_requests(request_ids)
        self.core.abort_requests(engine_ids)
        now = time.monotonic()
        for st in aborted:
            m = st.metrics
            self._aborted.append(FinishedRequestStats(
                "abort", now - m.arrival_time, len(st.prompt_token_ids), m.num_generation_tokens, m.ttft, m.tpot,
                max_tokens=self._max_tokens.get(st.parent.request_id if st.parent else st.request_id),
                n=st.parent.n if st.parent else 1))
        for rid in request_ids:
            self._max_tokens.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        # Timing of every request that sampled this step, FINAL_ONLY ones included (they return no output yet).
        it = IterationStats(num_scheduled_tokens=self.core.last_step_tokens)
        outputs, to_abort = self.output_processor.process_outputs(core_outputs, time.monotonic(), it)
        if to_abort:  # stop strings finished these: free their blocks now
            self.core.abort_requests(to_abort)
        self._log_stats(outputs, it)
        for ro in outputs:
            if ro.finished:
                self._max_tokens.pop(ro.request_id, None)
        return outputs

    def _log_stats(self, outputs: list[RequestOutput], it: IterationStats) -> None:
        for ro in outputs:
            if ro.metrics is not None and ro.finished:
                it.finished_requests.extend(finished_stats(ro, self._max_tokens.get(ro.request_id)))
        if self._aborted:
            it.finished_requests.extend(self._aborted)
            self._aborted = []
        sched = self.core.make_stats()
        for logger in self.stat_loggers:
            logger.record(sched, it)

    def record_idle_stats(self) -> None:
        """Tell the stat loggers the gauges (running, KV usage) and the aborts counted since the
        last step, when no step will (after aborts, or after the last step)."""
        self._log_stats([], IterationStats())

    def stats(self) -> dict[str, Any]:
        """A snapshot an operator can read: counts and KV usage (without resetting counters)."""
        return {**self.core.snapshot(),
                "prefix_cache_hit_rate": self.totals.prefix_cache_hit_rate,
                "num_preemptions": self.totals.num_preemptions,
                "prompt_tokens": self.totals.prompt_tokens,
                "generation_tokens": self.totals.generation_tokens,
                "finished_requests": self.totals.finished_requests}
