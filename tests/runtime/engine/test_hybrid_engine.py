"""The engine core on a tiny Qwen3.5 hybrid (CPU): each request's Gated DeltaNet state lives in
a state slot of the KV cache's second group. Greedy tokens must equal the plain greedy loop's
(runtime/worker/generate.py, one prefill and decode steps per sequence, itself checked against
transformers in tests/test_qwen3_5.py) alone, batched with 31 others, under chunked prefill
with a 40-token budget, through preemptions, and after prefix-cache hits that resume from a
state snapshot; every block and every state slot is free when the requests are done or
aborted."""
from __future__ import annotations

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.loader import load
from kiln.runtime.worker.generate import greedy_generate
from tests.tiny_models import make_tiny_hybrid

SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3_5")
    make_tiny_hybrid(d, "qwen3_5_conditional")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(1, 150, 32)]
    ref = greedy_generate(load(d, tokenizer=False).executor, 16, prompts, 12)
    return d, prompts, ref


def run(llm: LLM, prompts) -> list[list[int]]:
    out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, SP)]
    kv = llm.engine.core.scheduler.kv_cache_manager
    assert kv.usage == 0 and kv.state_usage == 0, "blocks or state slots left held"
    assert kv.coordinator.state_pool.get_num_free_blocks() == kv.kv_cache_config.num_state_slots
    return out


def test_alone_and_batched_with_31_others(hybrid):
    d, prompts, ref = hybrid
    llm = LLM(model=str(d), skip_tokenizer_init=True)
    assert llm.args.enable_prefix_caching is True  # on by default, hybrids too
    for p, want in zip(prompts[:3], ref[:3]):
        assert run(llm, [p]) == [want]
    assert run(llm, prompts) == ref  # (the first three may resume from their own snapshots)


def test_chunked_prefill_with_a_40_token_budget(hybrid):
    d, prompts, ref = hybrid
    llm = LLM(model=str(d), skip_tokenizer_init=True, max_num_batched_tokens=40)
    assert run(llm, prompts) == ref


def test_preemption_recomputes_the_state(hybrid):
    """A preempted request frees its slot and recomputes its prefix through the chunked form
    (where it first went through decode steps). On this f32 model every request still gives
    the reference tokens; the agreement is asserted and the count of preemptions checked."""
    d, prompts, ref = hybrid
    llm = LLM(model=str(d), skip_tokenizer_init=True, kv_cache_tokens=16 * 40, max_num_batched_tokens=128)
    got = run(llm, prompts)
    assert llm.stats()["num_preemptions"] > 0
    agree = sum(g == w for g, w in zip(got, ref))
    assert agree == len(ref), f"{agree}/{len(ref)} requests agree after preemption"


def test_fewer_state_slots_than_requests_wait_for_one(hybrid):
    d, prompts, ref = hybrid
    llm = LLM(model=str(d), skip_tokenizer_init=True, max_num_seqs=3)
    cfg = llm.engine.core.scheduler.kv_cache_manager.kv_cache_config
    assert cfg.num_state_slots - cfg.num_state_snapshots == 3 and cfg.num_state_snapshots == 1
    assert run(llm, prompts[:10]) == ref[:10]


def test_abort_frees_the_state_slot(hybrid):
    d, prompts, _ = hybrid
    llm = LLM(model=str(d), skip_tokenizer_init=True)
    eng = llm.engine
    for i, p in enumerate(prompts[:4]):
        eng.add_request(str(i), p, SP)
    eng.step()
    kv = eng.core.scheduler.kv_cache_manager
    assert kv.state_usage > 0
    eng.abort_request(["0", "1", "2", "3"])
    assert kv.usage == 0 and kv.state_usage == 0


def _restores(llm: LLM) -> list:
    """Record the state restores every step sends to the runner."""
    seen, runner = [], llm.engine.core.runner
    execute = runner.execute_model

    def spy(so):
        seen.extend(so.state_restores)
        return execute(so)
    runner.execute_model = spy
    return seen


def test_prefix_cache_hit_resumes_from_a_state_snapshot_with_the_cold_run_tokens(hybrid):
    """A request whose prompt shares 140 tokens with one served before resumes from the state
    snapshot at 128 (the last multiple of 64 the first prompt's prefill ended a chunk on) and
    the attention blocks of the same prefix, and computes only the rest: its greedy tokens are
    the cold run's (the plain loop's, which never caches). So are a chat-like continuation's
    (the first prompt + its output + a new turn) and an exact repeat's."""
    d, prompts, _ = hybrid
    rng = np.random.default_rng(1)
    first = rng.integers(3, 256, 150).tolist()
    other = first[:140] + rng.integers(3, 256, 30).tolist()
    llm = LLM(model=str(d), skip_tokenizer_init=True)
    restores = _restores(llm)
    (out_first,) = run(llm, [first])
    turn = first + out_first + rng.integers(3, 256, 20).tolist()
    cold = greedy_generate(load(d, tokenizer=False).executor, 16, [other, turn, first], 12)
    for i, p in enumerate([other, turn, first]):
        (o,) = llm.generate([p], SP)
        assert list(o.outputs[0].token_ids) == cold[i]
        # each resumes from first's snapshot at 128 (the continuation's own prefill is new)
        assert o.num_cached_tokens == 128 and len(restores) == i + 1, (i, o.num_cached_tokens, restores)
    kv = llm.engine.core.scheduler.kv_cache_manager
    assert kv.usage == 0 and kv.state_usage == 0


def test_prefix_caching_off_takes_no_snapshot(hybrid):
    d, prompts, ref = hybrid
    llm = LLM(model=str(d), skip_tokenizer_init=True, enable_prefix_caching=False)
    assert llm.engine.core.scheduler.kv_cache_manager.kv_cache_config.num_state_snapshots == 0
    restores = _restores(llm)
    assert run(llm, prompts[:4] * 2) == ref[:4] * 2 and not restores
