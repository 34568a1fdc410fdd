"""numpy references for the fused ops that graph/ops.py does not define yet.

`attention_preamble` is what a future passes/fuse_attention_preamble.py would emit:
per-head q/k RMSNorm (Qwen3), RoPE on q and k, and the paged KV-cache write. Its
reference is, by definition, the composition of the graph/ops.py ops it replaces;
it belongs in graph/ops.py once that pass exists.

`rope_tables` builds the cos/sin buffers the kernel reads, with exactly the
float32 arithmetic of ops.rope (positions as f32 times inv_freq, cos/sin times the
yarn attention factor), so a table row equals what ops.rope computes for that
position.
"""
from __future__ import annotations

import numpy as np

from kiln.graph import ops


def rope_tables(rotary_dim: int, theta: float, scaling: tuple = (), max_position: int = 2048
                ) -> tuple[np.ndarray, np.ndarray]:
    """-> (cos, sin): f32[max_position, rotary_dim // 2]"""
    inv_freq, attn_factor = ops._inv_freq(rotary_dim, theta, tuple(scaling), max_position)
    ang = np.arange(max_position, dtype=np.int32).astype(np.float32)[:, None] * inv_freq[None, :]
    cos = (np.cos(ang) * np.float32(attn_factor)).astype(np.float32)
    sin = (np.sin(ang) * np.float32(attn_factor)).astype(np.float32)
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


def attention_preamble(q, k, v, cache, positions, slot_mapping, q_norm_w=None, k_norm_w=None, *,
                       eps: float = 1e-6, offset: float = 0.0, theta: float, rotary_dim: int,
                       is_neox: bool = True, scaling: tuple = (), max_position: int = 2048):
    """q: [T, H, D], k, v: [T, Hkv, D], cache: [NB, 2, BS, Hkv, D] (written in place),
    positions, slot_mapping: i32[T]; q_norm_w, k_norm_w: [D] or None (both or neither).
    -> (rotated q: [T, H, D], cache)"""
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("attention_preamble: q and k norm weights come together")
    if q_norm_w is not None:
        q = ops.rms_norm(q, q_norm_w, eps=eps, offset=offset)
        k = ops.rms_norm(k, k_norm_w, eps=eps, offset=offset)
    rope = dict(theta=theta, rotary_dim=rotary_dim, is_neox=is_neox, scaling=tuple(scaling),
                max_position=max_position)
    q = ops.rope(q, positions, **rope)
    k = ops.rope(k, positions, **rope)
    return q, ops.cache_write(k, v, cache, slot_mapping)
