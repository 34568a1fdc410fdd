"""A GPU bundle holds a fixed number of logits rows per step; prompt logprobs need one row per
prompt token, so the scheduler shortens those chunks to fit. Checked on the CPU engine with the
same cap: every step fits, and the prompt logprobs and tokens equal an uncapped run."""
from __future__ import annotations

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from tests.tiny_models import make_tiny_model

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    make_tiny_model(d, "llama_gqa_untied")
    return d


def _run(model_dir, cap):
    llm = LLM(str(model_dir), skip_tokenizer_init=True, max_model_len=256, max_num_seqs=6,
              max_num_batched_tokens=128, kv_cache_tokens=4096)
    rows = []
    if cap is not None:
        llm.engine.core.scheduler.max_num_logits_rows = cap
    ex = llm.model.executor
    real = ex.execute

    def counted(inputs):
        rows.append(len(inputs["logits_indices"]))
        return real(inputs)
    ex.execute = counted
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (70, 9, 33, 50, 5)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2 if i % 2 == 0 else None)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    return outs, rows


def test_prompt_logprob_chunks_fit_the_logits_rows(model_dir):
    want, rows_free = _run(model_dir, None)
    got, rows = _run(model_dir, 8)
    assert max(rows_free) > 8  # uncapped, a step wants more rows than the cap
    assert max(rows) <= 8
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if a.prompt_logprobs is None:
            assert b.prompt_logprobs is None
            continue
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs, b.prompt_logprobs):
            if x is None:
                assert y is None
                continue
            assert x.keys() == y.keys()
            for t in x:
                assert x[t].rank == y[t].rank
                np.testing.assert_allclose(x[t].logprob, y[t].logprob, rtol=1e-5, atol=1e-6)
