"""FP8 activation quantisation, alone or fused into the op that produces the activation:
quant_fp8, rms_norm_quant, add_rms_norm_quant and silu_mul_quant (graph/fp8_ops.py), one
program per row.

Each kernel computes its producer's row exactly as the unfused kernel stores it (rms_norm.py's
norm, silu_mul.py's SwiGLU, rounded to the storage dtype), then quantises that row as
graph/fp8_ops.quantize_fp8 does, with the same IEEE operations in the same order:

    dynamic  s = max(amax / 448, min_scale) per `group` columns (amax over the rounded values;
             min_scale is the zero guard: a zero group gets min_scale and quantises to zeros)
    static   s = the largest of the given [1] input scales, the same for every token
    q        = clamp(x / s, -448, 448) rounded to e4m3 (round to nearest even)

Both divisions are `div_rn` (correctly rounded, as numpy divides): Triton's `/` on f32 compiles
to an approximate division on the GPU, which would move a value across an e4m3 rounding
boundary now and then. max is exact in any order, so the scale is the reference's bits; the
e4m3 values are too wherever the producer's row is (for quant_fp8 always).

Rows: the whole row sits in one program (BLOCK = next_pow2(N)), which the norm needs for its
mean anyway; the row is cut into its groups by a reshape, so `group` is a power of two or the
whole row (per-token scales); the group count need not be one (the row's padding makes whole
groups whose scales are not stored). Programs of tokens >= *n_rows_ptr return at once. No sum but the
norm's crosses a program, and the norm's order is rms_norm.py's (fixed by N), so the output does
not depend on the bucket.

MoE (add_rms_norm_quant's moe=, as rms_norm.py's): x is a MoE layer's expert rows o [T*k, N],
and the row added to the residual is their rank-order sum (moe_gemm.py moe_sum_row), the layer's
moe_sum launch saved.

Shapes: x, residual, gate, up: [T, N] in the model's dtype (row strides free, columns packed);
w: [N]; q: e4m3 [T, N]; s: f32 [T, N / group] (dynamic) or [T, 1] (static); res_out: [T, N].
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.configs import DEFAULT, Configs, RowConfig
from kiln.codegen.triton.launch import (KernelSpec, as_buf, check, check_inner_contiguous, check_shape, dtype_name,
                                        launch, next_pow2, shape_of, sig_type, strides_of)
from kiln.codegen.triton.moe import moe_sum_operands
from kiln.codegen.triton.moe_gemm import moe_sum_row
from kiln.codegen.triton.pdl import pdl_enter, pdl_step_input

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = tl.constexpr(448.0)  # e4m3fn's largest finite value
MODES = {"quant": 0, "rms_norm": 1, "add_rms_norm": 2, "silu_mul": 3}  # the producer fused in front


@triton.jit
def _quantize_row(y, cols, mask, q_row, s_row, s_ptr0, s_ptr1, s_ptr2, min_scale,
                  N_STATIC: tl.constexpr, GROUPS: tl.constexpr, GW: tl.constexpr, BLOCK: tl.constexpr):
    """y: f32 [BLOCK], the row's values (exactly representable in the storage dtype; 0 past N)
    -> e4m3 at q_row[cols], the scales at s_row[0:GROUPS] (static: s_row[0]). GW: columns per group
    (BLOCK when GROUPS == 1); the row is cut into BLOCK // GW groups, a power of two, of which the
    first GROUPS are real (N = GROUPS * GW need not be a power of two: 5,120 = 40 x 128)."""
    if N_STATIC > 0:
        s = tl.load(s_ptr0)
        if N_STATIC > 1:
            s = tl.maximum(s, tl.load(s_ptr1))
        if N_STATIC > 2:
            s = tl.maximum(s, tl.load(s_ptr2))
        q = tl.minimum(tl.maximum(tl.div_rn(y, s + tl.zeros_like(y)), -FP8_MAX), FP8_MAX)
        tl.store(q_row + cols, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_row, s)
    else:
        GP: tl.constexpr = BLOCK // GW  # groups in the padded row (a power of two)
        g = tl.reshape(y, (GP, GW))  # [GP, GW]; a group past N holds zeros
        amax = tl.max(tl.abs(g), axis=1)  # [GP]; exact in any order
        s = tl.maximum(tl.div_rn(amax, tl.full((GP,), FP8_MAX, tl.float32)), min_scale)
        q = tl.div_rn(g, tl.broadcast_to(s[:, None], (GP, GW)))
        q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
        tl.store(q_row + cols, tl.reshape(q, (BLOCK,)).to(tl.float8e4nv), mask=mask)
        gi = tl.arange(0, GP)
        tl.store(s_row + gi, s, mask=gi < GROUPS)


@triton.jit
def fp8_quant_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, n_rows_ptr, s_ptr0, s_ptr1, s_ptr2,
                     stride_x, stride_r, stride_q, stride_s, stride_o, eps, offset, min_scale,
                     tw_ptr, sx_ptr, gate_ptr, stride_gt,
                     N: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr, GW: tl.constexpr,
                     MODE: tl.constexpr,
                     N_STATIC: tl.constexpr, PDL: tl.constexpr = False, MOE_TOPK: tl.constexpr = 0,
                     MOE_SHARED: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    n_rows = pdl_step_input(n_rows_ptr, PDL)  # a step input: read before the wait (pdl.py)
    pdl_enter(PDL)  # before any other global access (pdl.py)
    # grid: (T,). MODE 0: y = x; 1: rms_norm(x, w); 2: rms_norm(x + r, w), x + r to res_out;
    # 3: silu(x) * r (x = gate, r = up). x's element type is the storage dtype.
    # MOE_TOPK > 0 (MODE 2): x is o [T*k, N], a MoE layer's expert rows, and x's row is their
    # sum weighted by tw f32[T*k] (+ sx [T, N] * sigmoid(gate [T, 1]) with MOE_SHARED): moe_sum_row.
    t = tl.program_id(0)
    if t >= n_rows:
        return
    t64 = t.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dt = x_ptr.dtype.element_ty
    if MOE_TOPK > 0:
        x = moe_sum_row(x_ptr, tw_ptr, sx_ptr, gate_ptr, stride_gt, t, cols, mask, dt, N, MOE_TOPK, MOE_SHARED,
                        INTERPRET)
    else:
        x = tl.load(x_ptr + t64 * stride_x + cols, mask=mask, other=0.0)
    if MODE == 0:
        y = x.to(tl.float32)
    elif MODE == 3:  # silu_mul.py's formula, rounded as its store rounds
        g = x.to(tl.float32)
        u = tl.load(r_ptr + t64 * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * u).to(dt).to(tl.float32)
    else:  # rms_norm.py's norm, step for step
        if MODE == 2:
            res = tl.load(r_ptr + t64 * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(dt)  # the new residual
            tl.store(res_out_ptr + t64 * stride_o + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / N
        rstd = 1.0 / tl.sqrt_rn(var + eps)
        xn = (xf * rstd).to(dt).to(tl.float32)  # rounded before the weight (HF)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (xn * (w + offset)).to(dt).to(tl.float32)  # what rms_norm would store
    _quantize_row(y, cols, mask, q_ptr + t64 * stride_q, s_ptr + t64 * stride_s, s_ptr0, s_ptr1, s_ptr2,
                  min_scale, N_STATIC, GROUPS, GW, BLOCK)


def fp8_quant_spec(t: int, n: int, group: int, dtype: str = "bfloat16", *, mode: str, n_static: int,
                   config: RowConfig, moe_topk: int = 0, moe_shared: str | None = None) -> KernelSpec:
    """group: columns per scale (ignored when n_static > 0: one scale per token). moe_topk > 0
    (mode add_rms_norm): x is a MoE layer's expert rows, summed here; moe_shared: the shared
    expert's gate dtype, its product added too (module docstring)."""
    block = next_pow2(n)  # = next_pow2(groups) * group for a power-of-two group: the norm's BLOCK either way
    groups = 1 if n_static or group == n else n // group
    check(n_static <= 3, "fp8_quant: at most 3 static input scales")
    check(groups == 1 or (n % group == 0 and group & (group - 1) == 0),
          f"fp8_quant: a group ({group}) must be a power of two dividing N ({n}), or N itself")
    check(not moe_topk or mode == "add_rms_norm", "fp8_quant: a MoE layer's sum goes only into add_rms_norm")
    p = sig_type(dtype)
    moe = dict(MOE_TOPK=moe_topk, INTERPRET=False, **({"MOE_SHARED": True} if moe_shared else {})) if moe_topk else {}
    return KernelSpec(
        module=__name__, kernel="fp8_quant_kernel",
        signature=dict(x_ptr=p, r_ptr=p, w_ptr=p, q_ptr="*fp8e4nv", s_ptr="*fp32", res_out_ptr=p,
                       n_rows_ptr="*i32", s_ptr0="*fp32", s_ptr1="*fp32", s_ptr2="*fp32",
                       **{s: "i32" for s in ("stride_x", "stride_r", "stride_q", "stride_s", "stride_o")},
                       eps="fp32", offset="fp32", min_scale="fp32", tw_ptr="*fp32", sx_ptr=p,
                       gate_ptr=sig_type(moe_shared) if moe_shared else p, stride_gt="i32"),
        constexprs=dict(N=n, BLOCK=block, GROUPS=groups, GW=block if groups == 1 else group, MODE=MODES[mode],
                        N_STATIC=n_static, **moe),
        grid=(t,), num_warps=config.num_warps, num_stages=1,
        divisible=("x_ptr", "r_ptr", "w_ptr", "q_ptr", "s_ptr", "res_out_ptr", "n_rows_ptr"))


def _rows(b, name, t=None, n=None):
    shp = shape_of(b)
    check(len(shp) == 2 and (t is None or shp == (t, n)), f"{name}: want [T, N] = {[t, n]}, got {list(shp)}")
    check_inner_contiguous(b, name)
    return strides_of(b)[0]


def _run(mode, x, r, w, scales, q, s, res_out, *, group, eps=0.0, offset=0.0, min_scale=0.0, n_rows=None,
         config=None, configs: Configs = DEFAULT, moe=None):
    x, r, w, q, s, res_out, n_rows = map(as_buf, (x, r, w, q, s, res_out, n_rows))
    scales = [as_buf(v) for v in scales]
    moe_args, topk, gate_dt = None, 0, None
    if moe is not None:  # x: the expert rows o [T*k, N]; r: the residual [T, N]
        check(mode == "add_rms_norm" and r is not None, "fp8_quant: moe= only with add_rms_norm")
        t, n = shape_of(r)
        tw, shared = moe
        (x, *moe_args), gate_dt = moe_sum_operands(x, tw, t, n, dtype_name(r), shared)
        topk, sx = shape_of(tw)[1], 0
    else:
        t, n = shape_of(x)
        sx = _rows(x, f"{mode}_quant x")
    check(n % group == 0, f"{mode}_quant: N ({n}) is not a multiple of the group ({group})")
    host = lambda shape, dt: as_buf(np.empty(shape, dtype=dt))  # noqa: E731 (interpreter outputs)
    q = q if q is not None else host((t, n), E4M3)
    g = 1 if scales else n // group
    s = s if s is not None else host((t, g), np.float32)
    check(dtype_name(q) == "float8_e4m3fn" and shape_of(q) == (t, n), f"{mode}_quant: q must be e4m3 [{t}, {n}]")
    check(dtype_name(s) == "float32" and shape_of(s) == (t, g), f"{mode}_quant: scales must be f32 [{t}, {g}]")
    check_inner_contiguous(s, f"{mode}_quant scales")
    moe_args = moe_args or [s, x, x, 0]  # placeholders unless x is a MoE layer's rows
    for v in scales:
        check(dtype_name(v) == "float32" and int(np.prod(shape_of(v))) == 1, f"{mode}_quant: a static scale is f32 [1]")
    sr = so = 0
    if r is not None:
        check(dtype_name(r) == dtype_name(x), f"{mode}_quant: the second input's dtype differs from x")
        sr = _rows(r, f"{mode}_quant second input", t, n)
    if mode == "add_rms_norm":
        res_out = res_out if res_out is not None else host((t, n), x.dtype)
        so = _rows(res_out, "add_rms_norm_quant res_out", t, n)
    if w is not None:
        check_shape(w, (n,), f"{mode}_quant w")
        check(dtype_name(w) == dtype_name(x), f"{mode}_quant: w dtype differs from x")
    n_rows = n_rows if n_rows is not None else as_buf(np.array([t], dtype=np.int32))
    config = config or configs.row(f"{mode}_quant", n)
    spec = fp8_quant_spec(t, n, group, dtype_name(x), mode=mode, n_static=len(scales), config=config,
                          moe_topk=topk, moe_shared=gate_dt)
    sp = (scales + [s, s, s])[:3]  # unused pointers: any f32 buffer
    launch(spec, [x, r if r is not None else x, w if w is not None else x, q, s,
                  res_out if res_out is not None else x, n_rows, *sp, sx, sr, strides_of(q)[0], strides_of(s)[0], so,
                  float(eps), float(offset), float(min_scale), *moe_args])
    unwrap = lambda b: b.array if getattr(b, "on_host", False) else b  # noqa: E731
    return (unwrap(q), unwrap(s), unwrap(res_out)) if mode == "add_rms_norm" else (unwrap(q), unwrap(s))


def quant_fp8(x, *scales, q=None, s=None, group: int, min_scale: float = 0.0, n_rows=None, config=None,
              configs: Configs = DEFAULT):
    """x: [T, N] -> (e4m3 [T, N], f32 [T, N / group] or, with static scales ([1] each), [T, 1])."""
    return _run("quant", x, None, None, scales, q, s, None, group=group, min_scale=min_scale, n_rows=n_rows,
                config=config, configs=configs)


def rms_norm_quant(x, w, *scales, q=None, s=None, eps: float, offset: float = 0.0, group: int,
                   min_scale: float = 0.0, n_rows=None, config=None, configs: Configs = DEFAULT):
    """quant_fp8(rms_norm(x, w)): x: [T, N], w: [N] -> (e4m3 [T, N], scales)."""
    return _run("rms_norm", x, None, w, scales, q, s, None, group=group, eps=eps, offset=offset,
                min_scale=min_scale, n_rows=n_rows, config=config, configs=configs)


def add_rms_norm_quant(x, residual, w, *scales, q=None, s=None, res_out=None, eps: float, offset: float = 0.0,
                       group: int, min_scale: float = 0.0, n_rows=None, config=None, configs: Configs = DEFAULT,
                       moe=None):
    """-> (e4m3 [T, N], scales, x + residual): add_rms_norm with its normalised row quantised.
    res_out may be `residual` itself (in place). moe: as rms_norm.add_rms_norm's (x the expert rows
    o [T*k, N], the row added their rank-order sum, moe_sum's launch saved)."""
    return _run("add_rms_norm", x, residual, w, scales, q, s, res_out, group=group, eps=eps, offset=offset,
                min_scale=min_scale, n_rows=n_rows, config=config, configs=configs, moe=moe)


def silu_mul_quant(gate, up, *scales, q=None, s=None, group: int, min_scale: float = 0.0, n_rows=None,
                   config=None, configs: Configs = DEFAULT):
    """quant_fp8(silu(gate) * up): gate, up: [T, N] -> (e4m3 [T, N], scales)."""
    return _run("silu_mul", gate, up, None, scales, q, s, None, group=group, min_scale=min_scale, n_rows=n_rows,
                config=config, configs=configs)
