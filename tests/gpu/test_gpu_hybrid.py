"""On the GPU: a tiny Qwen3.5 hybrid (Gated DeltaNet + gated attention) through its compiled
plans. Prefill logits against transformers on CUDA (kiln's bf16 error against the f32 truth no
worse than 1.5x transformers' own bf16 error), greedy tokens alone = batched, and a prefix-cache
hit (a state snapshot restored by device copies) gives the cold run's tokens."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.gpu.test_gpu_models import bf16_errors
from tests.tiny_models import make_tiny_hybrid

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, gpu_target):
    d = tmp_path_factory.mktemp("hybrid")
    make_tiny_hybrid(d, "qwen3_5_causal")
    load = transformers.AutoModelForCausalLM.from_pretrained
    hf32 = load(d, dtype=torch.float32).cuda().eval()
    hf16 = load(d, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(d, target=gpu_target, skip_tokenizer_init=True, **_engine_kw(d))
    return hf32, hf16, llm


def _engine_kw(d) -> dict:
    return dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, kv_cache_tokens=16 * 1024,
                bundle_dir=str(d / "bundle"))


def test_hybrid_prefill_logits_within_bf16_tolerance(hybrid):
    hf32, hf16, llm = hybrid
    lm = llm.model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (140, 70, 30, 5)]  # 140: three GDN chunks
    free = iter(range(1, lm.executor.num_blocks))
    chunks = [SeqChunk(p, 0, [next(free) for _ in range(-(-len(p) // 16))], state_slot=i + 1)
              for i, p in enumerate(prompts)]
    ours = lm.executor.execute(prepare_step(chunks, 16))["logits"]
    err_kiln, err_hf = bf16_errors(ours, prompts, hf32, hf16)
    print(f"\n[hybrid] max relative logit error vs f32: kiln bf16 {max(err_kiln):.2e}, "
          f"transformers bf16 {max(err_hf):.2e}")
    assert max(err_kiln) <= 1.5 * max(err_hf) + 1e-3


def test_hybrid_greedy_alone_equals_batched(hybrid):
    _, _, llm = hybrid
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 150, 12)]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts[:4]]
    assert alone == batched[:4]
    assert all(len(t) == 32 for t in batched)


def test_hybrid_prefix_cache_hit_gives_the_cold_tokens(hybrid, gpu_target):
    """As tests/runtime/engine/test_hybrid_engine.py on the CPU: requests sharing 140 tokens
    (or all 150, or a next turn) of one served before resume from its snapshot at 128, and give
    the tokens of an engine without prefix caching."""
    _, _, llm = hybrid
    d = Path(llm.args.model)
    cold_llm = LLM(d, target=gpu_target, skip_tokenizer_init=True, enable_prefix_caching=False, **_engine_kw(d))
    rng = np.random.default_rng(5)
    first = rng.integers(0, 256, 150).tolist()
    (out,) = llm.generate(first, GREEDY)
    follow = [first[:140] + rng.integers(0, 256, 30).tolist(),
              first + list(out.outputs[0].token_ids) + rng.integers(0, 256, 20).tolist(), first]
    for p in follow:
        (hit,) = llm.generate(p, GREEDY)
        (cold,) = cold_llm.generate(p, GREEDY)
        assert hit.num_cached_tokens == 128 and cold.num_cached_tokens == 0
        assert list(hit.outputs[0].token_ids) == list(cold.outputs[0].token_ids)


def test_hybrid_chunked_prefill_gives_the_batched_tokens(hybrid, gpu_target):
    """A 64-token budget cuts the prompts into chunks ending on multiples of 64 (the GDN kernel's
    chunks at absolute positions) beside other requests' decodes: the greedy tokens of a
    256-token budget, where most prompts run in one step (prefix caching off in both)."""
    _, _, llm = hybrid
    d = Path(llm.args.model)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in rng.integers(3, 200, 12)]
    outs = []
    for budget in (256, 64):
        kw = dict(_engine_kw(d), max_num_batched_tokens=budget, bundle_dir=str(d / f"bundle{budget}"))
        one = LLM(d, target=gpu_target, skip_tokenizer_init=True, enable_prefix_caching=False, **kw)
        outs.append([list(o.outputs[0].token_ids) for o in one.generate(prompts, GREEDY)])
    agree = sum(a == b for a, b in zip(*outs))
    assert agree == len(prompts), f"{agree}/{len(prompts)} prompts agree"


def test_hybrid_prompt_split_at_64_gives_the_one_step_bits(hybrid):
    _, _, llm = hybrid
    assert_split_and_neighbour_invariant(llm.model.executor, slotted=True)


def assert_split_and_neighbour_invariant(ex, slotted: bool) -> None:
    """The plans' own invariance: a 150-token prompt in one step, or as 64 + 86 over two steps
    (a hybrid's slot carrying the GDN state between them), gives bit-identical last logits; so
    does the prompt run beside another one."""
    rng = np.random.default_rng(4)
    p, other = rng.integers(0, 256, 150).tolist(), rng.integers(0, 256, 90).tolist()
    slot = (lambda i: i) if slotted else (lambda i: -1)  # noqa: E731
    blocks = [list(range(1 + 20 * i, 11 + 20 * i)) for i in range(3)]  # a KV table per run
    one = ex.execute(prepare_step([SeqChunk(p, 0, blocks[0], state_slot=slot(1))], 16))["logits"][0]
    ex.execute(prepare_step([SeqChunk(p[:64], 0, blocks[1][:4], state_slot=slot(2))], 16))
    two = ex.execute(prepare_step([SeqChunk(p[64:], 64, blocks[1], state_slot=slot(2))], 16))["logits"][0]
    beside = ex.execute(prepare_step([SeqChunk(other, 0, list(range(61, 67)), state_slot=slot(3)),
                                      SeqChunk(p, 0, blocks[2], state_slot=slot(4))], 16))["logits"][1]
    assert np.array_equal(one, beside), f"beside another prompt: max |diff| {np.abs(one - beside).max():.3e}"
    assert np.array_equal(one, two), f"split at 64: max |diff| {np.abs(one - two).max():.3e}"
