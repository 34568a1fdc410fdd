"""The engine core on tiny mixture-of-experts models (CPU): Qwen3-MoE (plain attention) and the
Qwen3.5-MoE hybrid (experts and a shared expert in every layer). A token's expert mix is its own
(moe_experts sums its top-k in rank order), so greedy tokens equal the plain greedy loop's
(runtime/worker/generate.py, itself checked against transformers in tests/test_moe_models.py)
alone, batched with 31 others, and under chunked prefill with a 40-token budget."""
from __future__ import annotations

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.loader import load
from kiln.runtime.worker.generate import greedy_generate
from tests.tiny_moe import make_tiny_moe

SP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def moe(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_tiny_moe(d, request.param)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(1, 150, 32)]
    ref = greedy_generate(load(d, tokenizer=False).executor, 16, prompts, SP.max_tokens)
    return d, prompts, ref


def run(llm: LLM, prompts) -> list[list[int]]:
    out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, SP)]
    assert llm.engine.core.scheduler.kv_cache_manager.usage == 0, "blocks left held"
    return out


def test_alone_and_batched_with_31_others(moe):
    d, prompts, ref = moe
    llm = LLM(model=str(d), skip_tokenizer_init=True, enable_prefix_caching=False)
    for p, want in zip(prompts[:3], ref[:3]):
        assert run(llm, [p]) == [want]
    assert run(llm, prompts) == ref


def test_chunked_prefill_with_a_40_token_budget(moe):
    d, prompts, ref = moe
    llm = LLM(model=str(d), skip_tokenizer_init=True, max_num_batched_tokens=40, enable_prefix_caching=False)
    assert run(llm, prompts) == ref
