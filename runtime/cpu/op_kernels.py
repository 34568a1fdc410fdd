"""The step's other compiled kernels: norms, SwiGLU, RoPE + KV write, paged attention.

Each follows the numpy reference of its op in graph/ops.py and takes the step's row count T
(buffers are the arena's, sized for the largest step). RoPE reads cos/sin tables built by
graph/rope.rope_tables (the same f32 arithmetic as ops.rope) and, like the KV write, is computed
without fastmath, so rotated q/k equal the reference's bits for the same input. Norms and
attention reduce in another order than numpy (tests compare within f32 rounding).

Only the attention (and the GEMVs, linear_kernels.py) run parallel loops: the norms, SwiGLU and
RoPE do microseconds of work a step, less than a fork/join of the thread pool costs.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

FM = {"reassoc", "contract", "nsz", "arcp"}


@njit(fastmath=FM, cache=True)
def rms_norm(x, w, eps, offset, out, T):
    """x, out: f32 [>=T, H] (rows normalised; a per-head norm passes [T*heads, D]); w: f32 [H]"""
    H = x.shape[1]
    for t in range(T):
        ss = np.float32(0)
        for i in range(H):
            ss += x[t, i] * x[t, i]
        inv = np.float32(1) / np.sqrt(ss / np.float32(H) + np.float32(eps))
        for i in range(H):
            out[t, i] = (x[t, i] * inv) * (w[i] + np.float32(offset))


@njit(fastmath=FM, cache=True)
def add_rms_norm(x, res, w, eps, offset, out, res_out, T):
    """res_out = x + res; out = rms_norm(res_out) (vLLM's fused_add_rms_norm)"""
    H = x.shape[1]
    for t in range(T):
        ss = np.float32(0)
        for i in range(H):
            s = x[t, i] + res[t, i]
            res_out[t, i] = s
            ss += s * s
        inv = np.float32(1) / np.sqrt(ss / np.float32(H) + np.float32(eps))
        for i in range(H):
            out[t, i] = (res_out[t, i] * inv) * (w[i] + np.float32(offset))


@njit(cache=True)
def add_rows(y, a, T):
    """y[:T] += a[:T] (a residual or a broadcast bias row: a [1, N])"""
    N = y.shape[1]
    one = a.shape[0] == 1
    for t in range(T):
        ta = 0 if one else t
        for i in range(N):
            y[t, i] += a[ta, i]


@njit(fastmath=FM, cache=True)
def silu_mul_grouped(y, group, out, T):
    """y: [>=T, 2I], gate and up interleaved in groups of `group` columns (graph/layout.py) ->
    out [>=T, I] = silu(gate) * up"""
    I = out.shape[1]
    for t in range(T):
        for c in range(I // group):
            for i in range(group):
                g = y[t, 2 * c * group + i]
                u = y[t, 2 * c * group + group + i]
                out[t, c * group + i] = g / (np.float32(1) + np.exp(-g)) * u


@njit(cache=True)
def _rope_row(x, cos, sin, p, rd, neox):
    """rotate x[:rd] (one head, f32 [D]) in place at position p; plain f32 ops as ops.rope"""
    half = rd // 2
    if neox:
        for i in range(half):
            x1, x2 = x[i], x[i + half]
            c, s = cos[p, i], sin[p, i]
            x[i] = x1 * c - x2 * s
            x[i + half] = x2 * c + x1 * s
    else:
        for i in range(half):
            x1, x2 = x[2 * i], x[2 * i + 1]
            c, s = cos[p, i], sin[p, i]
            x[2 * i] = x1 * c - x2 * s
            x[2 * i + 1] = x2 * c + x1 * s


@njit(cache=True)
def _head_norm(x, w, eps, offset):
    D = x.shape[0]
    ss = np.float32(0)
    for i in range(D):
        ss += x[i] * x[i]
    inv = np.float32(1) / np.sqrt(ss / np.float32(D) + np.float32(eps))
    for i in range(D):
        x[i] = (x[i] * inv) * (w[i] + np.float32(offset))


@njit(cache=True)
def rope_kv(q, k, v, cache, positions, slots, cos, sin, rd, neox, qn, kn, eps, offset, q_out, T):
    """q: [>=T, H, D], k, v: [>=T, Hkv, D] (views of the qkv GEMM's output); cache: [NB, 2, BS,
    Hkv, D]; qn, kn: [D] per-head norm weights (Qwen3) or empty -> q_out = rope(norm(q)), and
    rope(norm(k)), v written to the cache at slots (-1: padding, not written)."""
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    BS = cache.shape[2]
    norm = qn.shape[0] > 0
    for t in range(T):
        p = positions[t]
        for h in range(H):
            row = q_out[t, h]
            for i in range(D):
                row[i] = q[t, h, i]
            if norm:
                _head_norm(row, qn, eps, offset)
            _rope_row(row, cos, sin, p, rd, neox)
        sl = slots[t]
        if sl < 0:
            continue
        blk, off = sl // BS, sl % BS
        for h in range(Hkv):
            kr = cache[blk, 0, off, h]
            for i in range(D):
                kr[i] = k[t, h, i]
            if norm:
                _head_norm(kr, kn, eps, offset)
            _rope_row(kr, cos, sin, p, rd, neox)
            for i in range(D):
                cache[blk, 1, off, h, i] = v[t, h, i]


@njit(parallel=True, fastmath=FM, cache=True)
def paged_attention(q, cache, block_table, seq_lens, qsl, scale, window, out, seq_of):
    """q: [>=T, H, D]; cache: [NB, 2, BS, Hkv, D]; block_table: i32 [S, MB]; seq_lens: i32 [S];
    qsl: i32 [S+1]; seq_of: i32 [T] (the sequence of each query row; -1: skip the row, its out is
    left as it is) -> out [>=T, H, D].
    Causal, GQA; a row at position p sees keys max(0, p - window + 1) .. p (window 0: all).
    One (row, head) per parallel item: q scaled once into a scratch row, the scores of the row
    into a scratch row, then exp in its own loop (not between two dot products: 20 % less time
    at 129 keys, SmolLM2's 9 x 64 heads, 31 vs 39 us on one core), the weighted sum of values,
    and one multiply by 1 / the sum. Everything is indexed element by element (a view per key
    cost a reference count each)."""
    T = seq_of.shape[0]
    H, D = q.shape[1], q.shape[2]
    BS, Hkv = cache.shape[2], cache.shape[3]
    g = H // Hkv
    for item in prange(T * H):
        t, h = item // H, item % H
        s = seq_of[t]
        if s < 0:  # a row the caller attends otherwise (plan.py: prefill chunks through BLAS)
            continue
        L, n = seq_lens[s], qsl[s + 1] - qsl[s]
        p = L - n + (t - qsl[s])
        lo = max(0, p - window + 1) if window > 0 else 0
        kh = h // g
        qs = np.empty(D, np.float32)
        for i in range(D):
            qs[i] = q[t, h, i] * np.float32(scale)
        sc = np.empty(p + 1 - lo, np.float32)
        mx = np.float32(-np.inf)
        for key in range(lo, p + 1):
            blk, off = block_table[s, key // BS], key % BS
            a = np.float32(0)
            for i in range(D):
                a += qs[i] * cache[blk, 0, off, kh, i]
            sc[key - lo] = a
            mx = max(mx, a)
        den = np.float32(0)
        for j in range(p + 1 - lo):
            e = np.exp(sc[j] - mx)
            sc[j] = e
            den += e
        acc = np.zeros(D, np.float32)
        for key in range(lo, p + 1):
            blk, off = block_table[s, key // BS], key % BS
            e = sc[key - lo]
            for i in range(D):
                acc[i] += e * cache[blk, 1, off, kh, i]
        inv = np.float32(1) / den
        for i in range(D):
            out[t, h, i] = acc[i] * inv
