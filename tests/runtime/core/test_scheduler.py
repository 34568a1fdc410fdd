"""The scheduler (the spirit of vLLM's tests/v1/core/test_scheduler.py)."""
from __future__ import annotations

import pytest
from kiln.runtime.core.request import FinishReason, RequestStatus
from kiln.runtime.core.sched_output import ModelRunnerOutput

from tests.sched_fakes import (
    EOS,
    FakeRunner,
    create_requests,
    create_scheduler,
    fake_token,
    make_request,
    run_to_completion,
)


def _output(out, tokens: dict[str, int] | None = None, default: int = 7) -> ModelRunnerOutput:
    """One sampled token per scheduled request (what a partial prefill gets does not matter)."""
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(ids, [[(tokens or {}).get(r, default)] for r in ids])


def _step(s, tokens=None, default=7, runner=None):
    out = s.schedule()
    mro = runner.execute(out) if runner is not None else _output(out, tokens, default)
    return out, s.update_from_output(out, mro)


def _free(s):
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def test_schedule_new_requests():
    s = create_scheduler()
    reqs = create_requests(5, num_tokens=20)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["0", "1", "2", "3", "4"]
    assert out.num_scheduled_tokens == {str(i): 20 for i in range(5)} and out.total_num_scheduled_tokens == 100
    assert out.scheduled_cached_reqs.num_reqs == 0 and not out.finished_req_ids and not out.preempted_req_ids
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2],)
    assert all(r.status == RequestStatus.RUNNING and r.num_computed_tokens == 20 for r in reqs)
    assert s.get_request_counts() == (5, 0)


def test_token_budget_and_max_num_seqs():
    s = create_scheduler(max_num_batched_tokens=30)
    for r in create_requests(4, num_tokens=10):
        s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 10, "1": 10, "2": 10}
    s = create_scheduler(max_num_seqs=2)
    for r in create_requests(4, num_tokens=10):
        s.add_request(r)
    out, _ = _step(s)
    assert list(out.num_scheduled_tokens) == ["0", "1"] and len(s.running) == 2
    out, _ = _step(s)  # still two running: decodes only
    assert out.num_scheduled_tokens == {"0": 1, "1": 1} and len(s.waiting) == 2


def test_chunked_prefill_splits_long_prompt_and_mixes_decodes():
    s = create_scheduler(max_num_batched_tokens=64)
    short, long_ = make_request("short", list(range(1, 11))), make_request("long", list(range(1000, 1200)))
    s.add_request(short)
    s.add_request(long_)
    out, res = _step(s)
    assert out.num_scheduled_tokens == {"short": 10, "long": 54}
    assert list(res) == ["short"]  # the partial chunk samples nothing
    assert long_.num_computed_tokens == 54 and long_.num_output_tokens == 0
    out, res = _step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 63}
    c = out.scheduled_cached_reqs
    assert c.req_ids == ["short", "long"] and c.num_computed_tokens == [10, 54]
    assert c.new_token_ids[1] == list(range(1054, 1117))
    out, res = _step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 63}
    out, res = _step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 20}  # the last chunk
    assert list(res) == ["short", "long"] and long_.num_output_tokens == 1
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"short": 1, "long": 1}


def test_long_prefill_token_threshold_caps_chunks():
    s = create_scheduler(long_prefill_token_threshold=16)
    s.add_request(make_request("a", list(range(1, 41))))
    s.add_request(make_request("b", list(range(100, 105))))
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 16, "b": 5}
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 16, "b": 1}


def test_without_chunked_prefill_a_prompt_waits_for_room():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    s.add_request(make_request("a", list(range(1, 41))))
    s.add_request(make_request("b", list(range(100, 140))))
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 40}
    out, _ = _step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 40}


def test_tokens_of_partial_prefill_are_discarded():
    s = create_scheduler(max_num_batched_tokens=8)
    r = make_request("a", list(range(1, 21)))
    s.add_request(r)
    out = s.schedule()
    assert s.update_from_output(out, _output(out)) == {}
    assert r.num_output_tokens == 0


def _expected_tokens(rid, prompt_len, max_tokens):
    return [fake_token(rid, prompt_len + i) for i in range(max_tokens)]


def test_preemption_recomputes_and_completes():
    # 12 usable blocks of 4 tokens: three requests of 10 + 20 tokens need 24.
    s = create_scheduler(num_blocks=13, block_size=4, max_num_batched_tokens=32)
    reqs = create_requests(3, num_tokens=10, max_tokens=20, ignore_eos=True)
    for r in reqs:
        s.add_request(r)
    runner = FakeRunner(block_size=4)
    preempted_steps, tokens, steps = [], {}, 0
    while s.has_unfinished_requests():
        out = s.schedule()
        if out.preempted_req_ids:
            preempted_steps.append(out.preempted_req_ids)
            # Nothing admitted in a preempting step, not even the victim again.
            assert not out.scheduled_new_reqs and not out.scheduled_cached_reqs.resumed_req_ids
            assert not any(rid in out.num_scheduled_tokens for rid in out.preempted_req_ids)
        for rid, o in s.update_from_output(out, runner.execute(out)).items():
            tokens.setdefault(rid, []).extend(o.new_token_ids)
        steps += 1
        assert steps < 500
    assert preempted_steps and preempted_steps[0] == {"2"}  # FCFS: the last running one
    assert sum(r.num_preemptions for r in reqs) >= 1
    for r in reqs:
        assert tokens[r.request_id] == _expected_tokens(r.request_id, 10, 20)
    assert _free(s) == 12


def test_no_waiting_request_admitted_in_a_preempting_step():
    s = _priority_scheduler(5, block_size=4, max_num_seqs=2)  # 4 usable blocks
    a = make_request("a", list(range(1, 9)), priority=1, arrival_time=1.0, ignore_eos=True)
    b = make_request("b", list(range(20, 28)), priority=2, arrival_time=2.0, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    _step(s)  # a, b: 2 blocks each, none free
    s.add_request(make_request("c", [50, 51], priority=0, arrival_time=3.0))
    out, _ = _step(s)  # a needs a 3rd block: b is preempted; c would fit in b's freed block
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}
    assert not out.scheduled_new_reqs
    out, _ = _step(s)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["c"]


def test_resumed_request_gets_full_block_table_and_tokens():
    s = create_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=32)
    a, b = create_requests(2, num_tokens=8, max_tokens=10, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    runner = FakeRunner(block_size=4)
    while not b.num_preemptions:
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    while b.status != RequestStatus.RUNNING:
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    c = out.scheduled_cached_reqs
    assert "1" in c.resumed_req_ids
    i = c.req_ids.index("1")
    assert c.all_token_ids["1"] == b.all_token_ids[:len(c.all_token_ids["1"])]
    assert c.new_block_ids[i] == tuple(s.kv_cache_manager.get_block_ids("1"))
    run_to_completion(s, runner)


def _priority_scheduler(num_blocks, block_size=16, **kw):
    return create_scheduler(num_blocks=num_blocks, block_size=block_size, policy="priority", **kw)


def test_priority_orders_waiting_queue():
    s = _priority_scheduler(100)
    for rid, prio, t in [("0", 2, 1.0), ("1", 1, 3.0), ("2", 1, 2.0), ("3", 0, 4.0)]:
        s.add_request(make_request(rid, [1, 2, 3], priority=prio, arrival_time=t))
    out = s.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["3", "2", "1", "0"]


def test_priority_preempts_lowest_priority_running():
    # vLLM's scenario: 5 usable blocks of 16 tokens.
    s = _priority_scheduler(6, max_num_seqs=3)
    lo = make_request("lo", list(range(1, 33)), priority=5, arrival_time=1.0, ignore_eos=True)
    s.add_request(lo)
    _step(s)  # lo: 2 blocks, now 33 tokens
    hi = make_request("hi", list(range(100, 132)), priority=0, arrival_time=2.0, ignore_eos=True)
    s.add_request(hi)
    out, _ = _step(s)  # lo takes a 3rd block, hi its 2: all 5 used
    assert out.num_scheduled_tokens == {"lo": 1, "hi": 32} and _free(s) == 0
    out, _ = _step(s)  # hi needs a 3rd block: lo (lower priority) goes, though it came first
    assert out.preempted_req_ids == {"lo"} and out.num_scheduled_tokens == {"hi": 1}
    assert lo.status == RequestStatus.PREEMPTED and hi.status == RequestStatus.RUNNING
    assert s.make_stats().num_preemptions == 1


def test_fcfs_preempts_last_running():
    s = create_scheduler(num_blocks=6, max_num_seqs=3)
    a = make_request("a", list(range(1, 33)), ignore_eos=True)
    s.add_request(a)
    _step(s)
    b = make_request("b", list(range(100, 132)), ignore_eos=True)
    s.add_request(b)
    _step(s)
    out, _ = _step(s)  # b needs a block; b is the last running: it preempts itself
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}


def test_priority_victim_scheduled_this_step_is_unscheduled_and_uncached():
    runner = FakeRunner(4)
    # 5 usable blocks of 4 tokens; lo prefills 5 tokens a step.
    s = _priority_scheduler(6, block_size=4, long_prefill_token_threshold=5)
    lo = make_request("lo", list(range(1, 17)), priority=5, arrival_time=1.0)
    hi = make_request("hi", list(range(100, 104)), priority=0, arrival_time=2.0, ignore_eos=True)
    s.add_request(lo)
    _step(s, runner=runner)  # lo: tokens 0-4 (blocks 0-1)
    s.add_request(hi)
    _step(s, runner=runner)  # lo: tokens 5-9 (block 2); hi: 4 tokens (1 block) -> 1 block free
    assert _free(s) == 1
    # lo is scheduled first: tokens 10-14 complete its block 2 (published at
    # allocation) and take the last free block. Then hi needs a block and lo,
    # the lowest priority, is preempted after the fact: its budget comes back,
    # and block 2, whose KV this step would have written, must leave the
    # prefix cache (hi takes lo's block 3, freed first, so block 2 would stay).
    out, _ = _step(s, runner=runner)
    assert out.preempted_req_ids == {"lo"} and out.num_scheduled_tokens == {"hi": 1}
    assert out.scheduled_cached_reqs.req_ids == ["hi"] and out.total_num_scheduled_tokens == 1
    pool = s.kv_cache_manager.block_pool
    assert pool.get_cached_block(lo.block_hashes[1], [0]) is not None  # written in step 2
    assert pool.get_cached_block(lo.block_hashes[2], [0]) is None
    run_to_completion(s, runner, max_steps=200)
    assert _free(s) == 5


def test_priority_self_preemption_lets_higher_priority_run():
    runner = FakeRunner(4)
    s = _priority_scheduler(5, block_size=4)  # 4 usable blocks
    lo = make_request("lo", list(range(1, 8)), priority=5, arrival_time=1.0, ignore_eos=True)
    hi = make_request("hi", list(range(100, 108)), priority=0, arrival_time=2.0, ignore_eos=True)
    s.add_request(lo)
    _step(s, runner=runner)  # lo: 7 tokens in 2 blocks -> 8 tokens
    s.add_request(hi)
    _step(s, runner=runner)  # lo decodes token 7 (fills block 1), hi: 8 tokens in 2 blocks -> all 4 used
    assert _free(s) == 0
    out, _ = _step(s, runner=runner)  # lo needs a 3rd block: the victim is lo itself (lowest priority)
    assert out.preempted_req_ids == {"lo"} and out.num_scheduled_tokens == {"hi": 1}
    # lo's blocks were freed tail first, so hi's new block evicted lo's block 1
    # and its block 0 is still a prefix hit.
    pool = s.kv_cache_manager.block_pool
    assert pool.get_cached_block(lo.block_hashes[1], [0]) is None
    assert s.kv_cache_manager.get_computed_blocks(lo)[1] == 4
    run_to_completion(s, runner, max_steps=200)


def test_abort_waiting_and_running_frees_blocks():
    s = create_scheduler(num_blocks=20, max_num_seqs=2)
    reqs = create_requests(3, num_tokens=20)
    for r in reqs:
        s.add_request(r)
    _step(s)
    assert _free(s) == 19 - 4
    assert s.finish_requests(["0", "2", "nope"], RequestStatus.FINISHED_ABORTED) == ["0", "2"]
    assert reqs[0].get_finished_reason() == FinishReason.ABORT and str(FinishReason.ABORT) == "abort"
    assert _free(s) == 19 - 2 and s.get_num_unfinished_requests() == 1
    out, _ = _step(s)
    assert out.finished_req_ids == {"0", "2"} and out.num_scheduled_tokens == {"1": 1}
    assert s.finish_requests("0", RequestStatus.FINISHED_ABORTED) == []  # already gone
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and _free(s) == 19
    with pytest.raises(ValueError):
        s.finish_requests("1", RequestStatus.RUNNING)


def test_abort_while_step_runs_drops_its_output():
    s = create_scheduler()
    s.add_request(make_request("a", [1, 2, 3]))
    out = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.update_from_output(out, _output(out)) == {}


@pytest.mark.parametrize("sp, script, want_tokens, want_reason, want_stop_reason", [
    (dict(max_tokens=10), [5, 6, EOS, 8], [5, 6, EOS], FinishReason.STOP, None),
    (dict(max_tokens=4, ignore_eos=True), [5, EOS, 6, 7, 8], [5, EOS, 6, 7], FinishReason.LENGTH, None),
    (dict(max_tokens=3), [5, 6, 7, 8], [5, 6, 7], FinishReason.LENGTH, None),
    (dict(max_tokens=10, stop_token_ids=[6]), [5, 6, 7], [5, 6], FinishReason.STOP, 6),
    (dict(max_tokens=10, min_tokens=3, stop_token_ids=[6]), [EOS, 6, 5, 6], [EOS, 6, 5, 6], FinishReason.STOP, 6),
    (dict(max_tokens=10, min_tokens=2), [EOS, EOS, EOS], [EOS, EOS], FinishReason.STOP, None),
])
def test_stop_conditions(sp, script, want_tokens, want_reason, want_stop_reason):
    s = create_scheduler()
    r = make_request("a", [1, 2, 3], **sp)
    s.add_request(r)
    got, it = [], iter(script)
    while s.has_unfinished_requests():
        _, res = _step(s, {"a": next(it)})
        o = res["a"]
        got.extend(o.new_token_ids)
    assert got == want_tokens and o.finish_reason == want_reason and o.stop_reason == want_stop_reason
    assert r.output_token_ids == want_tokens and _free(s) == 99


def test_multi_token_output_is_trimmed_at_stop():
    s = create_scheduler()
    s.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    out = s.schedule()
    res = s.update_from_output(out, ModelRunnerOutput(["a"], [[5, EOS, 6, 7]], logprobs=[[0.1, 0.2, 0.3, 0.4]]))
    assert res["a"].new_token_ids == [5, EOS] and res["a"].new_logprobs == [0.1, 0.2]


def test_max_model_len_caps_output_and_exact_length_prompt_runs():
    s = create_scheduler(max_model_len=20, max_num_batched_tokens=8)
    s.add_request(make_request("a", list(range(1, 16)), max_tokens=None, ignore_eos=True))
    s.add_request(make_request("b", list(range(100, 120)), max_tokens=None, ignore_eos=True))  # exactly 20
    tokens, reasons, _ = run_to_completion(s, FakeRunner(16))
    assert len(tokens["a"]) == 5 and reasons["a"] == FinishReason.LENGTH
    assert len(tokens["b"]) == 1 and reasons["b"] == FinishReason.LENGTH
    with pytest.raises(ValueError, match="21 tokens"):
        s.add_request(make_request("c", list(range(1, 22))))


def test_request_larger_than_kv_cache_does_not_hang():
    s = create_scheduler(num_blocks=5, block_size=4, max_model_len=1000)  # 16 tokens of KV
    assert s.max_model_len == 16
    with pytest.raises(ValueError, match="KV cache 16 tokens"):
        s.add_request(make_request("big", list(range(1, 18))))
    s.add_request(make_request("a", list(range(1, 11)), max_tokens=100, ignore_eos=True))
    s.add_request(make_request("b", list(range(50, 60)), max_tokens=100, ignore_eos=True))
    tokens, reasons, _ = run_to_completion(s, FakeRunner(4), max_steps=200)
    assert len(tokens["a"]) == 6 and len(tokens["b"]) == 6
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert _free(s) == 4


def test_same_step_prefix_hit_and_common_prefix_blocks():
    s = create_scheduler()
    prompt = list(range(1, 41))
    a, b = make_request("a", prompt), make_request("b", prompt)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    # b hits a's two full blocks, which a writes in this very step.
    assert out.num_scheduled_tokens == {"a": 40, "b": 8}
    assert out.num_common_prefix_blocks == [2]
    FakeRunner(16).execute(out)  # writes precede reads: b's hit is valid


def test_add_request_validation_and_stats():
    s = create_scheduler(num_blocks=11)
    s.add_request(make_request("a", [1, 2, 3]))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("e", []))
    s.add_request(make_request("b", list(range(1, 40))))
    _step(s)
    st = s.make_stats()
    assert (st.num_running_reqs, st.num_waiting_reqs, st.num_preemptions) == (2, 0, 0)
    assert st.kv_cache_usage == pytest.approx(4 / 10)
    assert st.prefix_cache_stats.requests == 2
    assert not s.reset_prefix_cache()
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert s.reset_prefix_cache()
