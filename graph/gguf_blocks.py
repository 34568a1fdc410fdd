"""GGUF (llama.cpp) block formats kiln computes in: their byte layouts and numpy dequantisation.

A quantised GGUF matrix [N, K] is N rows of K / B blocks, each block `TS` bytes holding B weights
(ggml-common.h's block_q8_0, block_q4_0, ...). kiln keeps such a weight as its raw bytes,
u8 [N, K / B * TS] (graph/gguf_ops.py's linear_gguf), and dequantises inside the GEMM.

The references below are written from the layouts, one element e of a block at a time, so that
the Triton kernel (codegen/triton/gguf_gemm.py) can compute exactly the same thing per element.
All arithmetic is f32 on values read from f16/int fields, in gguf-py's order (gguf/quants.py,
the oracle: tests/test_gguf_blocks.py checks bit equality on random blocks):

  Q8_0  (B 32, TS 34):  d f16 | q int8 x32                     w = q * d
  Q4_0  (B 32, TS 18):  d f16 | qs u8 x16                      w = d * (nib - 8)
  Q4_1  (B 32, TS 20):  d f16 | m f16 | qs u8 x16              w = d * nib + m
        nib of element e: byte e % 16, low nibble for e < 16, high for e >= 16
  Q4_K  (B 256, TS 144): d f16 | dmin f16 | scales u8 x12 | qs u8 x128
        sub-block s = e // 32 has a 6-bit scale sc_s and min m_s packed in the 12 bytes
        (get_scale_min_k4); nib: byte (s // 2) * 32 + e % 32, high nibble for odd s
        w = (d * sc_s) * nib - dmin * m_s
  Q5_K  (B 256, TS 176): d | dmin | scales x12 | qh u8 x32 | qs u8 x128
        q = nib (as Q4_K) | ((qh[e % 32] >> s) & 1) << 4;  w = (d * sc_s) * q - dmin * m_s
  Q6_K  (B 256, TS 210): ql u8 x128 | qh u8 x64 | scales int8 x16 | d f16
        c = e // 128, r = e % 128: low 4 bits from ql[c * 64 + r % 64] (high nibble for r >= 64),
        high 2 bits (qh[c * 32 + r % 32] >> 2 (r // 32)) & 3; q = that 6-bit value - 32
        w = (d * scale[e // 16]) * q

Every product here is exact in f32 (at most 11 + 8 + 6 significand bits), so only Q4_1's, Q4_K's
and Q5_K's final add rounds, and a fused multiply-add gives the same bits as the two steps.
"""
from __future__ import annotations

import numpy as np

# ggml type name -> (weights a block, bytes a block): the formats whose blocks kiln computes in
BLOCKS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
_f32 = np.float32


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of K weights in `qtype` (K a multiple of its block)."""
    b, ts = BLOCKS[qtype]
    if k % b:
        raise ValueError(f"{qtype} rows hold whole blocks of {b} weights, not {k}")
    return k // b * ts


def k_of(qtype: str, nbytes: int) -> int:
    """Weights in a row of `nbytes` bytes of `qtype`."""
    b, ts = BLOCKS[qtype]
    if nbytes % ts:
        raise ValueError(f"a {qtype} row of {nbytes} bytes is not whole {ts}-byte blocks")
    return nbytes // ts * b


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte `at` of each block, as f32 [n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(_f32)


def _k4_scale_min(sb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes [n, 12] -> (sc, m) [n, 8] as ints (get_scale_min_k4: sub-blocks
    0-3 keep 6 bits in bytes 0-3 / 4-7; sub-blocks 4-7 take 4 bits from bytes 8-11 and their top 2
    bits from the top of bytes 0-3 / 4-7)."""
    sb = sb.astype(np.int32)
    lo, mid, hi = sb[:, 0:4], sb[:, 4:8], sb[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: element e from byte e % 16, low nibble first."""
    return np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 qs bytes [n, 128] -> [n, 8, 32]: sub-block s from bytes (s // 2) * 32 on,
    the low nibble for even s."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(-1, 8, 32).astype(np.int32)


def dequantize_blocks(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """u8 [n, TS] blocks of `qtype` -> f32 [n, B]."""
    n = blocks.shape[0]
    if qtype == "Q8_0":
        return blocks[:, 2:].view(np.int8).astype(_f32) * _f16(blocks, 0)
    if qtype == "Q4_0":
        return _f16(blocks, 0) * (_nibbles32(blocks[:, 2:]) - 8).astype(_f32)
    if qtype == "Q4_1":
        return _f16(blocks, 0) * _nibbles32(blocks[:, 4:]).astype(_f32) + _f16(blocks, 2)
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = _k4_scale_min(blocks[:, 4:16])
        d = (_f16(blocks, 0) * sc.astype(_f32))[..., None]  # [n, 8, 1]
        dm = (_f16(blocks, 2) * mn.astype(_f32))[..., None]
        if qtype == "Q4_K":
            q = _k_nibbles(blocks[:, 16:144])
        else:
            qh = blocks[:, 16:48].astype(np.int32)[:, None, :] >> np.arange(8).reshape(1, 8, 1)  # [n, 8, 32]
            q = _k_nibbles(blocks[:, 48:176]) | ((qh & 1) << 4)
        return (d * q.astype(_f32) - dm).reshape(n, 256)
    if qtype == "Q6_K":
        ql = blocks[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & 15).reshape(n, 2, 4, 32).astype(np.int32)  # [n, c, r // 32, r % 32]
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        q = (ql | ((qh & 3).astype(np.int32) << 4)) - 32  # [n, 2, 4, 32] = element c * 128 + r
        scale = blocks[:, 192:208].view(np.int8).astype(_f32)  # [n, 16]
        d = (_f16(blocks, 208) * scale).reshape(n, 16, 1)
        return (d * q.reshape(n, 16, 16).astype(_f32)).reshape(n, 256)
    raise ValueError(f"no block dequantisation for GGUF type {qtype!r} (kiln computes in {', '.join(BLOCKS)})")


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """u8 [..., R] rows of `qtype` blocks -> f32 [..., K]: the weights they hold."""
    b, ts = BLOCKS[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    lead, nbytes = raw.shape[:-1], raw.shape[-1]
    k = k_of(qtype, nbytes)
    return dequantize_blocks(raw.reshape(-1, ts), qtype).reshape(*lead, k)
