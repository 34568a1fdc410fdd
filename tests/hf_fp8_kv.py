"""The oracle for --kv-cache-dtype fp8: transformers with every K (after RoPE) and V passed
through float8_e4m3fn on its way into attention, which is what an fp8 KV cache stores and
gives back (scale 1.0, saturating at +-448). transformers has no fp8 KV cache of its own;
this is the same arithmetic done independently, in torch."""
from __future__ import annotations

from contextlib import contextmanager

import torch


def through_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)


@contextmanager
def fp8_kv(model):
    """Inside the block, `model` (Llama or Qwen3) attends over e4m3-rounded keys and values."""
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    saved = []
    for mod in (llama, qwen3):
        orig = mod.apply_rotary_pos_emb

        def rope(q, k, cos, sin, *args, _orig=orig, **kw):
            q, k = _orig(q, k, cos, sin, *args, **kw)
            return q, through_fp8(k)

        saved.append((mod, orig))
        mod.apply_rotary_pos_emb = rope
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, out: through_fp8(out))
             for layer in model.model.layers]
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()
        for mod, orig in saved:
            mod.apply_rotary_pos_emb = orig
