"""On the GPU: a tiny Qwen3.5 hybrid (Gated DeltaNet + gated attention) through its compiled
plans. Prefill logits against transformers on CUDA (kiln's bf16 error against the f32 truth no
worse than 1.5x transformers' own bf16 error), and greedy tokens alone = batched."""
from __future__ import annotations

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
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
    llm = LLM(d, target=gpu_target, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=16,
              max_num_batched_tokens=256, kv_cache_tokens=16 * 1024, bundle_dir=str(d / "bundle"))
    return hf32, hf16, llm


def _last_logits(model, p):
    with torch.no_grad():
        return model(torch.tensor([p], device="cuda")).logits[0, -1].float().cpu().numpy()


def test_hybrid_prefill_logits_within_bf16_tolerance(hybrid):
    hf32, hf16, llm = hybrid
    lm = llm.model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (140, 70, 30, 5)]  # 140: three GDN chunks
    free = iter(range(1, lm.executor.num_blocks))
    chunks = [SeqChunk(p, 0, [next(free) for _ in range(-(-len(p) // 16))], state_slot=i + 1)
              for i, p in enumerate(prompts)]
    ours = lm.executor.execute(prepare_step(chunks, 16))["logits"]
    assert np.isfinite(ours).all()
    err_kiln, err_hf = [], []
    for i, p in enumerate(prompts):
        truth = _last_logits(hf32, p)
        scale = np.abs(truth).max()
        err_kiln.append(np.abs(ours[i] - truth).max() / scale)
        err_hf.append(np.abs(_last_logits(hf16, p) - truth).max() / scale)
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
