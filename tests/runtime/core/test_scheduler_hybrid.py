"""The scheduler on a hybrid model (a Gated DeltaNet state group): prefill chunks short of the
request's end are cut back to end on an absolute multiple of GDN_CHUNK_ALIGN (64), where the
GDN chunked kernel cuts its chunks, so a prompt prefilled over several steps goes through the
same kernel chunks as one prefilled at once. A chunk inside one 64-token window runs as it is
(a budget under 64 still makes progress); the chunk that finishes the request is never cut.
A model without a state group keeps its chunks."""
from __future__ import annotations

from kiln.runtime.core.kv_cache_spec import full_attention_config, hybrid_config
from kiln.runtime.core.request import RequestStatus
from kiln.runtime.core.sched_output import ModelRunnerOutput
from kiln.runtime.core.scheduler import GDN_CHUNK_ALIGN, Scheduler, prefill_chunk_align
from kiln.runtime.core.scheduler_config import CacheConfig, SchedulerConfig

from tests.sched_fakes import FakeRunner, create_scheduler, fake_token, make_request


def _hybrid(**kw) -> Scheduler:
    kw.setdefault("num_state_slots", 8)
    return create_scheduler(enable_prefix_caching=False, **kw)


def _starts(out) -> dict[str, int]:
    """Where each scheduled request's chunk starts (the output carries the pre-step counts)."""
    starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    c = out.scheduled_cached_reqs
    starts.update(zip(c.req_ids, c.num_computed_tokens))
    return starts


def _output(out, token: int = 7) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(ids, [[token] for _ in ids])


def _prefill_ends(s, rid: str, prompt_len: int) -> list[int]:
    """Step a lone request until its prompt is computed; -> where each chunk ended."""
    s.add_request(make_request(rid, list(range(1, prompt_len + 1)), max_tokens=4))
    ends = []
    while not ends or ends[-1] < prompt_len:
        out = s.schedule()
        ends.append(_starts(out)[rid] + out.num_scheduled_tokens[rid])
        s.update_from_output(out, _output(out))
    return ends


def test_the_align_is_the_gdn_kernels_chunk():
    from kiln.graph.gdn_ops import CHUNK
    assert GDN_CHUNK_ALIGN == CHUNK == 64
    hybrid = hybrid_config(10, 16, 1, 1, "bf16", 2, (4, 3), (2, 4, 4), "bf16")
    assert prefill_chunk_align(hybrid) == 64 and _hybrid().prefill_chunk_align == 64
    assert prefill_chunk_align(full_attention_config(10, 16)) == 0
    assert create_scheduler().prefill_chunk_align == 0


def test_budget_100_rounds_every_chunk_but_the_last_down_to_64():
    assert _prefill_ends(_hybrid(max_num_batched_tokens=100), "a", 300) == [64, 128, 192, 256, 300]


def test_budget_40_runs_inside_a_window_and_aligns_where_it_crosses_one():
    ends = _prefill_ends(_hybrid(max_num_batched_tokens=40), "a", 300)
    assert ends == [40, 64, 104, 128, 168, 192, 232, 256, 296, 300]


def test_a_chunk_that_cannot_reach_a_window_end_waits_when_a_whole_window_fits_the_budget():
    """Budget 64, a request decoding ahead: the 63 tokens left cannot end a prefill chunk on a
    multiple of 64, so the long prompt waits (as vLLM's aligned split skips it) instead of
    running a chunk that ends inside a window; once the budget is whole it runs 64 at a time.
    Every chunk short of the prompt's end ends on a multiple of 64."""
    s = _hybrid(max_num_batched_tokens=64)
    assert s.align_waits
    s.add_request(make_request("d", list(range(1, 11)), max_tokens=5, ignore_eos=True))
    s.add_request(make_request("p", list(range(100, 300)), max_tokens=1))
    ends, steps = [], 0
    while s.has_unfinished_requests():
        out = s.schedule()
        assert out.total_num_scheduled_tokens > 0
        if "p" in out.num_scheduled_tokens:
            ends.append(_starts(out)["p"] + out.num_scheduled_tokens["p"])
        s.update_from_output(out, _output(out))
        steps += 1
        assert steps < 50
    assert ends == [64, 128, 192, 200]
    assert not _hybrid(max_num_batched_tokens=40).align_waits
    assert not _hybrid(max_num_batched_tokens=2048, long_prefill_token_threshold=32).align_waits


def test_the_chunk_that_finishes_the_prompt_is_never_cut():
    # 130 tokens fit the budget: one chunk, not 128 + 2
    assert _prefill_ends(_hybrid(max_num_batched_tokens=200), "a", 130) == [130]
    # the last chunk 192..250 ends off a boundary
    assert _prefill_ends(_hybrid(max_num_batched_tokens=100), "a", 250) == [64, 128, 192, 250]
    # a prompt ending on a boundary, and one within a window of it
    assert _prefill_ends(_hybrid(max_num_batched_tokens=100), "a", 128) == [64, 128]
    assert _prefill_ends(_hybrid(max_num_batched_tokens=100), "a", 65) == [65]


def test_a_model_without_a_state_group_keeps_its_chunks():
    plain = create_scheduler(max_num_batched_tokens=100, enable_prefix_caching=False)
    assert _prefill_ends(plain, "a", 300) == [100, 200, 300]
    plain = create_scheduler(max_num_batched_tokens=40, enable_prefix_caching=False)
    assert _prefill_ends(plain, "a", 300) == [40 * i for i in range(1, 8)] + [300]
    plain = create_scheduler(long_prefill_token_threshold=100, enable_prefix_caching=False)
    assert _prefill_ends(plain, "a", 300) == [100, 200, 300]


def test_long_prefill_token_threshold_chunks_are_aligned_too():
    s = _hybrid(max_num_batched_tokens=2048, long_prefill_token_threshold=100)
    assert _prefill_ends(s, "a", 300) == [64, 128, 192, 256, 300]
    s = _hybrid(max_num_batched_tokens=2048, long_prefill_token_threshold=40)
    assert _prefill_ends(s, "a", 150) == [40, 64, 104, 128, 150]


def test_requests_sharing_a_step_each_get_aligned_chunks_and_the_budget_is_right():
    s = _hybrid(max_num_batched_tokens=150, long_prefill_token_threshold=100)
    for rid, n in (("a", 300), ("b", 300), ("c", 20)):
        s.add_request(make_request(rid, list(range(1, n + 1)), max_tokens=8))
    out = s.schedule()
    # a: 100 -> 64 (86 left); b: 86 -> 64 (22 left); c: its whole 20-token prompt
    assert out.num_scheduled_tokens == {"a": 64, "b": 64, "c": 20}
    assert out.total_num_scheduled_tokens == 148
    s.update_from_output(out, _output(out))
    out = s.schedule()
    # a: 64..164 -> 128; b: 64..150 (the 86 left) -> 128; c decodes
    assert _starts(out) == {"a": 64, "b": 64, "c": 20}
    assert out.num_scheduled_tokens == {"a": 64, "b": 64, "c": 1}
    assert out.total_num_scheduled_tokens == 129
    s.update_from_output(out, _output(out))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 64, "b": 64, "c": 1}
    # the budget a cut hands back goes to the requests after it
    s = _hybrid(max_num_batched_tokens=100)
    for rid, n in (("a", 300), ("b", 30)):
        s.add_request(make_request(rid, list(range(1, n + 1)), max_tokens=8))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 64, "b": 30} and out.total_num_scheduled_tokens == 94


def test_a_waiting_prompt_whose_chunk_cannot_reach_a_window_end_waits_a_step():
    """Budget 100: short takes 70, and long's 30 would end inside 0..64, so long waits (a whole
    window fits a later step's budget); then it runs whole windows beside short's decodes.
    (Below a 64-token budget a chunk inside a window runs: test_budget_40_...)"""
    s = _hybrid(max_num_batched_tokens=100)
    s.add_request(make_request("short", list(range(1, 71)), max_tokens=8))
    s.add_request(make_request("long", list(range(1, 301)), max_tokens=8))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"short": 70}
    s.update_from_output(out, _output(out))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"short": 1, "long": 64}  # 0..99 -> 0..64
    s.update_from_output(out, _output(out))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"short": 1, "long": 64}  # 64..163 -> 64..128


def test_prompt_logprobs_rows_cap_then_align():
    kv = hybrid_config(100, 16, 1, 1, "bf16", 4, (4, 3), (2, 4, 4), "bf16")
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=1000, max_model_len=1024), kv,
                  CacheConfig(block_size=16, enable_prefix_caching=False), max_num_logits_rows=100)
    req = make_request("a", list(range(1, 301)), max_tokens=4)
    req.prompt_logprobs = 0  # (the fake sampling params have no such field)
    s.add_request(req)
    ends = []
    while not ends or ends[-1] < 300:
        out = s.schedule()
        ends.append(_starts(out)["a"] + out.num_scheduled_tokens["a"])
        s.update_from_output(out, _output(out))
    assert ends == [64, 128, 192, 256, 300]  # 100 rows a step, cut to the boundaries


def test_async_scheduling_steps_ahead_on_aligned_chunks():
    kv = hybrid_config(100, 16, 1, 1, "bf16", 4, (4, 3), (2, 4, 4), "bf16")
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_model_len=1024, async_scheduling=True), kv,
                  CacheConfig(block_size=16, enable_prefix_caching=False))
    s.add_request(make_request("a", list(range(1, 301)), max_tokens=3, ignore_eos=True))
    outs = [s.schedule() for _ in range(6)]  # nothing comes back in between
    assert [o.num_scheduled_tokens.get("a") for o in outs] == [64, 64, 64, 64, 44, 1]
    req = s.requests["a"]
    assert req.num_computed_tokens == 301 and req.num_output_placeholders == 2
    for o in outs:  # partial chunks sample nothing; the last two steps sample a token each
        done = _starts(o)["a"] + o.num_scheduled_tokens["a"] >= 300
        s.update_from_output(o, ModelRunnerOutput(["a"], [[5] if done else []]))
    assert req.output_token_ids == [5, 5] and req.num_output_placeholders == 0


def test_resumed_and_crowded_requests_keep_the_rule():
    """Many requests, a small KV cache (preemptions: resumed requests recompute prompt and
    outputs in chunks) and a 50-token budget, through the fake runner: every chunk short of
    its request's end either ends on a multiple of 64 or lies inside one 64-token window, and
    every request still gets its fake model's tokens."""
    s = _hybrid(num_blocks=24, block_size=16, max_num_batched_tokens=50, max_num_seqs=4, num_state_slots=3)
    runner = FakeRunner(16)
    lens = [150, 70, 130, 200, 64, 90, 129]
    reqs = [make_request(f"r{i}", [1 + 1000 * i + j for j in range(n)], max_tokens=12, ignore_eos=True)
            for i, n in enumerate(lens)]
    for r in reqs:
        s.add_request(r)
    cut = preempted = 0
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        preempted += len(out.preempted_req_ids)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= 50
        for rid, start in _starts(out).items():
            end = start + out.num_scheduled_tokens[rid]
            if end < len(s.requests[rid].all_token_ids):
                cut += 1
                assert end % 64 == 0 or end // 64 == start // 64, (rid, start, end)
        s.update_from_output(out, runner.execute(out))
    assert not s.has_unfinished_requests()
    assert cut > 0 and preempted > 0
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.output_token_ids == [fake_token(r.request_id, r.num_prompt_tokens + k) for k in range(12)]


# -- prefix caching: state snapshots (MambaManager) ----------------------------------------

def _caching(**kw) -> Scheduler:
    kw.setdefault("num_state_slots", 6)
    kw.setdefault("num_state_snapshots", 2)
    return create_scheduler(enable_prefix_caching=True, **kw)


def test_the_chunk_before_the_last_snapshot_boundary_ends_there_and_is_saved():
    """A 150-token prompt with a 2,048 budget runs as 128 + 22 (vLLM's "force to cache the last
    chunk"), and the slot after the first chunk is saved into a snapshot block after that
    step's forward."""
    s = _caching()
    assert s.snapshot_interval == 64
    s.add_request(make_request("a", list(range(1, 151)), max_tokens=2))
    out = s.schedule()
    assert out.num_scheduled_tokens["a"] == 128 and not out.state_restores
    slot = out.scheduled_new_reqs[0].block_ids[1][0]
    (save,) = out.state_saves
    assert save[0] == slot and save[1] != slot
    s.update_from_output(out, _output(out))
    out = s.schedule()
    assert out.num_scheduled_tokens["a"] == 22 and not out.state_saves  # 150 is no boundary


def test_a_hit_restores_the_snapshot_into_a_fresh_slot_after_it_was_written():
    """b shares a's first 140 tokens and arrives with it: in the step that saves a's snapshot
    (after its forward) b cannot resume from it, so it waits a step, then starts at 128 with
    the snapshot restored into its own slot before the forward."""
    s = _caching()
    s.add_request(make_request("a", list(range(1, 151)), max_tokens=8))
    s.add_request(make_request("b", list(range(1, 141)) + [999] * 10, max_tokens=2))
    first = s.schedule()
    assert list(first.num_scheduled_tokens) == ["a"]
    (save,) = first.state_saves
    s.update_from_output(first, _output(first))
    out = s.schedule()
    assert _starts(out)["b"] == 128  # the attention blocks and the snapshot of 128 tokens
    new_b = next(n for n in out.scheduled_new_reqs if n.req_id == "b")
    assert out.state_restores == [(save[1], new_b.block_ids[1][0])]
    assert new_b.block_ids[1][0] != save[1]


def test_snapshots_never_take_the_slots_of_requests_still_to_come():
    """With 2 running slots and no snapshot slot, prefills on boundaries take no snapshot."""
    s = _caching(num_state_slots=2, num_state_snapshots=0, max_num_seqs=2)
    for rid in "ab":
        s.add_request(make_request(rid, [ord(rid)] * 130, max_tokens=1))
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b"} and not out.state_saves

