"""attention_preamble: [q/k RMSNorm] -> RoPE -> paged KV-cache write, one launch.

Inputs are three views, q: [T, H, D], k, v: [T, Hkv, D], each with its own token
stride and heads packed (head stride D). Separate q/k/v projections pass their own
buffers; a fused qkv projection [T, (H + 2 Hkv) D] passes three views of one
buffer (offsets 0, H D, (H + Hkv) D, token stride (H + 2 Hkv) D). No copy either way.

Numbers follow reference.attention_preamble (= ops.rms_norm, ops.rope,
ops.cache_write): the normalised value is rounded to the storage dtype before the
weight and again after it, RoPE computes in f32 from that and rounds once. An fp8
cache (float8_e4m3fn) takes that rounded k, and v, saturated to +-448 and rounded
again (ops.to_cache). A rotary
partner is recomputed from its own load (same rstd, its own weight) rather than
shuffled between lanes. cos/sin come from f32 tables [max_pos, ROT/2]
(reference.rope_tables); dims >= ROT pass through (partial rotary).

grid: (T, cdiv(H, BLOCK_H) + cdiv(Hkv, BLOCK_H)): the first blocks rotate q heads
into q_out, the rest rotate k heads and write k and v to cache[block, 0|1, offset]
at slot_mapping[t] (slot -1: padding, nothing written). Tokens >= *n_rows_ptr
return at once.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.configs import DEFAULT, Configs, RowConfig
from kiln.codegen.triton.launch import (KernelSpec, as_buf, cdiv, check, check_dtype, check_inner_contiguous,
                                        check_shape, dtype_name, launch, next_pow2, shape_of, sig_type, strides_of)
from kiln.codegen.triton.pdl import pdl_enter, pdl_step_input


@triton.jit
def _norm_rope(src, heads, h0, w_ptr, cos_ptr, sin_ptr, pos, max_pos, eps, offset,
               D: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr, QK_NORM: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HS: tl.constexpr):
    """src: this token's row of `heads` heads, HS elements apart (D: packed; 2 D: the gated
    attention's q, whose heads interleave with their gates). -> (rotated [BLOCK_H, BLOCK_D] f32,
    packed offsets, mask)"""
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    HALF: tl.constexpr = ROT // 2
    if IS_NEOX:  # pairs (i, i + ROT/2)
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        c = tl.where(d < HALF, d, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
    else:  # gpt-j: pairs (2i, 2i + 1)
        partner = d ^ 1
        c = d // 2
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    rot = d < ROT
    partner = tl.where(rot, partner, d)
    mask = (h[:, None] < heads) & (d[None, :] < D)
    offs = h[:, None] * D + d[None, :]  # [BLOCK_H, BLOCK_D]
    x = tl.load(src + h[:, None] * HS + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + h[:, None] * HS + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        dt = src.dtype.element_ty
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)  # [BLOCK_H]
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32) + offset
        wp = tl.load(w_ptr + partner, mask=d < D, other=0.0).to(tl.float32) + offset
        x = ((x * rstd[:, None]).to(dt).to(tl.float32) * w[None, :]).to(dt).to(tl.float32)
        xp = ((xp * rstd[:, None]).to(dt).to(tl.float32) * wp[None, :]).to(dt).to(tl.float32)
    ok = rot & (pos >= 0) & (pos < max_pos)
    cs = tl.load(cos_ptr + pos.to(tl.int64) * HALF + c, mask=ok, other=1.0)  # [BLOCK_D]
    sn = tl.load(sin_ptr + pos.to(tl.int64) * HALF + c, mask=ok, other=0.0)
    # one explicit fma, so that the rounding does not depend on how the compiler contracts the
    # expression in this kernel's shape (gemm.gemm_rope_kernel computes the same in its epilogue)
    y = tl.where(rot[None, :], tl.fma(x, cs[None, :], (sign[None, :] * xp) * sn[None, :]), x)
    return y, offs, mask


@triton.jit
def attention_preamble_kernel(q_ptr, k_ptr, v_ptr, stride_qt, stride_kt, stride_vt, q_norm_ptr, k_norm_ptr,
                              cos_ptr, sin_ptr, positions_ptr, slot_ptr, n_rows_ptr, q_out_ptr, stride_qo,
                              cache_ptr, stride_cb, stride_ckv, stride_cp, stride_ch, max_pos, eps, offset,
                              H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                              BS: tl.constexpr, IS_NEOX: tl.constexpr, QK_NORM: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
                              Q_HS: tl.constexpr = 0):
    # Q_HS: q's head stride when its heads are not packed (0: D)
    t, hb = tl.program_id(0), tl.program_id(1)
    n_rows = pdl_step_input(n_rows_ptr, PDL)  # step inputs: read before the wait (pdl.py)
    pos = pdl_step_input(positions_ptr + t, PDL)  # (the bucket's T entries: in bounds past n_rows)
    pdl_enter(PDL)  # before any other global access (pdl.py)
    if t >= n_rows:
        return
    t64 = t.to(tl.int64)
    NQB: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    if hb < NQB:  # q heads [hb * BLOCK_H, ...) -> q_out: [T, H, D]
        y, offs, mask = _norm_rope(q_ptr + t64 * stride_qt, H, hb * BLOCK_H, q_norm_ptr, cos_ptr, sin_ptr, pos,
                                   max_pos, eps, offset, D, ROT, IS_NEOX, QK_NORM, BLOCK_H, BLOCK_D,
                                   Q_HS if Q_HS else D)
        tl.store(q_out_ptr + t64 * stride_qo + offs, y.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:  # k heads -> cache[blk, 0, off, h, :]; v heads copied to cache[blk, 1, off, h, :]
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            h0 = (hb - NQB) * BLOCK_H
            y, offs, mask = _norm_rope(k_ptr + t64 * stride_kt, HKV, h0, k_norm_ptr, cos_ptr, sin_ptr, pos,
                                       max_pos, eps, offset, D, ROT, IS_NEOX, QK_NORM, BLOCK_H, BLOCK_D, D)
            h = h0 + tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            dst = cache_ptr + (slot // BS).to(tl.int64) * stride_cb + (slot % BS) * stride_cp \
                + h[:, None] * stride_ch + d[None, :]
            tl.store(dst, to_cache(y.to(v_ptr.dtype.element_ty), cache_ptr.dtype.element_ty), mask=mask)
            v = tl.load(v_ptr + t64 * stride_vt + offs, mask=mask, other=0.0)
            tl.store(dst + stride_ckv, to_cache(v, cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def to_cache(x, CT: tl.constexpr):
    """x (the model's dtype: ops.rope rounded k there) -> the cache's element type CT. An fp8
    cache saturates at e4m3's largest finite value, as ops.to_cache does (scale 1.0)."""
    if CT == tl.float8e4nv:
        return tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0).to(CT)
    else:
        return x.to(CT)


def attention_preamble_spec(t: int, h: int, hkv: int, d: int, rot: int, bs: int, dtype: str = "bfloat16", *,
                            is_neox: bool, qk_norm: bool, config: RowConfig, cache_dtype: str | None = None,
                            q_head_stride: int = 0) -> KernelSpec:
    """q_head_stride: q's head stride where it is not D (the gated attention's q, 2 D); 0: D."""
    p = sig_type(dtype)
    block_h = min(next_pow2(hkv), 8)
    i32 = lambda *names: {n: "i32" for n in names}
    return KernelSpec(
        module=__name__, kernel="attention_preamble_kernel",
        signature=dict(q_ptr=p, k_ptr=p, v_ptr=p, **i32("stride_qt", "stride_kt", "stride_vt"), q_norm_ptr=p,
                       k_norm_ptr=p, cos_ptr="*fp32", sin_ptr="*fp32", positions_ptr="*i32", slot_ptr="*i32",
                       n_rows_ptr="*i32", q_out_ptr=p, stride_qo="i32", cache_ptr=sig_type(cache_dtype or dtype),
                       **i32("stride_cb", "stride_ckv", "stride_cp", "stride_ch", "max_pos"),
                       eps="fp32", offset="fp32"),
        constexprs=dict(H=h, HKV=hkv, D=d, ROT=rot, BS=bs, IS_NEOX=is_neox, QK_NORM=qk_norm, BLOCK_H=block_h,
                        BLOCK_D=next_pow2(d), **({"Q_HS": q_head_stride} if q_head_stride not in (0, d) else {})),
        grid=(t, cdiv(h, block_h) + cdiv(hkv, block_h)), num_warps=config.num_warps, num_stages=1,
        divisible=("q_ptr", "k_ptr", "v_ptr", "q_norm_ptr", "k_norm_ptr", "cos_ptr", "sin_ptr", "positions_ptr",
                   "slot_ptr", "n_rows_ptr", "q_out_ptr", "cache_ptr"))


def attention_preamble(q, k, v, cache, positions, slot_mapping, cos, sin, q_norm_w=None, k_norm_w=None,
                       q_out=None, *, eps: float = 1e-6, offset: float = 0.0, is_neox: bool = True,
                       n_rows=None, config: RowConfig | None = None, configs: Configs = DEFAULT):
    """q: [T, H, D], k, v: [T, Hkv, D], cache: [NB, 2, BS, Hkv, D] (written in place),
    positions, slot_mapping: i32[T], cos, sin: f32[max_pos, ROT/2] -> q_out: [T, H, D]"""
    q, k, v, cache, positions, slot_mapping, cos, sin, q_norm_w, k_norm_w, q_out, n_rows = map(
        as_buf, (q, k, v, cache, positions, slot_mapping, cos, sin, q_norm_w, k_norm_w, q_out, n_rows))
    t, h, d = shape_of(q)
    _, _, bs, hkv, _ = shape_of(cache)
    check(h % hkv == 0, f"attention_preamble: H={h} is not a multiple of Hkv={hkv}")
    # q's heads may be strided (the gated attention's q heads interleave with their gates)
    check(strides_of(q)[2] == 1 and strides_of(q)[1] >= d, "attention_preamble: q's head dim must be packed")
    for b, name in ((k, "k"), (v, "v")):
        check_inner_contiguous(b, f"attention_preamble {name}", 2)
        check(dtype_name(b) == dtype_name(q), f"attention_preamble: {name} dtype differs from q")
    check_shape(k, (t, hkv, d), "attention_preamble k")
    check_shape(v, (t, hkv, d), "attention_preamble v")
    check(dtype_name(cache) in (dtype_name(q), "float8_e4m3fn"),
          f"attention_preamble: cache dtype {dtype_name(cache)} is neither q's ({dtype_name(q)}) nor float8_e4m3fn")
    check_inner_contiguous(cache, "attention_preamble cache", 2)
    max_pos, half = shape_of(cos)
    rot = 2 * half
    check(rot <= d and shape_of(sin) == (max_pos, half), "attention_preamble: bad cos/sin tables")
    for b, name in ((cos, "cos"), (sin, "sin")):
        check_dtype(b, ("float32",), name)
        check_inner_contiguous(b, name, 2)
    for b, name in ((positions, "positions"), (slot_mapping, "slot_mapping")):
        check_shape(b, (t,), name)
        check_dtype(b, ("int32",), name)
    qk_norm = q_norm_w is not None
    check(qk_norm == (k_norm_w is not None), "attention_preamble: q and k norm weights come together")
    if qk_norm:
        check_shape(q_norm_w, (d,), "q_norm_w")
        check_shape(k_norm_w, (d,), "k_norm_w")
    q_out = q_out if q_out is not None else as_buf(np.empty((t, h, d), dtype=q.dtype))
    check(shape_of(q_out) == (t, h, d) and dtype_name(q_out) == dtype_name(q), "attention_preamble: bad q_out")
    check_inner_contiguous(q_out, "attention_preamble q_out", 2)
    n_rows = n_rows if n_rows is not None else as_buf(np.array([t], dtype=np.int32))
    spec = attention_preamble_spec(t, h, hkv, d, rot, bs, dtype_name(q), is_neox=is_neox, qk_norm=qk_norm,
                                   config=config or configs.row("attention_preamble", h * d),
                                   cache_dtype=dtype_name(cache), q_head_stride=strides_of(q)[1])
    wq, wk = (q_norm_w, k_norm_w) if qk_norm else (q, q)  # unused when QK_NORM is False
    sc = strides_of(cache)
    launch(spec, [q, k, v, strides_of(q)[0], strides_of(k)[0], strides_of(v)[0], wq, wk, cos, sin, positions,
                  slot_mapping, n_rows, q_out, strides_of(q_out)[0], cache, sc[0], sc[1], sc[2], sc[3],
                  max_pos, float(eps), float(offset)])
    return q_out.array if getattr(q_out, "on_host", False) else q_out
