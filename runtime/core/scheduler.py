"""vLLM V1's unified scheduler: one token budget per step, shared by all requests.

Ported in behaviour from vLLM V1 `vllm/v1/core/sched/scheduler.py`
(`Scheduler.schedule`, `_preempt_request`, `_make_cached_request_data`,
`_update_after_schedule`, `update_from_output`, `finish_requests`).

There is no prefill phase and no decode phase: each request has
`num_computed_tokens` catching up with `num_tokens`, and a step hands out tokens
to RUNNING requests first (in order), then admits WAITING ones, while the budget
(`max_num_batched_tokens`) and `max_num_seqs` last. A long prompt is computed
in chunks over several steps, mixed with other requests' decodes; its chunk
leaves a token for every decode after it and room for the head of the waiting
queue (`_prefill_room`, `_waiting_reserve`), so a short request arriving behind
it starts at the next step (vLLM lets the long prompt take the budget). When a
running request cannot get a KV block, another running request is preempted
(its blocks freed, recomputed later; FCFS takes the last running one, PRIORITY
the lowest priority) and no waiting request is admitted in that step.

Hybrid models (a `MambaSpec` state group: Gated DeltaNet layers) get their prefill
chunks cut at absolute multiples of GDN_CHUNK_ALIGN, the last chunk excepted (see
`_gdn_aligned_chunk`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kiln.runtime.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kiln.runtime.core.kv_cache_spec import GDN_CHUNK_ALIGN, KVCacheConfig, MambaSpec
from kiln.runtime.core.kv_cache_utils import get_request_block_hasher
from kiln.runtime.core.request import FinishReason, Request, RequestStatus
from kiln.runtime.core.request_queue import SchedulingPolicy, create_request_queue
from kiln.runtime.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kiln.runtime.core.scheduler_config import CacheConfig, SchedulerConfig
from kiln.runtime.core.scheduler_stats import SchedulerStats
from kiln.runtime.core.stop_check import append_and_check_stop


@dataclass
class _Step:
    """What one schedule() call has decided so far."""

    token_budget: int
    new_reqs: list[Request] = field(default_factory=list)
    resumed_reqs: list[Request] = field(default_factory=list)
    running_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)
    # Blocks given this step, for the requests that got some (a decode step mostly gets none).
    new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Rows of logits the step will want: one per scheduled request, plus these extra rows
    # of requests whose chunk scores prompt positions (a row per chunk token).
    prompt_rows: dict[str, int] = field(default_factory=dict)

    @property
    def num_logits_rows(self) -> int:
        return len(self.num_scheduled_tokens) + sum(self.prompt_rows.values())

    def schedule(self, request: Request, num_tokens: int, blocks: KVCacheBlocks) -> None:
        rid = request.request_id
        if any(blocks.blocks):
            self.new_blocks[rid] = blocks
        self.num_scheduled_tokens[rid] = num_tokens
        if request.prompt_logprobs is not None and _wants_prompt_rows(request):
            self.prompt_rows[rid] = num_tokens - 1
        self.token_budget -= num_tokens

    def unschedule_running(self, request: Request) -> None:
        self.running_reqs.remove(request)
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        self.prompt_rows.pop(request.request_id, None)
        self.new_blocks.pop(request.request_id, None)


_PREEMPTED = int(RequestStatus.PREEMPTED)  # every status above it is a finished one

# The chunk size of the Gated DeltaNet chunked form (CHUNK of graph/gdn_ops.py, which
# tests/runtime/core/test_scheduler_hybrid.py checks against this, and of the kernel in
# codegen/triton/gdn.py). Written out here so this module stays pure Python (kiln.graph pulls
# in numpy).


def prefill_chunk_align(kv_cache_config: KVCacheConfig) -> int:
    """The multiple prefill chunks of this cache's model must end on: GDN_CHUNK_ALIGN when a
    group holds Gated DeltaNet state (MambaSpec), else 0 (no alignment)."""
    if any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups):
        return GDN_CHUNK_ALIGN
    return 0


def _snapshot_split(start: int, num_new: int, num_tokens: int, interval: int) -> int:
    """A hybrid's prefill chunk [start, start + num_new) that crosses the request's last
    state-snapshot boundary (the last multiple of `interval` in its num_tokens) stops there,
    so that the state there is snapshotted for the prefix cache; the rest comes next step.
    vLLM's Scheduler._mamba_block_aligned_split does the same ("force to cache the last
    chunk")."""
    last = num_tokens - num_tokens % interval
    return last - start if start < last < start + num_new else num_new


def _gdn_aligned_chunk(start: int, num_new: int, align: int, wait: bool = False) -> int:
    """A prefill chunk [start, start + num_new) that is NOT the last one of its request, cut
    back to end on the last multiple of `align` inside it.

    Why: the Gated DeltaNet chunked kernel cuts a sequence into `align`-token chunks at
    absolute positions, so chunks that end on those positions make a prompt prefilled over
    several steps go through the same kernel chunks as one prefilled in one step (and give
    the same bits). A chunk lying inside one window (no multiple of `align` in
    (start, start + num_new]) waits for a later step (0) when `wait`: the caller says so where
    a whole window can come (the step's budget and the long-prefill threshold reach `align`),
    as vLLM's Scheduler._mamba_block_aligned_split (vllm/v1/core/sched/scheduler.py) skips a
    request whose chunk rounds down to nothing. Otherwise (a budget smaller than `align`) it
    runs as it is, to make progress, and that prompt's bits may differ from a one-step
    prefill's by rounding."""
    end = start + num_new
    aligned_end = end - end % align
    if aligned_end > start:
        return aligned_end - start
    return 0 if wait else num_new


def _wants_prompt_rows(request: Request) -> bool:
    """Its next chunk still scores prompt positions: one logits row per chunk token."""
    return (request.prompt_logprobs is not None
            and request.num_computed_tokens < request.num_prompt_tokens - 1)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_config: KVCacheConfig,
                 cache_config: CacheConfig | None = None, max_num_logits_rows: int | None = None) -> None:
        self.scheduler_config = scheduler_config
        # Logits rows one step may ask for (a GPU bundle's buckets hold max_num_seqs): a request
        # computing prompt logprobs needs a row per chunk token, so its chunks are capped.
        self.max_num_logits_rows = max_num_logits_rows
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.cache_config = cache_config or CacheConfig(block_size=self.block_size)
        if self.cache_config.block_size != self.block_size:
            raise ValueError(f"cache_config.block_size ({self.cache_config.block_size}) differs from the "
                             f"KV cache's block size ({self.block_size})")
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.policy = SchedulingPolicy(scheduler_config.policy)
        enable_caching = self.cache_config.enable_prefix_caching
        self.kv_cache_manager = KVCacheManager(kv_cache_config, scheduler_config.max_model_len, enable_caching)
        # A request longer than the whole KV cache could never be scheduled and
        # would preempt everything forever: cap every request at what one
        # request alone can hold (vLLM refuses to start instead).
        self.max_model_len = min(scheduler_config.max_model_len,
                                 self.kv_cache_manager.max_num_tokens_per_request)
        self.block_hasher = get_request_block_hasher(self.block_size) if enable_caching else None

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the previous schedule(); sent with the next output so
        # the runner frees their state.
        self.finished_req_ids: set[str] = set()
        self.prev_step_scheduled_req_ids: set[str] = set()
        self._num_preemptions = 0  # since the previous make_stats()
        # Async scheduling (vLLM's AsyncScheduler): schedule() may run again before the previous
        # step's tokens came back. A step that will sample a token for a request adds one
        # num_output_placeholders to it; update_from_output takes it off when the token arrives.
        self.async_scheduling = scheduler_config.async_scheduling
        # Hybrid models: a prefill chunk short of its request's end ends on a multiple of this
        # (0: any end; every model without a Gated DeltaNet state group).
        self.prefill_chunk_align = prefill_chunk_align(kv_cache_config)
        # With prefix caching, a hybrid's state is snapshotted where a prefill chunk ends on a
        # multiple of this (0: no snapshots); chunks end on its multiples (a multiple of the
        # GDN chunk too), and the last one before the request's end is always a chunk end.
        self.snapshot_interval = kv_cache_config.state_snapshot_interval if enable_caching else 0
        if self.snapshot_interval:
            self.prefill_chunk_align = self.snapshot_interval
        # A chunk that cannot reach the next aligned end waits for a step with budget left, where
        # every step's budget and the long-prefill threshold can hold a whole window.
        threshold = scheduler_config.long_prefill_token_threshold
        self.align_waits = bool(self.prefill_chunk_align) and min(
            scheduler_config.max_num_batched_tokens, threshold or scheduler_config.max_num_batched_tokens
        ) >= self.prefill_chunk_align

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError for one that can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: the prompt has {request.num_prompt_tokens} tokens, more than "
                f"the {self.max_model_len} a request may hold (max_model_len "
                f"{self.scheduler_config.max_model_len}, KV cache "
                f"{self.kv_cache_manager.max_num_tokens_per_request} tokens)")
        if request.block_hasher is None and self.block_hasher is not None:
            request.set_block_hasher(self.block_hasher)
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: str | Iterable[str] | None,
                        finished_status: RequestStatus) -> list[str]:
        """Finish requests from outside (abort, stop string found), waiting or
        running; frees their blocks. None means every request. -> the ids
        finished now (unknown or already finished ids are ignored)."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        ids = list(self.requests) if request_ids is None else list(dict.fromkeys(request_ids))
        reqs = [r for rid in ids if (r := self.requests.get(rid)) is not None and not r.is_finished()]
        running = {id(r) for r in reqs if r.status == RequestStatus.RUNNING}
        if running:
            self.running = [r for r in self.running if id(r) not in running]
        waiting = [r for r in reqs if id(r) not in running]
        if waiting:
            self.waiting.remove_requests(waiting)
        for r in reqs:
            r.status = finished_status
            self._free_request(r)
        return [r.request_id for r in reqs]

    def _free_request(self, request: Request) -> None:
        assert request.is_finished()
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Finished requests the runner has not been told about yet."""
        return len(self.finished_req_ids) > 0

    def get_request_counts(self) -> tuple[int, int]:
        """-> (running, waiting)."""
        return len(self.running), len(self.waiting)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        step = _Step(token_budget=self.max_num_scheduled_tokens)
        self._schedule_running(step)
        if not step.preempted_reqs:
            self._schedule_waiting(step)
        total = sum(step.num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens and step.token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs
        return self._make_output(step, total)

    def _cap_logits_rows(self, request: Request, num_new: int, step: _Step) -> int:
        """Shorten a prompt-logprobs chunk so the step's logits rows fit, keeping one row for
        every request that may still join this step."""
        if self.max_num_logits_rows is None or not _wants_prompt_rows(request):
            return num_new
        others = min(self.max_num_running_reqs, len(self.running) + len(self.waiting)) \
            - len(step.num_scheduled_tokens) - 1
        room = self.max_num_logits_rows - step.num_logits_rows - max(others, 0)
        return max(1, min(num_new, room))

    def _schedule_running(self, step: _Step) -> None:
        threshold = self.scheduler_config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        allocate_slots = self.kv_cache_manager.allocate_slots
        # Tokens each running request can take with nothing for allocate_slots to do (most decode
        # steps): those skip the call and are scheduled inline.
        room = self.kv_cache_manager.slot_room
        room_of = room.get if room is not None else None
        cap_rows = self.max_num_logits_rows is not None
        async_sched = self.async_scheduling
        align, snap = self.prefill_chunk_align, self.snapshot_interval
        running, scheduled = self.running, step.running_reqs
        num_scheduled = step.num_scheduled_tokens
        reserve = self._waiting_reserve()
        req_index = 0
        while req_index < len(running) and step.token_budget > 0:
            request = running[req_index]
            computed = request.num_computed_tokens
            num_new = len(request.all_token_ids) - computed
            if async_sched and request.num_output_placeholders:
                pending = request.num_output_placeholders
                if (len(request.output_token_ids) + pending >= request.max_tokens
                        or len(request.all_token_ids) + pending >= max_model_len):
                    # The tokens in flight already reach max_tokens / max_model_len: another
                    # step would only compute a token that gets dropped (vLLM does the same).
                    req_index += 1
                    continue
                num_new += pending  # the in-flight tokens' positions: the runner knows them
            wanted = num_new  # what would finish the request's known work
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > step.token_budget - reserve - 1 and computed + 1 < len(request.all_token_ids):
                # a prefill chunk that would take the rest of the budget (decodes never yield)
                num_new = min(num_new, self._prefill_room(step, req_index, reserve))
            # vLLM clamps to max_model_len - 1 - computed (for spec tokens),
            # which would strand a prompt of exactly max_model_len tokens.
            if num_new > step.token_budget:  # min(num_new, budget, room), without the call
                num_new = step.token_budget
            if num_new > max_model_len - computed:
                num_new = max_model_len - computed
            if num_new > 0 and cap_rows:
                num_new = self._cap_logits_rows(request, num_new, step)
            if align and 0 < num_new < wanted and computed + num_new < max_model_len:
                # A hybrid's chunk short of the request's end (after every other cap): cut to
                # a Gated DeltaNet chunk boundary.
                wait = self.align_waits and not _wants_prompt_rows(request)
                cut = _gdn_aligned_chunk(computed, num_new, align, wait)
                if cut == 0 and wait:
                    # Cut below a window by a share left to waiting requests: a hybrid yields in
                    # whole windows or not at all (the waiting head gets what is left, if any)
                    whole = min(wanted, threshold or wanted, step.token_budget, max_model_len - computed)
                    cut = whole if whole == wanted else _gdn_aligned_chunk(computed, whole, align, wait)
                num_new = cut
            if snap and num_new > 1:
                num_new = _snapshot_split(computed, num_new, len(request.all_token_ids), snap)
            if num_new <= 0:
                req_index += 1
                continue
            if (room_of is not None and computed + num_new <= room_of(request.request_id, -1)
                    and request.prompt_logprobs is None):
                # step.schedule of a request given no blocks, inline
                scheduled.append(request)
                num_scheduled[request.request_id] = num_new
                step.token_budget -= num_new
                req_index += 1
                continue
            while True:
                new_blocks = allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim, req_index = self._preempt_one(step, req_index)
                if victim is request:
                    break
            if new_blocks is None:
                # The request preempted itself (it was the last running one, or
                # the lowest priority). vLLM stops the loop here; going on lets
                # higher-priority requests after it run in this step (the same
                # thing under FCFS, where it was the last), so a step with
                # running requests always schedules some tokens.
                continue
            scheduled.append(request)
            step.schedule(request, num_new, new_blocks)
            req_index += 1

    def _prefill_room(self, step: _Step, req_index: int, reserve: int) -> int:
        """What running[req_index]'s prefill chunk may take: the budget less a token for each
        decode after it in the running list and the waiting head's reserve. Without the
        decodes' share, a short request admitted behind a long prefill got its first token and
        then no other until the prefill ended (running requests are served in order)."""
        decodes = sum(1 for r in self.running[req_index + 1:] if r.num_computed_tokens + 1 >= len(r.all_token_ids))
        return max(step.token_budget - decodes - reserve, 0)

    def _waiting_reserve(self) -> int:
        """Tokens of this step's budget that running prefill chunks leave to the head of the
        waiting queue: its prompt, at most half the budget (0 when max_num_seqs are running).

        Why (issue 42 #3): running requests are scheduled first, as in vLLM, so one long
        prompt's chunks took every step's whole budget and a 5-token request arriving behind
        it waited for the entire prefill (17 s on CPU with a 256-token budget). Leaving room
        lets a short request in at the next step, within one chunk's time; a long one arriving
        behind a long one shares the steps half and half. Decodes never yield. A head that then
        finds no free KV blocks is not admitted, and the prefill lost half a step: rare (the
        prefill needs blocks too) and bounded, so no block count is guessed here."""
        if not self.waiting or len(self.running) >= self.max_num_running_reqs:
            return 0
        return min(self.waiting.peek_request().num_tokens, self.max_num_scheduled_tokens // 2)

    def _preempt_one(self, step: _Step, req_index: int) -> tuple[Request, int]:
        """Preempt one running request to free blocks; -> (victim, adjusted req_index)."""
        num_valid_tokens = None
        if self.policy == SchedulingPolicy.PRIORITY:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            victim_index = self.running.index(victim)
            del self.running[victim_index]
            if victim_index < req_index:
                req_index -= 1
            if victim.request_id in step.num_scheduled_tokens:
                # Scheduled earlier in this step: hand back its budget, and
                # un-publish the blocks it would have written (vLLM leaves them
                # in the prefix cache, with contents never computed).
                step.unschedule_running(victim)
                num_valid_tokens = victim.num_computed_tokens
        else:
            victim = self.running.pop()
        self._preempt_request(victim, num_valid_tokens)
        step.preempted_reqs.append(victim)
        return victim, req_index

    def _preempt_request(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Free a running request's blocks and put it back at the head of the
        waiting queue; it will recompute its tokens (prefix hits permitting)."""
        assert request.status == RequestStatus.RUNNING, "only running requests can be preempted"
        self.kv_cache_manager.free(request, num_valid_tokens)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.prepend_request(request)

    def _schedule_waiting(self, step: _Step) -> None:
        threshold = self.scheduler_config.long_prefill_token_threshold
        kv = self.kv_cache_manager
        while self.waiting and step.token_budget > 0:
            if len(self.running) == self.max_num_running_reqs:
                break
            request = self.waiting.peek_request()
            # A preempted request's in-flight token comes back (update_from_output) before the
            # next schedule() can admit it: it never rejoins with tokens still unknown.
            assert request.num_output_placeholders == 0, request
            hit_blocks, num_computed = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed  # num_tokens: resumed ones have outputs
            wanted = num_new  # what would finish the request's known work
            if 0 < threshold < num_new:
                num_new = threshold
            if not self.scheduler_config.enable_chunked_prefill and num_new > step.token_budget:
                break
            num_new = min(num_new, step.token_budget)
            assert num_new > 0
            if self.max_num_logits_rows is not None and _wants_prompt_rows(request):
                # num_computed_tokens is set below; the cap looks at where this chunk starts
                saved, request.num_computed_tokens = request.num_computed_tokens, num_computed
                num_new = self._cap_logits_rows(request, num_new, step)
                request.num_computed_tokens = saved
            if self.prefill_chunk_align and num_new < wanted:
                # A hybrid's chunk short of the request's end, from where any prefix hit ends:
                # cut to a Gated DeltaNet chunk boundary (absolute positions).
                num_new = _gdn_aligned_chunk(num_computed, num_new, self.prefill_chunk_align,
                                             self.align_waits and not _wants_prompt_rows(request))
                if num_new <= 0:
                    break  # its chunk waits for a step with a whole window of budget (FCFS: so do later ones)
            if self.snapshot_interval and num_new > 1:
                num_new = _snapshot_split(num_computed, num_new, request.num_tokens, self.snapshot_interval)
            new_blocks = kv.allocate_slots(request, num_new, num_computed, hit_blocks)
            if new_blocks is None:
                break  # head-of-line: later requests wait too (FCFS order is kept)
            self.waiting.pop_request()
            self.running.append(request)
            kv.record_prefix_cache_stats(request, num_computed)
            if request.status == RequestStatus.WAITING:
                step.new_reqs.append(request)
            elif request.status == RequestStatus.PREEMPTED:
                step.resumed_reqs.append(request)
            else:
                raise RuntimeError(f"invalid status of a waiting request: {request.status.name}")
            # The runner gets the whole block list of an admitted request.
            step.schedule(request, num_new, kv.get_blocks(request.request_id))
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed

    def _make_output(self, step: _Step, total: int) -> SchedulerOutput:
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        num_common_prefix_blocks = (self.kv_cache_manager.get_num_common_prefix_blocks(self.running[0].request_id)
                                    if self.running else [0] * num_groups)
        new_reqs = [NewRequestData.from_request(r, step.new_blocks[r.request_id].get_block_ids())
                    for r in step.new_reqs]
        restores, saves = self.kv_cache_manager.take_state_copies()
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData.from_requests(
                step.running_reqs, step.resumed_reqs, step.num_scheduled_tokens, step.new_blocks,
                self.prev_step_scheduled_req_ids),
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in step.preempted_reqs},
            state_restores=restores, state_saves=saves,
        )
        self.prev_step_scheduled_req_ids = set(step.num_scheduled_tokens)
        # Advance after building the output (it carries the pre-step counts),
        # so a prefill can be scheduled again in the very next step.
        nst = step.num_scheduled_tokens
        for reqs in (step.running_reqs, step.new_reqs, step.resumed_reqs):
            for r in reqs:
                r.num_computed_tokens += nst[r.request_id]
        if self.async_scheduling:
            # A chunk reaching the request's last position (known tokens and the ones in flight)
            # samples one more token; partial prefill chunks sample nothing.
            for reqs in (step.running_reqs, step.new_reqs, step.resumed_reqs):
                for r in reqs:
                    if r.num_computed_tokens == len(r.all_token_ids) + r.num_output_placeholders:
                        r.num_output_placeholders += 1
        self.finished_req_ids = set()  # a new set: the output keeps the old one
        return out

    # ------------------------------------------------------------------ outputs

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> dict[str, EngineCoreOutput]:
        """Append sampled tokens, check stops, free finished requests.
        -> per request with news (tokens or a finish), in scheduling order.

        Under async scheduling (vLLM: AsyncScheduler._update_request_with_output) later steps
        may already have been scheduled, so a request's num_computed_tokens says nothing about
        this step: a token is expected exactly where the runner sampled one, and it settles one
        of the request's output placeholders. Tokens of requests finished (stopped, aborted)
        since this step was scheduled are dropped. A request preempted since then still gets
        its token (it is in the runner's copy of the request too, and its recomputation must
        include it); if that token ends it, it leaves the waiting queue."""
        outputs: dict[str, EngineCoreOutput] = {}
        if model_runner_output.failed:
            for rid in self.finish_requests(list(model_runner_output.failed), RequestStatus.FINISHED_ERROR):
                outputs[rid] = EngineCoreOutput(rid, [], FinishReason.ERROR,
                                                stop_reason=model_runner_output.failed[rid])
        stopped_running: set[int] = set()
        stopped_waiting: list[Request] = []
        index_of = model_runner_output.req_id_to_index
        sampled = model_runner_output.sampled_token_ids
        all_logprobs = model_runner_output.logprobs
        requests, max_model_len, ahead = self.requests, self.max_model_len, self.async_scheduling
        for rid in scheduler_output.num_scheduled_tokens:
            request = requests.get(rid)
            if request is None or request.status > _PREEMPTED:
                continue  # finished (aborted, stopped) while the step ran
            idx = index_of.get(rid)
            if idx is None or (not ahead and request.num_computed_tokens < len(request.all_token_ids)):
                continue  # a partial prefill chunk samples nothing (any token given is discarded)
            new_token_ids = sampled[idx]
            if len(new_token_ids) != 1:
                if not new_token_ids:
                    continue
                new_token_ids = list(new_token_ids)  # trimmed in place at a stop
            # (one token: nothing trims it, so the runner's list is handed on as it is)
            preempted = False  # synchronously every request of the step is running
            if ahead:
                request.num_output_placeholders -= len(new_token_ids)
                assert request.num_output_placeholders >= 0, request
                preempted = request.status != RequestStatus.RUNNING
            finish_reason = None
            if append_and_check_stop(request, new_token_ids, max_model_len):
                finish_reason = request.get_finished_reason()
                if model_runner_output.stop_reasons:  # e.g. a grammar's dead end forced EOS
                    request.stop_reason = model_runner_output.stop_reasons.get(rid, request.stop_reason)
                self._free_request(request)
                if preempted:
                    stopped_waiting.append(request)
                else:
                    stopped_running.add(id(request))
            logprobs = all_logprobs[idx] if all_logprobs else None
            if logprobs is not None and isinstance(logprobs, list):
                logprobs = logprobs[:len(new_token_ids)]
            num_cached = request.num_cached_tokens
            outputs[rid] = EngineCoreOutput(rid, new_token_ids, finish_reason, logprobs, None,
                                            request.stop_reason, num_cached if num_cached > 0 else 0)
        if stopped_running:
            self.running = [r for r in self.running if id(r) not in stopped_running]
        if stopped_waiting:
            self.waiting.remove_requests(stopped_waiting)
        return outputs

    # ------------------------------------------------------------------ stats

    def make_stats(self) -> SchedulerStats:
        """Gauges now, counters since the previous call."""
        num_preemptions, self._num_preemptions = self._num_preemptions, 0
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage, state_usage=self.kv_cache_manager.state_usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            num_preemptions=num_preemptions)

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes (after a weight update, say); False while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()
