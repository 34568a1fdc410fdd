"""gguf_gemm: linear_gguf (graph/gguf_ops.py), the weight's GGUF blocks dequantised inside the K loop.

    x: bf16 [M, K], w: u8 [N, RB] (each row K / B blocks of TS bytes: graph/gguf_blocks.py),
    bias: [N] | None  ->  y[m, n] = sum_k x[m, k] * bf16(deq(w)[n, k])  (+ bias), f32 sums

One kernel for decode (M <= 16: the GEMV; narrow tiles so that many programs stream the rows of
blocks, which is all a decode step reads of the weight) and prefill (64- or 128-row tiles). Each
K step dequantises a [BLOCK_K, BLOCK_N] tile of W in registers (_dequant: per element, exactly
graph/gguf_blocks.py's f32 formula, whose products are exact, so fused multiply-adds change no
bit), rounds it to x's dtype as the executor's cast of a weight dequantised at load would, and
chains it into the f32 accumulator with tl.dot, like codegen/triton/gemm.py's K loop. So:
- bits: the bf16 GEMM's (gemm_kernel without split-K) on the weights dequantised at load and
  stored in bf16; tests/codegen/test_gguf_kernels.py checks that under the interpreter.
- invariance (DESIGN): every output element sums its K in increasing order through the dot's
  accumulator, whatever the tile; BLOCK_K only cuts that chain into loads (the interpreter walks
  it in the tensor core's k=16 steps, gemm._dot_acc). No split-K: a decode tile's row has the
  prefill tile's bits, as gemm.py measured for bf16 tiles of 16 and 64+ rows on the H200.
- the f16 fields (d, dmin, m) are read through a second pointer to the same bytes typed f16
  (`wh`): every type's block size TS is even and its f16 fields sit at even offsets, so with
  an even row length they are 2-byte aligned.
On sm_90 the PTX is the bf16 GEMM's: mma.sync m16n8k16 for the 16-row decode tiles, wgmma for
64 rows and more (tests/codegen/test_bundle_gguf.py). Not run or tuned on a GPU yet: the
per-element byte gathers should hit L1 (a block's scales serve 32 or 256 columns), and no split-K
means few programs for a small N at batch 1 (SmolLM2's o_proj: 18 programs of 32 columns).

Padded rows: programs whose first row is >= *n_rows_ptr return at once; rows past it are
garbage the graph never reads. Rows of W past N are clamped to N - 1 (read, never stored).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.gemm import _dot_acc, _store_tile, _tile_ids
from kiln.codegen.triton.launch import (KernelSpec, as_buf, cdiv, check, check_inner_contiguous, dtype_name, launch,
                                        shape_of, sig_type, strides_of)
from kiln.codegen.triton.pdl import pdl_enter, pdl_step_input
from kiln.graph.gguf_blocks import BLOCKS, k_of

QTYPES = tuple(BLOCKS)  # the kernel's QT code is the index here: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K


@dataclass(frozen=True)
class GgufTile:
    """Per bucket: how output tiles are cut; leaves each element's K order alone."""
    block_m: int
    block_n: int
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


def gguf_tile(m: int, arch: str = "sm_90") -> GgufTile:
    """Defaults, not yet tuned on a GPU: decode (the GEMV) 16-row tiles 32 columns wide (more
    programs streaming W's blocks), then 64 x 64, then 128 x 128 (8 warps; sm_121's smaller
    shared memory: 2 stages)."""
    if m <= 16:
        return GgufTile(16, 32)
    if m <= 64:
        return GgufTile(64, 64)
    return GgufTile(128, 128, 32, 8, 3 if arch == "sm_90" else 2)


@triton.jit
def _f16(wh_ptr, byte_off):
    """The f16 field at an even byte offset, as f32 (exact)."""
    return tl.load(wh_ptr + byte_off // 2).to(tl.float32)


@triton.jit
def _byte(w_ptr, off):
    return tl.load(w_ptr + off).to(tl.int32)


@triton.jit
def _dequant(w_ptr, wh_ptr, row, rk, QT: tl.constexpr):
    """f32 [BK, BN]: the weights at columns rk [BK, 1] of the rows starting at byte offsets
    row [1, BN] (int64), by graph/gguf_blocks.py's formulas, element by element."""
    if QT == 0:  # Q8_0: d | q int8 x32
        base = row + (rk // 32) * 34
        q = tl.load(w_ptr + base + 2 + rk % 32).to(tl.int8, bitcast=True).to(tl.float32)
        return q * _f16(wh_ptr, base)
    elif QT == 1:  # Q4_0: d | qs x16
        base = row + (rk // 32) * 18
        e = rk % 32
        nib = (_byte(w_ptr, base + 2 + e % 16) >> ((e // 16) * 4)) & 15
        return _f16(wh_ptr, base) * (nib - 8).to(tl.float32)
    elif QT == 2:  # Q4_1: d | m | qs x16
        base = row + (rk // 32) * 20
        e = rk % 32
        nib = (_byte(w_ptr, base + 4 + e % 16) >> ((e // 16) * 4)) & 15
        return _f16(wh_ptr, base) * nib.to(tl.float32) + _f16(wh_ptr, base + 2)
    elif QT == 3 or QT == 4:  # Q4_K / Q5_K: d | dmin | scales x12 | [qh x32 |] qs x128
        TS: tl.constexpr = 144 if QT == 3 else 176
        base = row + (rk // 256) * TS
        e = rk % 256
        s = e // 32  # sub-block: its 6-bit scale and min (get_scale_min_k4)
        a = _byte(w_ptr, base + 4 + tl.where(s < 4, s, s - 4))
        b = _byte(w_ptr, base + 8 + s)
        c = _byte(w_ptr, base + 4 + s)
        sc = tl.where(s < 4, a & 63, (b & 15) | ((a >> 6) << 4))
        mn = tl.where(s < 4, b & 63, (b >> 4) | ((c >> 6) << 4))
        QS: tl.constexpr = 16 if QT == 3 else 48
        q = (_byte(w_ptr, base + QS + (s // 2) * 32 + e % 32) >> ((s % 2) * 4)) & 15
        if QT == 4:
            q = q | (((_byte(w_ptr, base + 16 + e % 32) >> s) & 1) << 4)
        d = _f16(wh_ptr, base) * sc.to(tl.float32)
        return d * q.to(tl.float32) - _f16(wh_ptr, base + 2) * mn.to(tl.float32)
    else:  # Q6_K: ql x128 | qh x64 | scales int8 x16 | d
        base = row + (rk // 256) * 210
        e = rk % 256
        c = e // 128
        r = e % 128
        lo = (_byte(w_ptr, base + c * 64 + r % 64) >> ((r // 64) * 4)) & 15
        hi = (_byte(w_ptr, base + 128 + c * 32 + r % 32) >> ((r // 32) * 2)) & 3
        sc = tl.load(w_ptr + base + 192 + e // 16).to(tl.int8, bitcast=True).to(tl.float32)
        return (_f16(wh_ptr, base + 208) * sc) * ((lo | (hi << 4)) - 32).to(tl.float32)


@triton.jit
def gguf_gemm_kernel(x_ptr, w_ptr, wh_ptr, bias_ptr, y_ptr, n_rows_ptr, M, stride_xm, stride_ym,
                     N: tl.constexpr, K: tl.constexpr, RB: tl.constexpr, QT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     INTERPRET: tl.constexpr, PDL: tl.constexpr = False):
    n_rows = pdl_step_input(n_rows_ptr, PDL)  # a step input: read before the wait (pdl.py)
    pdl_enter(PDL)  # before any other global access (pdl.py)
    # grid: (cdiv(N, BLOCK_N) * cdiv(M, BLOCK_M),), tiles in gemm._tile_ids' order
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= n_rows:
        return
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)  # [BM] rows of x and y
    rn = off_n + tl.arange(0, BLOCK_N)  # [BN] rows of w
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    row = (tl.minimum(rn, N - 1).to(tl.int64) * RB)[None, :]  # [1, BN] byte offset of each row of blocks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    STEP: tl.constexpr = 16 if INTERPRET else BLOCK_K  # the interpreter: the tensor core's k=16 steps
    for kk in range(0, K, STEP):  # K in increasing order: the invariant
        rk = kk + tl.arange(0, STEP)  # [BK]
        a = tl.load(x_rows + rk[None, :], mask=rm[:, None] < M, other=0.0)  # [BM, BK]
        b = _dequant(w_ptr, wh_ptr, row, rk[:, None], QT).to(x_ptr.dtype.element_ty)  # [BK, BN]
        acc = _dot_acc(a, b, acc, INTERPRET)
    _store_tile(acc, bias_ptr, y_ptr, y_ptr, rm, off_n, M, stride_ym, N, HAS_BIAS, BLOCK_M, BLOCK_N, 0, False)


@triton.jit
def gguf_dequant_kernel(w_ptr, wh_ptr, y_ptr, N, K: tl.constexpr, RB: tl.constexpr, QT: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y: f32 [N, K] = the weights of w's blocks (_dequant's values, unrounded): the in-kernel
    dequantisation on its own, for tests against gguf-py. grid: (cdiv(N, BN), K / BK)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row = (tl.minimum(rn, N - 1).to(tl.int64) * RB)[None, :]
    v = _dequant(w_ptr, wh_ptr, row, rk[:, None], QT)  # [BK, BN]
    tl.store(y_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None], v, mask=(rn < N)[None, :])


def gguf_gemm_spec(m: int, n: int, k: int, qtype: str, *, x_dtype="bfloat16", out_dtype="bfloat16",
                   has_bias=False, stride_xm: int | None = None, stride_ym: int | None = None,
                   tile: GgufTile) -> KernelSpec:
    """The one launch of an [m, k] x deq([n, k])^T GEMM over `qtype` blocks."""
    check(qtype in BLOCKS, f"gguf_gemm: no kernel for GGUF type {qtype!r} (kiln's: {', '.join(BLOCKS)})")
    b, ts = BLOCKS[qtype]
    check(k % b == 0 and k % tile.block_k == 0 and tile.block_k % 16 == 0,
          f"gguf_gemm: K={k} must be whole {qtype} blocks of {b} and whole {tile.block_k}-column steps")
    rb = k // b * ts
    xs, ys = stride_xm or k, stride_ym or n
    div = tuple(a for a, v in (("M", m), ("stride_xm", xs), ("stride_ym", ys)) if v % 16 == 0)
    return KernelSpec(
        module=__name__, kernel="gguf_gemm_kernel",
        signature={"x_ptr": sig_type(x_dtype), "w_ptr": "*u8", "wh_ptr": "*fp16", "bias_ptr": sig_type(x_dtype),
                   "y_ptr": sig_type(out_dtype), "n_rows_ptr": "*i32", "M": "i32", "stride_xm": "i32",
                   "stride_ym": "i32"},
        constexprs=dict(N=n, K=k, RB=rb, QT=QTYPES.index(qtype), HAS_BIAS=has_bias, BLOCK_M=tile.block_m,
                        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m, INTERPRET=False),
        grid=(cdiv(n, tile.block_n) * cdiv(m, tile.block_m),), num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        divisible=("x_ptr", "w_ptr", "wh_ptr", "bias_ptr", "y_ptr", "n_rows_ptr") + div)


def _blocks(w, qtype: str):
    """w: u8 [N, RB] -> (w, the same bytes typed f16, N, K)."""
    w = as_buf(w)
    n, rb = shape_of(w)
    check(dtype_name(w) == "uint8", f"gguf_gemm: w must be u8 blocks, got {dtype_name(w)}")
    check(qtype in BLOCKS, f"gguf_gemm: no kernel for GGUF type {qtype!r} (kiln's: {', '.join(BLOCKS)})")
    check_inner_contiguous(w, "gguf_gemm w", 2)
    k = k_of(qtype, rb)
    if w.on_host:
        wh = as_buf(w.array.view(np.float16))
    else:
        from kiln.codegen.triton.launch import Buf

        wh = Buf(ptr=w.ptr, shape=(n, rb // 2), dtype=np.float16)
    return w, wh, n, k


def gguf_gemm(x, w, bias=None, out=None, *, qtype: str, n_rows=None, tile: GgufTile | None = None,
              arch: str = "sm_90", out_dtype=None):
    """x: bf16 [M, K] (rows may be strided), w: u8 [N, K / B * TS] contiguous rows of `qtype` blocks,
    bias: [N] | None, out: [M, N] (default out_dtype, else x's dtype) -> out. numpy in -> interpreter."""
    x, bias, out, n_rows = map(as_buf, (x, bias, out, n_rows))
    w, wh, n, k = _blocks(w, qtype)
    m, kx = shape_of(x)
    check(kx == k, f"gguf_gemm: x has K={kx}, the {qtype} weight holds K={k}")
    check(dtype_name(x) in ("bfloat16", "float16"), "gguf_gemm: x must be bf16 or f16 (the dot's operands)")
    check_inner_contiguous(x, "gguf_gemm x")
    if out is None:
        out = as_buf(np.empty((m, n), dtype=out_dtype or x.dtype))
    check(shape_of(out) == (m, n), f"gguf_gemm: out must be [{m}, {n}]")
    check_inner_contiguous(out, "gguf_gemm out")
    if bias is not None:
        check(shape_of(bias) == (n,) and dtype_name(bias) == dtype_name(x), f"gguf_gemm: bias must be x's dtype [{n}]")
    if n_rows is None:
        n_rows = as_buf(np.array([m], dtype=np.int32))
    spec = gguf_gemm_spec(m, n, k, qtype, x_dtype=dtype_name(x), out_dtype=dtype_name(out),
                          has_bias=bias is not None, stride_xm=strides_of(x)[0], stride_ym=strides_of(out)[0],
                          tile=tile or gguf_tile(m, arch))
    launch(spec, [x, w, wh, bias if bias is not None else x, out, n_rows, m, strides_of(x)[0], strides_of(out)[0]])
    return out.array if getattr(out, "on_host", False) else out


def gguf_dequant(w, *, qtype: str, out=None):
    """w: u8 [N, K / B * TS] -> f32 [N, K]: the kernel's dequantisation on its own (numpy in -> interpreter)."""
    w, wh, n, k = _blocks(w, qtype)
    out = as_buf(out if out is not None else np.empty((n, k), np.float32))
    check(shape_of(out) == (n, k) and dtype_name(out) == "float32", f"gguf_dequant: out must be f32 [{n}, {k}]")
    bn, bk = 16, 32
    spec = KernelSpec(module=__name__, kernel="gguf_dequant_kernel",
                      signature={"w_ptr": "*u8", "wh_ptr": "*fp16", "y_ptr": "*fp32", "N": "i32"},
                      constexprs=dict(K=k, RB=shape_of(w)[1], QT=QTYPES.index(qtype), BLOCK_N=bn, BLOCK_K=bk),
                      grid=(cdiv(n, bn), k // bk), num_warps=4, num_stages=1, divisible=("w_ptr", "wh_ptr", "y_ptr"))
    launch(spec, [w, wh, out, n])
    return out.array if getattr(out, "on_host", False) else out
