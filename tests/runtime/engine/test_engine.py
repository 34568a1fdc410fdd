"""The engine core end to end on a tiny random llama: a request's greedy tokens do
not depend on batching, chunking, preemption or prefix-cache hits; prefix hits
skip work; logprobs are the model's log_softmax; bad requests fail by name."""
from __future__ import annotations

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.worker.generate import greedy_generate
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_llama")
    make_tiny_model(d, "llama_gqa_untied")
    return d


def engine(tiny_dir, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    return LLM(tiny_dir, skip_tokenizer_init=True, **kw)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(1, 70, size=32)]


@pytest.fixture(scope="module")
def alone(tiny_dir, prompts):
    llm = engine(tiny_dir)
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batched_equals_alone(tiny_dir, prompts, alone):
    assert tokens(engine(tiny_dir).generate(prompts, GREEDY)) == alone


def test_steps_run_their_longest_sequences_first(tiny_dir, prompts, alone):
    """The runner orders a step's sequences by context length, longest first (ModelRunner._chunks:
    the attention's longest programs start first), and the tokens are still each prompt's alone."""
    llm = engine(tiny_dir)
    ex = llm.model.executor
    seen, execute = [], ex.execute

    def spy(inputs):
        seen.append(np.asarray(inputs["seq_lens"]).copy())
        return execute(inputs)
    ex.execute = spy
    assert tokens(llm.generate(prompts, GREEDY)) == alone
    assert sum(len(set(sl.tolist())) > 1 for sl in seen) > 5  # steps with lengths to order
    assert all((np.diff(sl) <= 0).all() for sl in seen), "a step ran a longer sequence after a shorter one"


def test_chunked_prefill_small_budget_equals_alone(tiny_dir, prompts, alone):
    llm = engine(tiny_dir, max_num_batched_tokens=24, max_num_seqs=8)
    assert tokens(llm.generate(prompts, GREEDY)) == alone


def test_preemption_and_recompute_equals_alone(tiny_dir, prompts, alone):
    llm = engine(tiny_dir, kv_cache_tokens=16 * 14)  # 13 usable blocks: far fewer than 32 requests need
    preempted = []
    core = llm.engine.core
    step = core.scheduler.schedule

    def counting_schedule():
        out = step()
        preempted.extend(out.preempted_req_ids)
        return out

    core.scheduler.schedule = counting_schedule
    assert tokens(llm.generate(prompts, GREEDY)) == alone
    assert preempted, "the KV cache was meant to run out"
    stats = llm.stats()
    assert stats["num_free_blocks"] == 13 and stats["num_preemptions"] == len(preempted)
    assert stats["finished_requests"] == 32 and stats["generation_tokens"] == 32 * GREEDY.max_tokens
    assert stats["prompt_tokens"] == sum(len(p) for p in prompts)  # once per request, preempted or not


def test_prefix_cache_hit_equals_alone_and_skips_work(tiny_dir, prompts, alone):
    llm = engine(tiny_dir)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 256, size=64).tolist()
    first = prefix + [1, 2, 3]
    second = prefix + [9, 8, 7, 6, 5]
    scheduled = []
    sched = llm.engine.core.scheduler
    schedule = sched.schedule

    def recording():
        out = schedule()
        scheduled.append(dict(out.num_scheduled_tokens))
        return out

    sched.schedule = recording
    a = llm.generate(first, GREEDY)[0]
    scheduled.clear()
    totals = llm.engine.totals
    q0, h0 = totals.prefix_cache_queries, totals.prefix_cache_hits
    b = llm.generate(second, GREEDY)[0]
    assert b.num_cached_tokens == 64 and a.num_cached_tokens == 0
    assert list(scheduled[0].values()) == [len(second) - 64]  # only the uncached tokens
    assert totals.prefix_cache_hits - h0 == 64 and totals.prefix_cache_queries - q0 == len(second)
    assert llm.stats()["prefix_cache_hit_rate"] == pytest.approx(64 / (len(first) + len(second)))
    fresh = engine(tiny_dir, enable_prefix_caching=False).generate(second, GREEDY)[0]
    assert b.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_logprobs_are_log_softmax_of_the_model_logits(tiny_dir, prompts):
    llm = engine(tiny_dir)
    p = prompts[5]
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    steps: list = []
    lm = llm.model
    fresh_blocks = greedy_generate(lm.executor, lm.block_size, [p], 4, logits_out=steps)
    assert fresh_blocks[0] == out.token_ids
    for pos, (tok, logits) in enumerate(zip(out.token_ids, steps)):
        ref = logits[0] - logits[0].max()
        ref = ref - np.log(np.exp(ref).sum())
        got = out.logprobs[pos]
        assert set(got) >= set(np.argsort(-ref)[:3].tolist()) | {tok}
        for tid, lp in got.items():
            assert lp.logprob == pytest.approx(float(ref[tid]), abs=1e-5)
            assert lp.rank == 1 + int((ref > ref[tid]).sum())


def test_seeded_sampling_reproduces_alone_and_batched(tiny_dir, prompts):
    llm = engine(tiny_dir)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    a = llm.generate(prompts[0], sp)[0].outputs[0].token_ids
    batch = llm.generate([prompts[0]] + prompts[1:8], [sp] + [SamplingParams(temperature=1.0, max_tokens=10)] * 7)
    assert batch[0].outputs[0].token_ids == a


def test_bad_requests_name_the_problem(tiny_dir):
    llm = engine(tiny_dir, max_model_len=64)
    with pytest.raises(ValueError, match="70 tokens.*64"):
        llm.generate(list(range(70)), GREEDY)
    for field, kw in [("temperature", dict(temperature=-1)), ("top_p", dict(top_p=0)), ("top_p", dict(top_p=1.5)),
                      ("n", dict(n=0)), ("max_tokens", dict(max_tokens=0))]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    assert llm.stats()["num_running_reqs"] == 0 and llm.stats()["num_waiting_reqs"] == 0


def test_iteration_stats_match_the_requests_token_times(tiny_dir, prompts):
    """The output processor fills each step's IterationStats as it goes; what a stat logger
    gets must be what the requests' own token times say (TTFT from arrival to the first
    token, one inter-token latency per later token, prompt and generation token counts)."""
    from kiln.runtime.engine.outputs import OutputKind

    class Recorder:
        def __init__(self):
            self.its = []

        def record(self, sched, it):
            self.its.append(it)

    llm = engine(tiny_dir, max_num_batched_tokens=64)
    rec = Recorder()
    llm.engine.stat_loggers.append(rec)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    kinds = [OutputKind.FINAL_ONLY, OutputKind.DELTA, OutputKind.CUMULATIVE]
    for i, p in enumerate(prompts[:12]):
        llm.engine.add_request(f"r{i}", p, params, output_kind=kinds[i % 3])
    metrics = {f"r{i}": llm.engine.output_processor.states[f"r{i}"].metrics for i in range(12)}
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    ttft = sorted(x for it in rec.its for x in it.time_to_first_tokens)
    itl = sorted(x for it in rec.its for x in it.inter_token_latencies)
    assert ttft == sorted(m.token_times[0] - m.arrival_time for m in metrics.values())
    assert itl == sorted(b - a for m in metrics.values() for a, b in zip(m.token_times, m.token_times[1:]))
    assert sum(it.num_prompt_tokens for it in rec.its) == sum(len(p) for p in prompts[:12])
    assert sum(it.num_generation_tokens for it in rec.its) == 12 * 9
    assert sum(len(it.finished_requests) for it in rec.its) == 12


def test_the_startup_heap_is_frozen_and_later_garbage_still_collected(tiny_dir, prompts, alone):
    """After LLM(...) the engine's startup objects sit in the collector's permanent generation
    (vLLM's freeze_gc_heap): a full collection no longer walks them. Cycles made afterwards are
    still found, and a request's tokens do not change."""
    import gc

    llm = engine(tiny_dir)
    tracked = {id(o) for o in gc.get_objects()}
    assert gc.get_freeze_count() > 0
    assert id(llm.engine.core.scheduler.__dict__) not in tracked and id(llm.engine.core.scheduler) not in tracked
    cycle = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1
    assert tokens(llm.generate(prompts[:4], GREEDY)) == alone[:4]
