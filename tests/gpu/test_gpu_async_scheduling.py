"""Async scheduling on the GPU: the executor runs on the engine's worker thread (its CUDA
context made current there) while the scheduler plans the next step, and each step is
launched before the one ahead of it has been read back, its input ids fed from that step's
sampled ids on the device; every request gets exactly the tokens (and logprobs) of the
synchronous engine, under chunked prefill and preemption, greedy and seeded sampling,
penalties (which read the tokens on the host) and logprobs beyond the kernels' top-K."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from tests.tiny_models import make_tiny_model

torch = pytest.importorskip("torch")


def test_async_equals_sync_on_gpu(tmp_path, gpu_target):
    make_tiny_model(tmp_path, "qwen3_qknorm", dtype=torch.bfloat16)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 256, size=int(n)).tolist() for n in rng.integers(3, 90, size=24)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=16, logprobs=2, ignore_eos=True)
              for i in range(len(prompts))]
    common = dict(target=gpu_target, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=32,
                  bundle_dir=str(tmp_path / "bundle"), max_num_batched_tokens=32, kv_cache_tokens=16 * 16)
    # one batch mixing rows that read their own tokens on the host (penalties), rows with more
    # logprobs than the kernels' top-K (gathered from raw rows on the host) and plain rows
    mixed = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=12, ignore_eos=True,
                            **[dict(), dict(repetition_penalty=1.3, presence_penalty=0.5), dict(logprobs=25),
                               dict(prompt_logprobs=3)][i % 4])
             for i in range(len(prompts))]
    results = {}
    for flag in (False, True):
        llm = LLM(tmp_path, async_scheduling=flag, **common)
        g = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        fed = llm.engine.core.runner.fed_steps
        s = llm.generate(prompts, seeded)
        m = llm.generate(prompts, mixed)
        results[flag] = (g, [o.outputs[0].token_ids for o in s],
                         [[sorted(d) for d in o.outputs[0].logprobs] for o in s], llm.stats(),
                         [o.outputs[0].token_ids for o in m],
                         [[sorted(d.items()) for d in (o.outputs[0].logprobs or [])] for o in m],
                         [[sorted(d.items()) for d in (o.prompt_logprobs or []) if d] for o in m], fed)
        llm.model.executor.close()
    (g0, s0, l0, st0, m0, ml0, mp0, fed0), (g1, s1, l1, st1, m1, ml1, mp1, fed1) = results[False], results[True]
    assert g1 == g0 and s1 == s0 and l1 == l0
    assert m1 == m0 and ml1 == ml0 and mp1 == mp0
    assert fed0 == 0 and fed1 > 0  # async steps did take their input ids from the device
    assert st1["num_preemptions"] > 0 and st1["num_running_reqs"] == 0
    assert st1["num_free_blocks"] == st1["num_total_blocks"] - 1
    print(f"\n[gpu async scheduling] {len(prompts)} greedy + {len(prompts)} seeded requests, chunked (budget 32), "
          f"{st1['num_preemptions']} preemptions: identical to the synchronous engine")


def test_async_scheduling_decode_rate_on_gpu(tmp_path, gpu_target):
    """Printed, not asserted: 64 requests decoding, synchronous vs async, compiled as the test above
    (a compile-cache hit). The 8B shape's figures are `build.py bench --async-scheduling`."""
    make_tiny_model(tmp_path, "qwen3_qknorm", dtype=torch.bfloat16)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, size=32).tolist() for _ in range(64)]
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    common = dict(target=gpu_target, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=32,
                  bundle_dir=str(tmp_path / "bundle"), max_num_batched_tokens=32)
    rates, outs = {}, {}
    for flag in (False, True):
        llm = LLM(tmp_path, async_scheduling=flag, **common)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up (graph capture)
        t0 = time.perf_counter()
        got = llm.generate(prompts, sp)
        rates.setdefault(flag, []).append(64 * 100 / (time.perf_counter() - t0))
        outs[flag] = [o.outputs[0].token_ids for o in got]
        llm.model.executor.close()
    assert outs[True] == outs[False]
    print(f"\n[gpu async scheduling] 64 x 100 tokens, tiny model: sync {rates[False]} tok/s, async {rates[True]} tok/s")
