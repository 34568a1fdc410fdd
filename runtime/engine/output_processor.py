"""Engine-core outputs -> RequestOutputs: detokenize, apply stop strings,
gather logprobs, time each request, fan n>1 children back into one output.

Ported in behaviour from vLLM's vllm/v1/engine/output_processor.py
(OutputProcessor, RequestState) and parallel_sampling.py (ParentRequest).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

from kiln.runtime.text.detokenizer import IncrementalDetokenizer
from kiln.runtime.sample.logprobs import LogprobsProcessor
from kiln.runtime.engine.outputs import CompletionOutput, OutputKind, RequestMetrics, RequestOutput
from kiln.runtime.core.request import FinishReason
from kiln.runtime.sample.sampling_params import SamplingParams
from kiln.runtime.core.sched_output import EngineCoreOutput
from kiln.runtime.engine.stats import IterationStats


@dataclass
class ParentRequest:
    """An n > 1 request: its children run as separate engine requests."""
    request_id: str
    n: int
    output_kind: OutputKind
    finished: dict[int, CompletionOutput] = field(default_factory=dict)
    child_states: list["RequestState"] = field(default_factory=list)

    @staticmethod
    def child_id(request_id: str, index: int) -> str:
        return f"{index}_{request_id}"


@dataclass
class RequestState:
    request_id: str  # the engine request id (a child id for n > 1)
    index: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsProcessor
    metrics: RequestMetrics
    parent: Optional[ParentRequest] = None
    num_cached_tokens: int = 0
    sent_tokens: int = 0  # output tokens already handed out (DELTA)
    sent_logprobs: int = 0


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, *, output_kind: OutputKind, arrival_time: float,
                    index: int = 0, parent: Optional[ParentRequest] = None) -> None:
        if request_id in self.states:
            raise ValueError(f"duplicate request id {request_id!r}")
        st = RequestState(
            request_id, index, prompt, list(prompt_token_ids), params, output_kind,
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
            LogprobsProcessor.from_new_request(self.tokenizer, params),
            RequestMetrics(arrival_time), parent)
        self.states[request_id] = st
        if parent is not None:
            self.parents[parent.request_id] = parent
            parent.child_states.append(st)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def child_ids(self, request_ids: Iterable[str]) -> list[str]:
        """The engine ids behind request ids (a parent's children, else the id itself)."""
        out = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            out += [c.request_id for c in parent.child_states] if parent else [rid]
        return out

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget requests (and every child of a parent id). -> the engine ids dropped."""
        dropped = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            ids = [c.request_id for c in parent.child_states] if parent else [rid]
            for cid in ids:
                if self.states.pop(cid, None) is not None:
                    dropped.append(cid)
        return dropped

    def process_outputs(self, outputs: Iterable[EngineCoreOutput], now: Optional[float] = None,
                        iteration_stats: Optional[IterationStats] = None) -> tuple[list[RequestOutput], list[str]]:
        """-> (outputs for callers, engine ids to abort because a stop string ended them).

        iteration_stats, if given, gets this step's generation tokens, time to first token (and
        prompt tokens) of requests sampling their first token, and inter-token latencies of the
        others, FINAL_ONLY requests included (vLLM: _update_stats_from_output)."""
        now = time.monotonic() if now is None else now
        results, to_abort = [], []
        states, final_only, stop = self.states, OutputKind.FINAL_ONLY, FinishReason.STOP
        it = iteration_stats
        num_generation_tokens = 0
        if it is not None:
            itls, ttfts = it.inter_token_latencies, it.time_to_first_tokens
        for out in outputs:
            new_token_ids = out.new_token_ids
            num_generation_tokens += len(new_token_ids)
            st = states.get(out.request_id)
            if st is None:
                continue  # aborted while the step ran
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if out.new_prompt_logprobs is not None:
                st.logprobs.update_from_output(prompt=out.new_prompt_logprobs)
            if new_token_ids:
                m = st.metrics  # inline: this runs per request per step
                if m.first_token_time is None:
                    m.first_token_time = now
                    if it is not None:
                        ttfts.append(now - m.arrival_time)
                        it.num_prompt_tokens += len(st.prompt_token_ids)
                elif it is not None:
                    itls.append(now - m.last_token_time)
                m.last_token_time = now
                m.num_generation_tokens += len(new_token_ids)
                m.token_times.append(now)
                if out.new_logprobs is not None:
                    st.logprobs.update_from_output(sample=out.new_logprobs)
                stop_str = st.detokenizer.update(new_token_ids, finish_reason == stop)
                if stop_str is not None and finish_reason is None:
                    finish_reason, stop_reason = stop, stop_str
                    to_abort.append(st.request_id)
            st.num_cached_tokens = out.num_cached_tokens
            if finish_reason is not None:
                st.metrics.finished_time = now
                del states[st.request_id]
            elif st.output_kind == final_only:
                continue  # nothing to show before it finishes (what _make_output says)
            ro = self._make_output(st, finish_reason is not None, finish_reason, stop_reason)
            if ro is not None:
                results.append(ro)
        if it is not None:
            it.num_generation_tokens += num_generation_tokens
        return results, to_abort

    def _completion(self, st: RequestState, finished: bool, finish_reason, stop_reason) -> CompletionOutput:
        delta = st.output_kind == OutputKind.DELTA
        text = st.detokenizer.get_next_output_text(finished, delta)
        ids = st.detokenizer.output_token_ids
        lps = st.logprobs.logprobs
        if delta:
            ids, st.sent_tokens = ids[st.sent_tokens:], len(ids)
            if lps is not None:
                lps, st.sent_logprobs = lps[st.sent_logprobs:], len(lps)
        return CompletionOutput(st.index, text, list(ids), st.logprobs.cumulative_logprob,
                                None if lps is None else list(lps),
                                None if finish_reason is None else str(finish_reason), stop_reason)

    def _make_output(self, st: RequestState, finished: bool, finish_reason, stop_reason) -> Optional[RequestOutput]:
        parent = st.parent
        if st.output_kind == OutputKind.FINAL_ONLY and not finished:
            return None
        comp = self._completion(st, finished, finish_reason, stop_reason)
        rid = parent.request_id if parent else st.request_id
        if parent is not None and st.output_kind == OutputKind.FINAL_ONLY:
            parent.finished[st.index] = comp
            if len(parent.finished) < parent.n:
                return None
            self.parents.pop(parent.request_id, None)
            comps = [parent.finished[i] for i in sorted(parent.finished)]
            all_done = True
        else:
            comps = [comp]
            all_done = finished and (parent is None or self._parent_done(parent, st))
        return RequestOutput(rid, st.prompt, st.prompt_token_ids, comps, all_done,
                             prompt_logprobs=st.logprobs.pop_prompt_logprobs(), metrics=st.metrics,
                             num_cached_tokens=st.num_cached_tokens)

    def _parent_done(self, parent: ParentRequest, st: RequestState) -> bool:
        parent.finished[st.index] = None  # streamed already; count it as done
        if len(parent.finished) == parent.n:
            self.parents.pop(parent.request_id, None)
            return True
        return False
