"""Tiny random checkpoints built by transformers itself, saved as safetensors.

Weights are drawn with a larger spread than HF's default init (std 0.02 makes
every logit nearly equal, which would let a wrong kernel pass).
"""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rms_norm_eps=1e-6)

VARIANTS = {
    # name: (architecture, extra config)
    "llama_gqa_untied": ("LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama_tied_linear": ("LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1,
                                                   rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_llama3_rope": ("LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        attention_bias=True)),
    "qwen3_qknorm": ("Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3_yarn_tied": ("Qwen3ForCausalLM", dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
}


def make_tiny_model(out_dir: Path, variant: str, *, seed: int = 0, dtype=torch.float32):
    """Save the variant under out_dir; return the transformers model (eval, f32)."""
    arch, extra = VARIANTS[variant]
    cfg_cls = transformers.LlamaConfig if arch.startswith("Llama") else transformers.Qwen3Config
    cfg = cfg_cls(**{**BASE, **extra}, architectures=[arch])
    model = randomize(getattr(transformers, arch)(cfg).eval(), seed)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    return model.float()


def randomize(model, seed: int):
    """Weights with a spread that makes logits differ (norm weights near 1)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.4 if "embed" in name else 1.5 / p.shape[-1] ** 0.5))
    return model


# Qwen3.5 / Qwen3-Next hybrids: 3 Gated DeltaNet layers, then a gated full-attention layer (x2)
HYBRID_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6)
HYBRID_VARIANTS = ("qwen3_5_causal", "qwen3_5_conditional", "qwen3_next")
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2)


def make_tiny_hybrid(out_dir: Path, variant: str, *, seed: int = 0, **overrides):
    """A tiny hybrid checkpoint saved by transformers (eager attention, torch fallback kernels);
    returns the model (eval, f32)."""
    base = {**HYBRID_BASE, **overrides}
    if variant == "qwen3_5_causal":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**base))
    elif variant == "qwen3_5_conditional":  # the layout Qwen3.5/3.6 checkpoints ship, vision tower included
        model = transformers.Qwen3_5ForConditionalGeneration(
            transformers.Qwen3_5Config(text_config=base, vision_config=TINY_VISION))
    elif variant == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**base, num_experts=0))
    else:
        raise ValueError(variant)
    model.config._attn_implementation = "eager"
    model = randomize(model.eval(), seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model
