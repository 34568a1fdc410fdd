"""GEMV/GEMM and dequantisation over packed weights (packed.py), compiled by numba for this CPU.

Why the loops look like this. numba hands LLVM the loops as written; what made a 1.77 M-weight Q4_1
GEMV go from 1,080 us to 105 us on one Zen 3 core (measured while writing this file):
- the innermost loop runs over R = 64 output rows of a tile, contiguous in memory, so LLVM's loop
  vectoriser makes each AVX2 lane one row: no horizontal sums, no loop-carried FMA chain per lane
  longer than one block (a dot product per row vectorised over K left one 4-wide FMA chain);
- nibbles are split in float (floor(q / 16)) because numba promotes integer arithmetic on u8 to
  int64, and int64 -> float has no AVX2 instruction (every value went through a scalar convert);
- no array views inside the loops (each view is a reference count taken and dropped).
Every token of a step decodes the codes again (from L1) in the same expression: 1.45x faster at
T = 1 than decoding a tile once into lo/hi arrays that the T tokens then read (0.137 vs 0.199 ms
for SmolLM2's gate/up on one core), 15 % slower at T = 8. Batch 1 decode is what matters most,
and a token's sums are then the same bits whatever T is (batch invariance within the GEMV path,
tests/runtime/cpu/test_packed_weights.py); T past the switch (linear.py) goes through BLAS.

Dequantisation (dequant_*) is bit-exact to gguf-py: no fastmath there (no FMA contraction).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

# reassociation lets LLVM vectorise; contraction gives FMAs. No nnan/ninf: a NaN must stay a NaN.
FM = {"reassoc", "contract", "nsz", "arcp"}
_16 = np.float32(16.0)
_1_16 = np.float32(0.0625)


@njit(parallel=True, fastmath=FM, cache=True)
def gemv_q4(x, q, d, m, y, T):
    """x: f32 [>=T, K]; q: u8 [G, nb, 16, R]; d, m: f32 [G, nb, R] -> y[:T, :N] (N = y's width,
    rows past it are padding). y[t, n] = sum_b d[n,b] * sum_j x[t,32b+j] q[n,b,j] + m[n,b] sum_j x[t,32b+j]"""
    G, nb, _, R = q.shape
    N = y.shape[1]
    for g in prange(G):
        acc = np.zeros((T, R), np.float32)
        s = np.empty((T, R), np.float32)
        for b in range(nb):
            s[:, :] = 0
            for j in range(16):
                for t in range(T):
                    x0 = x[t, b * 32 + j]
                    x1 = x[t, b * 32 + 16 + j]
                    for r in range(R):
                        f = np.float32(q[g, b, j, r])
                        h = np.floor(f * _1_16)
                        s[t, r] += x0 * (f - _16 * h) + x1 * h
            for t in range(T):
                xs = np.float32(0)
                for j in range(32):
                    xs += x[t, b * 32 + j]
                for r in range(R):
                    acc[t, r] += d[g, b, r] * s[t, r] + m[g, b, r] * xs
        for t in range(T):
            for r in range(min(R, N - g * R)):
                y[t, g * R + r] = acc[t, r]


@njit(parallel=True, fastmath=FM, cache=True)
def gemv_q8(x, q, d, y, T):
    """x: f32 [>=T, K]; q: i8 [G, nb, gs, R]; d: f32 [G, nb, R] -> y[:T, :N]. Four codes of a row
    per load/store of its partial sum: SmolLM2's Q8_0 LM head ran 175 -> 144 us per 1.77 M weights
    on one core (minimum of 200 calls, 2026-12-07; one code per store: 175, eight: 180)."""
    G, nb, gs, R = q.shape
    N = y.shape[1]
    for g in prange(G):
        acc = np.zeros((T, R), np.float32)
        s = np.empty((T, R), np.float32)
        for b in range(nb):
            s[:, :] = 0
            for j in range(0, gs, 4):  # gs is 32 (Q8_0) or 16 (Q6_K)
                for t in range(T):
                    o = b * gs + j
                    x0, x1, x2, x3 = x[t, o], x[t, o + 1], x[t, o + 2], x[t, o + 3]
                    for r in range(R):
                        s[t, r] += ((x0 * np.float32(q[g, b, j, r]) + x1 * np.float32(q[g, b, j + 1, r]))
                                    + (x2 * np.float32(q[g, b, j + 2, r]) + x3 * np.float32(q[g, b, j + 3, r])))
            for t in range(T):
                for r in range(R):
                    acc[t, r] += d[g, b, r] * s[t, r]
        for t in range(T):
            for r in range(min(R, N - g * R)):
                y[t, g * R + r] = acc[t, r]


@njit(parallel=True, fastmath=FM, cache=True)
def gemv_f32(x, q, y, T):
    """x: f32 [>=T, K]; q: f32 [G, K, R] -> y[:T, :N]"""
    G, K, R = q.shape
    N = y.shape[1]
    for g in prange(G):
        acc = np.zeros((T, R), np.float32)
        for k in range(K):
            for t in range(T):
                x0 = x[t, k]
                for r in range(R):
                    acc[t, r] += x0 * q[g, k, r]
        for t in range(T):
            for r in range(min(R, N - g * R)):
                y[t, g * R + r] = acc[t, r]


# -- dequantisation: K-major [K, N] for BLAS (x @ wt), and chosen rows [n, K] ------------------

@njit(parallel=True, cache=True)
def dequant_q4_t(q, d, m, offset, out):
    """-> out[k, n] = value of row n, column k (out: f32 [K, >= G*R]); bit-exact to gguf-py"""
    G, nb, _, R = q.shape
    for g in prange(G):
        for b in range(nb):
            for j in range(16):
                for r in range(R):
                    f = np.float32(q[g, b, j, r])
                    h = np.floor(f * _1_16)
                    lo = f - _16 * h
                    if offset:
                        out[b * 32 + j, g * R + r] = d[g, b, r] * (lo - np.float32(8))
                        out[b * 32 + 16 + j, g * R + r] = d[g, b, r] * (h - np.float32(8))
                    else:
                        out[b * 32 + j, g * R + r] = d[g, b, r] * lo + m[g, b, r]
                        out[b * 32 + 16 + j, g * R + r] = d[g, b, r] * h + m[g, b, r]


@njit(parallel=True, cache=True)
def dequant_q8_t(q, d, out):
    G, nb, gs, R = q.shape
    for g in prange(G):
        for b in range(nb):
            for j in range(gs):
                for r in range(R):
                    out[b * gs + j, g * R + r] = np.float32(q[g, b, j, r]) * d[g, b, r]


@njit(parallel=True, cache=True)
def dequant_f32_t(q, out):
    G, K, R = q.shape
    for g in prange(G):
        for k in range(K):
            for r in range(R):
                out[k, g * R + r] = q[g, k, r]


@njit(cache=True)
def dequant_q4_rows(q, d, m, offset, rows, out):
    """out[i, :] = row rows[i] (an embedding lookup); bit-exact to gguf-py"""
    _, nb, _, R = q.shape
    for i in range(rows.shape[0]):
        g, r = rows[i] // R, rows[i] % R
        for b in range(nb):
            for j in range(16):
                f = np.float32(q[g, b, j, r])
                h = np.floor(f * _1_16)
                lo = f - _16 * h
                if offset:
                    out[i, b * 32 + j] = d[g, b, r] * (lo - np.float32(8))
                    out[i, b * 32 + 16 + j] = d[g, b, r] * (h - np.float32(8))
                else:
                    out[i, b * 32 + j] = d[g, b, r] * lo + m[g, b, r]
                    out[i, b * 32 + 16 + j] = d[g, b, r] * h + m[g, b, r]


@njit(cache=True)
def dequant_q8_rows(q, d, rows, out):
    _, nb, gs, R = q.shape
    for i in range(rows.shape[0]):
        g, r = rows[i] // R, rows[i] % R
        for b in range(nb):
            for j in range(gs):
                out[i, b * gs + j] = np.float32(q[g, b, j, r]) * d[g, b, r]


@njit(cache=True)
def dequant_f32_rows(q, rows, out):
    _, K, R = q.shape
    for i in range(rows.shape[0]):
        g, r = rows[i] // R, rows[i] % R
        for k in range(K):
            out[i, k] = q[g, k, r]
