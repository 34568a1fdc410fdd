"""The MoE expert GEMMs: gate_up with SiLU-and-mul fused, down with the routing weight applied,
and the top-k sum; each in a grouped form (rows sorted by expert, moe_align.py) and a decode
form (one program per assignment and column block, no sorting).

    gate_up: a[r] = silu(bf16(x[t] @ w13[e, :I]^T)) * bf16(x[t] @ w13[e, I:]^T)   a: [T*k, I]
    down:    o[r] = bf16(w2[e] @ a[r])                                           o: [T*k, H]
    sum:     y[t] = ((0 + w[t*k] o[t*k]) + w[t*k+1] o[t*k+1]) + ..., rounded     y: [T, H]
for r = t * k + j, e = topk_ids[t, j], w = topk_weights[t, j]: graph/moe_ops.py moe_experts,
whose every GEMM output is rounded as a dense linear's store (bf16 standing for the activation
dtype; f32 activations round nowhere).

Bits (DESIGN "Invariance by construction"): every output element is one chain of tl.dot over K
in increasing order from 0 (gemm.py's _dot_acc: the tensor core's k=16 steps, walked one at a
time under the interpreter), with no split-K, so an element's sum is fixed by the expert's
weight alone: not by BLOCK_M/N/K, the block a row was sorted into, its place in the tile, or
the rows beside it. The grouped and decode forms share that code (_expert_sums), so a token
gets the same bits whichever form runs and whatever else is in the step (tests/codegen/
test_moe_kernels.py proves it under the interpreter; on the GPU it rests on what gemm.py
measured on the H200: 16-row mma.sync tiles and 64/128-row wgmma tiles give identical rows;
not yet measured for these kernels). The epilogues round where the graph op rounds: gate and
up to the activation dtype (a dense linear's store), silu_mul's formula on them, a rounded
to the dtype; down's sums rounded to the dtype, times the routing weight rounded to f32
(mul.rn: never contracted into the sum's add, which would round once where the op rounds
twice), added from zero in rank order.

The top-k sum is not fused into the grouped down GEMM: a token's k rows sit in k experts'
blocks, computed by different programs in no fixed order, so a fused sum would need atomics
and their order would depend on the batch. The grouped down stores each expert's output o in
the activation dtype (exact: the op rounds it there), and moe_sum_kernel weights and adds a
token's k rows in rank order: half the bytes of f32 products through memory. The decode form of
down does the same per assignment (SPLIT: a program per (column block, assignment), storing o),
so that one token's k experts are k x H / BLOCK_N programs that fill the SMs at batch 1 (issue
37); its other form (not SPLIT, the "decode_token" path) owns all k rows of its token and does
the sum itself, in the same order on the same rounded products: the same bits, one launch and
the rows' round trip less, but H / BLOCK_N programs a token walking its k experts in turn
(latency-bound: 0.9 TB/s on the H200 at batch 1). moe_sum_kernel's SHARED form also does the
shared expert's sigmoid_mul and the add to the routed output (lower.py _defer_moe_sum), so the
split decode path adds no launch to a model with a shared expert.

GGUF experts (QT >= 0, graph/moe_ops.py moe_experts_gguf): w13 and w2 are the experts' rows of
GGUF blocks, u8 [E, 2I, RB] and [E, H, RB'] (RB bytes a row: graph/gguf_blocks.py), and each
K step's weight tile is dequantised in registers (gguf_gemm._dequant, gguf-py's f32 values)
and rounded to the activation dtype before the same tl.dot chain: the bits of these kernels on
the experts dequantised at load and stored in that dtype.

Block-wise FP8 experts (FP8, graph/fp8_ops.py moe_experts_fp8, W8A8 as fp8_gemm.py's linear_fp8):
w13 and w2 are e4m3 with f32 scales per [BN_W, BK_W] block (s13 [E, 2I/BN_W, H/BK_W], s2
[E, H/BN_W, I/BK_W]); gate_up reads x already quantised (e4m3 with its per-token per-BK_W-column
scales: the layer's quant_fp8), down quantises the SiLU-and-mul rows `a` (stored in the activation
dtype, as for bf16 experts) a BK_W-column group at a time as it reads them (_expert_sums_fp8), so
no e4m3 copy of a is written. Each group is one e4m3 dot promoted into the f32 sum, scaled by the
activation's and the weight block's scales in linear_fp8's order, groups in K order. vLLM's fused
MoE does the same arithmetic with a separate per_token_group_quant_fp8 of the intermediate
(vllm/model_executor/layers/fused_moe/fused_moe.py, fused_moe_kernel with block_shape). The sm_90
tensor-core rule of fp8_gemm.py holds here too: every FP8 expert tile has 64 rows at least and
whole warpgroups, the decode form included (its one live row in a 64-row program), so that a
token's row has the same bits in every form (moe.fp8_tiles, Fp8Experts.decode_m).

ModelOpt NVFP4 experts (NV, graph/nvfp4_ops.py moe_experts_nvfp4, W4A16 as nvfp4_gemm.py's
linear_nvfp4): w13 u8 [E, 2I, H/2] and w2 u8 [E, H, I/2] (two e2m1 a byte, low nibble first), their
e4m3 block scales per 16 columns (ws) and f32 per-tensor scales (ws2: [E, 2], the gate's and the up's;
[E, 1]). Each K step's tile is dequantised in registers (nvfp4_gemm._e2m1 times the block scale,
exact in bf16) before the same tl.dot chain as bf16 experts; the per-tensor scale multiplies the
f32 sums once, then the epilogues as for bf16 experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from kiln.codegen.triton.fp8_gemm import _dot_block
from kiln.codegen.triton.gemm import _dot_acc, _tile_ids
from kiln.codegen.triton.gguf_gemm import QTYPES, _dequant
from kiln.codegen.triton.nvfp4_gemm import _e2m1
from kiln.graph.gguf_blocks import row_bytes
from kiln.codegen.triton.launch import KernelSpec, cdiv, sig_type
from kiln.codegen.triton.moe_align import moe_align_capacity
from kiln.codegen.triton.pdl import pdl_enter


@dataclass(frozen=True)
class MoeTile:
    """Schedule knobs of the MoE GEMMs, per bucket: none changes a sum (module docstring).
    block_m is also the align step's block: the grouped form's rows per program. The decode
    form always takes 16-row tiles (the smallest tl.dot) holding one live row."""
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # row blocks that walk the weight's column blocks together (gemm._tile_ids)


@triton.jit
def _mul_rn(a, b, INTERPRET: tl.constexpr):
    """f32 a * b rounded to nearest, never fused into a later add: fp fusion would make it an
    FMA in moe_down_kernel's decode sum and not in moe_sum_kernel's. PTX mul.rn is never
    contracted; inline, because libdevice's mul_rn compiles to mul.rn.ftz (denormals flushed)."""
    if INTERPRET:
        return a * b
    else:
        a, b = tl.broadcast(a, b)
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _w_tile(w_ptr, w_rows, rn, rk, dt, N: tl.constexpr, K: tl.constexpr, QT: tl.constexpr):
    """The [BK, BN] weight tile at columns rk of rows rn: loaded, or (QT >= 0) dequantised from
    the rows of GGUF blocks at byte offsets w_rows and rounded to dt."""
    if QT >= 0:
        return _dequant(w_ptr, w_ptr.to(tl.pointer_type(tl.float16)), w_rows, rk[:, None], QT).to(dt)
    else:
        return tl.load(w_ptr + w_rows + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)


@triton.jit
def _w_tile_nv(w_ptr, s_ptr, rn, k0, dt, N: tl.constexpr, K: tl.constexpr, STEP: tl.constexpr):
    """NVFP4 (NV): the [STEP, BN] weight tile at columns k0.. of rows rn, from their packed e2m1
    bytes [N, K/2] (column 2j in byte j's low nibble) times their e4m3 block scales [N, K/16],
    rounded to dt: exact (nvfp4_gemm.py: at most 6 significant bits). The per-tensor scale is not
    here: it multiplies the f32 sums once (linear_nvfp4's order)."""
    n_ok = rn < N
    rows = rn.to(tl.int64)[:, None]
    rb = k0 // 2 + tl.arange(0, STEP // 2)
    code = tl.load(w_ptr + rows * (K // 2) + rb[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
    w = tl.interleave(_e2m1(code & 15), _e2m1(code >> 4))  # [BN, STEP]
    rg = k0 // 16 + tl.arange(0, STEP // 16)  # the step's scale groups: one load each, then broadcast
    sc = tl.load(s_ptr + rows * (K // 16) + rg[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (rn.shape[0], STEP // 16, 16)), (rn.shape[0], STEP))
    return tl.trans((w * sc).to(dt))


@triton.jit
def _expert_sums(x_rows, row_ok, w_ptr, w2_ptr, rn, N: tl.constexpr, K: tl.constexpr, TWO: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
                 QT: tl.constexpr = -1, RB: tl.constexpr = 0, xs_rows=None, ws_w=None, ws_w2=None,
                 FP8: tl.constexpr = False, BN_W: tl.constexpr = 1, BK_W: tl.constexpr = 1,
                 QUANT_A: tl.constexpr = False, MIN_SCALE: tl.constexpr = 0.0, NV: tl.constexpr = False,
                 g_w=None, g_w2=None):
    """f32 [BM, BN] sums x_rows . w[rn] over K from 0 in increasing order (TWO: also against
    w2, the up rows of the same expert, sharing the x loads). x_rows: [BM] pointers to rows of
    K elements, row_ok: [BM]; w_ptr, w2_ptr: an expert's [N, K] rows (packed), or with QT >= 0
    its [N, RB] rows of GGUF blocks (rows past N clamped: read, never stored); rn: [BN].
    FP8: block-wise e4m3 experts (_expert_sums_fp8). NV: NVFP4 experts, w_ptr, w2_ptr their packed
    rows, ws_w, ws_w2 their e4m3 block scales, g_w, g_w2 their f32 per-tensor scales (on the sums)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        acc, acc2 = _expert_sums_fp8(x_rows, row_ok, w_ptr, w2_ptr, rn, xs_rows, ws_w, ws_w2, acc, acc2, N, K, TWO,
                                     BLOCK_M, INTERPRET, BN_W, BK_W, QUANT_A, MIN_SCALE)
    else:  # (an if/else: the compiler lowers what follows a constexpr branch's return too)
        if QT >= 0:
            w_rows = tl.minimum(rn, N - 1).to(tl.int64)[None, :] * RB  # [1, BN] byte offsets
        else:
            w_rows = rn.to(tl.int64)[None, :] * K  # [1, BN]
        STEP: tl.constexpr = 16 if INTERPRET else BLOCK_K  # gemm._split_acc says why
        for k0 in range(0, K, STEP):
            rk = k0 + tl.arange(0, STEP)
            a = tl.load(x_rows[:, None] + rk[None, :], mask=row_ok[:, None] & (rk[None, :] < K), other=0.0)
            if NV:
                acc = _dot_acc(a, _w_tile_nv(w_ptr, ws_w, rn, k0, a.dtype, N, K, STEP), acc, INTERPRET)
                if TWO:
                    acc2 = _dot_acc(a, _w_tile_nv(w2_ptr, ws_w2, rn, k0, a.dtype, N, K, STEP), acc2, INTERPRET)
            else:
                acc = _dot_acc(a, _w_tile(w_ptr, w_rows, rn, rk, a.dtype, N, K, QT), acc, INTERPRET)
                if TWO:
                    acc2 = _dot_acc(a, _w_tile(w2_ptr, w_rows, rn, rk, a.dtype, N, K, QT), acc2, INTERPRET)
        if NV:  # the per-tensor scales, once on the f32 sums
            acc = acc * tl.load(g_w)
            if TWO:
                acc2 = acc2 * tl.load(g_w2)
    return acc, acc2


@triton.jit
def _expert_sums_fp8(x_rows, row_ok, w_ptr, w2_ptr, rn, xs_rows, ws_w, ws_w2, acc, acc2, N: tl.constexpr,
                     K: tl.constexpr, TWO: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr,
                     BN_W: tl.constexpr, BK_W: tl.constexpr, QUANT_A: tl.constexpr, MIN_SCALE: tl.constexpr):
    """_expert_sums of block-wise FP8 experts (graph/fp8_ops.py moe_experts_fp8, W8A8 as linear_fp8):
    w_ptr, w2_ptr e4m3 [N, K] rows; ws_w, ws_w2 their f32 scales [N / BN_W, K / BK_W]. For each
    BK_W-column group j in K order: P = x[:, group] . w[rn, group] as one e4m3 dot (fp8_gemm's
    _dot_block: promoted into f32 once a group), then acc += (P * xs[:, j]) * ws[rn // BN_W, j],
    linear_fp8's order. The activations: QUANT_A False, x_rows are e4m3 rows with f32 scales at
    xs_rows[j] (quant_fp8's output); QUANT_A, x_rows are rows in the activation dtype (the SiLU-and-
    mul a) quantised here a group at a time as graph/fp8_ops.quantize_fp8 and fp8_quant._quantize_row
    do: s = max(amax / 448, MIN_SCALE), q = clamp(x / s, +-448) to e4m3, both divisions div_rn.
    Each column program quantises its rows again: the same bits, the [T*k, I] e4m3 copy never stored.
    A group narrower than the 32 columns an e4m3 dot takes loads 32 masked to the group (zeros)."""
    GP: tl.constexpr = 32 if BK_W < 32 else BK_W  # the group's columns, padded
    KB: tl.constexpr = K // BK_W  # groups (K is whole groups)
    kin = tl.arange(0, GP)
    kok = kin < BK_W
    w_rows = rn.to(tl.int64)[None, :] * K  # [1, BN]
    ws_rows = (tl.minimum(rn, N - 1) // BN_W) * KB  # [BN]: each column's row of scales (past N: read, unused)
    n_ok = rn < N
    for j in range(KB):
        rk = j * BK_W + kin
        a = tl.load(x_rows[:, None] + rk[None, :], mask=row_ok[:, None] & kok[None, :], other=0.0)
        if QUANT_A:
            af = a.to(tl.float32)
            amax = tl.max(tl.abs(af), axis=1)  # [BM]; exact in any order
            xs = tl.maximum(tl.div_rn(amax, tl.full((BLOCK_M,), 448.0, tl.float32)), MIN_SCALE)
            q = tl.div_rn(af, tl.broadcast_to(xs[:, None], (BLOCK_M, GP)))
            a = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)
        else:
            xs = tl.load(xs_rows + j, mask=row_ok, other=0.0)  # [BM]
        b = tl.load(w_ptr + w_rows + rk[:, None], mask=n_ok[None, :] & kok[:, None], other=0.0)
        part = _dot_block(a, b, tl.zeros_like(acc), GP, INTERPRET)
        acc += (part * xs[:, None]) * tl.load(ws_w + ws_rows + j)[None, :]
        if TWO:
            b2 = tl.load(w2_ptr + w_rows + rk[:, None], mask=n_ok[None, :] & kok[:, None], other=0.0)
            part2 = _dot_block(a, b2, tl.zeros_like(acc2), GP, INTERPRET)
            acc2 += (part2 * xs[:, None]) * tl.load(ws_w2 + ws_rows + j)[None, :]
    return acc, acc2


@triton.jit
def _rows(pid_m, r_dec, sorted_ptr, block_expert_ptr, ids_ptr, NUM_ROWS, BLOCK_M: tl.constexpr,
          DECODE: tl.constexpr):
    """A program's assignment rows [BM] (flat r = t * k + j; NUM_ROWS: none) and their expert.
    Grouped: block pid_m of the sorted rows. Decode: assignment r_dec alone, in row 0."""
    lane = tl.arange(0, BLOCK_M)
    if DECODE:
        rows = tl.where(lane == 0, r_dec, NUM_ROWS)
        e = tl.load(ids_ptr + r_dec)
    else:
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + lane)
        e = tl.load(block_expert_ptr + pid_m)
    return rows, e.to(tl.int64)


@triton.jit
def moe_gate_up_kernel(x_ptr, w_ptr, a_ptr, ids_ptr, sorted_ptr, block_expert_ptr, n_post_ptr, n_rows_ptr,
                       EM, NUM_ROWS, stride_x, xs_ptr, ws_ptr, stride_xs, ws2_ptr,
                       I: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DECODE: tl.constexpr,
                       INTERPRET: tl.constexpr, PDL: tl.constexpr = False, QT: tl.constexpr = -1,
                       RB: tl.constexpr = 0, FP8: tl.constexpr = False, BN_W: tl.constexpr = 1,
                       BK_W: tl.constexpr = 1, NV: tl.constexpr = False):
    # x: [T, H] (rows strided); w: [E, 2I, H] (gate rows, then up rows; QT >= 0: [E, 2I, RB] GGUF
    # blocks); a: [T*k, I] packed
    # FP8: x e4m3 with scales xs f32 [T, H / BK_W] (rows strided by stride_xs), w e4m3 with scales
    # ws f32 [E, 2I / BN_W, H / BK_W]; NV (NVFP4): w u8 [E, 2I, H/2], ws e4m3 [E, 2I, H/16] block
    # scales, ws2 f32 [E, 2] the gate's and the up's per-tensor scales; unused pointers are placeholders
    # grid: grouped (cdiv(EM, BM) * cdiv(I, BN),); decode (cdiv(I, BN), T*k)
    pdl_enter(PDL)  # before any global access (pdl.py)
    if DECODE:
        pid_m, pid_n, r_dec = 0, tl.program_id(0), tl.program_id(1)
        # the expert id first (in bounds for every program, used only by a live one), so that its
        # load and n_rows' are in flight together: the weight addresses wait on both
        rows, e = _rows(pid_m, r_dec, sorted_ptr, block_expert_ptr, ids_ptr, NUM_ROWS, BLOCK_M, DECODE)
        if r_dec // TOPK >= tl.load(n_rows_ptr):
            return
    else:
        pid_m, pid_n = _tile_ids(tl.program_id(0), EM, I, BLOCK_M, BLOCK_N, GROUP_M)
        r_dec = 0
        if pid_m * BLOCK_M >= tl.load(n_post_ptr):
            return
        rows, e = _rows(pid_m, r_dec, sorted_ptr, block_expert_ptr, ids_ptr, NUM_ROWS, BLOCK_M, DECODE)
    ok = rows < NUM_ROWS
    tok = (tl.where(ok, rows, 0) // TOPK).to(tl.int64)  # [BM]: token t of r
    x_rows = x_ptr + tok * stride_x
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ROW: tl.constexpr = RB if QT >= 0 else H // 2 if NV else H  # w's elements a row
    wg = w_ptr + e * (2 * I * ROW)
    # the scales of an expert's gate (or up) rows: FP8 one per [BN_W, BK_W] block, NV one per 16 columns
    SR: tl.constexpr = I * (H // 16) if NV else (H // BK_W) * (I // BN_W)
    wsg = ws_ptr + e * (2 * SR)
    g, u = _expert_sums(x_rows, ok, wg, wg + I * ROW, rn, I, H, True, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, QT, RB,
                        xs_ptr + tok * stride_xs, wsg, wsg + SR, FP8, BN_W, BK_W, False, 0.0, NV,
                        ws2_ptr + e * 2, ws2_ptr + e * 2 + 1)
    dt = a_ptr.dtype.element_ty
    g = g.to(dt).to(tl.float32)  # what a dense gate_up linear would store
    u = u.to(dt).to(tl.float32)
    act = g / (1.0 + tl.exp(-g)) * u  # silu_mul.py's formula
    dst = a_ptr + rows.to(tl.int64)[:, None] * I + rn[None, :]
    tl.store(dst, act.to(dt), mask=ok[:, None] & (rn[None, :] < I))


@triton.jit
def moe_down_kernel(a_ptr, w_ptr, tw_ptr, o_ptr, y_ptr, ids_ptr, sorted_ptr, block_expert_ptr, n_post_ptr,
                    n_rows_ptr, EM, NUM_ROWS, stride_y, ws_ptr, ws2_ptr,
                    I: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DECODE: tl.constexpr,
                    INTERPRET: tl.constexpr, PDL: tl.constexpr = False, QT: tl.constexpr = -1,
                    RB: tl.constexpr = 0, SPLIT: tl.constexpr = False, FP8: tl.constexpr = False,
                    BN_W: tl.constexpr = 1, BK_W: tl.constexpr = 1, MIN_SCALE: tl.constexpr = 0.0,
                    NV: tl.constexpr = False):
    # FP8: w e4m3 [E, H, I] with scales ws f32 [E, H / BN_W, I / BK_W]; a (the activation dtype) is
    # quantised per row per BK_W columns as the K loop reads it (_expert_sums_fp8); NV (NVFP4): w u8
    # [E, H, I/2], ws e4m3 [E, H, I/16], ws2 f32 [E, 1]; unused pointers are placeholders
    # a: [T*k, I] packed; w: [E, H, I] (QT >= 0: [E, H, RB] GGUF blocks); tw: f32[T*k] routing weights
    # grouped: o: [T*k, H] packed (the dtype's), grid (cdiv(EM, BM) * cdiv(H, BN),); tw, y unused
    # decode, SPLIT: o as grouped, a program per (column block, assignment), grid (cdiv(H, BN), T*k)
    # decode, not SPLIT: y: [T, H] (rows strided), the token's k rows summed in rank order, grid (cdiv(H, BN), T)
    pdl_enter(PDL)  # before any global access (pdl.py)
    ROW: tl.constexpr = RB if QT >= 0 else I // 2 if NV else I  # w's elements a row
    SR: tl.constexpr = H * (I // 16) if NV else ((H + BN_W - 1) // BN_W) * (I // BK_W)  # an expert's scales
    if DECODE and not SPLIT:
        pid_n, t = tl.program_id(0), tl.program_id(1)
        if t >= tl.load(n_rows_ptr):
            return
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(TOPK):  # rank order, from zero (moe_sum_kernel's order)
            rows, e = _rows(0, t * TOPK + j, sorted_ptr, block_expert_ptr, ids_ptr, NUM_ROWS, BLOCK_M, True)
            ok = rows < NUM_ROWS
            acc, _ = _expert_sums(a_ptr + rows.to(tl.int64) * I, ok, w_ptr + e * (H * ROW), w_ptr, rn, H, I, False,
                                  BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, QT, RB, ws_ptr, ws_ptr + e * SR, ws_ptr,
                                  FP8, BN_W, BK_W, True, MIN_SCALE, NV, ws2_ptr + e, ws2_ptr)
            o = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # the expert's output, as a linear stores it
            y = y + _mul_rn(tl.load(tw_ptr + t * TOPK + j), o, INTERPRET)
        lane = tl.arange(0, BLOCK_M)
        dst = y_ptr + t.to(tl.int64) * stride_y + lane[:, None] * 0 + rn[None, :]  # row 0 holds the token
        tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=(lane[:, None] == 0) & (rn[None, :] < H))
    else:
        if DECODE:  # SPLIT: one assignment r_dec, in row 0; its token's rank-order sum is moe_sum_kernel's
            pid_m, pid_n, r_dec = 0, tl.program_id(0), tl.program_id(1)
            rows, e = _rows(pid_m, r_dec, sorted_ptr, block_expert_ptr, ids_ptr, NUM_ROWS, BLOCK_M, DECODE)
            if r_dec // TOPK >= tl.load(n_rows_ptr):  # (the id loaded first: moe_gate_up_kernel says why)
                return
        else:
            pid_m, pid_n = _tile_ids(tl.program_id(0), EM, H, BLOCK_M, BLOCK_N, GROUP_M)
            r_dec = 0
            if pid_m * BLOCK_M >= tl.load(n_post_ptr):
                return
            rows, e = _rows(pid_m, r_dec, sorted_ptr, block_expert_ptr, ids_ptr, NUM_ROWS, BLOCK_M, DECODE)
        ok = rows < NUM_ROWS
        safe = tl.where(ok, rows, 0).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, _ = _expert_sums(a_ptr + safe * I, ok, w_ptr + e * (H * ROW), w_ptr, rn, H, I, False,
                              BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET, QT, RB, ws_ptr, ws_ptr + e * SR, ws_ptr,
                              FP8, BN_W, BK_W, True, MIN_SCALE, NV, ws2_ptr + e, ws2_ptr)
        # the expert's output, as a linear stores it (moe_sum_kernel weights it)
        tl.store(o_ptr + safe[:, None] * H + rn[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=ok[:, None] & (rn[None, :] < H))


@triton.jit
def moe_sum_row(o_ptr, tw_ptr, x_ptr, gate_ptr, stride_gt, t, cols, m, dt: tl.constexpr, H: tl.constexpr,
                TOPK: tl.constexpr, SHARED: tl.constexpr, INTERPRET: tl.constexpr):
    """Token t's MoE layer output at `cols` (mask m), rounded to dt: moe_sum_kernel's row, and
    the row rms_norm_kernel / fp8_quant_kernel sum in place of x when the lowering hands them the
    layer's sum (lower.py _norm_takes_moe_sum). One body for every kernel that computes it, so a
    token's bits do not depend on which launch ran its sum.
    o: [T*k, H] packed (a token's k rows adjacent, in rank order); tw: f32[T*k]. SHARED: + the
    shared expert's x * sigmoid(gate) (models/moe.py: sigmoid_mul then add), with
    gdn.sigmoid_mul_kernel's formula and roundings (HAS_ADD, GATE_PER_HEAD): x: [T, H] packed,
    gate: [T, 1] (rows strided by stride_gt)."""
    src = o_ptr + t.to(tl.int64) * (TOPK * H) + cols
    y = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOPK):  # rank order from zero: graph/moe_ops.py's `y += w_j * o_j`
        o = tl.load(src + j * H, mask=m, other=0.0).to(tl.float32)
        y = y + _mul_rn(tl.load(tw_ptr + t * TOPK + j), o, INTERPRET)
    out = y.to(dt)  # the routed experts' output, rounded as moe_experts rounds it
    if SHARED:
        x = tl.load(x_ptr + t.to(tl.int64) * H + cols, mask=m, other=0.0).to(tl.float32)
        gt = tl.load(gate_ptr + t.to(tl.int64) * stride_gt).to(tl.float32)
        sg = (1.0 / (1.0 + tl.exp(-gt))).to(dt).to(tl.float32)
        out = (out.to(tl.float32) + (x * sg).to(dt).to(tl.float32)).to(dt)
    return out


@triton.jit
def moe_sum_kernel(o_ptr, tw_ptr, y_ptr, n_rows_ptr, stride_y, x_ptr, gate_ptr, stride_gt,
                   H: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
                   PDL: tl.constexpr = False, SHARED: tl.constexpr = False):
    # grid: (T, cdiv(H, BLOCK)); y: [T, H] (rows strided); the row: moe_sum_row (o, tw, and with
    # SHARED the shared expert's x and gate)
    pdl_enter(PDL)  # before any global access (pdl.py)
    t, pid = tl.program_id(0), tl.program_id(1)
    if t >= tl.load(n_rows_ptr):
        return
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    out = moe_sum_row(o_ptr, tw_ptr, x_ptr, gate_ptr, stride_gt, t, cols, m, y_ptr.dtype.element_ty, H, TOPK,
                      SHARED, INTERPRET)
    tl.store(y_ptr + t.to(tl.int64) * stride_y + cols, out, mask=m)


def _gemm_spec(kernel: str, sig: dict, n_out: int, t: int, top_k: int, e: int, h: int, i: int, *,
               tile: MoeTile, decode: bool, qtype: str | None = None, split: bool = False,
               fp8: Fp8Experts | None = None, nvfp4: bool = False) -> KernelSpec:
    bm = (fp8.decode_m if fp8 else 16) if decode else tile.block_m
    if fp8:
        fp8.check(tile, bm, h, i)
    if decode:  # gate_up, and split down: a program per (column block, assignment); down: per (column block, token)
        grid = (cdiv(n_out, tile.block_n), t * top_k if kernel == "moe_gate_up_kernel" or split else t, 1)
    else:
        grid = (cdiv(moe_align_capacity(t, top_k, e, bm), bm) * cdiv(n_out, tile.block_n), 1, 1)
    return KernelSpec(
        module=__name__, kernel=kernel, signature=sig,
        constexprs=dict(I=i, H=h, TOPK=top_k, BLOCK_M=bm, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                        GROUP_M=tile.group_m, DECODE=decode, INTERPRET=False, **({"SPLIT": True} if split else {}),
                        **(_gguf_constexprs(qtype, h if kernel == "moe_gate_up_kernel" else i, tile) if qtype else {}),
                        **(fp8.constexprs(kernel) if fp8 else {}),
                        **(_nvfp4_constexprs(h if kernel == "moe_gate_up_kernel" else i, tile) if nvfp4 else {})),
        grid=grid, num_warps=tile.num_warps, num_stages=tile.num_stages,
        divisible=tuple(n for n in sig if n.endswith("_ptr")))


@dataclass(frozen=True)
class Fp8Experts:
    """Block-wise FP8 experts (graph/fp8_ops.py moe_experts_fp8): the weights' [bn, bk] scale blocks,
    the intermediate's min_scale (quantize_fp8's zero guard), the target arch (whose tensor-core
    rule sets the decode form's rows: fp8_gemm.py's module docstring)."""
    block: tuple[int, int]
    min_scale: float = 0.0
    arch: str = "sm_90"

    @property
    def decode_m(self) -> int:
        """sm_90: 64 rows (e4m3 wgmma) in the decode form too, so that a token's row gets the grouped
        form's bits (a 16-row e4m3 dot is an f16 mma.sync there: other bits); sm_121: 16."""
        return 64 if self.arch == "sm_90" else 16

    def check(self, tile: MoeTile, bm: int, h: int, i: int) -> None:
        bn, bk = self.block
        if h % bk or i % bk or i % bn or bk & (bk - 1) or bk > 128:
            raise ValueError(f"moe: FP8 experts of H={h}, I={i} need whole [{bn}, {bk}] blocks, bk a power of "
                             f"two up to 128")
        if self.arch == "sm_90" and (bm < 64 or tile.num_warps % 4):
            raise ValueError(f"moe: an sm_90 FP8 expert tile needs BLOCK_M >= 64 and warpgroups (e4m3 wgmma "
                             f"in every bucket), got {bm} rows, {tile.num_warps} warps")

    def constexprs(self, kernel: str) -> dict:
        bn, bk = self.block
        return dict(FP8=True, BN_W=bn, BK_W=bk, **({"MIN_SCALE": self.min_scale} if kernel == "moe_down_kernel"
                                                    else {}))


def _nvfp4_constexprs(k: int, tile: MoeTile) -> dict:
    """NVFP4 experts: K whole 16-column scale groups and whole K steps (the tile has no K mask)."""
    if k % 16 or k % tile.block_k:
        raise ValueError(f"moe: NVFP4 experts of K={k} need whole 16-column groups and {tile.block_k}-column steps")
    return dict(NV=True)


def _gguf_constexprs(qtype: str, k: int, tile: MoeTile) -> dict:
    """QT and RB of a GGUF weight whose rows hold K = k weights (K whole blocks and whole K steps)."""
    if k % tile.block_k:
        raise ValueError(f"moe: K={k} is not whole {tile.block_k}-column steps")
    return dict(QT=QTYPES.index(qtype), RB=row_bytes(qtype, k))


_META = {"ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "n_post_ptr": "*i32",
         "n_rows_ptr": "*i32", "EM": "i32", "NUM_ROWS": "i32"}


def moe_gate_up_spec(t: int, top_k: int, e: int, h: int, i: int, dtype: str = "bfloat16", *, tile: MoeTile,
                     decode: bool, qtype: str | None = None, fp8: Fp8Experts | None = None,
                     nvfp4: bool = False) -> KernelSpec:
    """x [T, H] through w13 [E, 2I, H] (qtype: [E, 2I, RB] GGUF blocks; fp8: e4m3 x and w13 with
    their scales; nvfp4: u8 [E, 2I, H/2] with e4m3 block and f32 per-tensor scales) -> a [T*k, I] in
    dtype: grouped over moe_align's blocks, or decode."""
    p = sig_type(dtype)
    w = "*fp8e4nv" if fp8 else "*u8" if qtype or nvfp4 else p
    x = "*fp8e4nv" if fp8 else p
    sig = {"x_ptr": x, "w_ptr": w, "a_ptr": p, **_META, "stride_x": "i32",
           "xs_ptr": "*fp32" if fp8 else x, "ws_ptr": "*fp32" if fp8 else "*fp8e4nv" if nvfp4 else w,
           "stride_xs": "i32", "ws2_ptr": "*fp32" if nvfp4 else w}
    return _gemm_spec("moe_gate_up_kernel", sig, i, t, top_k, e, h, i, tile=tile, decode=decode, qtype=qtype,
                      fp8=fp8, nvfp4=nvfp4)


def moe_down_spec(t: int, top_k: int, e: int, h: int, i: int, dtype: str = "bfloat16", *, tile: MoeTile,
                  decode: bool, qtype: str | None = None, split: bool = False,
                  fp8: Fp8Experts | None = None, nvfp4: bool = False) -> KernelSpec:
    """a [T*k, I] through w2 [E, H, I] (qtype: [E, H, RB] GGUF blocks; fp8: e4m3 w2 with its scales,
    a quantised in the K loop): grouped, or decode with split -> o [T*k, H] (then moe_sum); decode
    without -> y [T, H]."""
    if split and not decode:
        raise ValueError("moe: split is a decode form of down")
    p = sig_type(dtype)
    w = "*fp8e4nv" if fp8 else "*u8" if qtype or nvfp4 else p
    sig = {"a_ptr": p, "w_ptr": w, "tw_ptr": "*fp32", "o_ptr": p, "y_ptr": p, **_META,
           "stride_y": "i32", "ws_ptr": "*fp32" if fp8 else "*fp8e4nv" if nvfp4 else w,
           "ws2_ptr": "*fp32" if nvfp4 else w}
    return _gemm_spec("moe_down_kernel", sig, h, t, top_k, e, h, i, tile=tile, decode=decode, qtype=qtype,
                      split=split, fp8=fp8, nvfp4=nvfp4)


def moe_sum_spec(t: int, top_k: int, h: int, dtype: str = "bfloat16", *, block: int = 1024,
                 num_warps: int = 4, shared: str | None = None) -> KernelSpec:
    """The rank-order sum of each token's k weighted expert rows; shared: the shared expert's
    gate dtype, its sigmoid_mul and the add to the routed output done here too (moe_sum_kernel)."""
    block = min(block, 1 << max(4, (h - 1).bit_length()))
    p = sig_type(dtype)
    return KernelSpec(module=__name__, kernel="moe_sum_kernel",
                      signature=dict(o_ptr=p, tw_ptr="*fp32", y_ptr=p, n_rows_ptr="*i32", stride_y="i32", x_ptr=p,
                                     gate_ptr=sig_type(shared) if shared else p, stride_gt="i32"),
                      constexprs=dict(H=h, TOPK=top_k, BLOCK=block, INTERPRET=False,
                                      **({"SHARED": True} if shared else {})),
                      grid=(t, cdiv(h, block)), num_warps=num_warps, num_stages=1,
                      divisible=("o_ptr", "tw_ptr", "y_ptr", "n_rows_ptr", "x_ptr"))
