"""The GPU engine under chunked prefill with a small budget and under preemption
gives every request exactly the tokens it gets alone."""
from __future__ import annotations

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from tests.tiny_models import make_tiny_model

torch = pytest.importorskip("torch")


def test_chunked_and_preempted_equal_alone(tmp_path, gpu_target):
    make_tiny_model(tmp_path, "qwen3_qknorm", dtype=torch.bfloat16)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(3, 90, size=24)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    common = dict(target=gpu_target, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=32,
                  bundle_dir=str(tmp_path / "bundle"))
    big = LLM(tmp_path, max_num_batched_tokens=256, kv_cache_tokens=16 * 2048, **common)
    alone = [big.generate(p, sp)[0].outputs[0].token_ids for p in prompts]
    small = LLM(tmp_path, max_num_batched_tokens=32, kv_cache_tokens=16 * 16, **common)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, sp)]
    assert got == alone
    assert small.stats()["num_preemptions"] > 0
    print(f"\n[gpu engine] chunked (budget 32) + {small.stats()['num_preemptions']} preemptions: "
          f"{len(prompts)}/{len(prompts)} requests identical to alone")
