"""The messages of one engine step: scheduler -> model runner -> scheduler -> caller.

Ported in behaviour from vLLM V1 `vllm/v1/core/sched/output.py`
(`NewRequestData`, `CachedRequestData`, `SchedulerOutput`),
`vllm/v1/outputs.py` (`ModelRunnerOutput`) and `vllm/v1/engine/__init__.py`
(`EngineCoreOutput`).

The scheduler output is a diff against what the model runner already holds:
full data for requests it sees for the first time, deltas for the rest. A
runner keeps, per request id, the token ids and the block table, and applies:
  1. drop `finished_req_ids` (keep preempted requests: they return as resumed);
  2. add `scheduled_new_reqs`;
  3. for `scheduled_cached_reqs`: a request in `resumed_req_ids` (back from
     preemption) gets its block table *replaced* by `new_block_ids`; any other
     gets `new_block_ids` appended. `all_token_ids` is present for every
     cached request not scheduled in the previous step (resync its tokens);
  4. compute, for each request in `num_scheduled_tokens`, that many tokens
     starting at its `num_computed_tokens`, and sample a token only for requests
     whose computed tokens then reach their token count (partial prefill
     chunks sample nothing).
Unlike vLLM (which sends them only under pipeline parallelism), kiln always
fills `new_token_ids`: the tokens of that request to compute this step.

KV contract: the scheduler may give a request prefix-cache hits on blocks that
another request of the *same step* writes. An executor must therefore write
the KV of every token of the step before any attention reads it (per layer),
and must run every step it is handed.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.runtime.core.request import FinishReason, Request

if TYPE_CHECKING:
    from kiln.runtime.core.kv_cache_manager import KVCacheBlocks


@dataclass
class NewRequestData:
    """A request the runner has not seen (or has dropped) — full data."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    block_ids: tuple[list[int], ...]  # per KV cache group
    num_computed_tokens: int  # prefix-cache hit: tokens whose KV is already there

    @classmethod
    def from_request(cls, request: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        return cls(req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                   sampling_params=request.sampling_params, block_ids=block_ids,
                   num_computed_tokens=request.num_computed_tokens)


@dataclass
class CachedRequestData:
    """Deltas for requests the runner holds (or held before a preemption); lists are parallel to req_ids."""

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)  # tokens to compute this step
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)  # for requests not scheduled last step
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def from_requests(cls, running_reqs: Sequence[Request], resumed_reqs: Sequence[Request],
                      num_scheduled_tokens: Mapping[str, int], new_blocks: Mapping[str, KVCacheBlocks],
                      prev_step_scheduled_req_ids: set[str]) -> CachedRequestData:
        """Built before the requests' computed counts advance for this step. new_blocks holds
        the requests given blocks this step (an absent one got none).
        (vLLM: `Scheduler._make_cached_request_data`.)"""
        reqs = list(itertools.chain(running_reqs, resumed_reqs)) if resumed_reqs else running_reqs
        req_ids = [r.request_id for r in reqs]
        computed = [r.num_computed_tokens for r in reqs]
        new_token_ids = [r.all_token_ids[start:start + num_scheduled_tokens[rid]]
                         for r, rid, start in zip(reqs, req_ids, computed)]
        new_block_ids: list = [None] * len(reqs)
        if new_blocks:
            for i, rid in enumerate(req_ids):
                b = new_blocks.get(rid)
                if b is not None:
                    new_block_ids[i] = b.get_block_ids(allow_none=True)
        all_token_ids = {}
        if not prev_step_scheduled_req_ids.issuperset(req_ids):
            all_token_ids = {r.request_id: list(r.all_token_ids) for r in reqs
                             if r.request_id not in prev_step_scheduled_req_ids}
        return cls(req_ids, {r.request_id for r in resumed_reqs}, new_token_ids, all_token_ids, new_block_ids,
                   computed, [len(r.output_token_ids) for r in reqs])

    def is_resumed(self, req_id: str) -> bool:
        return req_id in self.resumed_req_ids


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    num_common_prefix_blocks: list[int]  # per group: blocks shared by every running request
    finished_req_ids: set[str]  # finished since the previous step: runner frees their state
    preempted_req_ids: set[str]  # preempted in this step: they come back later as resumed
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)  # unused yet
    # A hybrid model's state-slot copies (source slot, destination slot), each list in order
    # (runtime/core/single_type_kv_cache_manager.py MambaManager): prefix-cache snapshots
    # restored into slots before this step's forward, and slots saved as snapshots after it.
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What the runner hands back: per scheduled request (in `req_ids` order),
    its sampled token ids (empty for a partial prefill chunk) and optionally
    per-token logprobs (any per-request list, one entry per sampled token)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[Any] | None = None
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    prompt_logprobs: dict[str, Any] = field(default_factory=dict)  # req_id -> LogprobsTensors or None
    stop_reasons: dict[str, str] = field(default_factory=dict)  # req_id -> why the runner ended it (its last token)
    # req_id -> why the runner could not start it (its own parameters failed there): it is not in
    # req_ids, and the scheduler finishes it with FinishReason.ERROR; the step's others go on
    failed: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.sampled_token_ids) != len(self.req_ids):
            raise ValueError(f"{len(self.req_ids)} request ids but {len(self.sampled_token_ids)} token lists")
        if not self.req_id_to_index:
            self.req_id_to_index = dict(zip(self.req_ids, range(len(self.req_ids))))


@dataclass(slots=True)  # one per request per step: slots make it smaller and a little cheaper to build
class EngineCoreOutput:
    """One request's news from one step: tokens to detokenize and, when it
    finished, why. `stop_reason` is the stop token id that ended it, if any."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    new_logprobs: Any = None
    new_prompt_logprobs: Any = None  # LogprobsTensors for the prompt positions scored this step
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
