"""Async scheduling (vLLM's --async-scheduling): step N+1 is scheduled while step N executes
on the engine core's worker thread. The oracle is the synchronous engine: for the same
requests, async on and off give the same tokens, text, finish reasons, stop reasons and
logprobs through LLM.generate, across EOS and stop-token stops, max_tokens 1, stop strings,
n > 1, (prompt) logprobs, prefix-cache hits, chunked prefill and preemption; aborts with a
step in flight free every block; a CUDA target refuses the flag by name."""
from __future__ import annotations

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from tests.server.tiny_chat_model import make_tiny_chat_model
from tests.tiny_models import make_tiny_model

EOS = 258  # the tiny chat model's <|im_end|>


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("async_llama")
    make_tiny_model(d, "llama_gqa_untied")
    return d


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("async_chat"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(1, 70, size=24)]


def summary(outs) -> tuple[list, list[float]]:
    """Everything a caller sees of a request's result (metrics aside): -> (the exact part:
    ids, token ids, text, finish and stop reasons, logprob ranks and token sets; the floats:
    logprobs, cumulative logprobs). The floats may differ in the last bits of float32, because
    a step's batch (hence numpy's BLAS blocking) differs; tokens may not."""
    floats: list[float] = []

    def lps(d):
        if d is None:
            return None
        floats.extend(lp.logprob for lp in d.values())
        return {t: (lp.rank, lp.decoded_token) for t, lp in d.items()}

    exact = [(o.request_id, o.finished, o.num_cached_tokens,
              None if o.prompt_logprobs is None else [lps(d) for d in o.prompt_logprobs],
              [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob is None,
                None if c.logprobs is None else [lps(d) for d in c.logprobs]) for c in o.outputs])
             for o in outs]
    floats += [c.cumulative_logprob for o in outs for c in o.outputs if c.cumulative_logprob is not None]
    return exact, floats


def assert_same(got, want) -> None:
    (e1, f1), (e2, f2) = summary(got), summary(want)
    assert e1 == e2
    assert len(f1) == len(f2) and np.allclose(f1, f2, rtol=1e-5, atol=1e-5)


def both(model_dir, prompts, params, **kw):
    """-> (sync outputs, async outputs, the async LLM) for the same requests on fresh engines."""
    kw.setdefault("kv_cache_tokens", 4096)
    if "skip_tokenizer_init" not in kw and not (model_dir / "tokenizer.json").exists():
        kw["skip_tokenizer_init"] = True
    sync = LLM(model_dir, **kw)
    asy = LLM(model_dir, async_scheduling=True, **kw)
    assert asy.engine.core.async_scheduling and not sync.engine.core.async_scheduling
    return sync.generate(prompts, params), asy.generate(prompts, params), asy


def assert_idle(llm: LLM) -> None:
    s = llm.stats()
    assert s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0
    assert s["num_free_blocks"] == s["num_total_blocks"] - 1  # block 0 is the null block
    assert not llm.engine.core._batch_queue  # nothing left in flight once idle


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=10, ignore_eos=True, logprobs=2)
          for i in range(24)]


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=24, max_num_seqs=8),
                                dict(max_num_seqs=3), dict(long_prefill_token_threshold=16)],
                         ids=["plain", "chunked", "few-seqs", "long-prefill-cap"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_same_outputs_as_sync(tiny_dir, prompts, params, kw):
    a, b, llm = both(tiny_dir, prompts, params, **kw)
    assert_same(b, a)
    assert_idle(llm)


def test_preemption_same_outputs_and_every_block_back(tiny_dir, prompts):
    a, b, llm = both(tiny_dir, prompts, SEEDED, kv_cache_tokens=16 * 14)  # 13 usable blocks
    assert_same(b, a)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the KV cache was meant to run out"
    assert stats["generation_tokens"] == 24 * 10 and stats["finished_requests"] == 24
    assert_idle(llm)


def test_preempted_request_keeps_its_in_flight_token(tiny_dir, prompts):
    """A request preempted while a step computing its next token is in flight: the token still
    arrives and is appended (the resumed request recomputes with it). Greedy on a cache too
    small for the batch preempts such requests; the tokens must match the synchronous run."""
    a, b, llm = both(tiny_dir, prompts[:12], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                     kv_cache_tokens=16 * 10, max_num_seqs=6)
    assert_same(b, a)
    assert llm.stats()["num_preemptions"] > 0
    assert_idle(llm)


def test_prefix_cache_hits_same_outputs(tiny_dir):
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 256, size=48).tolist()
    ps = [prefix + rng.integers(0, 256, size=k).tolist() for k in (1, 5, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sync = LLM(tiny_dir, skip_tokenizer_init=True, kv_cache_tokens=4096)
    asy = LLM(tiny_dir, skip_tokenizer_init=True, kv_cache_tokens=4096, async_scheduling=True)
    for llm in (sync, asy):
        llm.generate(ps[0], params)  # publish the prefix
    a, b = sync.generate(ps[1:], params), asy.generate(ps[1:], params)
    assert_same(b, a)
    assert [o.num_cached_tokens for o in b] == [48, 48, 48]
    assert asy.stats()["prefix_cache_hit_rate"] == sync.stats()["prefix_cache_hit_rate"] > 0
    assert_idle(asy)


def test_eos_stop_tokens_max_tokens_and_n(chat_dir):
    """Real EOS stops (not ignore_eos: a logit bias makes <|im_end|> likely), stop token ids,
    max_tokens 1 and 2, n > 1, with text and logprobs; a request ending at step N was
    already scheduled in step N+1, whose token for it must be dropped."""
    texts = [f"prompt {i} " * (i % 4 + 1) for i in range(12)]
    params = []
    for i in range(12):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=30, logit_bias={EOS: 4.0}, logprobs=1))
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=1 + (i // 4) % 2))
        elif kind == 2:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=20, n=3, stop_token_ids=[ord("e")]))
        else:
            params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=25, logit_bias={EOS: 3.0}, min_tokens=3))
    a, b, llm = both(chat_dir, texts, params)
    assert_same(b, a)
    reasons = [(c.finish_reason, c.stop_reason) for o in b for c in o.outputs]
    assert ("stop", None) in reasons, "no request stopped at EOS"  # EOS: stop_reason None
    assert ("stop", ord("e")) in reasons and ("length", None) in reasons
    assert [len(o.outputs[0].token_ids) for o in b[1::4]] == [1, 2, 1]
    assert_idle(llm)


def test_stop_strings_and_prompt_logprobs(chat_dir):
    """Stop strings end requests from the detokenizer (an abort of the core request while its
    next step is in flight); prompt logprobs come with prefill chunks."""
    texts = [f"the quick brown fox {i} jumps" for i in range(8)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, stop=["e", "a"], prompt_logprobs=2,
                             logprobs=0) for i in range(8)]
    a, b, llm = both(chat_dir, texts, params, max_num_batched_tokens=16)
    assert_same(b, a)
    assert any(c.stop_reason in ("e", "a") for o in b for c in o.outputs)
    assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in b)
    assert_idle(llm)


def test_abort_with_a_step_in_flight_frees_every_block(tiny_dir, prompts):
    llm = LLM(tiny_dir, skip_tokenizer_init=True, kv_cache_tokens=4096, async_scheduling=True)
    eng, core = llm.engine, llm.engine.core
    free0 = core.snapshot()["num_free_blocks"]
    in_flight = []
    abort = core.abort_requests

    def recording_abort(ids):
        in_flight.append(len(core._batch_queue))
        return abort(ids)

    core.abort_requests = recording_abort
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(prompts[:8]):
        eng.add_request(f"r{i}", p, params)
    for _ in range(5):
        eng.step()
    eng.abort_request(["r1", "r4"])  # a step that computes their next tokens is executing now
    outs = []
    for _ in range(3):
        outs += eng.step()
    assert not any(o.request_id in ("r1", "r4") for o in outs), "tokens of aborted requests were reported"
    eng.abort_request([f"r{i}" for i in range(8)])
    assert in_flight == [1, 1], "the aborts were meant to land while a step executed"
    assert not eng.has_unfinished_requests()
    assert core.snapshot()["num_free_blocks"] == free0 and not core._batch_queue
    # the engine serves on (hitting the prefixes the aborted requests left in the cache) with
    # the same tokens as a fresh synchronous engine
    fresh = LLM(tiny_dir, skip_tokenizer_init=True, kv_cache_tokens=4096).generate(prompts[:4], GREEDY)
    again = llm.generate(prompts[:4], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fresh]
    assert any(o.num_cached_tokens for o in again)


def test_in_flight_tokens_never_pass_max_tokens(tiny_dir, prompts):
    """A request whose in-flight token is its last is not scheduled again: with max_tokens 1
    no request is ever scheduled after its prefill."""
    llm = LLM(tiny_dir, skip_tokenizer_init=True, kv_cache_tokens=4096, async_scheduling=True)
    sched = llm.engine.core.scheduler
    schedule, counts = sched.schedule, {}

    def recording():
        out = schedule()
        for rid in out.num_scheduled_tokens:
            counts[rid] = counts.get(rid, 0) + 1
        return out

    sched.schedule = recording
    outs = llm.generate(prompts[:6], SamplingParams(temperature=0, max_tokens=1))
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 6
    assert set(counts.values()) == {1}


def test_a_step_failing_on_the_worker_thread_reaches_the_caller(tiny_dir, prompts):
    """An executor error on the worker thread (the fourth model step fails) is raised by
    LLM.generate with its own message, as the synchronous engine raises it, instead of
    hanging or dropping requests silently."""
    for flag in (False, True):
        llm = LLM(tiny_dir, skip_tokenizer_init=True, kv_cache_tokens=4096, async_scheduling=flag)
        execute, calls = llm.model.executor.execute, []

        def failing(inputs):
            calls.append(1)
            if len(calls) == 4:
                raise RuntimeError("device lost")
            return execute(inputs)

        llm.model.executor.execute = failing
        with pytest.raises(RuntimeError, match="device lost"):
            llm.generate(prompts[:6], GREEDY)
        assert len(calls) in ((4,) if not flag else (4, 5)), "steps ran on after the failure"
