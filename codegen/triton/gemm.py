"""gemm: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), bf16 in, fp32 accumulate, bf16 or f32 out.

One kernel serves decode (M <= 16: narrow BLOCK_N, many programs streaming W) and
prefill (128x128 tiles). Both paths reduce K the same way, which is the invariance
argument (DESIGN "Invariance by construction"):
- every output element is `acc = tl.dot(x_blk, w_blk, acc)` over K blocks in
  increasing order, the fp32 accumulator chained through the
  dot (never `acc += dot(...)`, which adds a rounding per block). A broadcast
  multiply + tl.sum cannot match the tensor core's bits, so there is no such path.
- split-K (SPLIT_K > 1) cuts K into fixed ranges per weight, each written as an f32
  partial; `gemm_reduce_kernel` sums partials in order 0..S-1, then adds the bias.
  Where M gives enough tiles (prefill; Configs.gemm_fold), FOLD has each program
  compute its tile's splits one after the other, each from zero, and add them in the
  same order in registers: the same bits, no partials, no reduce launch. A tile too large
  for two accumulators (FOLD_MEM) parks the running sum in its own workspace slot instead.
  The splits' ranges are whole blocks of the weight's BLOCK_K (GemmReduction.block_k).
- the K block a program loads at a time (BLOCK_K here: GemmTile.block_k, else the
  weight's) is a schedule knob on the GPU: tl.dot chains its K in k=16 steps through
  the accumulator, so 32, 64 or 128 columns a block give the same sums in the same order.
  The interpreter walks K one k=16 step at a time (_split_acc), so its bits do not depend
  on BLOCK_K either.
- TMA (sm_90, wgmma tiles) loads the same tiles through descriptors instead of pointers.
- tile shape, warps and stages (GemmTile) only move elements between programs.
So row i's output is the same bits for M=1 and M=37: tests/codegen proves it under
the interpreter, test_triton_gpu.py on the GPU. Measured on the H200 (sm_90): decode
tiles (BLOCK_M 16/32, mma.sync) and prefill tiles (BLOCK_M 64/128, wgmma, 4 or 8
warps) give identical rows, and so does BLOCK_K 32/64/128 (the tensor core chains
k=16 steps either way); split-K does change the bits, hence one split per weight.
sm_121 (mma.sync only) is not yet measured.

SwiGLU epilogue (SILU_GROUP = G > 0, passes/fuse_gate_up_silu.py): w is the stacked gate/up
weight [2I, K] stored block-interleaved, rows [g0..g(G-1), u0..u(G-1), gG.., uG.., ...]
(graph/layout.py), so every tile of BLOCK_N (a multiple of 2G) columns holds matching gate and
up columns. The epilogue rounds the f32 sums to y's dtype, as the plain GEMM's store would,
splits each 2G-column group into its gate and up halves, and stores silu_mul's exact f32
formula `g / (1 + exp(-g)) * u` on those rounded values: y is [M, I], tile pid_n writing
columns pid_n * BLOCK_N / 2 on. Permuting columns moves no element's K sum, so the bits are
gemm + silu_mul's, in every bucket (tests/codegen/test_triton_kernels.py). Split-K partials
keep the interleaved columns; gemm_reduce_kernel applies the same epilogue after its sum.

Padded rows: programs whose first row is >= *n_rows_ptr (the live token count, a
device scalar) return at once; rows past it are garbage the graph never reads.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.attention_preamble import to_cache
from kiln.codegen.triton.configs import DEFAULT, Configs, GemmReduction, GemmTile, with_tma
from kiln.codegen.triton.launch import (KernelSpec, as_buf, cdiv, check, check_dtype, check_inner_contiguous,
                                        check_shape, dtype_name, launch, shape_of, sig_type, strides_of)
from kiln.codegen.triton.pdl import pdl_enter, pdl_step_input


@triton.jit
def _dot_acc(a, b, acc, INTERPRET: tl.constexpr):
    if INTERPRET:
        # The interpreter's tl.dot is numpy matmul: wrong for bf16, and for f32 its
        # rounding follows BLAS blocking, i.e. the tile shape. Model the tensor core
        # instead, where each element sums its K in one order whatever the tile: a
        # broadcast product reduced over the middle axis, which numpy accumulates in
        # order k = 0, 1, ... (bf16 -> f32 is exact). _split_acc hands it one k=16
        # step at a time, as the tensor core chains them.
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _split_acc(x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, rn, M, stride_xm, k_start,
               N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               TMA: tl.constexpr, INTERPRET: tl.constexpr):
    """The f32 sums of the tile at rows off_m, columns rn [BN] over one K split [k_start,
    k_start + K_PER_SPLIT), from zero: a split-K partial (or, unsplit, the whole sum).
    TMA: x_desc, w_desc load the tiles, whose columns are then off_n + arange(BN); else the
    pointers do (the descriptors are None), and the columns rn may be any (gemm_rope_kernel)."""
    rm = off_m + tl.arange(0, BLOCK_M)  # [BM] rows of x
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * K  # [1, BN]; w: [N, K] contiguous
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The interpreter walks K in the tensor core's k=16 steps, so BLOCK_K moves no rounding
    # there either (on the GPU tl.dot chains those steps itself).
    STEP: tl.constexpr = 16 if INTERPRET else BLOCK_K
    for kk in range(0, K_PER_SPLIT, STEP):  # K blocks in increasing order: the invariant
        k0 = k_start + kk
        if TMA:
            # The same tiles in the same K order, loaded by the tensor memory accelerator: no
            # address math, no masks (the TMA unit zero-fills rows >= M and columns >= K, as
            # the masks do), the copies issued asynchronously by one thread. Same bits as the
            # pointer loads (the GPU test proves it).
            a = x_desc.load([off_m, k0])  # [BM, BK]
            b = w_desc.load([off_n, k0]).T  # [BK, BN]
        else:
            rk = k0 + tl.arange(0, STEP)  # [BK]
            a = tl.load(x_rows + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            b = tl.load(w_rows + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc = _dot_acc(a, b, acc, INTERPRET)  # [BM, BK] @ [BK, BN] chained into the f32 accumulator
    return acc


@triton.jit
def _silu_mul_epilogue(acc, dtype: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       G: tl.constexpr):
    """acc: f32 [BM, BN] over interleaved columns [g x G, u x G, g x G, ...] -> f32 [BM, BN / 2]
    silu(g) * u, with g and u rounded to `dtype` first (the unfused GEMM's store) and then
    silu_mul.py's formula, so the result rounds to silu_mul_kernel's bits."""
    a = tl.reshape(acc, (BLOCK_M, BLOCK_N // (2 * G), 2, G))  # [BM, groups, gate|up, G]
    a = tl.permute(a, (0, 1, 3, 2))  # [BM, groups, G, gate|up]
    g, u = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_N // 2, 2)))
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _store_tile(acc, bias_ptr, res_ptr, y_ptr, rm, off_n, M, stride_ym, N: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SILU_GROUP: tl.constexpr, HAS_RES: tl.constexpr):
    """y = acc (+ bias), rounded to y's dtype; SILU_GROUP: the SwiGLU epilogue instead (no bias),
    y having N / 2 columns. HAS_RES: y = that rounded value + res (res: [M, N], y's strides),
    in f32 and rounded again: add_rms_norm's residual add, on the value the plain store writes."""
    if SILU_GROUP:  # (None where a compiled spec leaves it out: off)
        h = _silu_mul_epilogue(acc, y_ptr.dtype.element_ty, BLOCK_M, BLOCK_N, SILU_GROUP)
        ro = off_n // 2 + tl.arange(0, BLOCK_N // 2)  # [BN / 2] columns of y
        y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + ro[None, :]
        tl.store(y, h.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (ro[None, :] < N // 2))
    else:
        rn = off_n + tl.arange(0, BLOCK_N)  # [BN] columns of y
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        offs = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if HAS_RES:  # (None where a compiled spec leaves it out: off)
            res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32) + res
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_ids(pid, M, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program pid's tile -> (row block, column block). Programs walk W's column blocks with
    GROUP_M row blocks side by side, so the programs in flight share each W tile through L2
    (N-major order re-read all of W from HBM for every row block: at M = 2,048 that made a
    prefill GEMM memory-bound). One row block (decode): N-major, W's rows spread over all SMs.
    Which program computes a tile never changes its sums."""
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _tile_sums(x_ptr, w_ptr, part_ptr, off_m, off_n, rn, M, stride_xm, pid_k,
               N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
               FOLD: tl.constexpr, FOLD_MEM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, TMA: tl.constexpr, INTERPRET: tl.constexpr):
    """The f32 sums of the tile at rows off_m, columns rn: split pid_k's (a partial), or with FOLD
    every split's, added in order. TMA: the columns are off_n + arange(BN)."""
    # The interpreter takes the pointer path: its numpy model of the dot sums a transposed
    # tile in another order, which would fake a difference.
    tma: tl.constexpr = TMA and not INTERPRET
    x_desc, w_desc = None, None
    if tma:  # built by this program, in the launch's global scratch
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    # this program's split (FOLD: the first; its grid has one program per tile)
    acc = _split_acc(x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, rn, M, stride_xm, pid_k * K_PER_SPLIT,
                     N, K, K_PER_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, tma, INTERPRET)
    if FOLD:
        # The other splits, each from zero, added in order 1..S-1: gemm_reduce_kernel's
        # `acc = p0; acc = acc + p1; ...` on the same f32 values, so the same bits, without the
        # partials' round trip through memory or the reduce launch. (gemm_specs folds only
        # splits of >= 2 K blocks: a one-block split is a bare dot(a, b, 0), and Triton's
        # combine pass rewrites `acc + dot(a, b, 0)` into dot(a, b, acc), another rounding.)
        # A loop, not unrolled: unrolled, ptxas kept a third accumulator live and spilled
        # (128x128 tile, 8 warps, 4 splits: 255 registers and 524 bytes of spills, rolled 154).
        if FOLD_MEM:
            # A tile whose running sum and split accumulator do not fit in registers side by side
            # (128x256, 8 warps: 128 f32 a thread each) parks the running sum in its own slot of
            # the workspace (part[0], which no other program touches) while the next split runs,
            # then adds it back: the same f32 values added in the same order, so the same bits.
            # Its partials still make a round trip through memory, but one program's, within
            # the launch: no second set of programs, no f32 tensor for the norm to read.
            rp = off_m + tl.arange(0, BLOCK_M)
            run = part_ptr + rp.to(tl.int64)[:, None] * N + rn[None, :]
            pmask = (rp[:, None] < M) & (rn[None, :] < N)
            for s in range(1, SPLIT_K):
                tl.store(run, acc, mask=pmask)
                nxt = _split_acc(x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, rn, M, stride_xm, s * K_PER_SPLIT,
                                 N, K, K_PER_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, tma, INTERPRET)
                tl.debug_barrier()  # every thread's store of the running sum before any reload
                acc = tl.load(run, mask=pmask, other=0.0) + nxt
        else:
            for s in range(1, SPLIT_K):
                acc = acc + _split_acc(x_ptr, w_ptr, x_desc, w_desc, off_m, off_n, rn, M, stride_xm,
                                       s * K_PER_SPLIT, N, K, K_PER_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, tma, INTERPRET)
    return acc


@triton.jit
def gemm_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, part_ptr, n_rows_ptr, M, stride_xm, stride_ym,
                N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FOLD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, TMA: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
                SILU_GROUP: tl.constexpr = 0, HAS_RES: tl.constexpr = False, FOLD_MEM: tl.constexpr = False):
    n_rows = pdl_step_input(n_rows_ptr, PDL)  # a step input: read before the wait (pdl.py)
    pdl_enter(PDL)  # before any other global access (pdl.py)
    # grid: (cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M), 1, 1 if FOLD else SPLIT_K), tiles in _tile_ids' order
    pid, pid_k = tl.program_id(0), tl.program_id(2)
    pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= n_rows:
        return
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc = _tile_sums(x_ptr, w_ptr, part_ptr, off_m, off_n, off_n + tl.arange(0, BLOCK_N), M, stride_xm, pid_k,
                     N, K, K_PER_SPLIT, SPLIT_K, FOLD, FOLD_MEM, BLOCK_M, BLOCK_N, BLOCK_K, TMA, INTERPRET)
    rm = off_m + tl.arange(0, BLOCK_M)  # [BM] rows of y
    if SPLIT_K == 1 or FOLD:
        _store_tile(acc, bias_ptr, res_ptr, y_ptr, rm, off_n, M, stride_ym, N, HAS_BIAS, BLOCK_M, BLOCK_N,
                    SILU_GROUP, HAS_RES)
    else:  # part: f32[SPLIT_K, M, N] (SILU_GROUP: still the interleaved columns; the reduce splits them)
        rn = off_n + tl.arange(0, BLOCK_N)  # [BN] columns of the partials
        p = part_ptr + (pid_k * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
        tl.store(p, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _rope_pair_cols(pid_n, j, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """gemm_rope_kernel's columns for tile column j of column block pid_n. BLOCK_N >= D: the
    block's own (whole heads). BLOCK_N < D: half a block from the first half of a head and
    the matching half from its second (RoPE's neox pairs i and i + D/2 in one tile):
    head pid_n // (D / BN), dims i BN/2 + [0, BN/2) and D/2 + i BN/2 + [0, BN/2)."""
    if BLOCK_N >= D:
        return pid_n * BLOCK_N + j
    else:
        W: tl.constexpr = BLOCK_N // 2
        head = pid_n // (D // BLOCK_N)
        i = pid_n % (D // BLOCK_N)
        return head * D + i * W + j % W + (j // W) * (D // 2)


@triton.jit
def _rope_table_rows(cos_ptr, sin_ptr, pos, d1, max_pos, HALF: tl.constexpr):
    """cos, sin [BM, dims d1] at each row's position (1 and 0 where it is out of the tables, as the preamble)."""
    ok = ((pos >= 0) & (pos < max_pos))[:, None]
    toff = pos.to(tl.int64)[:, None] * HALF + d1[None, :]
    return tl.load(cos_ptr + toff, mask=ok, other=1.0), tl.load(sin_ptr + toff, mask=ok, other=0.0)


@triton.jit
def gemm_rope_kernel(x_ptr, w_ptr, bias_ptr, part_ptr, n_rows_ptr, M, stride_xm,
                     q_out_ptr, stride_qo, cache_ptr, stride_cb, stride_ckv, stride_cp, stride_ch,
                     cos_ptr, sin_ptr, positions_ptr, slot_ptr, max_pos,
                     N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FOLD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, TMA: tl.constexpr, INTERPRET: tl.constexpr,
                     H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                     PDL: tl.constexpr = False, FOLD_MEM: tl.constexpr = False):
    """The q/k/v projection with the attention preamble in its epilogue (no q/k norm, full
    rotary, neox pairs): y = x @ w^T (+ bias) over [q heads | k heads | v heads] of D columns,
    rounded to the model's dtype as gemm_kernel stores it, then attention_preamble's RoPE on
    the q and k heads, in its f32 formula, q to q_out [T, H, D], k and v into the paged cache at
    slot_mapping[t] (-1: nothing). The sums are gemm_kernel's (the same K order whichever
    program holds a column), the epilogue the preamble kernel's, so the bits of gemm +
    attention_preamble: one launch and the qkv tensor's round trip less.
    grid: (cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M), 1, 1); split-K only folded (no partials)."""
    n_rows = pdl_step_input(n_rows_ptr, PDL)  # a step input: read before the wait (pdl.py)
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    live = tl.minimum(rm, M - 1)  # the step inputs' rows (the bucket's M entries)
    # Small (decode) tiles read what the epilogue needs before the K loop, where its latency hides:
    # the positions and slots (step inputs: before the PDL wait), the rotary tables' rows. A
    # prefill tile's would hold registers through the loop (a 128 x 256 tile spilled), so it
    # reads them after.
    EARLY: tl.constexpr = BLOCK_M * BLOCK_N <= 2048
    if EARLY:
        pos = pdl_step_input(positions_ptr + live, PDL)  # [BM]
        slot = pdl_step_input(slot_ptr + live, PDL)
    pdl_enter(PDL)  # before any other global access (pdl.py)
    if off_m >= n_rows:
        return
    j = tl.arange(0, BLOCK_N)
    rn = _rope_pair_cols(pid_n, j, BLOCK_N, D)
    # the head and first-half dim of each (x1, x2) pair the epilogue splits the tile into
    NHT: tl.constexpr = BLOCK_N // D if BLOCK_N >= D else 1  # heads in the tile
    W: tl.constexpr = D // 2 if BLOCK_N >= D else BLOCK_N // 2  # first-half dims per head in it
    HALF: tl.constexpr = D // 2
    e = tl.arange(0, NHT * W)
    if BLOCK_N >= D:
        head = pid_n * NHT + e // W  # [NHT W] the head and first-half dim of each (x1, x2) pair below
        d1 = e % W
    else:
        head = pid_n // (D // BLOCK_N) + e * 0
        d1 = (pid_n % (D // BLOCK_N)) * W + e
    if EARLY:
        cs, sn = _rope_table_rows(cos_ptr, sin_ptr, pos, d1, max_pos, HALF)
    acc = _tile_sums(x_ptr, w_ptr, part_ptr, off_m, off_n, rn, M, stride_xm, 0,
                     N, K, K_PER_SPLIT, SPLIT_K, FOLD, FOLD_MEM, BLOCK_M, BLOCK_N, BLOCK_K, TMA, INTERPRET)
    dt = q_out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    if not EARLY:
        pos = tl.load(positions_ptr + live)
        slot = tl.load(slot_ptr + live)
        cs, sn = _rope_table_rows(cos_ptr, sin_ptr, pos, d1, max_pos, HALF)
    x = acc.to(dt).to(tl.float32)  # the qkv tensor gemm_kernel would store, as the preamble reads it
    x1, x2 = tl.split(tl.permute(tl.reshape(x, (BLOCK_M, NHT, 2, W)), (0, 1, 3, 2)))
    x1 = tl.reshape(x1, (BLOCK_M, NHT * W))  # dims d1 of each head, and x2 their partners d1 + D/2
    x2 = tl.reshape(x2, (BLOCK_M, NHT * W))
    # attention_preamble._norm_rope's y = x cs + (sign xp) sn, sign -1 for the first half
    y1 = tl.fma(x1, cs, (-x2) * sn)
    y2 = tl.fma(x2, cs, x1 * sn)
    is_v = head >= H + HKV  # [NHT W]
    y1 = tl.where(is_v[None, :], x1, y1).to(dt)
    y2 = tl.where(is_v[None, :], x2, y2).to(dt)
    rows = (rm[:, None] < M) & (head < H + 2 * HKV)[None, :]  # (a last block of whole heads past N: none)
    is_q = (head < H)[None, :]
    qo = q_out_ptr + rm.to(tl.int64)[:, None] * stride_qo + (head * D + d1)[None, :]
    tl.store(qo, y1, mask=rows & is_q)
    tl.store(qo + HALF, y2, mask=rows & is_q)
    kv = tl.where(is_v, 1, 0)  # K (0) or V (1) half of the cache block
    kvh = tl.where(is_v, head - H - HKV, head - H)
    dst = cache_ptr + (slot // BS).to(tl.int64)[:, None] * stride_cb + (slot % BS)[:, None] * stride_cp \
        + (kv * stride_ckv + kvh * stride_ch + d1)[None, :]
    ct = cache_ptr.dtype.element_ty
    wr = rows & (slot >= 0)[:, None] & (head >= H)[None, :]
    tl.store(dst, to_cache(y1, ct), mask=wr)
    tl.store(dst + HALF, to_cache(y2, ct), mask=wr)


@triton.jit
def gemm_reduce_kernel(part_ptr, bias_ptr, y_ptr, n_rows_ptr, M, stride_ym,
                       N: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
                       SILU_GROUP: tl.constexpr = 0):
    pdl_enter(PDL)  # before any global access (pdl.py)
    # grid: (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)); sums the split-K partials in fixed order
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_rows_ptr):
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc = acc + tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    _store_tile(acc, bias_ptr, y_ptr, y_ptr, rm, pid_n * BLOCK_N, M, stride_ym, N, HAS_BIAS, BLOCK_M, BLOCK_N,
                SILU_GROUP, False)


def fold_through_memory(tile: GemmTile) -> bool:
    """Whether a folded tile parks its running sum in the workspace (gemm_kernel FOLD_MEM)
    rather than in registers: where one f32 [BM, BN] tile takes more than 64 registers a
    thread (Configs.gemm_fold says why 64), two of them would spill."""
    return tile.block_m * tile.block_n // (32 * tile.num_warps) > 64


def needs_workspace(red: GemmReduction, tile: GemmTile, fold: bool) -> bool:
    """Whether a GEMM writes f32 to the workspace f32[S, M, N]: split-K partials (not folded),
    or a folded tile's running sum (fold_through_memory)."""
    return red.split_k > 1 and (not fold or fold_through_memory(tile))


def residual_in_epilogue(m: int, split_k: int, fold: bool) -> bool:
    """Whether an [m, ...] linear_add adds its residual in the GEMM's epilogue: where the program
    stores y itself (split-K 1 or folded) and above 16 rows. At up to 16 rows (decode) the
    residual stays in the norm's launch, as add_rms_norm: there the norm's cost is its latency,
    not its bytes, and the epilogue's residual load would sit at the end of the GEMM's chain."""
    return m > 16 and (split_k == 1 or fold)


def silu_tile(tile: GemmTile, group: int) -> GemmTile:
    """The tile with BLOCK_N widened to a multiple of 2G, so that every program holds whole
    gate/up group pairs for the SwiGLU epilogue (a schedule knob: the sums do not change).
    group 0: the tile as it is."""
    if group and tile.block_n % (2 * group):
        return replace(tile, block_n=-(-tile.block_n // (2 * group)) * 2 * group)
    return tile


def gemm_specs(m: int, n: int, k: int, *, x_dtype="bfloat16", out_dtype="bfloat16", has_bias=False,
               stride_xm: int | None = None, stride_ym: int | None = None,
               tile: GemmTile, red: GemmReduction, silu_group: int = 0, has_res: bool = False) -> list[KernelSpec]:
    """The launches of one GEMM: the main kernel, plus the ordered reduce when split-K, unless
    the tile folds the splits into the main kernel (`tile.fold`, resolved: Configs.gemm_fold).
    silu_group G > 0: the SwiGLU epilogue over a weight interleaved in groups of G rows (the
    output has n / 2 columns); whichever kernel stores y applies it."""
    xs, ys = stride_xm or k, stride_ym or (n // 2 if silu_group else n)
    if silu_group:
        check(not has_bias, "gemm: the SwiGLU epilogue takes no bias")
        check(n % (2 * silu_group) == 0 and tile.block_n % (2 * silu_group) == 0 and 128 % (2 * silu_group) == 0,
              f"gemm: the SwiGLU epilogue needs N ({n}) and BLOCK_N ({tile.block_n}) multiples of 2G = {2 * silu_group}")
    k_per_split = red.k_per_split(k)  # the weight's, whatever the tile
    check(red.split_k == 1 or k_per_split * (red.split_k - 1) < k, "gemm: split_k leaves a split empty")
    bk = tile.block_k or red.block_k
    check(bk % 16 == 0 and (red.split_k == 1 or k_per_split % bk == 0),
          f"gemm: a tile's block_k ({bk}) must be a multiple of 16 that cuts each split's {k_per_split} "
          f"columns into whole blocks")
    fold = bool(tile.fold) and red.split_k > 1
    fold_mem = fold and fold_through_memory(tile)
    check(not has_res or ((red.split_k == 1 or fold) and not silu_group and not has_bias),
          "gemm: the residual epilogue needs the program to store y itself (no split-K partials), no SwiGLU, no bias")
    check(not fold or k_per_split >= 2 * bk,
          f"gemm: fold needs >= 2 K blocks per split (K={k}, block_k={bk}, split_k={red.split_k})")
    t = sig_type
    # the hints launch.hint_ints would add (the autotuner compiles these specs directly)
    div = tuple(a for a, v in (("M", m), ("stride_xm", xs), ("stride_ym", ys)) if v % 16 == 0)
    # TMA's global strides must be multiples of 16 bytes (pointers are 16-byte aligned: `divisible`)
    tma = bool(tile.tma) and xs % 16 == 0 and k % 16 == 0
    ptrs = ("x_ptr", "w_ptr", "bias_ptr", "res_ptr", "y_ptr", "part_ptr", "n_rows_ptr")
    main = KernelSpec(
        module=__name__, kernel="gemm_kernel",
        signature={"x_ptr": t(x_dtype), "w_ptr": t(x_dtype), "bias_ptr": t(x_dtype), "res_ptr": t(out_dtype),
                   "y_ptr": t(out_dtype),
                   "part_ptr": "*fp32", "n_rows_ptr": "*i32", "M": "i32", "stride_xm": "i32", "stride_ym": "i32"},
        constexprs=dict(N=n, K=k, K_PER_SPLIT=k_per_split, HAS_BIAS=has_bias, SPLIT_K=red.split_k, FOLD=fold,
                        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=bk,
                        GROUP_M=tile.group_m, TMA=tma, INTERPRET=False,
                        **({"SILU_GROUP": silu_group} if silu_group else {}), **({"HAS_RES": True} if has_res else {}),
                        **({"FOLD_MEM": True} if fold_mem else {})),
        grid=(cdiv(n, tile.block_n) * cdiv(m, tile.block_m), 1, 1 if fold else red.split_k),
        num_warps=tile.num_warps, num_stages=tile.num_stages, divisible=ptrs + div)
    if red.split_k == 1 or fold:
        return [main]
    reduce = KernelSpec(
        module=__name__, kernel="gemm_reduce_kernel",
        signature={"part_ptr": "*fp32", "bias_ptr": t(x_dtype), "y_ptr": t(out_dtype), "n_rows_ptr": "*i32",
                   "M": "i32", "stride_ym": "i32"},
        constexprs=dict(N=n, HAS_BIAS=has_bias, SPLIT_K=red.split_k, BLOCK_M=32, BLOCK_N=128,
                        **({"SILU_GROUP": silu_group} if silu_group else {})),
        grid=(cdiv(n, 128), cdiv(m, 32)), num_warps=4, num_stages=1,
        divisible=("part_ptr", "bias_ptr", "y_ptr", "n_rows_ptr") + tuple(d for d in div if d != "stride_xm"))
    return [main, reduce]


def gemm(x, w, bias=None, out=None, *, n_rows=None, workspace=None, tile: GemmTile | None = None,
         red: GemmReduction | None = None, configs: Configs = DEFAULT, arch: str = "sm_90", reduce: bool = True,
         silu_group: int = 0, residual=None):
    """x: [M, K] (rows may be strided), w: [N, K] contiguous, bias: [N] | None,
    out: [M, N] bf16 or f32; n_rows: i32[1] live rows (default M); workspace: f32[S, M, N]
    when split-K and not folded, or folded through memory (needs_workspace). numpy arrays in ->
    interpreter; device buffers in -> all must be given. The tile (default configs.gemm_tile's)
    decides TMA loads and whether split-K is folded into the main kernel (configs.gemm_fold;
    tile.fold=None: its rule): either way the same bits. reduce=False (split-K only, not
    folded): leave the partials in the workspace for
    a consumer that reduces them itself (add_rms_norm's x_split). silu_group G > 0: w is a
    gate/up stack interleaved in groups of G rows (graph/layout.py) and out is
    silu(gate) * up: [M, N / 2], the bits of this GEMM's gate and up columns through silu_mul.
    residual: [M, N] in out's dtype and strides (it may be `out` itself): out = y + residual, the
    residual add of add_rms_norm on the value y would be (linear_add; the program must store y:
    no unfolded split-K, no bias, no SwiGLU)."""
    x, w, bias, out, n_rows, workspace, residual = map(as_buf, (x, w, bias, out, n_rows, workspace, residual))
    (m, k), (n, k2) = shape_of(x), shape_of(w)
    check(k == k2, f"gemm: x has K={k}, w has K={k2}")
    check_dtype(x, ("bfloat16", "float16", "float32"), "gemm x")
    check(dtype_name(w) == dtype_name(x), "gemm: x and w dtypes differ")
    check_inner_contiguous(x, "gemm x")
    check_inner_contiguous(w, "gemm w", 2)
    red = red or configs.gemm_reduction(n, k)
    tile = with_tma(tile, arch) if tile else configs.gemm_tile(m, n, k, arch)
    tile = replace(tile, fold=configs.gemm_fold(m, n, k, tile, red, arch))
    check(reduce or not tile.fold, "gemm: reduce=False wants the split-K partials, but this tile folds them")
    check(reduce or not silu_group, "gemm: reduce=False leaves no place for the SwiGLU epilogue")
    n_out = n // 2 if silu_group else n
    if out is None:
        out = as_buf(np.empty((m, n_out), dtype=x.dtype))
    if n_rows is None:
        n_rows = as_buf(np.array([m], dtype=np.int32))
    if bias is not None:
        check_shape(bias, (n,), "gemm bias")
        check(dtype_name(bias) == dtype_name(x), "gemm: bias dtype differs from x")
    check_shape(out, (m, n_out), "gemm out")
    check_inner_contiguous(out, "gemm out")
    if needs_workspace(red, tile, tile.fold):
        if workspace is None:
            check(getattr(out, "on_host", False), f"gemm: split_k={red.split_k} needs a device workspace "
                  f"f32[{red.split_k}, {m}, {n}]")
            workspace = as_buf(np.empty((red.split_k, m, n), dtype=np.float32))
        check_shape(workspace, (red.split_k, m, n), "gemm workspace")
        check_dtype(workspace, ("float32",), "gemm workspace")
    if residual is not None:
        check(shape_of(residual) == shape_of(out) and dtype_name(residual) == dtype_name(out)
              and strides_of(residual) == strides_of(out), "gemm: the residual must have out's shape, dtype and strides")
    specs = gemm_specs(m, n, k, x_dtype=dtype_name(x), out_dtype=dtype_name(out), has_bias=bias is not None,
                       stride_xm=strides_of(x)[0], stride_ym=strides_of(out)[0], tile=tile, red=red,
                       silu_group=silu_group, has_res=residual is not None)
    b = bias if bias is not None else out  # unused when HAS_BIAS is False
    r = residual if residual is not None else out  # unused without HAS_RES
    ws = workspace if workspace is not None else out
    launch(specs[0], [x, w, b, r, out, ws, n_rows, m, strides_of(x)[0], strides_of(out)[0]])
    if len(specs) > 1 and reduce:
        launch(specs[1], [ws, b, out, n_rows, m, strides_of(out)[0]])
    return out.array if getattr(out, "on_host", False) else out


def rope_tile(tile: GemmTile, d: int, red: GemmReduction, k: int) -> GemmTile:
    """The tile gemm_rope_kernel runs: pointer loads where BLOCK_N < D (its columns are two runs
    of a head, not one box; BLOCK_N and D powers of two, so the tile holds whole neox pairs,
    _rope_pair_cols), and split-K folded (the kernel stores no partials), its K block halved
    where a split would hold fewer than two (gemm_specs' fold rule). Schedule knobs only: the
    sums do not change (gemm.py)."""
    if tile.block_n < d and tile.tma:
        tile = replace(tile, tma=False)
    if red.split_k > 1:
        per, bk = red.k_per_split(k), tile.block_k or red.block_k
        while bk > 16 and per < 2 * bk:
            bk //= 2
        check(per >= 2 * bk and per % bk == 0, f"gemm_rope: split-K {red.split_k} of K={k} leaves a split "
              f"too short to fold ({per} columns)")
        tile = replace(tile, fold=True, block_k=bk if bk != red.block_k else tile.block_k)
    return tile


def gemm_rope_specs(m: int, n: int, k: int, *, h: int, hkv: int, d: int, bs: int, dtype: str = "bfloat16",
                    cache_dtype: str | None = None, has_bias: bool = False, stride_xm: int | None = None,
                    stride_qo: int | None = None, tile: GemmTile, red: GemmReduction) -> list[KernelSpec]:
    """The one launch of gemm_rope (rope_tile: split-K folded into it, no partials to reduce)."""
    check(d >= 2 and d & (d - 1) == 0, f"gemm_rope: the head dim ({d}) must be a power of two")
    check(n == (h + 2 * hkv) * d, f"gemm_rope: N={n} is not (H + 2 Hkv) D = {(h + 2 * hkv) * d}")
    tile = rope_tile(tile, d, red, k)
    main = gemm_specs(m, n, k, x_dtype=dtype, out_dtype=dtype, has_bias=has_bias, stride_xm=stride_xm,
                      tile=tile, red=red)[0]
    c = {key: v for key, v in main.constexprs.items() if key not in ("SILU_GROUP", "HAS_RES")}
    t = sig_type
    i32 = lambda *names: {nm: "i32" for nm in names}
    sig = {"x_ptr": t(dtype), "w_ptr": t(dtype), "bias_ptr": t(dtype), "part_ptr": "*fp32", "n_rows_ptr": "*i32",
           **i32("M", "stride_xm"), "q_out_ptr": t(dtype), **i32("stride_qo"), "cache_ptr": t(cache_dtype or dtype),
           **i32("stride_cb", "stride_ckv", "stride_cp", "stride_ch"), "cos_ptr": "*fp32", "sin_ptr": "*fp32",
           "positions_ptr": "*i32", "slot_ptr": "*i32", **i32("max_pos")}
    div = tuple(a for a, v in (("M", m), ("stride_xm", stride_xm or k), ("stride_qo", stride_qo or h * d))
                if v % 16 == 0)
    return [KernelSpec(module=__name__, kernel="gemm_rope_kernel", signature=sig,
                       constexprs=dict(c, H=h, HKV=hkv, D=d, BS=bs), grid=(main.grid[0], 1, 1),
                       num_warps=main.num_warps, num_stages=main.num_stages,
                       divisible=("x_ptr", "w_ptr", "bias_ptr", "part_ptr", "n_rows_ptr", "q_out_ptr", "cache_ptr",
                                  "cos_ptr", "sin_ptr", "positions_ptr", "slot_ptr") + div)]


def gemm_rope(x, w, bias, q_out, cache, positions, slot_mapping, cos, sin, *, h: int, hkv: int, n_rows=None,
              workspace=None, tile: GemmTile | None = None, red: GemmReduction | None = None,
              configs: Configs = DEFAULT, arch: str = "sm_90"):
    """q/k/v projection + attention_preamble (no q/k norm, full rotary, neox) in one launch:
    x: [M, K], w: [(H + 2 Hkv) D, K] (the stacked q, k, v rows), bias: [N] | None ->
    q_out: [M, H, D] (written), cache: [NB, 2, BS, Hkv, D] (k and v written at slot_mapping);
    positions, slot_mapping: i32[M]; cos, sin: f32[max_pos, D / 2]. The same bits as gemm()
    into a qkv tensor followed by attention_preamble on its three views. workspace: f32[S, M, N]
    where a folded split-K tile parks its running sum (needs_workspace)."""
    x, w, bias, q_out, cache, positions, slot_mapping, cos, sin, n_rows, workspace = map(
        as_buf, (x, w, bias, q_out, cache, positions, slot_mapping, cos, sin, n_rows, workspace))
    (m, k), (n, k2) = shape_of(x), shape_of(w)
    check(k == k2, f"gemm_rope: x has K={k}, w has K={k2}")
    check(dtype_name(w) == dtype_name(x) and dtype_name(q_out) == dtype_name(x), "gemm_rope: dtypes differ")
    check_inner_contiguous(x, "gemm_rope x")
    check_inner_contiguous(w, "gemm_rope w", 2)
    nb, two, bs, hkv2, d = shape_of(cache)
    check(two == 2 and hkv2 == hkv, f"gemm_rope: cache {list(shape_of(cache))} is not [NB, 2, BS, {hkv}, D]")
    check(dtype_name(cache) in (dtype_name(x), "float8_e4m3fn"), "gemm_rope: cache dtype")
    check_inner_contiguous(cache, "gemm_rope cache", 2)
    check(shape_of(q_out) == (m, h, d), f"gemm_rope: q_out must be [{m}, {h}, {d}]")
    check_inner_contiguous(q_out, "gemm_rope q_out", 2)
    max_pos, half = shape_of(cos)
    check(2 * half == d and shape_of(sin) == (max_pos, half), "gemm_rope: cos/sin must be f32[max_pos, D / 2] "
          "(full rotary)")
    for b, name in ((positions, "positions"), (slot_mapping, "slot_mapping")):
        check_shape(b, (m,), name)
    if bias is not None:
        check_shape(bias, (n,), "gemm_rope bias")
    red = red or configs.gemm_reduction(n, k)
    tile = with_tma(tile, arch) if tile else configs.gemm_tile(m, n, k, arch)
    tile = rope_tile(tile, d, red, k)
    if needs_workspace(red, tile, bool(tile.fold)):
        if workspace is None:
            check(getattr(q_out, "on_host", False), "gemm_rope: a tile folding through memory needs a workspace")
            workspace = as_buf(np.empty((red.split_k, m, n), dtype=np.float32))
        check_shape(workspace, (red.split_k, m, n), "gemm_rope workspace")
    if n_rows is None:
        n_rows = as_buf(np.array([m], dtype=np.int32))
    spec, = gemm_rope_specs(m, n, k, h=h, hkv=hkv, d=d, bs=bs, dtype=dtype_name(x), cache_dtype=dtype_name(cache),
                            has_bias=bias is not None, stride_xm=strides_of(x)[0], stride_qo=strides_of(q_out)[0],
                            tile=tile, red=red)
    sc = strides_of(cache)
    launch(spec, [x, w, bias if bias is not None else x, workspace if workspace is not None else q_out, n_rows, m,
                  strides_of(x)[0], q_out, strides_of(q_out)[0], cache, sc[0], sc[1], sc[2], sc[3], cos, sin,
                  positions, slot_mapping, max_pos])
    return q_out.array if getattr(q_out, "on_host", False) else q_out
