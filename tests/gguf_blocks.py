"""Test helpers: GGUF blocks built byte-wise from the layouts (graph/gguf_blocks.py), for the types
gguf-py cannot quantise (the k-quants) and for fresh random blocks of every type.

random_blocks fills every byte at random (so every nibble, packed 6-bit scale and sign bit pattern
turns up) but the f16 fields, which get finite random values of either sign: a NaN or an infinite
scale would compare unequal to itself and prove nothing.

quantize_k writes a float matrix as Q4_K / Q5_K / Q6_K blocks by a plain rule (per 32- or 16-weight
sub-block: scale and min from its range, rounded to the 6- or 8-bit grid of the super-block's
d / dmin), not llama.cpp's search for the best scales: the tests need real blocks of the format
whose dequantised weights are close to the floats, not llama.cpp's choice of them."""
from __future__ import annotations

import numpy as np

from kiln.graph.gguf_blocks import BLOCKS

# byte offsets of each type's f16 fields
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, n: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """u8 [n, TS]: random bytes, finite random f16 fields (magnitudes about `scale`, either sign)."""
    _, ts = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (n, ts), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        f = (rng.uniform(0.2, 1.0, n) * scale * rng.choice([-1, 1], n)).astype(np.float16)
        blocks[:, at:at + 2] = f.view(np.uint8).reshape(n, 2)
    return blocks


def random_matrix(qtype: str, n: int, k: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """u8 [n, K / B * TS]: n rows of random blocks."""
    b, ts = BLOCKS[qtype]
    return random_blocks(qtype, n * (k // b), rng, scale).reshape(n, k // b * ts)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _pack_k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> the 12 bytes get_scale_min_k4 unpacks."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def quantize_k(w: np.ndarray, qtype: str) -> np.ndarray:
    """f32 [..., K] (K a multiple of 256) -> u8 [..., K / 256 * TS] blocks of Q4_K, Q5_K or Q6_K."""
    lead, k = w.shape[:-1], w.shape[-1]
    x = w.reshape(-1, 256).astype(np.float32)
    n = x.shape[0]
    if qtype == "Q6_K":
        sub = x.reshape(n, 16, 16)
        amax = np.abs(sub).max(-1)  # [n, 16]
        step = amax / 31  # per 16 weights: q in [-32, 31]
        d = np.maximum(step.max(-1), 1e-8) / 127  # scales are int8
        d16 = d.astype(np.float16).astype(np.float32)
        d16 = np.where(d16 == 0, np.float32(6e-8), d16)
        scale = np.clip(np.round(step / d16[:, None]), 1, 127).astype(np.int8)
        eff = d16[:, None] * scale.astype(np.float32)
        q = np.clip(np.round(sub / eff[..., None]), -32, 31).astype(np.int32) + 32  # [n, 16, 16]
        q = q.reshape(n, 2, 4, 32)  # element c * 128 + r as (c, r // 32, r % 32)
        ql = np.zeros((n, 2, 64), np.uint8)
        ql[:, :, 0:32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
        ql[:, :, 32:64] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
        hi = (q >> 4) & 3  # [n, 2, 4, 32]
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).astype(np.uint8)
        blocks = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scale.view(np.uint8), _f16_bytes(d16)], 1)
        return blocks.reshape(*lead, k // 256 * 210)
    levels = 15 if qtype == "Q4_K" else 31
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)  # [n, 8]: w = d sc q - dmin m with m >= 0 covers negatives
    step = (sub.max(-1) - lo) / levels
    d = np.maximum(step.max(-1), 1e-8) / 63
    dmin = np.maximum((-lo).max(-1), 1e-8) / 63
    d16, dmin16 = (v.astype(np.float16).astype(np.float32) for v in (d, dmin))
    d16, dmin16 = (np.where(v == 0, np.float32(6e-8), v) for v in (d16, dmin16))
    sc = np.clip(np.round(step / d16[:, None]), 1, 63).astype(np.int32)
    mn = np.clip(np.round(-lo / dmin16[:, None]), 0, 63).astype(np.int32)
    eff_d, eff_m = d16[:, None] * sc, dmin16[:, None] * mn
    q = np.clip(np.round((sub + eff_m[..., None]) / eff_d[..., None]), 0, levels).astype(np.int32)  # [n, 8, 32]
    nib = q & 15
    qs = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8).reshape(n, 128)  # sub-blocks 2c, 2c + 1
    head = [_f16_bytes(d16), _f16_bytes(dmin16), _pack_k4_scales(sc, mn)]
    if qtype == "Q4_K":
        blocks = np.concatenate(head + [qs], 1)
        return blocks.reshape(*lead, k // 256 * 144)
    qh = np.zeros((n, 32), np.int32)
    for s in range(8):
        qh |= ((q[:, s] >> 4) & 1) << s
    blocks = np.concatenate(head + [qh.astype(np.uint8), qs], 1)
    return blocks.reshape(*lead, k // 256 * 176)
