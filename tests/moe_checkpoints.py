"""What tests/test_fp8_moe.py and tests/test_nvfp4_moe.py share in writing a quantised MoE checkpoint
from a tiny transformers MoE (tests/tiny_moe.py, the per-expert layout): which tensors a MoE
checkpoint quantises (every expert's gate/up/down_proj, the shared expert's, the attention and GDN
projections and the dense MLPs; not the router, the shared expert's gate, the GDN in_proj_a/in_proj_b,
the embeddings, lm_head or the vision tower), the walk that quantises them in a format's own way, and
the f32 transformers oracle on the dequantised weights."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import torch
from safetensors.numpy import load_file, save_file

QUANTISED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
             "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")


def _leaf(module: str) -> str:
    """model.language_model.layers.3.mlp.experts.5.up_proj -> mlp.experts.up_proj (the expert index dropped)"""
    parts = module.split(".")
    rest = parts[parts.index("layers") + 2:] if "layers" in parts else parts
    return ".".join(p for p in rest if not p.isdigit())


def quantised_state(model, src: Path,
                    quantise: Callable[[str, np.ndarray], tuple[dict[str, np.ndarray], np.ndarray]]):
    """The tiny model's file at src/model.safetensors with each quantised Linear `weight` replaced by
    quantise(module, w f32) -> (its tensors by file name, its dequantised f32 weight); the rest bf16, as
    the real checkpoints keep it (a tied lm_head not stored). -> (tensors to save, dequantised weights)."""
    sd = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, w in sd.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and w.ndim == 2 and (_leaf(module) in QUANTISED or ".experts." in name) \
                and ".visual." not in f".{name}":
            tensors, deq[name] = quantise(module, w.astype(np.float32))
            out.update(tensors)
        else:
            out[name] = w.astype(ml_dtypes.bfloat16)  # stays bf16, as the real checkpoints keep it
            deq[name] = out[name].astype(np.float32)
    if model.config.get_text_config().tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out, deq


def dequantised_oracle(model, src: Path, deq: dict[str, np.ndarray]):
    """The tiny model's class in f32 holding `deq` (written over src/model.safetensors), experts eager."""
    save_file(deq, str(src / "model.safetensors"), metadata={"format": "pt"})
    oracle = type(model).from_pretrained(src, dtype=torch.float32).eval()
    oracle.config._experts_implementation = "eager"
    return oracle
