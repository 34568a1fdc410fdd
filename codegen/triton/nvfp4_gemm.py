"""nvfp4_gemm: linear_nvfp4 (graph/nvfp4_ops.py) as a W4A16 GEMM: ModelOpt NVFP4 weights
dequantised inside the K loop, bf16 tensor-core math, f32 accumulation. sm_90 has no FP4 MMA,
so this is what Hopper runs (vLLM does the same through Marlin's FP4 path there).

    x:   bf16 [M, K]   (rows may be strided)
    w:   u8 [N, K/2]   two e2m1 values a byte, column 2j in byte j's low nibble
    ws:  e4m3 [N, K/16], ws2: f32 [1]
    y[m, n] = ws2 * sum_k x[m, k] * (e2m1[n, k] * ws[n, k // 16])  (+ bias[n]), rounded to y's dtype

Each K block: the packed bytes [BN, BK/2] are split into their nibbles, decoded to f32
(_e2m1, the format's bit fields), interleaved back into column order (low nibble first), times
their block scales, and cast to x's dtype. That cast is exact: an e2m1 value has 2 significant
bits and an e4m3 scale 4, so their product has at most 6 (bf16 keeps 8), and the exponents stay
inside bf16's range. So the tensor core multiplies exactly the reference's W = e2m1 * ws and the
only difference from numpy is the order of the f32 sums; ws2 multiplies the f32 accumulator
once, as the reference does, then the bias.

Invariance (DESIGN; gemm.py holds the argument): every output element is one chain
`acc = tl.dot(x_blk, w_blk, acc)` over K in increasing order, no split-K, so a row's bits do not
depend on the bucket, and the tile (nvfp4_tile) only moves whole elements between programs. The
interpreter walks K one k=16 step at a time (gemm._dot_acc models the tensor core's chain), so
its bits do not depend on BLOCK_K either (tests/codegen/test_nvfp4_kernels.py).

Padded rows: programs whose first row is >= *n_rows_ptr return at once; rows past it in a live
program are garbage the graph never reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.gemm import _dot_acc, _tile_ids
from kiln.codegen.triton.launch import (KernelSpec, as_buf, cdiv, check, check_inner_contiguous, dtype_name, launch,
                                        shape_of, sig_type, strides_of)
from kiln.codegen.triton.pdl import pdl_enter, pdl_step_input

GROUP = 16  # e2m1 values per e4m3 block scale


@dataclass(frozen=True)
class Nvfp4Tile:
    """Per bucket: how output tiles are cut (never the K order)."""
    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


SM90_MAX_ROWS = 32  # mma.sync tiles only on sm_90 (nvfp4_tile, moe.nvfp4_tiles)


def nvfp4_tile(m: int, arch: str = "sm_90") -> Nvfp4Tile:
    """Defaults, not yet tuned on a GPU: decode (M <= 16) narrow column tiles so that many programs
    stream the packed weight; prefill wider tiles. sm_121 (~99 KiB of shared memory a block) keeps
    fewer stages. On sm_90 every tile has at most 32 rows, so every bucket runs mma.sync: on the
    H100 a 64-row (wgmma) tile of the dequantised W4A16 operand gave other bits than the 16- and
    32-row (mma.sync) tiles for a few outputs (~1 bf16 ulp, 36 of 153,600 in the NVFP4 MoE experts
    probe, bench/moe_tile_bits_probe.py), where bf16 weights loaded from memory give one set of bits
    in both forms; a token's row must not depend on its bucket (DESIGN "Invariance by construction")."""
    stages = 3 if arch == "sm_90" else 2
    if m <= 16:
        return Nvfp4Tile(16, 32, 128, 4, stages)
    if arch == "sm_90":
        return Nvfp4Tile(SM90_MAX_ROWS, 64 if m <= 64 else 128, 64, 4, stages)
    if m <= 64:
        return Nvfp4Tile(64, 64, 64, 4, stages)
    return Nvfp4Tile(128, 128, 64, 8, stages)


@triton.jit
def _e2m1(code):
    """int32 e2m1 codes (0..15) -> f32, from the format's bit fields: bit 3 sign, bits 2-1 the
    exponent (bias 1), bit 0 the mantissa. A normal value 2^(e-1) * (1 + m/2) is the f32 with
    exponent field e - 1 + 127 and top mantissa bit m, i.e. the bits (126 << 23) + (code & 7) << 22;
    exponent 0 is subnormal: m * 0.5."""
    mag = code & 7
    normal = ((126 << 23) + (mag << 22)).to(tl.float32, bitcast=True)
    v = tl.where(mag >= 2, normal, mag.to(tl.float32) * 0.5)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def nvfp4_gemm_kernel(x_ptr, w_ptr, ws_ptr, ws2_ptr, bias_ptr, y_ptr, n_rows_ptr, M, stride_xm, stride_ym,
                      N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    n_rows = pdl_step_input(n_rows_ptr, PDL)  # a step input: read before the wait (pdl.py)
    pdl_enter(PDL)  # before any other global access (pdl.py)
    # grid: (cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M),), tiles in gemm._tile_ids' order
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= n_rows:
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of x and y
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows of w, columns of y
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * (K // 2)  # [BN, 1]; w: [N, K/2] contiguous
    ws_rows = ws_ptr + rn.to(tl.int64)[:, None] * (K // 16)  # [BN, 1]; ws: [N, K/16] contiguous
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    STEP: tl.constexpr = 16 if INTERPRET else BLOCK_K  # the interpreter: the tensor core's k=16 steps
    for k0 in range(0, K, STEP):  # K blocks in increasing order: the invariant
        rk = k0 + tl.arange(0, STEP)  # [BK] columns
        a = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)  # [BM, BK]
        rb = k0 // 2 + tl.arange(0, STEP // 2)  # [BK / 2] bytes
        packed = tl.load(w_rows + rb[None, :], mask=n_ok[:, None] & (rb < K // 2)[None, :], other=0)
        code = packed.to(tl.int32)  # [BN, BK / 2]
        w = tl.interleave(_e2m1(code & 15), _e2m1(code >> 4))  # [BN, BK]: column 2j low nibble, 2j+1 high
        rg = k0 // 16 + tl.arange(0, STEP // 16)  # [BK / 16] scale groups
        s = tl.load(ws_rows + rg[None, :], mask=n_ok[:, None] & (rg < K // 16)[None, :], other=0.0)
        s = tl.reshape(tl.broadcast_to(s.to(tl.float32)[:, :, None], (BLOCK_N, STEP // 16, 16)), (BLOCK_N, STEP))
        b = (w * s).to(x_ptr.dtype.element_ty)  # exact: <= 6 significant bits
        acc = _dot_acc(a, tl.trans(b), acc, INTERPRET)  # [BM, BK] @ [BK, BN] chained into f32
    acc = acc * tl.load(ws2_ptr)  # the per-tensor scale, once on the f32 sums (the reference's order)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def nvfp4_gemm_spec(m: int, n: int, k: int, *, x_dtype="bfloat16", out_dtype=None, bias_dtype: str | None = None,
                    stride_xm: int | None = None, stride_ym: int | None = None, tile: Nvfp4Tile) -> KernelSpec:
    """The one launch of an [m, k] x NVFP4 [n, k]^T GEMM."""
    check(k % GROUP == 0, f"nvfp4_gemm: K={k} is not a multiple of the {GROUP}-value scale groups")
    check(tile.block_k % GROUP == 0 and tile.block_m >= 16, f"nvfp4_gemm: bad tile {tile}")
    out_dtype = out_dtype or x_dtype
    xs, ys = stride_xm or k, stride_ym or n
    div = tuple(a for a, v in (("M", m), ("stride_xm", xs), ("stride_ym", ys)) if v % 16 == 0)
    return KernelSpec(
        module=__name__, kernel="nvfp4_gemm_kernel",
        signature={"x_ptr": sig_type(x_dtype), "w_ptr": "*u8", "ws_ptr": "*fp8e4nv", "ws2_ptr": "*fp32",
                   "bias_ptr": sig_type(bias_dtype or out_dtype), "y_ptr": sig_type(out_dtype), "n_rows_ptr": "*i32",
                   "M": "i32", "stride_xm": "i32", "stride_ym": "i32"},
        constexprs=dict(N=n, K=k, HAS_BIAS=bias_dtype is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                        BLOCK_K=tile.block_k, GROUP_M=tile.group_m, INTERPRET=False),
        grid=(cdiv(n, tile.block_n) * cdiv(m, tile.block_m),), num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        divisible=("x_ptr", "w_ptr", "ws_ptr", "ws2_ptr", "bias_ptr", "y_ptr", "n_rows_ptr") + div)


def nvfp4_gemm(x, w, ws, ws2, bias=None, out=None, *, n_rows=None, tile: Nvfp4Tile | None = None,
               arch: str = "sm_90"):
    """x: [M, K] bf16 (rows may be strided), w: u8 [N, K/2], ws: e4m3 [N, K/16], ws2: f32 [1], all
    contiguous; bias: [N] | None; out: [M, N] (default x's dtype) -> out. numpy in -> interpreter."""
    x, w, ws, ws2, bias, out, n_rows = map(as_buf, (x, w, ws, ws2, bias, out, n_rows))
    (m, k), (n, kb) = shape_of(x), shape_of(w)
    check(kb * 2 == k and dtype_name(w) == "uint8", f"nvfp4_gemm: w must be u8 [N, {k // 2}] for x's K={k}")
    check(shape_of(ws) == (n, k // GROUP) and dtype_name(ws) == "float8_e4m3fn",
          f"nvfp4_gemm: ws must be e4m3 [{n}, {k // GROUP}]")
    check(int(np.prod(shape_of(ws2))) == 1 and dtype_name(ws2) == "float32", "nvfp4_gemm: ws2 must be one f32")
    check_inner_contiguous(x, "nvfp4_gemm x")
    check_inner_contiguous(w, "nvfp4_gemm w", 2)
    check_inner_contiguous(ws, "nvfp4_gemm ws", 2)
    if out is None:
        out = as_buf(np.empty((m, n), dtype=x.np_dtype if hasattr(x, "np_dtype") else x.dtype))
    check(shape_of(out) == (m, n), f"nvfp4_gemm: out must be [{m}, {n}]")
    check_inner_contiguous(out, "nvfp4_gemm out")
    if bias is not None:
        check(shape_of(bias) == (n,), f"nvfp4_gemm: bias must be [{n}]")
    if n_rows is None:
        n_rows = as_buf(np.array([m], dtype=np.int32))
    spec = nvfp4_gemm_spec(m, n, k, x_dtype=dtype_name(x), out_dtype=dtype_name(out),
                           bias_dtype=dtype_name(bias) if bias is not None else None, stride_xm=strides_of(x)[0],
                           stride_ym=strides_of(out)[0], tile=tile or nvfp4_tile(m, arch))
    launch(spec, [x, w, ws, ws2, bias if bias is not None else out, out, n_rows, m, strides_of(x)[0],
                  strides_of(out)[0]])
    return out.array if getattr(out, "on_host", False) else out
