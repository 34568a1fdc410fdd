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


@njit(parallel=True, fastmath=FM, cache=True)
def gemv_bf16(x, q, y, T):
    """x: f32 [>=T, K]; q: u16 [G, K, R] bf16 bit patterns -> y[:T, :N]: gemv_f32's sums over the
    weights widened exactly (a bf16 is the high half of its f32), each k's R weights widened once
    into a buffer seen as u32 and as f32"""
    G, K, R = q.shape
    N = y.shape[1]
    for g in prange(G):
        acc = np.zeros((T, R), np.float32)
        w = np.empty(R, np.float32)
        wb = w.view(np.uint32)
        for k in range(K):
            for r in range(R):
                wb[r] = np.uint32(q[g, k, r]) << np.uint32(16)
            for t in range(T):
                x0 = x[t, k]
                for r in range(R):
                    acc[t, r] += x0 * w[r]
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


@njit(parallel=True, cache=True)
def dequant_bf16_t(q, out):
    G, K, R = q.shape
    for g in prange(G):
        w = np.empty(R, np.float32)
        wb = w.view(np.uint32)
        for k in range(K):
            for r in range(R):
                wb[r] = np.uint32(q[g, k, r]) << np.uint32(16)
            for r in range(R):
                out[k, g * R + r] = w[r]


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


@njit(cache=True)
def dequant_bf16_rows(q, rows, out):
    _, K, R = q.shape
    w = np.empty(1, np.float32)
    wb = w.view(np.uint32)
    for i in range(rows.shape[0]):
        g, r = rows[i] // R, rows[i] % R
        for k in range(K):
            wb[0] = np.uint32(q[g, k, r]) << np.uint32(16)
            out[i, k] = w[0]


# -- activations quantised to q8_1 blocks (KILN_CPU_ACT_QUANT=q8_1; linear.py says when) -------

@njit(cache=True)
def quantize_q8_1(x, T, xq, dx, sx):
    """x: f32 [>=T, K] -> xq: i16 [>=T, K] (values -127..127), dx, sx: f32 [>=T, K/32].
    Per block of 32: d = amax / 127, q = rint(x / d) (x * (1 / d), as ggml), s = d * sum(q).
    ggml's quantize_row_q8_1_ref (ggml-quants.c) with two differences, both kept by the numpy
    reference (linear.quantize_q8_1_reference): d and s stay f32 (ggml stores f16), and ties round
    to even, as ggml's AVX2 quantize_row_q8_1 does (_mm256_round_ps, _MM_ROUND_NEAREST), where the
    scalar reference rounds them away from zero. No fastmath: the codes are the reference's bits."""
    nb = x.shape[1] // 32
    for t in range(T):
        for b in range(nb):
            amax = np.float32(0)
            for j in range(32):
                amax = max(amax, abs(x[t, b * 32 + j]))
            d = amax / np.float32(127)
            inv = np.float32(1) / d if d != 0 else np.float32(0)
            s = 0
            for j in range(32):
                v = np.int16(np.rint(x[t, b * 32 + j] * inv))
                xq[t, b * 32 + j] = v
                s += v
            dx[t, b] = d
            sx[t, b] = d * np.float32(s)


@njit(parallel=True, fastmath=FM, cache=True)
def gemv_q4_q8(xq, dx, sx, q, d, m, y, T):
    """y[t, n] = sum_b (d[n,b] dx[t,b]) isum + m[n,b] sx[t,b], isum = sum_j xq[t,32b+j] code[n,b,j]:
    llama.cpp's ggml_vec_dot_q4_1_q8_1 (ggml-cpu/arch/x86/quants.c) over this file's 64-row tiles.
    Integer sums are exact: |xq| <= 127 and codes <= 15, so the 16 products of one nibble half of a
    block stay within +-30,480 and fit the int16 lanes that LLVM picks for these loops (vpmullw,
    16 rows a register on AVX2: SmolLM2's gate/up [3072, 576] 134 -> 93 us on one core, minimum
    of 200 calls, against gemv_q4 on f32 activations); low and high nibbles sum separately for
    that reason. Only the per-block scaling is float (fastmath: FMA and reassociation there)."""
    G, nb, _, R = q.shape
    N = y.shape[1]
    for g in prange(G):
        acc = np.zeros((T, R), np.float32)
        sl = np.empty(R, np.int16)
        sh = np.empty(R, np.int16)
        for b in range(nb):
            for t in range(T):
                sl[:] = 0
                sh[:] = 0
                for j in range(16):
                    a0 = xq[t, b * 32 + j]
                    a1 = xq[t, b * 32 + 16 + j]
                    for r in range(R):
                        c = q[g, b, j, r]
                        sl[r] = sl[r] + a0 * (c & 15)
                        sh[r] = sh[r] + a1 * (c >> 4)
                dxb, sxb = dx[t, b], sx[t, b]
                for r in range(R):
                    acc[t, r] += (d[g, b, r] * dxb) * (np.float32(sl[r]) + np.float32(sh[r])) + m[g, b, r] * sxb
        for t in range(T):
            for r in range(min(R, N - g * R)):
                y[t, g * R + r] = acc[t, r]
