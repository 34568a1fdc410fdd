"""fp8_gemm: linear_fp8 (graph/fp8_ops.py) on FP8 tensor cores, W8A8 with the scales in the
epilogue of each activation group.

    x: e4m3 [M, K], xs: f32 [M, G]  (one activation scale per token per K / G columns)
    w: e4m3 [N, K], ws: f32 [ceil(N / bn), ceil(K / bk)]  (one weight scale per [bn, bk] block)
    y[m, n] = sum over groups j in order of (P_j[m, n] * xs[m, j]) * ws[n // bn, (j K/G) // bk]
              (+ bias[n]), rounded to y's dtype; P_j = x[m, group j] . w[n, group j], f32 sums

The three FP8 layouts kiln runs are the same formula with other (G, bn, bk): block-wise
checkpoints (Qwen3-FP8: bn = bk = 128, G = K / 128, so P_j is one 128-column block; vLLM's
w8a8_block_fp8_matmul walks K the same way, read for its structure, not copied); FP8_DYNAMIC
per channel (bn = 1, bk = K, G = 1: one P over all of K, scaled once); ModelOpt per tensor
(bn = N, bk = K, G = 1, xs the static input scale the quant kernel wrote for every token).

Invariance by construction (DESIGN; gemm.py holds the bf16 argument): each output element's
sums are fixed by the weight alone, never by the bucket:
- the groups are added in order j = 0, 1, ... and each group's P is a chain of tl.dot over
  BLOCK_K-column blocks in increasing order; GK (columns a group) and BLOCK_K come from the
  weight's shape and its scales' layout (fp8_reduction), the same for every bucket; no split-K.
- precision: on sm_90 Triton accumulates e4m3 wgmma chains in the tensor core's reduced-precision
  accumulator unless told otherwise (CUDA backend: max_num_imprecise_acc_default = 2^30). Every
  dot here passes max_num_imprecise_acc = BLOCK_K, so the tensor core's partial over one block
  is added into the f32 accumulator by an f32 add, block by block (DeepSeek-V3 and DeepGEMM
  promote every 128 columns for the same reason). The promotion points are then the weight's.
- the instruction: on sm_90 a 16-row program's e4m3 dot is upcast to f16 and run on mma.sync,
  a 64-row one on e4m3 wgmma, and the two give other bits (docs/GPU_NOTES.md, the e4m3 attention
  dots). So every sm_90 tile has BLOCK_M >= 64 and a multiple of 4 warps (fp8_tile, checked in
  fp8_gemm_specs): decode buckets spend tensor-core work on padded rows so that a token's row is
  the prefill bucket's. sm_121 has no wgmma: every tile there is mma.sync, any BLOCK_M.
- tile shape, warps, stages and GROUP_M only move whole output elements between programs.

The interpreter models the dot as gemm._dot_acc does (an f32 product summed over k), one k=32
step at a time, so its bits do not depend on the tile either (tests/codegen). A group
narrower than the 32 columns an e4m3 dot needs (tiny test checkpoints' 16-column blocks) loads
32 columns masked to the group: the extra products are exact zeros.

Padded rows: programs whose first row is >= *n_rows_ptr return at once; rows past it in a live
program are garbage the graph never reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.gemm import _tile_ids
from kiln.codegen.triton.launch import (KernelSpec, as_buf, cdiv, check, check_inner_contiguous, dtype_name, launch,
                                        next_pow2, shape_of, sig_type, strides_of)
from kiln.codegen.triton.pdl import pdl_enter, pdl_step_input


@dataclass(frozen=True)
class Fp8Reduction:
    """Per weight, for every bucket: the K order of every output element."""
    group_k: int  # columns per activation scale (a group's P is scaled once)
    block_k: int  # columns per tl.dot (and per promotion into the f32 accumulator)


def fp8_reduction(k: int, groups: int) -> Fp8Reduction:
    """128-column dots (the e4m3 wgmma's k32 four times: DeepGEMM's promotion interval), fewer
    where a group is narrower; never fewer than the 32 an e4m3 dot takes."""
    gk = k // groups
    return Fp8Reduction(gk, min(128, max(32, next_pow2(gk))))


@dataclass(frozen=True)
class Fp8Tile:
    """Per bucket: how output tiles are cut; leaves each element's K order alone."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


def fp8_tile(m: int, arch: str = "sm_90") -> Fp8Tile:
    """Defaults (not yet tuned on a GPU). sm_90: 64-row tiles at least (see above), narrow ones
    for decode so that more programs stream W; sm_121 (~99 KiB of shared memory a block, mma.sync
    only): 16-row decode tiles."""
    if arch == "sm_90":
        if m <= 64:
            return Fp8Tile(64, 32 if m <= 16 else 64, 4, 4)
        return Fp8Tile(128, 128, 8, 3)
    if m <= 16:
        return Fp8Tile(16, 32, 4, 4)
    return Fp8Tile(64, 64, 4, 3) if m <= 64 else Fp8Tile(128, 128, 8, 2)


@triton.jit
def _dot_block(a, b, acc, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a [BM, BK] . b [BK, BN], the tensor core's partial over the block promoted into
    the f32 accumulator by one f32 add (max_num_imprecise_acc = BLOCK_K)."""
    if INTERPRET:  # e4m3 -> f32 is exact; the products are exact in f32 (at most 8 significant bits)
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)


@triton.jit
def fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, n_rows_ptr, M, stride_xm, stride_xsm, stride_ym,
                    N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, GK: tl.constexpr,
                    BN_W: tl.constexpr, BK_W: tl.constexpr, KB_W: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    n_rows = pdl_step_input(n_rows_ptr, PDL)  # a step input: read before the wait (pdl.py)
    pdl_enter(PDL)  # before any other global access (pdl.py)
    # grid: (cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M),), tiles in gemm._tile_ids' order
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= n_rows:
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of x, xs and y
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows of w, columns of y
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * K  # [1, BN]; w: [N, K] contiguous (K-major B for wgmma)
    ws_rows = ws_ptr + (rn // BN_W) * KB_W  # [BN]: each column's row of weight scales
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(GROUPS):  # activation groups in K order: the weight's reduction order
        k0 = j * GK
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the group's blocks in increasing order (the interpreter walks them in the e4m3 dot's
        # k=32 steps, which keeps its [BM, 32, BN] product under its tensor size limit)
        STEP: tl.constexpr = 32 if INTERPRET else BLOCK_K
        for kk in range(0, GK, STEP):
            kin = kk + tl.arange(0, STEP)  # [STEP] columns within the group
            rk = k0 + kin
            a = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (kin < GK)[None, :], other=0.0)
            b = tl.load(w_rows + rk[:, None], mask=n_ok[None, :] & (kin < GK)[:, None], other=0.0)
            part = _dot_block(a, b, part, BLOCK_K, INTERPRET)
        xs = tl.load(xs_ptr + rm.to(tl.int64) * stride_xsm + j, mask=m_ok, other=0.0)  # [BM]
        ws = tl.load(ws_rows + k0 // BK_W, mask=n_ok, other=0.0)  # [BN]
        acc += (part * xs[:, None]) * ws[None, :]  # graph/fp8_ops.linear_fp8's order
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemm_spec(m: int, n: int, k: int, groups: int, block: tuple[int, int], *, out_dtype="bfloat16",
                  bias_dtype: str | None = None, stride_xm: int | None = None, stride_ym: int | None = None,
                  tile: Fp8Tile, arch: str = "sm_90") -> KernelSpec:
    """The one launch of an [m, k] x [n, k]^T FP8 GEMM with `groups` activation scales a row and
    weight scales per block = (bn, bk)."""
    bn, bk = block
    red = fp8_reduction(k, groups)
    check(k % groups == 0 and bk % red.group_k == 0,
          f"fp8_gemm: {groups} activation groups of K={k} do not tile the weight's {bk}-column scale blocks")
    check(arch != "sm_90" or (tile.block_m >= 64 and tile.num_warps % 4 == 0),
          f"fp8_gemm: an sm_90 tile needs BLOCK_M >= 64 and warpgroups (e4m3 wgmma in every bucket), got "
          f"{tile.block_m} rows, {tile.num_warps} warps")
    xs, ys = stride_xm or k, stride_ym or n
    div = tuple(a for a, v in (("M", m), ("stride_xm", xs), ("stride_ym", ys)) if v % 16 == 0)
    return KernelSpec(
        module=__name__, kernel="fp8_gemm_kernel",
        signature={"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                   "bias_ptr": sig_type(bias_dtype or out_dtype), "y_ptr": sig_type(out_dtype), "n_rows_ptr": "*i32",
                   "M": "i32", "stride_xm": "i32", "stride_xsm": "i32", "stride_ym": "i32"},
        constexprs=dict(N=n, K=k, GROUPS=groups, GK=red.group_k, BN_W=bn, BK_W=bk, KB_W=cdiv(k, bk),
                        HAS_BIAS=bias_dtype is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                        BLOCK_K=red.block_k, GROUP_M=tile.group_m, INTERPRET=False),
        grid=(cdiv(n, tile.block_n) * cdiv(m, tile.block_m),), num_warps=tile.num_warps,
        num_stages=tile.num_stages, divisible=("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "bias_ptr", "y_ptr",
                                               "n_rows_ptr") + div)


def fp8_gemm(x, xs, w, ws, bias=None, out=None, *, block: tuple[int, int], n_rows=None, tile: Fp8Tile | None = None,
             arch: str = "sm_90", out_dtype=None):
    """x: e4m3 [M, K] (rows may be strided), xs: f32 [M, G] packed, w: e4m3 [N, K] contiguous,
    ws: f32 with one scale per `block` (any shape of that many elements, row-major), bias: [N] |
    None, out: [M, N] (default out_dtype, else bf16) -> out. numpy in -> interpreter."""
    x, xs, w, ws, bias, out, n_rows = map(as_buf, (x, xs, w, ws, bias, out, n_rows))
    (m, k), (n, k2) = shape_of(x), shape_of(w)
    check(k == k2, f"fp8_gemm: x has K={k}, w has K={k2}")
    check(dtype_name(x) == dtype_name(w) == "float8_e4m3fn", "fp8_gemm: x and w must be e4m3")
    check_inner_contiguous(x, "fp8_gemm x")
    check_inner_contiguous(w, "fp8_gemm w", 2)
    check(len(shape_of(xs)) == 2 and shape_of(xs)[0] == m and dtype_name(xs) == "float32",
          f"fp8_gemm: xs must be f32 [{m}, G]")
    check_inner_contiguous(xs, "fp8_gemm xs")
    bn, bk = block
    check(dtype_name(ws) == "float32" and int(np.prod(shape_of(ws))) == cdiv(n, bn) * cdiv(k, bk),
          f"fp8_gemm: ws must be f32 with one scale per [{bn}, {bk}] block of [{n}, {k}]")
    check_inner_contiguous(ws, "fp8_gemm ws", len(shape_of(ws)))
    if out is None:
        import ml_dtypes

        out = as_buf(np.empty((m, n), dtype=out_dtype or ml_dtypes.bfloat16))
    check(shape_of(out) == (m, n), f"fp8_gemm: out must be [{m}, {n}]")
    check_inner_contiguous(out, "fp8_gemm out")
    if bias is not None:
        check(shape_of(bias) == (n,), f"fp8_gemm: bias must be [{n}]")
    if n_rows is None:
        n_rows = as_buf(np.array([m], dtype=np.int32))
    spec = fp8_gemm_spec(m, n, k, shape_of(xs)[1], block, out_dtype=dtype_name(out),
                         bias_dtype=dtype_name(bias) if bias is not None else None, stride_xm=strides_of(x)[0],
                         stride_ym=strides_of(out)[0], tile=tile or fp8_tile(m, arch), arch=arch)
    launch(spec, [x, xs, w, ws, bias if bias is not None else out, out, n_rows, m, strides_of(x)[0],
                  strides_of(xs)[0], strides_of(out)[0]])
    return out.array if getattr(out, "on_host", False) else out
