"""paged_attention kernels: varlen causal GQA attention over the paged KV cache.

One kernel for prefill, mixed and decode batches; the wrapper and the argument
list are in paged_attention_launch.py. Shapes:
  q: [T, H, D]   cache: [NB, 2, BS, Hkv, D]   block_table: i32[S, MB]
  seq_lens: i32[S]   query_start_loc: i32[S+1]   out: [T, H, D]

Invariance (a token's output must not depend on how queries are grouped): every
key position k belongs to tile k // TILE and segment k // SEG, fixed by position
alone. For each query row the kernel
  1. runs an online softmax over the tiles of a segment in increasing order,
     starting from the empty state (m=-inf, l=0, acc=0);
  2. folds the segments into a running state in increasing order with `_fold`;
  3. divides once at the end (`_finalize`).
Rows whose tile or segment is fully masked (a prefill block's earlier rows, keys
past the window) take an exact identity step (alpha=1, p=0; empty fold), so the
extra work a program does for its other rows never changes a row's bits.
Query blocks are aligned to absolute positions (rows p // BLOCK_Q), so a position
sits in the same row of the same tile shape in prefill and in decode.
SPLIT=False: one program folds all of its segments. SPLIT=True (decode, long
contexts): program z computes segment z alone and stores (m, l, acc) in f32;
attention_merge_kernel folds them in order with the same `_fold` and `_finalize`.
Both give the same bits, so a bucket may choose either.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fold(M, Ls, ACC, m, l, acc):
    """Merge a segment's (m, l, acc) into the running (M, Ls, ACC). rows: [R], acc: [R, D]"""
    M_new = tl.maximum(M, m)
    base = tl.where(M_new == -float("inf"), 0.0, M_new)
    a = tl.where(M == M_new, 1.0, tl.exp2(M - base))
    b = tl.where(m == M_new, 1.0, tl.exp2(m - base))
    Ls = tl.fma(l, b, Ls * a)
    ACC = tl.fma(acc, b[:, None], ACC * a[:, None])
    return M_new, Ls, ACC


@triton.jit
def _finalize(Ls, ACC):
    return ACC / tl.where(Ls > 0, Ls, 1.0)[:, None]


@triton.jit
def _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest s with start(s) <= pid, start(s) = (qsl[s] + s (2 BLOCK_Q - 2)) // BLOCK_Q:
    monotone and leaves room for every q block of s (see the wrapper's grid)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = (tl.load(qsl_ptr + mid) + mid * (2 * BLOCK_Q - 2)) // BLOCK_Q
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _segment(q, pos, valid, z, k_lo, k_hi, kv_base, bt_row, stride_cb, stride_ckv, stride_cp, L, window,
             qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
             TILE: tl.constexpr, SEG: tl.constexpr, INTERPRET: tl.constexpr):
    """Online softmax over the tiles of segment z that intersect [k_lo, k_hi).
    q: [BLOCK_M, BLOCK_D]; pos: i32[BLOCK_M] row positions. -> (m, l, acc) of this segment."""
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    d = tl.arange(0, BLOCK_D)
    t_lo = tl.maximum(z * SEG, k_lo // TILE * TILE)
    t_hi = tl.minimum((z + 1) * SEG, k_hi)
    for k0 in range(t_lo, t_hi, TILE):
        kpos = k0 + tl.arange(0, TILE)  # [TILE] absolute key positions
        in_seq = kpos < L
        blk = tl.load(bt_row + kpos // BS, mask=in_seq, other=0)
        kv = kv_base + blk.to(tl.int64) * stride_cb + (kpos % BS) * stride_cp  # [TILE]
        kmask = in_seq[None, :] & (d[:, None] < D)
        k = tl.load(kv[None, :] + d[:, None], mask=kmask, other=0.0)  # [BLOCK_D, TILE] = K^T
        v = tl.load(kv[:, None] + stride_ckv + d[None, :], mask=in_seq[:, None] & (d[None, :] < D), other=0.0)
        if INTERPRET:  # the interpreter's bf16 dot is wrong; bf16 -> f32 is exact
            s = tl.dot(q.to(tl.float32), k.to(tl.float32))
        else:
            s = tl.dot(q, k)
        s = s * qk_scale  # [BLOCK_M, TILE], log2 domain
        vis = valid[:, None] & in_seq[None, :] & (kpos[None, :] <= pos[:, None])
        vis = vis & ((window == 0) | (kpos[None, :] > pos[:, None] - window))
        s = tl.where(vis, s, -float("inf"))
        m_t = tl.max(s, axis=1)
        m_new = tl.maximum(m_i, m_t)
        base = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.where(m_t > m_i, tl.exp2(m_i - base), 1.0)  # exactly 1 when nothing new
        p = tl.exp2(s - base[:, None])  # masked -> exactly 0
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        pv = p.to(v.dtype)
        if INTERPRET:
            acc = tl.dot(pv.to(tl.float32), v.to(tl.float32), acc)
        else:
            acc = tl.dot(pv, v, acc)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def paged_attention_kernel(q_ptr, stride_qt, stride_qh, cache_ptr, stride_cb, stride_ckv, stride_cp, stride_ch,
                           bt_ptr, stride_bt, seq_lens_ptr, qsl_ptr, num_seqs, out_ptr, stride_ot, stride_oh,
                           ws_acc_ptr, ws_ml_ptr, qk_scale, window,
                           H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           BS: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
                           SEG: tl.constexpr, MAX_SEGS: tl.constexpr, SPLIT: tl.constexpr,
                           INTERPRET: tl.constexpr):
    # grid: (q-block bound, HKV, MAX_SEGS if SPLIT else 1)
    pid, kvh, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q)
    q0 = tl.load(qsl_ptr + s)
    n = tl.load(qsl_ptr + s + 1) - q0
    L = tl.load(seq_lens_ptr + s)
    c = L - n  # position of the sequence's first query
    blk = c // BLOCK_Q + pid - (q0 + s * (2 * BLOCK_Q - 2)) // BLOCK_Q  # absolute q block
    if (n == 0) | (blk * BLOCK_Q > L - 1):
        return
    G: tl.constexpr = H // HKV
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    rows = tl.arange(0, BLOCK_M)
    g = rows % G_PAD
    pos = blk * BLOCK_Q + rows // G_PAD  # [BLOCK_M] query position of each row
    valid = (pos >= c) & (pos < L) & (g < G)
    tok = (q0 + pos - c).to(tl.int64)
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    qmask = valid[:, None] & (d[None, :] < D)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    p_min = tl.maximum(blk * BLOCK_Q, c)
    p_max = tl.minimum(blk * BLOCK_Q + BLOCK_Q - 1, L - 1)
    k_lo = tl.where(window > 0, tl.maximum(p_min - window + 1, 0), 0)
    kv_base = cache_ptr + kvh * stride_ch
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    if SPLIT:
        if (z < k_lo // SEG) | (z > p_max // SEG):
            return
        m, l, acc = _segment(q, pos, valid, z, k_lo, p_max + 1, kv_base, bt_row, stride_cb, stride_ckv,
                             stride_cp, L, window, qk_scale, D, BLOCK_D, BS, BLOCK_M, TILE, SEG, INTERPRET)
        ws = (tok * MAX_SEGS + z) * H + head  # ws_ml: f32[T, MAX_SEGS, H, 2], ws_acc: f32[T, MAX_SEGS, H, D]
        tl.store(ws_ml_ptr + ws * 2, m, mask=valid)
        tl.store(ws_ml_ptr + ws * 2 + 1, l, mask=valid)
        tl.store(ws_acc_ptr + ws[:, None] * D + d[None, :], acc, mask=qmask)
    else:
        M = tl.full((BLOCK_M,), -float("inf"), tl.float32)
        Ls = tl.zeros((BLOCK_M,), tl.float32)
        ACC = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for zz in range(k_lo // SEG, p_max // SEG + 1):
            m, l, acc = _segment(q, pos, valid, zz, k_lo, p_max + 1, kv_base, bt_row, stride_cb, stride_ckv,
                                 stride_cp, L, window, qk_scale, D, BLOCK_D, BS, BLOCK_M, TILE, SEG, INTERPRET)
            M, Ls, ACC = _fold(M, Ls, ACC, m, l, acc)
        o = _finalize(Ls, ACC)
        dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def attention_merge_kernel(ws_acc_ptr, ws_ml_ptr, positions_ptr, n_rows_ptr, out_ptr, stride_ot, stride_oh, window,
                           H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                           SEG: tl.constexpr, MAX_SEGS: tl.constexpr):
    # grid: (T, cdiv(H, BLOCK_H)); folds token t's segments in increasing order
    t, hb = tl.program_id(0), tl.program_id(1)
    if t >= tl.load(n_rows_ptr):
        return
    pos = tl.load(positions_ptr + t)
    k_lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < H
    mask = hmask[:, None] & (d[None, :] < D)
    M = tl.full((BLOCK_H,), -float("inf"), tl.float32)
    Ls = tl.zeros((BLOCK_H,), tl.float32)
    ACC = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    # Unrolled over every possible segment so that no load waits on the fold before it (a
    # rolled loop made a batch-1 merge 9 dependent round trips to memory). Segments outside
    # [k_lo // SEG, pos // SEG] load the empty state (m=-inf, l=0, acc=0), whose fold is an
    # exact identity, so the bits equal the unsplit kernel's in-order fold.
    z_lo = k_lo // SEG
    z_hi = pos // SEG
    for z in tl.static_range(MAX_SEGS):
        live = (z >= z_lo) & (z <= z_hi)
        ws = (t.to(tl.int64) * MAX_SEGS + z) * H + h
        m = tl.load(ws_ml_ptr + ws * 2, mask=hmask & live, other=-float("inf"))
        l = tl.load(ws_ml_ptr + ws * 2 + 1, mask=hmask & live, other=0.0)
        acc = tl.load(ws_acc_ptr + ws[:, None] * D + d[None, :], mask=mask & live, other=0.0)
        M, Ls, ACC = _fold(M, Ls, ACC, m, l, acc)
    o = _finalize(Ls, ACC)
    dst = out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=mask)
