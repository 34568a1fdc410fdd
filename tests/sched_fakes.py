"""Fakes for the scheduler tests: sampling params, request factories, and a fake
model runner that keeps a fake KV cache and checks what the scheduler tells it.

The fake runner applies SchedulerOutput exactly as a real runner must (see
`kiln/runtime/core/sched_output.py`): it keeps per-request tokens and block tables,
writes each scheduled token's id into its KV slot, then checks that every slot a
request reads (all its earlier positions) holds that request's token at that
position. A prefix-cache hit on the wrong block, a block freed while still in
use, or a wrong block-table delta all show up as a mismatch.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kiln.runtime.core.kv_cache_spec import full_attention_config, hybrid_config
from kiln.runtime.core.request import Request
from kiln.runtime.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kiln.runtime.core.scheduler import Scheduler
from kiln.runtime.core.scheduler_config import CacheConfig, SchedulerConfig

EOS = 0


@dataclass
class FakeSamplingParams:
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1


def create_scheduler(num_blocks: int = 100, block_size: int = 16, max_num_batched_tokens: int = 2048,
                     max_num_seqs: int = 16, max_model_len: int = 1024, enable_prefix_caching: bool = True,
                     enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                     policy: str = "fcfs", num_state_slots: int = 0, num_state_snapshots: int = 0) -> Scheduler:
    """num_state_slots > 0: a hybrid model's two groups (attention blocks, state slots), of
    which num_state_snapshots slots are for prefix-cache snapshots."""
    sc = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                         long_prefill_token_threshold=long_prefill_token_threshold, policy=policy)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    kv = (hybrid_config(num_blocks, block_size, 1, 1, "bf16", num_state_slots, (4, 3), (2, 4, 4), "bf16",
                        num_state_snapshots=num_state_snapshots)
          if num_state_slots else full_attention_config(num_blocks, block_size))
    return Scheduler(sc, kv, cc)


def make_request(rid: str, prompt: list[int], eos_token_id: int | None = EOS, priority: int = 0,
                 arrival_time: float | None = None, **sp) -> Request:
    return Request(rid, prompt, FakeSamplingParams(**sp), eos_token_id=eos_token_id, priority=priority,
                   arrival_time=arrival_time)


def create_requests(num: int, num_tokens: int = 10, start: int = 0, same_prompt: bool = False,
                    **sp) -> list[Request]:
    """Requests with distinct prompts (token ids >= 1, so never EOS) unless same_prompt."""
    reqs = []
    for i in range(start, start + num):
        base = 0 if same_prompt else i * 1000
        reqs.append(make_request(str(i), [1 + base + j for j in range(num_tokens)],
                                 arrival_time=float(i), **sp))
    return reqs


def fake_token(req_id: str, position: int, vocab: int = 50, eos_every: int = 0) -> int:
    """A deterministic "model": the token at `position` of request `req_id`.
    With eos_every > 0, about 1 in eos_every tokens is EOS."""
    h = int.from_bytes(hashlib.sha256(f"{req_id}:{position}".encode()).digest()[:8], "little")
    if eos_every and h % eos_every == 0:
        return EOS
    return 1 + h % vocab


class FakeRunner:
    def __init__(self, block_size: int, token_fn=fake_token) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.kv: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id written there
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        # A hybrid model's state slots: slot -> the tokens its state has consumed (a recurrence
        # over them); a request's slot, from the second group's block ids.
        self.state: dict[int, tuple[int, ...]] = {}
        self.slot: dict[str, int] = {}
        self.num_restores = 0  # state restores made (prefix-cache hits of a hybrid)

    def _copy_states(self, copies) -> None:
        for src, dst in copies:
            self.state[dst] = self.state.get(src)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
            self.slot.pop(rid, None)
        self._copy_states(out.state_restores)
        self.num_restores += len(out.state_restores)
        start: dict[str, int] = {}
        for nr in out.scheduled_new_reqs:
            assert nr.req_id not in self.tokens, f"{nr.req_id} sent as new twice"
            self.tokens[nr.req_id] = list(nr.prompt_token_ids)
            self.blocks[nr.req_id] = list(nr.block_ids[0])
            if len(nr.block_ids) > 1:
                self.slot[nr.req_id] = nr.block_ids[1][0]
            start[nr.req_id] = nr.num_computed_tokens
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            if rid in c.resumed_req_ids:
                assert rid not in self.tokens, f"resumed {rid} was not dropped at preemption"
                self.tokens[rid] = list(c.all_token_ids[rid])
                self.blocks[rid] = list(c.new_block_ids[i][0])
                if len(c.new_block_ids[i]) > 1:
                    self.slot[rid] = c.new_block_ids[i][1][0]
            else:
                assert rid in self.tokens, f"cached {rid} unknown to the runner"
                if rid in c.all_token_ids:
                    self.tokens[rid] = list(c.all_token_ids[rid])
                if c.new_block_ids[i] is not None:
                    self.blocks[rid].extend(c.new_block_ids[i][0])
            start[rid] = c.num_computed_tokens[i]
            n = out.num_scheduled_tokens[rid]
            assert c.new_token_ids[i] == self.tokens[rid][start[rid]:start[rid] + n]
        assert set(start) == set(out.num_scheduled_tokens)
        bs = self.block_size
        # Write every scheduled token's KV first (a same-step prefix hit reads them).
        for rid, n in out.num_scheduled_tokens.items():
            toks, blocks, s = self.tokens[rid], self.blocks[rid], start[rid]
            assert s + n <= len(toks), f"{rid}: scheduled past its tokens"
            assert len(blocks) * bs >= s + n, f"{rid}: {len(blocks)} blocks for {s + n} tokens"
            for pos in range(s, s + n):
                self.kv[blocks[pos // bs], pos % bs] = toks[pos]
        # The recurrent state: a chunk starting past 0 must find its slot holding exactly the
        # tokens before it (a wrong snapshot restored, a slot shared or freed early all show).
        for rid, n in out.num_scheduled_tokens.items():
            if rid in self.slot:
                s, slot = start[rid], self.slot[rid]
                if s:
                    got = self.state.get(slot)
                    assert got == tuple(self.tokens[rid][:s]), \
                        f"{rid}: slot {slot} holds the state of {got}, expected its first {s} tokens"
                self.state[slot] = tuple(self.tokens[rid][:s + n])
        self._copy_states(out.state_saves)
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            toks, blocks, s = self.tokens[rid], self.blocks[rid], start[rid]
            for pos in range(s + n):
                got = self.kv.get((blocks[pos // bs], pos % bs))
                assert got == toks[pos], f"{rid}: KV at position {pos} holds {got}, expected {toks[pos]}"
            req_ids.append(rid)
            if s + n == len(toks):
                tok = self.token_fn(rid, len(toks))
                toks.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000):
    """Step until nothing is left; -> (outputs per request id, finish reason per id, steps)."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, object] = {}
    steps = 0
    while scheduler.has_unfinished_requests():
        assert steps < max_steps, "the scheduler did not finish"
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens > 0, "a step with unfinished requests scheduled nothing"
        for rid, o in scheduler.update_from_output(out, runner.execute(out)).items():
            tokens.setdefault(rid, []).extend(o.new_token_ids)
            if o.finished:
                reasons[rid] = o.finish_reason
        steps += 1
    return tokens, reasons, steps
