"""Weights as the compiled CPU kernels read them: quantised codes re-tiled, never re-quantised.

A GGUF tensor's blocks (Q4_0, Q4_1, Q4_K, Q8_0, Q6_K) become one of three packed kinds, tiled in
groups of R = 64 output rows so that a GEMV kernel vectorises across rows (each SIMD lane is one
output row; no horizontal sums, kernels.py says why that matters under numba):

    q4:  codes u8 [G, nb, 16, R]  (byte j of a 32-value sub-block: value j in the low nibble,
         value j + 16 in the high one, Q4_0/Q4_1's own order), d, m: f32 [G, nb, R]
         value = d * (q - 8)            (Q4_0: `offset`; m holds -8 d for the GEMV's algebra)
         value = d * q + m              (Q4_1; Q4_K with d = d * sc and m = -(dmin * min) of
                                         each 32-value sub-block, as gguf-py computes them)
    q8:  codes i8 [G, nb, gs, R], d: f32 [G, nb, R]; value = q * d  (Q8_0: gs 32; Q6_K: gs 16,
         d = d * scale, its 6-bit codes stored in a byte: 8 bits a weight where the file has 6.56)
    bf16: u16 [G, K, R]                 (bf16 checkpoints: the 16-bit patterns, widened to f32 in the
                                         kernels, exact; half the bytes a GEMV streams of f32 tiles)
    f32: [G, K, R]                      (other float checkpoints; f16 widened exactly)

Scales are the file's f16 (or f16 x int8 product, rounded to f32 as gguf-py does) widened to f32,
which is exact, so dequantising a packed weight gives gguf-py's `dequantize` bit for bit
(tests/runtime/cpu/test_packed.py). N is padded up to a multiple of R with zero scales.

Layouts of the GGUF blocks follow ggml (ggml-quants.h, block_q4_0 ... block_q6_K), as gguf-py's
quants.py reads them.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

R = 64  # output rows per tile: 8 AVX2 lanes x 8 registers of accumulators

# GGUF block types this target keeps packed: name -> (values per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q8_0": (32, 34), "Q6_K": (256, 210)}


@dataclass
class PackedWeight:
    kind: str  # "q4", "q8", "bf16" or "f32"
    n: int  # logical output rows
    k: int  # input columns
    q: np.ndarray
    d: np.ndarray | None = None
    m: np.ndarray | None = None
    offset: bool = False  # q4 only: value = d * (q - 8) (Q4_0)
    source: str = "F32"  # the checkpoint's type, for messages

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.d, self.m) if a is not None)


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """f16 at byte `at` of every block, widened to f32 (exact). raw: u8 [..., block_bytes]"""
    return np.ascontiguousarray(raw[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _tile(a: np.ndarray, n_pad: int) -> np.ndarray:
    """[N, *rest] rows -> [G, *rest, R] (rows padded with zeros to a multiple of R)"""
    if n_pad:
        a = np.concatenate([a, np.zeros((n_pad, *a.shape[1:]), a.dtype)])
    g = a.shape[0] // R
    a = a.reshape(g, R, *a.shape[1:])
    return np.ascontiguousarray(np.moveaxis(a, 1, -1))


def _nibbles_to_q4(codes: np.ndarray) -> np.ndarray:
    """codes u8 [N, nb, 32] (0..15) -> bytes [N, nb, 16]: value j low, value j + 16 high"""
    return (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)


def _q4k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and mins -> (scale, min) u8 [..., 8] (ggml get_scale_min_k4)"""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale, mins


def pack_gguf(type_name: str, raw: np.ndarray, k: int) -> PackedWeight:
    """raw: u8 [N, row_bytes], one weight row per row (HF row order), of GGUF `type_name` blocks."""
    vals, nbytes = BLOCKS[type_name]
    n = raw.shape[0]
    if k % vals or raw.shape[1] != k // vals * nbytes:
        raise ValueError(f"{type_name} rows of {k} values are {k // vals * nbytes} bytes, not {raw.shape[1]}")
    b = raw.reshape(n, k // vals, nbytes)
    pad = -n % R
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(b, 0)
        if type_name == "Q4_0":
            m, qs, offset = -8 * d, b[..., 2:], True
        else:
            m, qs, offset = _f16(b, 2), b[..., 4:], False
        return PackedWeight("q4", n, k, _tile(np.ascontiguousarray(qs), pad), _tile(d, pad), _tile(m, pad),
                            offset, type_name)
    if type_name == "Q4_K":
        d, dmin = _f16(b, 0), _f16(b, 2)
        scale, mins = _q4k_scales(b[..., 4:16])
        ds = (d[..., None] * scale.astype(np.float32)).reshape(n, -1)  # f32 products, as gguf-py
        ms = -(dmin[..., None] * mins.astype(np.float32)).reshape(n, -1)
        qs = b[..., 16:].reshape(n, -1, 4, 32)  # 4 chunks of 32 bytes: 64 values each
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 32)  # sub-blocks of 32
        return PackedWeight("q4", n, k, _tile(_nibbles_to_q4(codes), pad), _tile(ds, pad), _tile(ms, pad),
                            False, type_name)
    if type_name == "Q8_0":
        d = _f16(b, 0)
        qs = np.ascontiguousarray(b[..., 2:]).view(np.int8)
        return PackedWeight("q8", n, k, _tile(qs, pad), _tile(d, pad), source=type_name)
    if type_name == "Q6_K":
        ql, qh = b[..., :128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
        scales = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
        d = _f16(b, 208)
        lo = np.stack([ql & 0x0F, ql >> 4], axis=3).reshape(n, -1, 2, 4, 32)  # [.., half, 4 x 32]
        hi = np.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=3)  # [.., half, 4, 32]
        codes = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, -1, 16)
        ds = (d[..., None] * scales).reshape(n, -1)  # one scale per 16 values
        return PackedWeight("q8", n, k, _tile(codes, pad), _tile(ds, pad), source=type_name)
    raise ValueError(f"no packed form for {type_name}")


def pack_float(w: np.ndarray, source: str = "F32") -> PackedWeight:
    """A float [N, K] weight: bf16 kept as its bit patterns in bf16 tiles, anything else that widens
    to f32 exactly (f32, f16) in f32 tiles."""
    n, k = w.shape
    if w.dtype == ml_dtypes.bfloat16:
        return PackedWeight("bf16", n, k, _tile(np.ascontiguousarray(w).view(np.uint16), -n % R), source=source)
    return PackedWeight("f32", n, k, _tile(np.asarray(w, np.float32), -n % R), source=source)
