"""Tiny random mixture-of-experts checkpoints built by transformers itself (eager experts: the
plain per-expert loop, not grouped_mm), saved in the per-expert layout transformers writes by
default or in its stacked in-memory layout (save_original_format=False).

  qwen3_moe    Qwen3MoeForCausalLM, 6 layers: experts in layers 1 and 5 (decoder_sparse_step 2,
               layer 3 in mlp_only_layers), dense MLPs elsewhere; norm_topk_prob False
  qwen3_5_moe  Qwen3_5MoeForConditionalGeneration (tiny vision tower), the 8-layer hybrid of
               tests/tiny_models.py with experts and a shared expert in every layer
  qwen3_next   Qwen3NextForCausalLM, the same hybrid; layer 2 dense (mlp_only_layers)
"""
from __future__ import annotations

from pathlib import Path

import transformers

from tests.tiny_models import BASE, HYBRID_BASE, TINY_VISION, randomize

MOE_VARIANTS = ("qwen3_moe", "qwen3_5_moe", "qwen3_next")
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def make_tiny_moe(out_dir: Path, variant: str, *, seed: int = 0, stacked: bool = False, **overrides):
    """Save the variant under out_dir (stacked: experts.gate_up_proj / down_proj tensors instead of
    experts.{e}.*); return the transformers model (eval, f32)."""
    if variant == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**BASE, "num_hidden_layers": 6, **EXPERTS, "decoder_sparse_step": 2,
                                             "mlp_only_layers": [3], "norm_topk_prob": False, **overrides},
                                          architectures=["Qwen3MoeForCausalLM"])
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif variant == "qwen3_5_moe":
        text = {k: v for k, v in HYBRID_BASE.items() if k != "intermediate_size"}
        text.update(EXPERTS, shared_expert_intermediate_size=48, **overrides)
        model = transformers.Qwen3_5MoeForConditionalGeneration(
            transformers.Qwen3_5MoeConfig(text_config=text, vision_config=TINY_VISION))
    elif variant == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **{**HYBRID_BASE, **EXPERTS, "shared_expert_intermediate_size": 48, "mlp_only_layers": [2],
               "norm_topk_prob": True, **overrides}))
    else:
        raise ValueError(variant)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"  # the plain loop (the default is grouped_mm)
    model = randomize(model.eval(), seed)
    model.save_pretrained(out_dir, safe_serialization=True, save_original_format=not stacked)
    return model
