"""Gated DeltaNet kernels (../shared/specs/qwen3_5.md section 6), each checked under the
interpreter against graph/gdn_ops.py's numpy references (tests/codegen/test_gdn_kernels.py):

- causal_conv1d: the depthwise causal conv over q|k|v with its rolling state, SiLU fused;
  one program per (sequence, channel block) walks the sequence's tokens (a prefill chunk or
  one decode token), reading the K-1 inputs before them from the sequence's state slot and
  writing its last K-1 back.
- gdn_recurrent: the gated delta rule token by token (decode), with the gates (softplus of
  a + dt_bias times -exp(A_log), sigmoid beta) and q/k l2 norms fused in; the fp32 state
  [dk, BV] of one value head lives in registers and is updated in place in its slot.
- gdn_chunked: the chunked (WY / UT) form for prefill: one program per (sequence, value head)
  walks 64-token chunks cut at absolute positions (the first may be partial), as
  gdn_ops.gdr_chunked does: cumulative gates, K K^T, (I + A)^-1 by forward substitution,
  u / w, the inter-chunk state and the output.
- gated_rms_norm: the GDN output's per-head norm times w times silu(z).

Not yet wired into codegen/lower.py: a hybrid model compiles for the cpu target only.
Layouts: q, k, v are column slices of the conv output [T, conv_dim] (their row stride is
conv_dim); a, b: [T, Hv]; states: conv [NS, C, K-1], recurrent [NS, Hv, dk, dv] (f32).
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.launch import (KernelSpec, as_buf, cdiv, check, dtype_name, launch, next_pow2, shape_of,
                                        sig_type, strides_of)

CHUNK = 64


@triton.jit
def causal_conv1d_kernel(x_ptr, w_ptr, state_ptr, y_ptr, slots_ptr, seq_lens_ptr, qsl_ptr, stride_x, stride_y,
                         C: tl.constexpr, KW: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr):
    # grid: (S, cdiv(C, BLOCK)); x, y: [T, C]; w: [C, 1, KW]; state: [NS, C, KW - 1]; KW <= 4
    s, pid = tl.program_id(0), tl.program_id(1)
    q0 = tl.load(qsl_ptr + s)
    q1 = tl.load(qsl_ptr + s + 1)
    if q1 <= q0:
        return
    ctx = tl.load(seq_lens_ptr + s) - (q1 - q0)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    c = pid * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    w_last = tl.load(w_ptr + c * KW + (KW - 1), mask=m, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + c * KW + (KW - 2), mask=m & (KW >= 2), other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + c * KW + (KW - 3), mask=m & (KW >= 3), other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + c * KW + (KW - 4), mask=m & (KW >= 4), other=0.0).to(tl.float32)
    # h1, h2, h3: the inputs 1, 2, 3 tokens back (zeros for a fresh sequence)
    sbase = state_ptr + slot * (C * (KW - 1)) + c * (KW - 1)
    has = (ctx > 0) & (slot >= 0)
    h1 = tl.load(sbase + (KW - 2), mask=m & has & (KW >= 2), other=0.0).to(tl.float32)
    h2 = tl.load(sbase + (KW - 3), mask=m & has & (KW >= 3), other=0.0).to(tl.float32)
    h3 = tl.load(sbase + (KW - 4), mask=m & has & (KW >= 4), other=0.0).to(tl.float32)
    for t64 in range(q0.to(tl.int64), q1.to(tl.int64)):
        xt = tl.load(x_ptr + t64 * stride_x + c, mask=m, other=0.0).to(tl.float32)
        acc = w_last * xt + w1 * h1 + w2 * h2 + w3 * h3
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + t64 * stride_y + c, acc.to(y_ptr.dtype.element_ty), mask=m)
        h3 = h2
        h2 = h1
        h1 = xt
    if slot >= 0:
        sd = state_ptr.dtype.element_ty
        tl.store(sbase + (KW - 2), h1.to(sd), mask=m & (KW >= 2))
        tl.store(sbase + (KW - 3), h2.to(sd), mask=m & (KW >= 3))
        tl.store(sbase + (KW - 4), h3.to(sd), mask=m & (KW >= 4))


@triton.jit
def _gates(a_ptr, b_ptr, row, h, A, dtb):
    """-> (g, beta) of one token and value head (gdn_ops.gdn_gates)."""
    a = tl.load(a_ptr + row + h).to(tl.float32)
    b = tl.load(b_ptr + row + h)
    x = a + dtb
    sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    bf = b.to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-bf))).to(b_ptr.dtype.element_ty).to(tl.float32)
    return A * sp, beta


@triton.jit
def gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, o_ptr, slots_ptr,
                         seq_lens_ptr, qsl_ptr, stride_qk, stride_v, stride_ab, stride_o, scale,
                         HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr):
    # grid: (S, HV, cdiv(DV, BV)); one value head's [DK, BV] state slice per program
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q0 = tl.load(qsl_ptr + s)
    q1 = tl.load(qsl_ptr + s + 1)
    if q1 <= q0:
        return
    ctx = tl.load(seq_lens_ptr + s) - (q1 - q0)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    kh = h // (HV // HK)  # value head h reads key head h // r (repeat_interleave)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    sp = state_ptr + slot * (HV * DK * DV) + h * (DK * DV) + rk[:, None] * DV + rv[None, :]
    smask = mk[:, None] & mv[None, :]
    S = tl.load(sp, mask=smask & (ctx > 0) & (slot >= 0), other=0.0).to(tl.float32)
    A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    for t64 in range(q0.to(tl.int64), q1.to(tl.int64)):
        q = tl.load(q_ptr + t64 * stride_qk + kh * DK + rk, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64 * stride_qk + kh * DK + rk, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64 * stride_v + h * DV + rv, mask=mv, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        g, beta = _gates(a_ptr, b_ptr, t64 * stride_ab, h, A, dtb)
        S = S * tl.exp(g)
        u = tl.sum(S * k[:, None], 0)
        S = S + k[:, None] * (beta * (v - u))[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(o_ptr + t64 * stride_o + h * DV + rv, o.to(o_ptr.dtype.element_ty), mask=mv)
    if slot >= 0:
        tl.store(sp, S, mask=smask)


@triton.jit
def gdn_chunked_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, o_ptr, slots_ptr,
                       seq_lens_ptr, qsl_ptr, stride_qk, stride_v, stride_ab, stride_o, scale,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr):
    # grid: (S, HV); BT = the chunk size (64); BV >= DV: the whole head's state per program
    s, h = tl.program_id(0), tl.program_id(1)
    q0 = tl.load(qsl_ptr + s)
    q1 = tl.load(qsl_ptr + s + 1)
    n = q1 - q0
    if n <= 0:
        return
    ctx = tl.load(seq_lens_ptr + s) - n
    slot = tl.load(slots_ptr + s).to(tl.int64)
    kh = h // (HV // HK)
    rk, rv, rt = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BT)
    mk, mv = rk < DK, rv < DV
    sp = state_ptr + slot * (HV * DK * DV) + h * (DK * DV) + rk[:, None] * DV + rv[None, :]
    smask = mk[:, None] & mv[None, :]
    S = tl.load(sp, mask=smask & (ctx > 0) & (slot >= 0), other=0.0).to(tl.float32)
    A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    lower = rt[:, None] >= rt[None, :]
    strict = rt[:, None] > rt[None, :]
    eye = (rt[:, None] == rt[None, :]).to(tl.float32)
    off = ctx % BT
    num_chunks = (off + n + BT - 1) // BT
    for c in range(0, num_chunks):
        c0 = tl.maximum(c * BT - off, 0)  # the chunk's tokens [c0, c1) of the sequence
        c1 = tl.minimum((c + 1) * BT - off, n)
        rows = q0 + c0 + rt
        live = rt < (c1 - c0)
        r64 = rows.to(tl.int64)
        Q = tl.load(q_ptr + r64[:, None] * stride_qk + kh * DK + rk[None, :], mask=live[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        K = tl.load(k_ptr + r64[:, None] * stride_qk + kh * DK + rk[None, :], mask=live[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        V = tl.load(v_ptr + r64[:, None] * stride_v + h * DV + rv[None, :], mask=live[:, None] & mv[None, :],
                    other=0.0).to(tl.float32)
        Q = Q / tl.sqrt(tl.sum(Q * Q, 1) + 1e-6)[:, None] * scale
        K = K / tl.sqrt(tl.sum(K * K, 1) + 1e-6)[:, None]
        a = tl.load(a_ptr + r64 * stride_ab + h, mask=live, other=0.0).to(tl.float32)
        bb = tl.load(b_ptr + r64 * stride_ab + h, mask=live, other=0.0)
        x = a + dtb
        g = tl.where(live, A * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0)))), 0.0)
        beta = tl.where(live, (1.0 / (1.0 + tl.exp(-bb.to(tl.float32)))).to(b_ptr.dtype.element_ty)
                        .to(tl.float32), 0.0)
        G = tl.cumsum(g, 0)
        D = tl.where(lower, tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0)), 0.0)
        Am = tl.where(strict, tl.dot(K * beta[:, None], tl.trans(K)) * D, 0.0)
        # T = (I + Am)^-1 by forward substitution: row i = e_i - sum_{j<i} Am[i, j] T[j]
        T = eye
        for i in range(1, BT):
            ai = tl.sum(tl.where(rt[:, None] == i, Am, 0.0), 0)  # Am[i, :]
            row = tl.sum(tl.where(rt[:, None] == i, eye, 0.0), 0) - tl.sum(ai[:, None] * T, 0)
            T = tl.where(rt[:, None] == i, row[None, :], T)
        eG = tl.exp(G)
        U = tl.dot(T, V * beta[:, None])
        W = tl.dot(T, K * (beta * eG)[:, None])
        Vn = U - tl.dot(W, S)
        O = tl.dot(Q * eG[:, None], S) + tl.dot(tl.dot(Q, tl.trans(K)) * D, Vn)
        tl.store(o_ptr + r64[:, None] * stride_o + h * DV + rv[None, :], O.to(o_ptr.dtype.element_ty),
                 mask=live[:, None] & mv[None, :])
        g_last = tl.sum(tl.where(rt == (c1 - c0 - 1), G, 0.0), 0)
        S = tl.exp(g_last) * S + tl.dot(tl.trans(K * tl.where(live, tl.exp(g_last - G), 0.0)[:, None]), Vn)
    if slot >= 0:
        tl.store(sp, S, mask=smask)


@triton.jit
def gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, stride_x, stride_z, stride_y, eps,
                          HV: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    # grid: (T, HV); x, y: [T, HV, DV]; z: [T, HV * DV]; w: [DV]
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r = tl.arange(0, BV)
    m = r < DV
    x = tl.load(x_ptr + t * stride_x + h * DV + r, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * stride_z + h * DV + r, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + r, mask=m, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    xn = (x / tl.sqrt(tl.sum(x * x, 0) / DV + eps)).to(dt).to(tl.float32)
    y = (w * xn).to(dt).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    tl.store(y_ptr + t * stride_y + h * DV + r, y.to(dt), mask=m)


# -- wrappers ----------------------------------------------------------------------------

def _i32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int32)


def causal_conv1d(x, w, state, seq_lens, query_start_loc, state_slots, *, silu: bool = True, block: int = 128):
    """x: [T, C]; w: [C, 1, K] (K <= 4); state: [NS, C, K-1] (in place) -> y [T, C] (silu(conv) if silu)."""
    x, w, state = as_buf(x), as_buf(w), as_buf(state)
    t, c = shape_of(x)
    kw = shape_of(w)[-1]
    check(2 <= kw <= 4, f"causal_conv1d: kernel width {kw} (supported: 2..4)")
    check(tuple(shape_of(state)[1:]) == (c, kw - 1), "causal_conv1d: state is not [NS, C, K-1]")
    y = as_buf(np.empty((t, c), dtype=x.dtype))
    n_seq = len(seq_lens)
    spec = KernelSpec(module=__name__, kernel="causal_conv1d_kernel",
                      signature=dict(x_ptr=sig_type(dtype_name(x)), w_ptr=sig_type(dtype_name(w)),
                                     state_ptr=sig_type(dtype_name(state)), y_ptr=sig_type(dtype_name(x)),
                                     slots_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32", stride_x="i32",
                                     stride_y="i32"),
                      constexprs=dict(C=c, KW=kw, BLOCK=block, SILU=silu), grid=(n_seq, cdiv(c, block)),
                      num_warps=4, num_stages=1)
    launch(spec, [x, w, state, y, as_buf(_i32(state_slots)), as_buf(_i32(seq_lens)), as_buf(_i32(query_start_loc)),
                  strides_of(x)[0], c])
    return y.array


def _gdn_args(q, k, v, a, b, a_log, dt_bias, state, seq_lens, query_start_loc, state_slots):
    q, k, v, a, b, state = map(as_buf, (q, k, v, a, b, state))
    t, hv, dv = shape_of(v)
    check(shape_of(q) == shape_of(k) and len(shape_of(q)) == 3, "gdn: q and k must be [T, Hk, dk] alike")
    _, hk, dk = shape_of(q)
    check(hv % hk == 0 and tuple(shape_of(state)[1:]) == (hv, dk, dv), "gdn: heads or state shape disagree")
    check(strides_of(q) == strides_of(k) and strides_of(a) == strides_of(b), "gdn: q/k and a/b strides differ")
    o = as_buf(np.empty((t, hv, dv), dtype=v.dtype))
    sig = dict(q_ptr=sig_type(dtype_name(q)), k_ptr=sig_type(dtype_name(k)), v_ptr=sig_type(dtype_name(v)),
               a_ptr=sig_type(dtype_name(a)), b_ptr=sig_type(dtype_name(b)), alog_ptr="*fp32", dtb_ptr="*fp32",
               state_ptr="*fp32", o_ptr=sig_type(dtype_name(v)), slots_ptr="*i32", seq_lens_ptr="*i32",
               qsl_ptr="*i32", stride_qk="i32", stride_v="i32", stride_ab="i32", stride_o="i32", scale="fp32")
    args = [q, k, v, a, b, as_buf(np.ascontiguousarray(a_log, np.float32)),
            as_buf(np.ascontiguousarray(dt_bias, np.float32)), state, o, as_buf(_i32(state_slots)),
            as_buf(_i32(seq_lens)), as_buf(_i32(query_start_loc)), strides_of(q)[0], strides_of(v)[0],
            strides_of(a)[0], hv * dv, float(dk ** -0.5)]
    return o, sig, args, dict(HK=hk, HV=hv, DK=dk, DV=dv, BK=next_pow2(dk)), hv, dv


def gdn_recurrent(q, k, v, a, b, a_log, dt_bias, state, seq_lens, query_start_loc, state_slots, *, block_v: int = 32):
    """The fused gates + l2 norms + gated delta rule, token by token (decode). q, k: [T, Hk, dk]
    (raw, after the conv), v: [T, Hv, dv], a, b: [T, Hv]; state: f32 [NS, Hv, dk, dv] in place."""
    o, sig, args, cx, hv, dv = _gdn_args(q, k, v, a, b, a_log, dt_bias, state, seq_lens, query_start_loc,
                                         state_slots)
    bv = min(block_v, next_pow2(dv))
    spec = KernelSpec(module=__name__, kernel="gdn_recurrent_kernel", signature=sig, constexprs=dict(cx, BV=bv),
                      grid=(len(seq_lens), hv, cdiv(dv, bv)), num_warps=4, num_stages=1)
    launch(spec, args)
    return o.array


def gdn_chunked(q, k, v, a, b, a_log, dt_bias, state, seq_lens, query_start_loc, state_slots, *, chunk: int = CHUNK):
    """As gdn_recurrent, through the chunked form in `chunk`-token chunks at absolute positions (prefill)."""
    o, sig, args, cx, hv, dv = _gdn_args(q, k, v, a, b, a_log, dt_bias, state, seq_lens, query_start_loc,
                                         state_slots)
    spec = KernelSpec(module=__name__, kernel="gdn_chunked_kernel", signature=sig,
                      constexprs=dict(cx, BV=next_pow2(dv), BT=chunk), grid=(len(seq_lens), hv), num_warps=4,
                      num_stages=1)
    launch(spec, args)
    return o.array


def gated_rms_norm(x, z, w, *, eps: float):
    """x: [T, Hv, dv], z: [T, Hv * dv] (or [T, Hv, dv]), w: [dv] -> [T, Hv, dv] in x's dtype."""
    x, z, w = as_buf(x), as_buf(z), as_buf(w)
    t, hv, dv = shape_of(x)
    y = as_buf(np.empty((t, hv, dv), dtype=x.dtype))
    spec = KernelSpec(module=__name__, kernel="gated_rms_norm_kernel",
                      signature=dict(x_ptr=sig_type(dtype_name(x)), z_ptr=sig_type(dtype_name(z)),
                                     w_ptr=sig_type(dtype_name(w)), y_ptr=sig_type(dtype_name(x)), stride_x="i32",
                                     stride_z="i32", stride_y="i32", eps="fp32"),
                      constexprs=dict(HV=hv, DV=dv, BV=next_pow2(dv)), grid=(t, hv), num_warps=4, num_stages=1)
    launch(spec, [x, z, w, y, strides_of(x)[0], strides_of(z)[0], hv * dv, float(eps)])
    return y.array
