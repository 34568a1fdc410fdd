"""paged_attention kernels: varlen causal GQA attention over the paged KV cache.

One kernel for prefill, mixed and decode batches; the wrapper and the argument
list are in paged_attention_launch.py. Shapes:
  q: [T, H, D]   cache: [NB, 2, BS, Hkv, D] (q's dtype, or float8_e4m3fn)   block_table: i32[S, MB]
  seq_lens: i32[S]   query_start_loc: i32[S+1]   out: [T, H, D]

Invariance (a token's output must not depend on how queries are grouped): every
key position k belongs to tile k // TILE and segment k // SEG, fixed by position
alone (TILE and SEG are the reduction knobs, one per model; the decode variant may take a
TILE of its own where its bits are already its own, over an e4m3 cache: AttentionConfig.decode_tile).
For each query row the kernel
  1. runs an online softmax over the tiles of a segment in increasing order,
     starting from the empty state (m=-inf, l=0, acc=0);
  2. folds the segments into a running state in increasing order with `_fold`;
  3. divides once at the end (`_finalize`).
Rows never mix: the only sums are inside tensor-core dots (QK^T, PV, and the row sums
l, taken as P @ ones on the tensor core rather than with tl.sum, whose cross-lane
order follows the tile's layout), and the tensor core gives an element the same bits
whatever the tile shape or instruction (mma.sync at 16 rows, wgmma at 64; measured,
tests/codegen/test_triton_gpu.py). So the rows per program (BLOCK_Q positions x the
GQA group), the warps and the stages are schedule knobs, free per bucket: decode
takes 16-row programs, prefill 64-row ones.
A mixed bucket with AttentionConfig.route_mixed runs two launches: the decode variant for its
sequences of one query (16-row programs, as in a decode bucket) and the prefill variant for
the others, each skipping the other's sequences. A sequence with one query then takes the
decode kernel in every bucket. Over an e4m3 cache that is the only way its bits can match
(16-row mma.sync and 64-row wgmma programs round its f16 dots differently: GPU_NOTES, the
strict xfail in test_triton_gpu.py), and its programs have a quarter of the prefill rows.
Rows whose tile or segment is fully masked (a prefill block's earlier rows, keys
past the window) take an exact identity step (alpha=1, p=0; empty fold). Tiles that
every row of the block sees whole skip the mask (the masked path would compute the
same bits) and are software-pipelined in their own loop.
An e4m3 cache (--kv-cache-dtype fp8) runs both dots in f16: K/V tiles widen to f16 exactly
in one instruction per pair (cvt.rn.f16x2.e4m3x2; to bf16 takes three more), q rounds
bf16 -> f16 exactly in f16's normal range (6.1e-5 <= |q| < 65504), P rounds to f16 (finer
than bf16). H200, Llama-8B heads (bench/attn_sweep.py): 256 sequences x 1,500 keys 381 us
with bf16 dots, 288 with f16 (a bf16 cache: 373); a 2,048-token prefill 222 / 181 (182.5).
DV_PARTS (decode only; a schedule knob, paged_attention_launch.decode_dv_parts): the KV head's
V columns cut into DV_PARTS programs side by side (grid axis 1: HKV * DV_PARTS, a KV head's parts
neighbours in launch order, so its K comes from HBM once and from L2 for the others). Every part
computes the same scores (q k^T over all of D: the same dot, the same bits) and row sums, and its
[rows, D / DV_PARTS] share of P @ V; an output element's sum over the keys does not depend on the
columns beside it (mma.sync tiles N in independent 8-column blocks), so the bits are the unparted
kernel's. It multiplies a short decode's programs (head_dim 256, 2-4 KV heads: 8 segments at 512
keys are 16-32 programs; GPU_NOTES) and divides the accumulators a program holds.
SPLIT=False: one program folds all of its segments. SPLIT=True (decode, long
contexts): program z computes segment z alone (folding it into the empty state, an
exact identity) and stores (m, l, acc) in f32; `_merge` folds them in order with the
same `_fold` and `_finalize`. Both give the same bits. The merge runs in
attention_merge_kernel (a second launch), or with MERGE (decode only) in the attention
kernel itself: each live segment's program (each of its DV_PARTS), once its partial is stored,
counts itself in on an i32 counter of its (sequence, KV head), and the one that counts last
merges all of D, then puts the counter back to 0 (see `_merge_if_last`). With DV_PARTS, part 0
alone stores a segment's (m, l); the others store their columns of acc.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kiln.codegen.triton.pdl import pdl_enter, pdl_step_input


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
def _interp_dot(a, b, acc):
    """The interpreter's tl.dot is numpy matmul: wrong for bf16, and its f32 rounding follows
    BLAS blocking, i.e. the number of rows. Model the tensor core instead, where an element
    sums its K in one order whatever the tile (as gemm.py's _dot_acc does)."""
    return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _scores(q, pos, valid, k0, bt_row, kv_base, stride_cb, stride_ckv, stride_cp, L, window, dv0,
            D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
            MASKED: tl.constexpr, INTERPRET: tl.constexpr):
    """One key tile: -> (s = q k^T [BLOCK_M, TILE], unscaled, -inf where not visible; v [TILE, BLOCK_DV],
    V's columns dv0 .. dv0 + BLOCK_DV: the program's part of the head (DV_PARTS))."""
    kpos = k0 + tl.arange(0, TILE)  # [TILE] absolute key positions
    d = tl.arange(0, BLOCK_D)
    dv = dv0 + tl.arange(0, BLOCK_DV)
    if MASKED:
        in_seq = kpos < L
        blk = tl.load(bt_row + kpos // BS, mask=in_seq, other=0)
        kv = kv_base + blk.to(tl.int64) * stride_cb + (kpos % BS) * stride_cp  # [TILE]
        k = tl.load(kv[None, :] + d[:, None], mask=in_seq[None, :] & (d[:, None] < D), other=0.0)  # K^T
        v = tl.load(kv[:, None] + stride_ckv + dv[None, :], mask=in_seq[:, None] & (dv[None, :] < D), other=0.0)
    else:  # the whole tile is inside the sequence
        blk = tl.load(bt_row + kpos // BS)
        kv = kv_base + blk.to(tl.int64) * stride_cb + (kpos % BS) * stride_cp
        k = tl.load(kv[None, :] + d[:, None], mask=d[:, None] < D, other=0.0)
        v = tl.load(kv[:, None] + stride_ckv + dv[None, :], mask=dv[None, :] < D, other=0.0)
    k = k.to(q.dtype)  # an e4m3 cache widens to f16 (exact); a no-op otherwise
    v = v.to(q.dtype)
    if INTERPRET:
        s = _interp_dot(q, k, tl.zeros((q.shape[0], TILE), tl.float32))
    else:
        s = tl.dot(q, k)
    if MASKED:
        vis = valid[:, None] & in_seq[None, :] & (kpos[None, :] <= pos[:, None])
        vis = vis & ((window == 0) | (kpos[None, :] > pos[:, None] - window))
        s = tl.where(vis, s, -float("inf"))
    return s, v


@triton.jit
def _pv(p, v, ones, acc, INTERPRET: tl.constexpr):
    """-> (row sums of bf16(p), bf16(p) @ v + acc), both on the tensor core (see the docstring)."""
    pv = p.to(v.dtype)
    if INTERPRET:
        return tl.sum(pv.to(tl.float32), axis=1), _interp_dot(pv, v, acc)
    else:
        return tl.max(tl.dot(pv, ones), axis=1), tl.dot(pv, v, acc)


@triton.jit
def _pv2(p0, v0, p1, v1, ones, acc, INTERPRET: tl.constexpr):
    """_pv over a tile in two key halves (HALVES): each sum chained through the accumulator
    of its first half's dot, so the tensor core adds the tile's k-chunks in the order one
    dot over the whole tile does (the interpreter's model sums each half whole instead)."""
    pv0 = p0.to(v0.dtype)
    pv1 = p1.to(v1.dtype)
    if INTERPRET:
        rows = tl.sum(pv0.to(tl.float32), axis=1) + tl.sum(pv1.to(tl.float32), axis=1)
        return rows, _interp_dot(pv1, v1, _interp_dot(pv0, v0, acc))
    else:
        return tl.max(tl.dot(pv1, ones, tl.dot(pv0, ones)), axis=1), tl.dot(pv1, v1, tl.dot(pv0, v0, acc))


@triton.jit
def _step(s, v, s1, v1, ones, first, last, M, Ls, ACC, m_i, l_i, acc, qk_scale, ONE: tl.constexpr,
          HALVES: tl.constexpr, INTERPRET: tl.constexpr):
    """One tile's online-softmax step on the segment state (m_i, l_i, acc), reset first when
    the tile opens a segment (`first`) and folded into (M, Ls, ACC) when it closes one
    (`last`). s is unscaled (see below for where the scale goes). HALVES == 2: the tile
    comes as two key halves (s, v) and (s1, v1), the same values a whole tile's would be."""
    if ONE:  # SEG == TILE: every tile is a whole segment, always opened and closed
        # Scaled first: m_t goes straight into _fold's exp2(m_t - base), and a product
        # feeding a subtraction is one the compiler may or may not contract into an fma,
        # per program shape (with m_t = max(s) * scale here, the seg == tile case of
        # test_triton_gpu.py's invariance test failed on the H200).
        s = s * qk_scale
        m_t = tl.max(s, axis=1)
        if HALVES == 2:
            s1 = s1 * qk_scale
            m_t = tl.maximum(m_t, tl.max(s1, axis=1))
        base = tl.where(m_t == -float("inf"), 0.0, m_t)
        p = tl.exp2(s - base[:, None])  # masked -> exactly 0
        if HALVES == 2:
            l_t, acc_t = _pv2(p, v, tl.exp2(s1 - base[:, None]), v1, ones, tl.zeros_like(ACC), INTERPRET)
        else:
            l_t, acc_t = _pv(p, v, ones, tl.zeros_like(ACC), INTERPRET)
        M, Ls, ACC = _fold(M, Ls, ACC, m_t, l_t, acc_t)
    else:
        # The row max scales exactly (rounding is monotone, the scale positive), and m_t
        # reaches the arithmetic only through max/compare, so it is never contracted;
        # exp2 takes an explicit fma(s, scale, -max): one op per score, not two.
        if HALVES == 2:
            m_t = tl.maximum(tl.max(s, axis=1), tl.max(s1, axis=1)) * qk_scale
        else:
            m_t = tl.max(s, axis=1) * qk_scale
        m_i = tl.where(first, -float("inf"), m_i)
        m_new = tl.maximum(m_i, m_t)
        base = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.where(m_t > m_i, tl.exp2(m_i - base), 1.0)  # exactly 1 when nothing new
        alpha = tl.where(first, 0.0, alpha)  # a new segment: acc * 0 = 0 (acc is finite), l too
        p = tl.exp2(tl.fma(s, qk_scale, -base[:, None]))
        if HALVES == 2:
            p1 = tl.exp2(tl.fma(s1, qk_scale, -base[:, None]))
            l_t, acc = _pv2(p, v, p1, v1, ones, acc * alpha[:, None], INTERPRET)
        else:
            l_t, acc = _pv(p, v, ones, acc * alpha[:, None], INTERPRET)
        l_i = l_i * alpha + l_t
        m_i = m_new
        if last:  # folds once per segment, not once per tile
            M, Ls, ACC = _fold(M, Ls, ACC, m_i, l_i, acc)
    return M, Ls, ACC, m_i, l_i, acc


@triton.jit
def _tiles(k_from, k_to, lo, hi, q, pos, valid, bt_row, kv_base, stride_cb, stride_ckv, stride_cp, L, window, dv0,
           qk_scale, ones, M, Ls, ACC, m_i, l_i, acc, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
           BS: tl.constexpr, TILE: tl.constexpr, SEG: tl.constexpr, MASKED: tl.constexpr, HALVES: tl.constexpr,
           INTERPRET: tl.constexpr):
    """The tiles k0 = k_from, k_from + TILE, ... < k_to of the range [lo, hi), one software-pipelined loop.
    HALVES == 2: each tile's K and V loaded and multiplied as two halves of TILE // 2 keys (half
    the operands live at once), folded as one tile."""
    ONE: tl.constexpr = SEG == TILE
    HALF: tl.constexpr = TILE // HALVES
    for k0 in range(k_from, k_to, TILE):
        s, v = _scores(q, pos, valid, k0, bt_row, kv_base, stride_cb, stride_ckv, stride_cp, L, window, dv0,
                       D, BLOCK_D, BLOCK_DV, BS, HALF, MASKED, INTERPRET)
        if HALVES == 2:
            s1, v1 = _scores(q, pos, valid, k0 + HALF, bt_row, kv_base, stride_cb, stride_ckv, stride_cp, L,
                             window, dv0, D, BLOCK_D, BLOCK_DV, BS, HALF, MASKED, INTERPRET)
        else:
            s1, v1 = s, v
        M, Ls, ACC, m_i, l_i, acc = _step(s, v, s1, v1, ones, (k0 == lo) | (k0 % SEG == 0),
                                          (k0 + TILE >= hi) | ((k0 + TILE) % SEG == 0),
                                          M, Ls, ACC, m_i, l_i, acc, qk_scale, ONE, HALVES, INTERPRET)
    return M, Ls, ACC, m_i, l_i, acc


@triton.jit
def _attend(q, pos, valid, lo, hi, full_hi, bt_row, kv_base, stride_cb, stride_ckv, stride_cp, L, window, dv0,
            qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BS: tl.constexpr,
            BLOCK_M: tl.constexpr, TILE: tl.constexpr, SEG: tl.constexpr, HALVES: tl.constexpr,
            INTERPRET: tl.constexpr):
    """Tiles k0 = lo, lo + TILE, ... < hi (lo a multiple of TILE), segment by segment, from the
    empty state -> (M, Ls, ACC [BLOCK_M, BLOCK_DV]: V's columns from dv0). Tiles below full_hi need no mask."""
    M = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    Ls = tl.zeros((BLOCK_M,), tl.float32)
    ACC = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    if INTERPRET:  # unused there (the interpreter has no bf16 constants)
        ones = tl.full((TILE // HALVES, 16), 1.0, tl.float32)
    else:
        ones = tl.full((TILE // HALVES, 16), 1.0, q.dtype)
    mid = tl.maximum(tl.minimum(full_hi, hi), lo)
    M, Ls, ACC, m_i, l_i, acc = _tiles(lo, mid, lo, hi, q, pos, valid, bt_row, kv_base, stride_cb, stride_ckv,
                                       stride_cp, L, window, dv0, qk_scale, ones, M, Ls, ACC, m_i, l_i, acc,
                                       D, BLOCK_D, BLOCK_DV, BS, TILE, SEG, False, HALVES, INTERPRET)
    M, Ls, ACC, m_i, l_i, acc = _tiles(mid, hi, lo, hi, q, pos, valid, bt_row, kv_base, stride_cb, stride_ckv,
                                       stride_cp, L, window, dv0, qk_scale, ones, M, Ls, ACC, m_i, l_i, acc,
                                       D, BLOCK_D, BLOCK_DV, BS, TILE, SEG, True, HALVES, INTERPRET)
    return M, Ls, ACC


@triton.jit
def paged_attention_kernel(q_ptr, stride_qt, stride_qh, cache_ptr, stride_cb, stride_ckv, stride_cp, stride_ch,
                           bt_ptr, stride_bt, seq_lens_ptr, qsl_ptr, num_seqs, out_ptr, stride_ot, stride_oh,
                           ws_acc_ptr, ws_ml_ptr, cnt_ptr, qk_scale, window,
                           H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           BS: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
                           SEG: tl.constexpr, MAX_SEGS: tl.constexpr, SPLIT: tl.constexpr, DECODE: tl.constexpr,
                           INTERPRET: tl.constexpr, MERGE: tl.constexpr = False, PDL: tl.constexpr = False,
                           ROUTE: tl.constexpr = False, HALVES: tl.constexpr = 1, DV_PARTS: tl.constexpr = 1):
    # grid: (q-block bound, or S for DECODE, HKV * DV_PARTS, MAX_SEGS if SPLIT else 1)
    # DV_PARTS (DECODE): program (kvh, part) computes V's columns [part, part + 1) * BLOCK_D / DV_PARTS
    # of its heads (every part the whole scores: the same bits in each; see the module docstring)
    # ROUTE: one of a mixed bucket's two launches (DECODE: its sequences of one query; else the rest)
    # cnt_ptr (MERGE): i32[S, HKV], all 0 when the launch starts and when it ends
    pid, kvh, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    part = kvh % DV_PARTS  # the parts of a KV head are neighbours in launch order (they share its K in L2)
    kvh = kvh // DV_PARTS
    if DECODE:  # one query per sequence: program pid serves sequence pid, no search; its offsets
        s = pid  # and length are step inputs, read before the wait (pdl.py)
        q0 = pdl_step_input(qsl_ptr + s, PDL)
        n = pdl_step_input(qsl_ptr + s + 1, PDL) - q0
        L = pdl_step_input(seq_lens_ptr + s, PDL)
        if ROUTE:  # a mixed bucket's launch for its sequences of one query: the rest are the
            if n != 1:  # other launch's (returns before the wait: nothing of this kernel's read)
                return
        pdl_enter(PDL)  # before any other global access (pdl.py)
    else:
        pdl_enter(PDL)  # before any global access (pdl.py)
        # Heaviest first: the hardware starts programs in launch order (axis 0 fastest), and a
        # causal q block's work grows with its position, so the launch order (q block, KV head)
        # is remapped to (KV head fastest, q blocks from the last): the longest programs start
        # first and the short ones fill the tail (longest-processing-time-first, as
        # FlashAttention walks its m blocks in reverse). A bijection of the grid; bits unchanged.
        nq = tl.num_programs(0)
        lin = kvh * nq + pid
        kvh = lin % HKV
        pid = nq - 1 - lin // HKV
        s = _find_seq(qsl_ptr, num_seqs, pid, BLOCK_Q)
        q0 = tl.load(qsl_ptr + s)
        n = tl.load(qsl_ptr + s + 1) - q0
        L = tl.load(seq_lens_ptr + s)
        if ROUTE:  # a sequence of one query is the decode launch's: empty here (returns below)
            n = tl.where(n == 1, 0, n)
    c = L - n  # position of the sequence's first query
    if DECODE:
        blk = c // BLOCK_Q
    else:
        blk = c // BLOCK_Q + pid - (q0 + s * (2 * BLOCK_Q - 2)) // BLOCK_Q  # absolute q block
    if (n == 0) | (blk * BLOCK_Q > L - 1):
        return
    G: tl.constexpr = H // HKV
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    BLOCK_DV: tl.constexpr = BLOCK_D // DV_PARTS
    dv0 = part * BLOCK_DV
    rows = tl.arange(0, BLOCK_M)
    g = rows % G_PAD
    pos = blk * BLOCK_Q + rows // G_PAD  # [BLOCK_M] query position of each row
    valid = (pos >= c) & (pos < L) & (g < G)
    tok = (q0 + pos - c).to(tl.int64)
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    qmask = valid[:, None] & (d[None, :] < D)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        q = q.to(tl.float16)  # the dots run in f16 over an e4m3 cache (see the module docstring)
    p_min = tl.maximum(blk * BLOCK_Q, c)
    p_max = tl.minimum(blk * BLOCK_Q + BLOCK_Q - 1, L - 1)
    k_lo = tl.where(window > 0, tl.maximum(p_min - window + 1, 0), 0)
    lo = k_lo // TILE * TILE
    hi = p_max + 1
    full_hi = tl.where(window > 0, lo, (p_min + 1) // TILE * TILE)  # tiles every row sees whole
    kv_base = cache_ptr + kvh * stride_ch
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    if SPLIT:
        z_lo = k_lo // SEG
        z_hi = p_max // SEG
        if (z < z_lo) | (z > z_hi):  # no keys in segment z: nothing stored, not counted (MERGE)
            return
        M, Ls, ACC = _attend(q, pos, valid, tl.maximum(lo, z * SEG), tl.minimum(hi, (z + 1) * SEG), full_hi,
                             bt_row, kv_base, stride_cb, stride_ckv, stride_cp, L, window, dv0, qk_scale,
                             D, BLOCK_D, BLOCK_DV, BS, BLOCK_M, TILE, SEG, HALVES, INTERPRET)
        ws = (tok * MAX_SEGS + z) * H + head  # ws_ml: f32[T, MAX_SEGS, H, 2], ws_acc: f32[T, MAX_SEGS, H, D]
        tl.store(ws_ml_ptr + ws * 2, M, mask=valid & (part == 0))  # every part has the same (m, l)
        tl.store(ws_ml_ptr + ws * 2 + 1, Ls, mask=valid & (part == 0))
        dv = dv0 + tl.arange(0, BLOCK_DV)
        tl.store(ws_acc_ptr + ws[:, None] * D + dv[None, :], ACC, mask=valid[:, None] & (dv[None, :] < D))
        if MERGE:  # DECODE: the one query is at position c = L - 1, token q0 (tok of the valid rows)
            _merge_if_last(cnt_ptr + s * HKV + kvh, (z_hi - z_lo + 1) * DV_PARTS, ws_acc_ptr, ws_ml_ptr, z_lo,
                           z_hi, q0.to(tl.int64), kvh, out_ptr, stride_ot, stride_oh, H, HKV, D, BLOCK_D, G_PAD,
                           MAX_SEGS)
    else:
        M, Ls, ACC = _attend(q, pos, valid, lo, hi, full_hi, bt_row, kv_base, stride_cb, stride_ckv, stride_cp, L,
                             window, dv0, qk_scale, D, BLOCK_D, BLOCK_DV, BS, BLOCK_M, TILE, SEG, HALVES, INTERPRET)
        o = _finalize(Ls, ACC)
        dv = dv0 + tl.arange(0, BLOCK_DV)
        dst = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (dv[None, :] < D))


MERGE_CHUNK = tl.constexpr(16)  # segments a merge unrolls (loads in flight together)


@triton.jit
def _merge(ws_acc_ptr, ws_ml_ptr, t, h, hmask, z_lo, z_hi, ROWS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
           BLOCK_D: tl.constexpr, MAX_SEGS: tl.constexpr, CACHE: tl.constexpr):
    """Token t's segments z_lo..z_hi of heads h [ROWS] folded in increasing order -> o [ROWS, BLOCK_D] (f32).
    Elementwise per (head, d): the bits do not depend on ROWS or on which kernel runs it."""
    d = tl.arange(0, BLOCK_D)
    mask = hmask[:, None] & (d[None, :] < D)
    M = tl.full((ROWS,), -float("inf"), tl.float32)
    Ls = tl.zeros((ROWS,), tl.float32)
    ACC = tl.zeros((ROWS, BLOCK_D), tl.float32)
    # Unrolled CHUNK segments at a time so that no load waits on the fold before it (a rolled
    # loop made a batch-1 merge 9 dependent round trips to memory), and rolled over chunks:
    # unrolling all of MAX_SEGS made a 131,072-token bundle (256 segments) take more than 25
    # minutes to compile. Chunks run from the one holding z_lo to the one holding z_hi;
    # segments outside that range load the empty state (m=-inf, l=0, acc=0), whose fold is an
    # exact identity, so the bits equal the unsplit kernel's in-order fold.
    CHUNK: tl.constexpr = MERGE_CHUNK if MAX_SEGS > MERGE_CHUNK else MAX_SEGS
    for c0 in range(z_lo // CHUNK * CHUNK, z_hi + 1, CHUNK):
        for i in tl.static_range(CHUNK):
            z = c0 + i
            live = (z >= z_lo) & (z <= z_hi)
            ws = (t.to(tl.int64) * MAX_SEGS + z) * H + h
            m = tl.load(ws_ml_ptr + ws * 2, mask=hmask & live, other=-float("inf"), cache_modifier=CACHE)
            l = tl.load(ws_ml_ptr + ws * 2 + 1, mask=hmask & live, other=0.0, cache_modifier=CACHE)
            acc = tl.load(ws_acc_ptr + ws[:, None] * D + d[None, :], mask=mask & live, other=0.0,
                          cache_modifier=CACHE)
            M, Ls, ACC = _fold(M, Ls, ACC, m, l, acc)
    return _finalize(Ls, ACC)


@triton.jit
def _merge_if_last(cnt_ptr, n_programs, ws_acc_ptr, ws_ml_ptr, z_lo, z_hi, tok, kvh, out_ptr, stride_ot, stride_oh,
                   H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   G_PAD: tl.constexpr, MAX_SEGS: tl.constexpr):
    """The n_programs programs of one (sequence, KV head) (segments z_lo..z_hi, each in DV_PARTS
    column parts) count themselves in on *cnt_ptr after storing their partials; the last merges
    the group's heads of token tok (all of D) into out and puts the counter back to 0 for the next launch.
    Ordering: the barrier puts every thread's partial stores before thread 0's atomic (Triton
    issues a scalar atomic from one thread and hands its result to all through shared memory),
    whose release publishes them at GPU scope; the last program's acquire (then the CTA
    barrier of that hand-over) orders its loads after every other program's stores, and the
    loads bypass L1 (.cg)."""
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if old == n_programs - 1:
        G: tl.constexpr = H // HKV
        g = tl.arange(0, G_PAD)
        h = kvh * G + g
        hmask = g < G
        o = _merge(ws_acc_ptr, ws_ml_ptr, tok, h, hmask, z_lo, z_hi, G_PAD, H, D, BLOCK_D, MAX_SEGS, ".cg")
        d = tl.arange(0, BLOCK_D)
        dst = out_ptr + tok * stride_ot + h[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & (d[None, :] < D))
        tl.store(cnt_ptr, 0)


@triton.jit
def attention_merge_kernel(ws_acc_ptr, ws_ml_ptr, positions_ptr, n_rows_ptr, out_ptr, stride_ot, stride_oh, window,
                           H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                           SEG: tl.constexpr, MAX_SEGS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # before any global access (pdl.py)
    # grid: (T, cdiv(H, BLOCK_H)); folds token t's segments in increasing order
    t, hb = tl.program_id(0), tl.program_id(1)
    if t >= tl.load(n_rows_ptr):
        return
    pos = tl.load(positions_ptr + t)
    k_lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < H
    o = _merge(ws_acc_ptr, ws_ml_ptr, t, h, hmask, k_lo // SEG, pos // SEG, BLOCK_H, H, D, BLOCK_D, MAX_SEGS, "")
    dst = out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & (d[None, :] < D))
