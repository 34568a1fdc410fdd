"""A request's own parameters never take the engine down (issue 42 #8): a negative seed is a
seed (its 64-bit two's complement), a seed past a signed 64-bit integer is refused by name, and
a request whose state fails to build inside a step finishes with finish_reason "error" while
the step's other requests and every later one run on."""
from __future__ import annotations

import asyncio

import pytest

from kiln import LLM, SamplingParams
from kiln.entrypoints.async_llm import AsyncLLM
from kiln.runtime.engine.async_llm import RequestFailedError
from kiln.runtime.sample.sampling_params import SEED_MAX, SEED_MIN, InvalidSamplingParamsError
from tests.tiny_models import make_tiny_model

PROMPT = [5, 9, 2, 7, 1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("request_faults")
    make_tiny_model(d, "llama_gqa_untied")
    return d


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, skip_tokenizer_init=True, kv_cache_tokens=2048)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_negative_seeds_sample_and_replay(llm):
    sp = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True) for s in (-5, SEED_MIN, -5, 5)]
    first = _ids(llm.generate([PROMPT] * 4, sp))
    assert first[0] == first[2] and len(first[1]) == 8  # a seed replays, whatever its sign
    assert _ids(llm.generate([PROMPT], sp[:1])) == first[:1]
    # n > 1 at the top of the range: the children's seeds wrap instead of failing mid-add
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=SEED_MAX, n=3, max_tokens=4))[0]
    assert len(out.outputs) == 3


@pytest.mark.parametrize("seed", [SEED_MAX + 1, SEED_MIN - 1, 10 ** 30, 1.5, "7"])
def test_seeds_outside_a_signed_64_bit_integer_are_refused_by_name(seed):
    with pytest.raises(InvalidSamplingParamsError, match="seed must be an integer in") as e:
        SamplingParams(seed=seed)
    assert e.value.field == "seed"


def test_a_request_failing_inside_the_step_fails_alone(llm):
    """bad_words on an engine without a tokenizer raises where the runner builds the request's
    state, inside the step: before the fix that ValueError left the engine, every later request
    failing too."""
    ok = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=6, bad_words=["x"])
    alone = _ids(llm.generate([PROMPT], ok))
    outs = llm.generate([PROMPT, PROMPT, [3, 3, 3]], [ok, bad, ok])
    assert _ids(outs)[0] == alone[0] and len(outs[2].outputs[0].token_ids) == 6
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "bad_words needs a tokenizer" in str(failed.stop_reason)
    assert _ids(llm.generate([PROMPT], ok)) == alone  # the engine runs on
    assert llm.stats()["num_free_blocks"] == llm.engine.core.scheduler.kv_cache_config.num_blocks - 1


def test_async_llm_raises_for_that_request_only(tiny_dir):
    engine = AsyncLLM.from_engine_args(_args(tiny_dir))
    try:
        async def run(rid, sp):
            ids = []
            async for out in engine.generate(PROMPT, sp, rid):
                ids += out.outputs[0].token_ids
            return ids

        async def main():
            ok = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
            bad = SamplingParams(temperature=0, max_tokens=5, bad_words=["x"])
            return await asyncio.gather(run("a", ok), run("b", bad), run("c", ok), return_exceptions=True)

        a, b, c = asyncio.run(main())
        assert len(a) == 5 and c == a
        assert isinstance(b, RequestFailedError) and "bad_words" in str(b)
        assert engine.is_running
    finally:
        engine.shutdown()


def _args(tiny_dir):
    from kiln.entrypoints.engine_args import EngineArgs
    return EngineArgs(model=str(tiny_dir), skip_tokenizer_init=True, kv_cache_tokens=2048)


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), -float("inf")])
def test_a_logit_bias_that_is_not_finite_is_refused_by_name(bias):
    """Before: accepted, every logit turned NaN and the request sampled token 0 over and over."""
    with pytest.raises(InvalidSamplingParamsError, match="logit_bias values must be finite") as e:
        SamplingParams(logit_bias={5: bias})
    assert e.value.field == "logit_bias"
