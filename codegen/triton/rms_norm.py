"""rms_norm and add_rms_norm (vLLM's fused_add_rms_norm), one program per row.

Semantics are graph/ops.py's: mean of squares in f32, x * 1/sqrt(var + eps) rounded
to the storage dtype, then times (w + offset) in f32 and rounded again (HF
LlamaRMSNorm; offset=1 is the Gemma / Qwen3-Next (1 + w) form). add_rms_norm first
rounds x + residual to the storage dtype, writes it as the new residual, and
normalises that.

MoE (add_rms_norm's moe=): x is not a row but a MoE layer's expert rows o [T*k, N], and the row
added to the residual is their rank-order sum (with the shared expert's product: moe_gemm.py
moe_sum_row, moe_sum_kernel's very body), so the layer's output never goes through memory and
its moe_sum launch is saved (lower.py _norm_takes_moe_sum). Bits as moe_sum then add_rms_norm.

Rows: x is [T, R, N] with any token and row strides (R = 1 for [T, N]; per-head q/k
norm passes [T, heads, D]), so a view into a fused qkv buffer works. The whole row
sits in one program (BLOCK_N = next_pow2(N)), so the reduction order is fixed by N
and the config, never by T. Programs of tokens >= *n_rows_ptr return at once.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.configs import DEFAULT, Configs, RowConfig
from kiln.codegen.triton.launch import (KernelSpec, as_buf, check, check_inner_contiguous, check_shape, dtype_name,
                                        launch, next_pow2, shape_of, sig_type, strides_of)
from kiln.codegen.triton.moe import moe_sum_operands
from kiln.codegen.triton.moe_gemm import moe_sum_row
from kiln.codegen.triton.pdl import pdl_enter, pdl_step_input


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, n_rows_ptr,
                    stride_xt, stride_xr, stride_rt, stride_rr, stride_yt, stride_yr, stride_ot, stride_or,
                    stride_xs, eps, offset, tw_ptr, sx_ptr, gate_ptr, stride_gt,
                    N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, X_SPLIT: tl.constexpr,
                    PDL: tl.constexpr = False, MOE_TOPK: tl.constexpr = 0, MOE_SHARED: tl.constexpr = False,
                    INTERPRET: tl.constexpr = False):
    n_rows = pdl_step_input(n_rows_ptr, PDL)  # a step input: read before the wait (pdl.py)
    pdl_enter(PDL)  # before any other global access (pdl.py)
    # grid: (T, R). x, res, y, res_out: [T, R, N]; w: [N] (its dtype is the storage dtype).
    # X_SPLIT > 0: x is a split-K GEMM's f32 partials [X_SPLIT, T, N] (stride_xs apart), summed
    # here exactly as gemm_reduce_kernel sums them (in order 0..S-1, then rounded), so the
    # fused launch gives the same bits as reduce + norm.
    # MOE_TOPK > 0 (R = 1): x is o [T*k, N], the MoE layer's expert rows, and x's row is their
    # sum weighted by tw f32[T*k] (+ sx [T, N] * sigmoid(gate [T, 1]) with MOE_SHARED): moe_sum_row.
    t, r = tl.program_id(0), tl.program_id(1)
    if t >= n_rows:
        return
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dt = w_ptr.dtype.element_ty
    xrow = x_ptr + t.to(tl.int64) * stride_xt + r * stride_xr + cols
    if MOE_TOPK > 0:
        x = moe_sum_row(x_ptr, tw_ptr, sx_ptr, gate_ptr, stride_gt, t, cols, mask, dt, N, MOE_TOPK, MOE_SHARED,
                        INTERPRET)
    elif X_SPLIT > 0:
        acc = tl.load(xrow, mask=mask, other=0.0)
        for s in tl.static_range(1, X_SPLIT):
            acc = acc + tl.load(xrow + s * stride_xs, mask=mask, other=0.0)
        x = acc.to(dt)
    else:
        x = tl.load(xrow, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + t.to(tl.int64) * stride_rt + r * stride_rr + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(dt)  # the new residual
        tl.store(res_out_ptr + t.to(tl.int64) * stride_ot + r * stride_or + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    xn = (xf * rstd).to(dt).to(tl.float32)  # rounded before the weight (HF)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xn * (w + offset)
    tl.store(y_ptr + t.to(tl.int64) * stride_yt + r * stride_yr + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_spec(t: int, r: int, n: int, dtype: str = "bfloat16", *, has_residual: bool,
                  config: RowConfig, x_split: int = 0, moe_topk: int = 0, moe_shared: str | None = None) -> KernelSpec:
    """moe_topk > 0: x is a MoE layer's expert rows, summed here (module docstring); moe_shared: the
    shared expert's gate dtype, its product added too."""
    p = sig_type(dtype)
    moe = dict(MOE_TOPK=moe_topk, INTERPRET=False, **({"MOE_SHARED": True} if moe_shared else {})) if moe_topk else {}
    return KernelSpec(
        module=__name__, kernel="rms_norm_kernel",
        signature=dict(x_ptr="*fp32" if x_split else p, res_ptr=p, w_ptr=p, y_ptr=p, res_out_ptr=p,
                       n_rows_ptr="*i32",
                       **{s: "i32" for s in ("stride_xt", "stride_xr", "stride_rt", "stride_rr", "stride_yt",
                                             "stride_yr", "stride_ot", "stride_or", "stride_xs")},
                       eps="fp32", offset="fp32", tw_ptr="*fp32", sx_ptr=p,
                       gate_ptr=sig_type(moe_shared) if moe_shared else p, stride_gt="i32"),
        constexprs=dict(N=n, BLOCK_N=next_pow2(n), HAS_RESIDUAL=has_residual, X_SPLIT=x_split, **moe),
        grid=(t, r), num_warps=config.num_warps, num_stages=1,
        divisible=("x_ptr", "res_ptr", "w_ptr", "y_ptr", "res_out_ptr", "n_rows_ptr"))


def _rows3(x, name):
    """[T, N] or [T, R, N] -> (buf, T, R, N, stride_t, stride_r)."""
    shp, st = shape_of(x), strides_of(x)
    check(len(shp) in (2, 3), f"{name}: want [T, N] or [T, R, N], got {list(shp)}")
    check_inner_contiguous(x, name)
    if len(shp) == 2:
        return shp[0], 1, shp[1], st[0], 0
    return shp[0], shp[1], shp[2], st[0], st[1]


def _norm(x, residual, w, out, res_out, n_rows, eps, offset, config, configs, x_split=0, moe=None):
    x, residual, w, out, res_out, n_rows = map(as_buf, (x, residual, w, out, res_out, n_rows))
    sxs = 0
    moe_args, topk, gate_dt = [w, x, x, 0], 0, None  # placeholders unless x is a MoE layer's rows
    if moe is not None:
        check(not x_split and residual is not None, "add_rms_norm: moe= takes the experts' rows as x, "
              "with a residual and no split")
        t, r, n, _, _ = _rows3(residual, "add_rms_norm residual")
        check(r == 1, "add_rms_norm: moe= wants [T, N] rows")
        tw, shared = moe
        (x, *moe_args), gate_dt = moe_sum_operands(x, tw, t, n, dtype_name(residual), shared)
        topk, sxt, sxr, like = shape_of(tw)[1], 0, 0, residual
    elif x_split:
        shp = shape_of(x)
        check(len(shp) == 3 and shp[0] == x_split and dtype_name(x) == "float32" and residual is not None,
              f"add_rms_norm: x_split={x_split} wants f32 partials [{x_split}, T, N] and a residual")
        check_inner_contiguous(x, "add_rms_norm partials", 2)
        t, r, n, sxt, sxr, sxs = shp[1], 1, shp[2], strides_of(x)[1], 0, strides_of(x)[0]
        like = residual
    else:
        t, r, n, sxt, sxr = _rows3(x, "rms_norm x")
        like = x
    check_shape(w, (n,), "rms_norm w")
    check(dtype_name(w) == dtype_name(like), "rms_norm: w dtype differs from x")
    host = lambda: as_buf(np.empty(shape_of(like), dtype=like.dtype))
    out = out if out is not None else host()
    check(shape_of(out) == shape_of(like) and dtype_name(out) == dtype_name(like), "rms_norm: bad out")
    _, _, _, syt, syr = _rows3(out, "rms_norm out")
    has_res = residual is not None
    if has_res:
        check(shape_of(residual) == shape_of(like) and dtype_name(residual) == dtype_name(like),
              "add_rms_norm: bad residual")
        res_out = res_out if res_out is not None else host()
        check(shape_of(res_out) == shape_of(like) and dtype_name(res_out) == dtype_name(like),
              "add_rms_norm: bad res_out")
        _, _, _, srt, srr = _rows3(residual, "add_rms_norm residual")
        _, _, _, sot, sor = _rows3(res_out, "add_rms_norm res_out")
    else:
        residual, res_out, srt, srr, sot, sor = x, out, 0, 0, 0, 0
    n_rows = n_rows if n_rows is not None else as_buf(np.array([t], dtype=np.int32))
    config = config or configs.row("rms_norm", n)
    spec = rms_norm_spec(t, r, n, dtype_name(like), has_residual=has_res, config=config, x_split=x_split,
                         moe_topk=topk, moe_shared=gate_dt)
    launch(spec, [x, residual, w, out, res_out, n_rows, sxt, sxr, srt, srr, syt, syr, sot, sor, sxs,
                  float(eps), float(offset), *moe_args])
    unwrap = lambda b: b.array if getattr(b, "on_host", False) else b
    return (unwrap(out), unwrap(res_out)) if has_res else unwrap(out)


def rms_norm(x, w, out=None, *, eps: float, offset: float = 0.0, n_rows=None,
             config: RowConfig | None = None, configs: Configs = DEFAULT):
    """x: [T, N] or [T, R, N] -> rms_norm(x) * (w + offset), same shape and dtype."""
    return _norm(x, None, w, out, None, n_rows, eps, offset, config, configs)


def add_rms_norm(x, residual, w, out=None, res_out=None, *, eps: float, offset: float = 0.0,
                 n_rows=None, config: RowConfig | None = None, configs: Configs = DEFAULT, x_split: int = 0,
                 moe=None):
    """-> (rms_norm(x + residual), x + residual). res_out may be `residual` itself (in place).
    x_split=S: x is a split-K GEMM's f32 partials [S, T, N], reduced here (its reduce launch saved).
    moe=(topk_weights f32[T, k], shared None or (sx [T, N], gate [T, 1])): x is a MoE layer's expert
    rows o [T*k, N] and the row added is moe.moe_sum's of them (its launch saved)."""
    return _norm(x, residual, w, out, res_out, n_rows, eps, offset, config, configs, x_split, moe)
