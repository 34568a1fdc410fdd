"""On the GPU: kiln's bf16 logits and greedy tokens against transformers on CUDA,
and the engine's invariance (alone = batched = chunked = preempted = prefix hit); with
--kv-cache-dtype fp8 too, where transformers' keys and values go through e4m3 the same
way (tests/hf_fp8_kv.py)."""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.hf_fp8_kv import fp8_kv
from tests.tiny_models import make_tiny_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# (model, --kv-cache-dtype)
VARIANTS = [("llama_gqa_untied", "auto"), ("qwen3_qknorm", "auto"), ("llama_llama3_rope", "auto"),
            ("llama_gqa_untied", "fp8"), ("qwen3_qknorm", "fp8")]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def _prompts(n: int, seed: int, vocab: int = 256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(k)).tolist() for k in rng.integers(3, 90, size=n)]


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: f"{v[0]}-{v[1]}")
def tiny(request, tmp_path_factory, gpu_target):
    variant, kv = request.param
    d = tmp_path_factory.mktemp(variant)
    make_tiny_model(d, variant, dtype=torch.bfloat16)  # saved in bf16
    load = transformers.AutoModelForCausalLM.from_pretrained
    # the truth: the bf16 weights in f32 arithmetic, loaded fresh so RoPE's inv_freq was never rounded to bf16
    hf32 = load(d, dtype=torch.float32).cuda().eval()
    hf16 = load(d, dtype=torch.bfloat16).cuda().eval()
    if kv == "fp8":
        hf32.kv_context = hf16.kv_context = fp8_kv
    llm = LLM(d, target=gpu_target, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=32,
              max_num_batched_tokens=256, kv_cache_tokens=16 * 2048, bundle_dir=str(d / "bundle"),
              kv_cache_dtype=kv)
    return f"{variant}-{kv}", hf32, hf16, llm


def _last_logits(model, p):
    with torch.no_grad(), getattr(model, "kv_context", nullcontext)(model):
        return model(torch.tensor([p], device="cuda")).logits[0, -1].float().cpu().numpy()


def bf16_errors(ours, prompts, hf32, hf16):
    """-> (kiln's, transformers' bf16) max relative errors of each prompt's last logits against
    transformers' f32 truth; ours: kiln's last-position logits, a row per prompt."""
    assert np.isfinite(ours).all()
    err_kiln, err_hf = [], []
    for i, p in enumerate(prompts):
        truth = _last_logits(hf32, p)
        scale = np.abs(truth).max()
        err_kiln.append(np.abs(ours[i] - truth).max() / scale)
        err_hf.append(np.abs(_last_logits(hf16, p) - truth).max() / scale)
    return err_kiln, err_hf


def test_prefill_logits_within_bf16_tolerance(tiny):
    """bf16 tolerance, measured: kiln's error against the f32 truth is no worse than
    transformers' own bf16 CUDA path's error against the same truth."""
    name, hf32, hf16, llm = tiny
    lm = llm.model
    prompts = [p[:30] for p in _prompts(8, seed=1)]  # one step: at most 240 of the 256-token budget
    free = iter(range(1, lm.executor.num_blocks))
    chunks = [SeqChunk(p, 0, [next(free) for _ in range(-(-len(p) // 16))]) for p in prompts]
    ours = lm.executor.execute(prepare_step(chunks, 16))["logits"]  # the last position of each prompt
    err_kiln, err_hf = bf16_errors(ours, prompts, hf32, hf16)
    print(f"\n[{name}] max relative logit error vs f32: kiln bf16 {max(err_kiln):.2e}, "
          f"transformers bf16 {max(err_hf):.2e}")
    assert max(err_kiln) <= 1.5 * max(err_hf) + 1e-3


def _greedy(model, p, n):
    with torch.no_grad(), getattr(model, "kv_context", nullcontext)(model):
        return model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()


def _agreement(a, b):
    """(sequences identical, tokens before the first divergence summed)"""
    same = sum(x == y for x, y in zip(a, b))
    prefix = sum(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(a, b))
    return same, prefix


def test_greedy_tokens_agree_with_transformers_cuda(tiny):
    """Exact agreement reported for kiln vs transformers bf16 and vs the f32 truth. Tokens
    before the first divergence is a noisy statistic (one early near-tie flip ends a prompt's
    count; two draws of these tiny models gave kiln/transformers ratios of 0.67-1.37), so the
    assertion is coarse: a real bug (wrong RoPE, wrong cache slot) diverges within a few tokens,
    far below half of what transformers' own bf16 path achieves against the same truth."""
    name, hf32, hf16, llm = tiny
    prompts = _prompts(32, seed=2)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    truth = [_greedy(hf32, p, 64) for p in prompts]
    theirs = [_greedy(hf16, p, 64) for p in prompts]
    k_t, h_t, k_h = _agreement(ours, truth), _agreement(theirs, truth), _agreement(ours, theirs)
    print(f"\n[{name}] greedy, 32 prompts x 64 steps (identical prompts; tokens before first divergence): "
          f"kiln vs transformers bf16 {k_h[0]}/32, {k_h[1]}/2048; kiln vs f32 truth {k_t[0]}/32, {k_t[1]}/2048; "
          f"transformers bf16 vs f32 truth {h_t[0]}/32, {h_t[1]}/2048")
    assert k_t[1] >= 0.5 * h_t[1]


def test_engine_invariance_on_gpu(tiny, gpu_target):
    name, _, _, llm = tiny
    prompts = _prompts(32, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert batched == alone, f"{name}: batched differs from alone"
    # a shared 64-token prefix: the second request reads the first one's cached blocks
    prefix = _prompts(1, seed=4)[0][:3] * 22
    a = llm.generate(prefix[:64] + [1, 2, 3], sp)[0]
    b = llm.generate(prefix[:64] + [4, 5, 6, 7], sp)[0]
    assert b.num_cached_tokens == 64
    cold = llm.engine.core.scheduler.kv_cache_manager.reset_prefix_cache()
    assert cold
    b2 = llm.generate(prefix[:64] + [4, 5, 6, 7], sp)[0]
    assert b2.num_cached_tokens == 0 and b2.outputs[0].token_ids == b.outputs[0].token_ids
    del a
