"""Rotary embedding frequencies for the rope types Hugging Face defines.

Ported from the behaviour of transformers' modeling_rope_utils.py
(_compute_default/linear/llama3/yarn_rope_parameters). Returns inverse
frequencies over the rotary dims and the factor that scales cos and sin (yarn's
attention factor; 1 elsewhere). Computed once at build time, so in float64 and
rounded to float32 like the reference.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(rotary_dim: int, theta: float, scaling: Mapping[str, Any] | None,
                    max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """-> (inv_freq: f32[rotary_dim // 2], attention_factor)."""
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling, max_position_embeddings), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _llama3(inv_freq: np.ndarray, p: Mapping[str, Any], max_pos: int) -> np.ndarray:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p.get("original_max_position_embeddings", max_pos))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated by `factor`, short ones kept, the middle band blended
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def _yarn(dim: int, base: float, p: Mapping[str, Any], max_pos: int) -> tuple[np.ndarray, float]:
    orig = p.get("original_max_position_embeddings", max_pos)
    factor = p.get("factor") or max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference avoids a zero-width ramp the same way
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_tables(rotary_dim: int, theta: float, scaling: tuple = (), max_position: int = 2048
                ) -> tuple[np.ndarray, np.ndarray]:
    """-> (cos, sin): f32[max_position, rotary_dim // 2], the buffers GPU kernels read.
    Same float32 arithmetic as ops.rope (f32 positions times inv_freq, times the yarn
    attention factor), so a row equals what ops.rope computes at that position."""
    inv_freq, attn_factor = rope_parameters(rotary_dim, theta, dict(scaling), max_position)
    ang = np.arange(max_position, dtype=np.int32).astype(np.float32)[:, None] * inv_freq[None, :]
    cos = (np.cos(ang) * np.float32(attn_factor)).astype(np.float32)
    sin = (np.sin(ang) * np.float32(attn_factor)).astype(np.float32)
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)
