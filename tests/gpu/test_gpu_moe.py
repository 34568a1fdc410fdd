"""On the GPU: tiny MoE models (Qwen3-MoE; the Qwen3.5-MoE hybrid with its shared expert) through
their compiled plans: prefill logits against transformers on CUDA (kiln's bf16 error against the
f32 truth no worse than 1.5x transformers' own bf16 error), and greedy tokens alone = batched =
under chunked prefill (the decode path and the grouped path give a token the same bits)."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.gpu.test_gpu_hybrid import assert_split_and_neighbour_invariant
from tests.gpu.test_gpu_models import bf16_errors
from tests.tiny_moe import make_tiny_moe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def moe(request, tmp_path_factory, gpu_target):
    d = tmp_path_factory.mktemp(request.param)
    model = make_tiny_moe(d, request.param)  # f32, eager experts
    hf32 = copy.deepcopy(model).cuda().eval()
    hf16 = model.to(torch.bfloat16).cuda().eval()
    llm = LLM(d, target=gpu_target, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=16,
              max_num_batched_tokens=256, kv_cache_tokens=16 * 1024, bundle_dir=str(d / "bundle"))
    return request.param, hf32, hf16, llm


def test_moe_prefill_logits_within_bf16_tolerance(moe):
    """As the dense models' check, over the median prompt: a bf16 router's top-k flips where two
    experts' logits round alike, and one flipped token moves a prompt's last logits by ~0.1-0.5
    of their range (transformers' own bf16 does so on other prompts), so the largest error of a
    few prompts says which engine met a near-tie, not which computes better."""
    name, hf32, hf16, llm = moe
    lm = llm.model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (140, 70, 30, 5, *rng.integers(2, 30, 8))]
    slot = lambda i: i + 1 if getattr(lm.executor, "num_state_slots", 0) else -1  # noqa: E731
    rows = []
    for batch in (range(0, 4), range(4, len(prompts))):  # each step within the 256-token bucket
        free = iter(range(1, lm.executor.num_blocks))
        chunks = [SeqChunk(prompts[i], 0, [next(free) for _ in range(-(-len(prompts[i]) // 16))],
                           state_slot=slot(i)) for i in batch]
        rows.append(lm.executor.execute(prepare_step(chunks, 16))["logits"])
    ours = np.concatenate(rows)
    err_kiln, err_hf = bf16_errors(ours, prompts, hf32, hf16)
    print(f"\n[{name}] relative logit error vs f32 (median / max of {len(prompts)} prompts): kiln bf16 "
          f"{np.median(err_kiln):.2e} / {max(err_kiln):.2e}, transformers bf16 {np.median(err_hf):.2e} / "
          f"{max(err_hf):.2e}")
    assert np.median(err_kiln) <= 1.5 * np.median(err_hf) + 1e-3


def test_moe_greedy_alone_equals_batched_and_chunked(moe, gpu_target):
    name, _, _, llm = moe
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 150, 12)]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts[:4]]
    assert alone == batched[:4]
    d = llm.args.model
    chunked = LLM(d, target=gpu_target, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=16,
                  max_num_batched_tokens=64, kv_cache_tokens=16 * 1024, enable_prefix_caching=False,
                  bundle_dir=f"{d}/bundle64")
    got = [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY)]
    agree = sum(a == b for a, b in zip(got, batched))
    assert agree == len(prompts), f"{agree}/{len(prompts)} prompts agree"


def test_moe_prompt_split_at_64_gives_the_one_step_bits(moe):
    name, _, _, llm = moe
    assert_split_and_neighbour_invariant(llm.model.executor, slotted=name != "qwen3_moe")
