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

- sigmoid_mul: the gated attention's output gate, read in place from q_proj's output.

codegen/lower.py launches them (a mixed bucket runs the chunked kernel for its prefills and
the recurrent one for its one-token sequences, so a decode token's bits do not depend on its
bucket); tests/codegen/test_lowering_hybrid.py replays a tiny hybrid's plans.
Layouts: q, k, v are column slices of the conv output [T, conv_dim] (their row stride is
conv_dim); a, b: [T, Hv]; states: conv [NS, C, K-1], recurrent [NS, Hv, dk, dv] (f32).
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.launch import (Buf, KernelSpec, as_buf, cdiv, check, dtype_name, is_host, launch, next_pow2,
                                        shape_of, sig_type, strides_of)
from kiln.codegen.triton.pdl import pdl_enter

CHUNK = 64


@triton.jit
def causal_conv1d_kernel(x_ptr, w_ptr, state_ptr, y_ptr, slots_ptr, seq_lens_ptr, qsl_ptr, stride_x, stride_y,
                         C: tl.constexpr, KW: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr,
                         PDL: tl.constexpr = False):
    # grid: (S, cdiv(C, BLOCK)); x, y: [T, C]; w: [C, 1, KW]; state: [NS, C, KW - 1]; KW <= 4
    pdl_enter(PDL)  # before any global access (pdl.py)
    s, pid = tl.program_id(0), tl.program_id(1)
    # the sequence's step inputs all at once, before the early exit (a load after the branch
    # is not issued before it: one more round trip on a decode's chain of dependent loads)
    q0 = tl.load(qsl_ptr + s)
    q1 = tl.load(qsl_ptr + s + 1)
    seq_len = tl.load(seq_lens_ptr + s)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    if q1 <= q0:
        return
    ctx = seq_len - (q1 - q0)
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
def _gated_norm(o, z_row, w_ptr, r, m, eps, DV: tl.constexpr, dt: tl.constexpr):
    """f32 [BV] o of one head (BV >= DV; lanes past DV zero) -> rms_norm(o) * w * silu(z) in f32,
    rounded where graph/gdn_ops.gated_rms_norm rounds: o as the rule's output is stored, the
    normed o, w times it (gated_rms_norm_kernel's formula: equal bits under the interpreter; on a
    GPU the sum of squares may reduce in another order than that kernel's, which costs nothing,
    since a token's row always comes from the same form of the rule, never from both)."""
    x = o.to(dt).to(tl.float32)
    xn = (x / tl.sqrt(tl.sum(x * x, 0) / DV + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + r, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_row + r, mask=m, other=0.0).to(tl.float32)
    return (w * xn).to(dt).to(tl.float32) * (z / (1.0 + tl.exp(-z)))


@triton.jit
def _norm_if_last(cnt_ptr, row_ptr, z_row, w_ptr, eps, DV: tl.constexpr, BDV: tl.constexpr, NV: tl.constexpr):
    """The NV programs of one (token, value head) each stored their columns of the rounded o in
    its output row; each counts itself in on *cnt_ptr, and the one that counts last reads the
    whole row back and writes _gated_norm of it in place, the bits of a program that held the
    row whole (the same rounded values, one sum over all DV), then puts the counter back to 0.
    Ordering as paged_attention._merge_if_last: the barrier puts the program's stores before its
    atomic, whose release publishes them at GPU scope; the last one's acquire orders its loads
    (.cg: not from L1) after every other program's stores."""
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if old == NV - 1:
        r = tl.arange(0, BDV)
        m = r < DV
        dt = row_ptr.dtype.element_ty
        x = tl.load(row_ptr + r, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        y = _gated_norm(x, z_row, w_ptr, r, m, eps, DV, dt)
        tl.store(row_ptr + r, y.to(dt), mask=m)
        tl.store(cnt_ptr, 0)


@triton.jit
def gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, o_ptr, slots_ptr,
                         seq_lens_ptr, qsl_ptr, stride_qk, stride_v, stride_ab, stride_o, scale,
                         z_ptr, nw_ptr, stride_z, norm_eps, cnt_ptr,
                         HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, SINGLE_ONLY: tl.constexpr,
                         PDL: tl.constexpr = False, BT: tl.constexpr = 64, NORM: tl.constexpr = False,
                         BDV: tl.constexpr = 0):
    # grid: (S, HV, cdiv(DV, BV)); one value head's [DK, BV] state slice per program (every step
    # of the rule is separable over the value columns; on a GPU the sums over DK may still reduce
    # in another order per tile and warps, so a launch's BV and warps are part of its bits: the
    # decode and mixed buckets launch the same ones).
    # NORM: the gated RMSNorm of the output (gated_rms_norm_kernel's formula on the rounded o)
    # before the store, o_ptr then receiving rms_norm(o) * nw * silu(z); z: [T, HV * DV] rows
    # strided, nw: [DV], BDV = next_pow2(DV). With BV >= DV the program holds the row and norms
    # it in registers; with NV = cdiv(DV, BV) > 1 programs a head, the last of a (token, head) to
    # store its columns norms the row (_norm_if_last) on the counter cnt_ptr[t * HV + h] (i32
    # [T, HV], zero at the start)
    # SINGLE_ONLY: only the tokens alone in their BT-window at the end of this step's chunk: the
    # one-token sequences (a prefill bucket's decodes) and the last token of a longer sequence
    # that starts a new window (the chunked kernel, launched before, leaves it and the state
    # before it in the slot). So a token alone in its window takes this kernel's bits whether
    # it is a decode, a prompt's last token prefilled in one step, or a one-token prefill chunk
    pdl_enter(PDL)  # before any global access (pdl.py)
    NV: tl.constexpr = (DV + BV - 1) // BV
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the sequence's step inputs and the head's gate parameters all at once, before the early
    # exits (a load after a branch is not issued before it: two more round trips before the
    # state's load, on a decode's chain of dependent loads)
    q0 = tl.load(qsl_ptr + s)
    q1 = tl.load(qsl_ptr + s + 1)
    seq_len = tl.load(seq_lens_ptr + s)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    if q1 <= q0:
        return
    if SINGLE_ONLY and q1 - q0 != 1:
        if seq_len % BT != 1:
            return
        q0 = q1 - 1
    ctx = seq_len - (q1 - q0)
    kh = h // (HV // HK)  # value head h reads key head h // r (repeat_interleave)
    rk = tl.arange(0, BK)
    rv = vb * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    # i32 offsets from a scalar base (int64 pointers to the whole tile, live from the load to the
    # store, would hold 2 registers an element)
    sbase = state_ptr + slot * (HV * DK * DV) + h * (DK * DV)
    soff = rk[:, None] * DV + rv[None, :]
    smask = mk[:, None] & mv[None, :]
    S = tl.load(sbase + soff, mask=smask & (ctx > 0) & (slot >= 0), other=0.0).to(tl.float32)
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
        row = o_ptr + t64 * stride_o + h * DV
        if NORM and NV == 1:
            o = _gated_norm(o, z_ptr + t64 * stride_z + h * DV, nw_ptr, rv, mv, norm_eps, DV,
                            o_ptr.dtype.element_ty)
        tl.store(row + rv, o.to(o_ptr.dtype.element_ty), mask=mv)
        if NORM and NV > 1:
            _norm_if_last(cnt_ptr + t64 * HV + h, row, z_ptr + t64 * stride_z + h * DV, nw_ptr, norm_eps, DV,
                          BDV, NV)
    if slot >= 0:
        tl.store(sbase + soff, S, mask=smask)


@triton.jit
def gdn_chunked_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, o_ptr, slots_ptr,
                       seq_lens_ptr, qsl_ptr, stride_qk, stride_v, stride_ab, stride_o, scale,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, SKIP_SINGLE: tl.constexpr,
                       PDL: tl.constexpr = False):
    # grid: (S, HV, cdiv(DV, BV)); BT = the chunk size (64). Every step of the form is
    # separable over the value columns, so a program owns a [DK, BV] slice of the state (the
    # K K^T solve is recomputed per slice). SKIP_SINGLE: leave the tokens alone in their window
    # at the end of a chunk (one-token sequences, and a last token that starts a new window) to
    # the recurrent kernel (SINGLE_ONLY), launched after this one
    pdl_enter(PDL)  # before any global access (pdl.py)
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q0 = tl.load(qsl_ptr + s)
    q1 = tl.load(qsl_ptr + s + 1)
    n = q1 - q0
    if n <= 0:
        return
    if SKIP_SINGLE and n == 1:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx = seq_len - n
    if SKIP_SINGLE and seq_len % BT == 1:
        n = n - 1  # the last token, alone in its window: the recurrent kernel's
    slot = tl.load(slots_ptr + s).to(tl.int64)
    kh = h // (HV // HK)
    rk, rv, rt = tl.arange(0, BK), vb * BV + tl.arange(0, BV), tl.arange(0, BT)
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
def gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, n_rows_ptr, stride_x, stride_z, stride_y, eps,
                          HV: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
    # grid: (T, HV); x, y: [T, HV, DV]; z: [T, HV * DV]; w: [DV]; rows from *n_rows_ptr on: padding
    pdl_enter(PDL)  # before any global access (pdl.py)
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if t >= tl.load(n_rows_ptr):
        return
    r = tl.arange(0, BV)
    m = r < DV
    x = tl.load(x_ptr + t * stride_x + h * DV + r, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * stride_z + h * DV + r, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + r, mask=m, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    xn = (x / tl.sqrt(tl.sum(x * x, 0) / DV + eps)).to(dt).to(tl.float32)
    y = (w * xn).to(dt).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    tl.store(y_ptr + t * stride_y + h * DV + r, y.to(dt), mask=m)


@triton.jit
def sigmoid_mul_kernel(x_ptr, gate_ptr, y_ptr, add_ptr, n_rows_ptr, stride_gt, stride_gh,
                       H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False,
                       GATE_PER_HEAD: tl.constexpr = False, HAS_ADD: tl.constexpr = False):
    # grid: (T, H); x, y: [T, H, D]; gate: [T, H, D] with row strides (the gated attention's gate
    # columns of its q projection), or [T, H, 1] broadcast over D (GATE_PER_HEAD: the shared
    # expert's one gate a token); y = x * sigmoid(gate), sigmoid rounded to x's dtype first;
    # HAS_ADD: y = add + that product (rounded first), as the graph's sigmoid_mul then add
    pdl_enter(PDL)  # before any global access (pdl.py)
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if t >= tl.load(n_rows_ptr):
        return
    r = tl.arange(0, BD)
    m = r < D
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + (t * H + h) * D + r, mask=m, other=0.0).to(tl.float32)
    if GATE_PER_HEAD:
        gt = tl.load(gate_ptr + t * stride_gt + h * stride_gh).to(tl.float32)
    else:
        gt = tl.load(gate_ptr + t * stride_gt + h * stride_gh + r, mask=m, other=0.0).to(tl.float32)
    sg = (1.0 / (1.0 + tl.exp(-gt))).to(dt).to(tl.float32)
    y = (x * sg).to(dt)
    if HAS_ADD:
        y = (tl.load(add_ptr + (t * H + h) * D + r, mask=m, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dt)
    tl.store(y_ptr + (t * H + h) * D + r, y, mask=m)


# -- specs and wrappers ----------------------------------------------------------------
# Wrappers take numpy arrays (the interpreter; outputs allocated here and returned) or Bufs
# (codegen/lower.py records launches over symbolic pointers; outputs given).

def _meta(x) -> Buf:
    """A step-input i32 vector: a Buf or a device tensor as it is, anything else as a host i32 array."""
    return x if isinstance(x, Buf) or not is_host(x) else as_buf(np.ascontiguousarray(x, dtype=np.int32))


def _out(out, shape, like) -> Buf:
    return as_buf(out) if out is not None else as_buf(np.empty(shape, dtype=like.dtype))


def _unwrap(b):
    return b.array if getattr(b, "on_host", False) else b


def _rows(n_rows, t) -> Buf:
    return _meta(np.array([t], np.int32) if n_rows is None else n_rows)


def causal_conv1d_spec(n_seq: int, c: int, kw: int, dtype: str, state_dtype: str, *, silu: bool,
                       block: int = 128) -> KernelSpec:
    return KernelSpec(module=__name__, kernel="causal_conv1d_kernel",
                      signature=dict(x_ptr=sig_type(dtype), w_ptr=sig_type(dtype), state_ptr=sig_type(state_dtype),
                                     y_ptr=sig_type(dtype), slots_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32",
                                     stride_x="i32", stride_y="i32"),
                      constexprs=dict(C=c, KW=kw, BLOCK=block, SILU=silu), grid=(n_seq, cdiv(c, block)),
                      num_warps=4, num_stages=1)


def causal_conv1d(x, w, state, seq_lens, query_start_loc, state_slots, out=None, *, silu: bool = True,
                  block: int = 128):
    """x: [T, C] (rows may be strided); w: [C, 1, K] (K <= 4); state: [NS, C, K-1] (in place)
    -> y [T, C] (silu(conv) if silu). One program per (sequence, channel block)."""
    x, w, state = as_buf(x), as_buf(w), as_buf(state)
    t, c = shape_of(x)
    kw = shape_of(w)[-1]
    check(2 <= kw <= 4, f"causal_conv1d: kernel width {kw} (supported: 2..4)")
    check(tuple(shape_of(state)[1:]) == (c, kw - 1), "causal_conv1d: state is not [NS, C, K-1]")
    check(strides_of(x)[1] == 1 and strides_of(state)[1:] == (kw - 1, 1), "causal_conv1d: x columns or state strided")
    y = _out(out, (t, c), x)
    check(shape_of(y) == (t, c) and strides_of(y) == (c, 1), "causal_conv1d: out must be a packed [T, C]")
    seq_lens = _meta(seq_lens)
    spec = causal_conv1d_spec(shape_of(seq_lens)[0], c, kw, dtype_name(x), dtype_name(state), silu=silu, block=block)
    launch(spec, [x, w, state, y, _meta(state_slots), seq_lens, _meta(query_start_loc), strides_of(x)[0], c])
    return _unwrap(y)


# The recurrent (decode) kernel's default launch: a head's value columns in DV / BV programs.
# One program per head (BV = DV = 128, 4 warps: the fused norm's old launch) took 255 registers and
# spilled ~670 bytes a thread (ptxas, sm_90; 8 warps the same), and at batch 1 left 100 of 132 SMs
# idle (32-48 heads): 12.4 us a layer on the H200 for 4 MB of state traffic. [128, 32] on 4 warps:
# 128 registers, no spills, 4 programs a head (so [128, 8] on 1 warp; vLLM's
# fla/ops/fused_recurrent.py fused_recurrent_gated_delta_rule_fwd takes BV = min(V, 8) on 1 warp).
# The same arithmetic for every BV (equal bits under the interpreter; the fused norm sums the whole
# row in one program either way: _norm_if_last); on a GPU the dk sums' order may follow the tile.
RECURRENT_BV, RECURRENT_WARPS = 32, 4


def gdn_spec(form: str, n_seq: int, hk: int, hv: int, dk: int, dv: int, dtypes: tuple[str, str, str], *,
             block_v: int, mixed: bool = False, chunk: int = CHUNK, norm: bool = False,
             num_warps: int | None = None) -> KernelSpec:
    """form "recurrent" (decode; in a mixed bucket only its one-token sequences) or "chunked"
    (prefill; in a mixed bucket not the one-token sequences). dtypes: (q/k, v/out, a/b).
    norm (recurrent only): the gated RMSNorm fused (split heads: the last program of a row norms it)."""
    qk, v, ab = (sig_type(d) for d in dtypes)
    sig = dict(q_ptr=qk, k_ptr=qk, v_ptr=v, a_ptr=ab, b_ptr=ab, alog_ptr="*fp32", dtb_ptr="*fp32",
               state_ptr="*fp32", o_ptr=v, slots_ptr="*i32", seq_lens_ptr="*i32", qsl_ptr="*i32", stride_qk="i32",
               stride_v="i32", stride_ab="i32", stride_o="i32", scale="fp32")
    bv = min(block_v, next_pow2(dv))
    cx = dict(HK=hk, HV=hv, DK=dk, DV=dv, BK=next_pow2(dk), BV=bv)
    div = ()
    if form == "recurrent":
        sig.update(z_ptr=v, nw_ptr=v, stride_z="i32", norm_eps="fp32", cnt_ptr="*i32")
        cx.update(SINGLE_ONLY=mixed, BT=chunk, NORM=norm, BDV=next_pow2(dv))
        kernel, warps = "gdn_recurrent_kernel", num_warps or 4
        # 16-byte aligned in every plan (a state's region, an arena tensor, the step inputs, the
        # counters' region): without the hint the state tile moved 4 bytes a load (ptxas, sm_90)
        div = ("state_ptr", "o_ptr", "slots_ptr", "seq_lens_ptr", "qsl_ptr", "cnt_ptr")
    elif form == "chunked":
        check(not norm, "gdn: the chunked form has no fused norm (its value blocks split a head)")
        cx.update(BT=chunk, SKIP_SINGLE=mixed)
        kernel, warps = "gdn_chunked_kernel", num_warps or 8
    else:
        raise ValueError(f"gdn_spec: form {form!r}")
    return KernelSpec(module=__name__, kernel=kernel, signature=sig, constexprs=cx, grid=(n_seq, hv, cdiv(dv, bv)),
                      num_warps=warps, num_stages=1, divisible=div)


def _gdn(form, q, k, v, a, b, a_log, dt_bias, state, seq_lens, query_start_loc, state_slots, out, *, scale,
         block_v, mixed, norm=None, counter=None, num_warps=None):
    q, k, v, a, b, state = map(as_buf, (q, k, v, a, b, state))
    t, hv, dv = shape_of(v)
    check(shape_of(q) == shape_of(k) and len(shape_of(q)) == 3, "gdn: q and k must be [T, Hk, dk] alike")
    _, hk, dk = shape_of(q)
    check(hv % hk == 0 and tuple(shape_of(state)[1:]) == (hv, dk, dv), "gdn: heads or state shape disagree")
    check(strides_of(q) == strides_of(k) and strides_of(a) == strides_of(b), "gdn: q/k and a/b strides differ")
    check(strides_of(q)[1:] == (dk, 1) and strides_of(v)[1:] == (dv, 1) and strides_of(a)[1] == 1,
          "gdn: heads must be packed within a row")
    check(dtype_name(state) == "float32", "gdn: the recurrent state is f32")
    o = _out(out, (t, hv, dv), v)
    check(shape_of(o) == (t, hv, dv) and strides_of(o) == (hv * dv, dv, 1), "gdn: out must be a packed [T, Hv, dv]")
    seq_lens = _meta(seq_lens)
    spec = gdn_spec(form, shape_of(seq_lens)[0], hk, hv, dk, dv, (dtype_name(q), dtype_name(v), dtype_name(a)),
                    block_v=block_v, mixed=mixed, norm=norm is not None, num_warps=num_warps)
    f32 = lambda x: x if isinstance(x, Buf) or not is_host(x) else as_buf(np.ascontiguousarray(x, np.float32))
    args = [q, k, v, a, b, f32(a_log), f32(dt_bias), state, o, _meta(state_slots), seq_lens,
            _meta(query_start_loc), strides_of(q)[0], strides_of(v)[0], strides_of(a)[0], hv * dv,
            float(dk ** -0.5 if scale is None else scale)]
    if form == "recurrent":
        if norm is None:  # unused by the kernel (NORM off): any buffer of the dtype will do
            args += [o, o, 0, 0.0, seq_lens]
        else:
            z, w, eps = as_buf(norm[0]), as_buf(norm[1]), norm[2]
            check(shape_of(w) == (dv,) and dtype_name(w) == dtype_name(v) == dtype_name(z), "gdn norm: w [dv], dtypes")
            check(shape_of(z)[0] == t and strides_of(z)[-1] == 1 and int(np.prod(shape_of(z)[1:])) == hv * dv
                  and (len(shape_of(z)) == 2 or strides_of(z)[1] == dv),
                  "gdn norm: z must be [T, Hv * dv] (rows strided, heads packed)")
            args += [z, w, strides_of(z)[0], float(eps)]
            if spec.grid[2] == 1:
                args.append(seq_lens)  # unused: the program holds its row whole
            else:
                cnt = as_buf(np.zeros((t, hv), np.int32)) if counter is None else as_buf(counter)
                check(tuple(shape_of(cnt)) == (t, hv) and dtype_name(cnt) == "int32",
                      "gdn norm: counter must be i32 [T, Hv] (zero; the kernel leaves it zero)")
                args.append(cnt)
    launch(spec, args)
    return _unwrap(o)


def gdn_recurrent(q, k, v, a, b, a_log, dt_bias, state, seq_lens, query_start_loc, state_slots, out=None, *,
                  scale: float | None = None, block_v: int = RECURRENT_BV, mixed: bool = False, norm=None,
                  counter=None, num_warps: int = RECURRENT_WARPS):
    """The fused gates + l2 norms + gated delta rule, token by token (decode). q, k: [T, Hk, dk]
    (raw, after the conv; q's norm scaled by `scale`, dk^-0.5 by default), v: [T, Hv, dv], a, b:
    [T, Hv]; state: f32 [NS, Hv, dk, dv] in place. mixed: only the one-token sequences.
    norm: (z, w, eps): out gets gated_rms_norm(o, z, w) instead of o; where block_v splits a head,
    counter: i32 [T, Hv], zero (left zero; a fresh one if not given: the interpreter)."""
    return _gdn("recurrent", q, k, v, a, b, a_log, dt_bias, state, seq_lens, query_start_loc, state_slots, out,
                scale=scale, block_v=block_v, mixed=mixed, norm=norm, counter=counter, num_warps=num_warps)


def gdn_chunked(q, k, v, a, b, a_log, dt_bias, state, seq_lens, query_start_loc, state_slots, out=None, *,
                scale: float | None = None, block_v: int = 64, mixed: bool = False):
    """As gdn_recurrent, through the chunked form in 64-token chunks at absolute positions
    (prefill). mixed: leave the one-token sequences to gdn_recurrent(mixed=True)."""
    return _gdn("chunked", q, k, v, a, b, a_log, dt_bias, state, seq_lens, query_start_loc, state_slots, out,
                scale=scale, block_v=block_v, mixed=mixed)


def gated_rms_norm_spec(t: int, hv: int, dv: int, dtype: str, z_dtype: str) -> KernelSpec:
    return KernelSpec(module=__name__, kernel="gated_rms_norm_kernel",
                      signature=dict(x_ptr=sig_type(dtype), z_ptr=sig_type(z_dtype), w_ptr=sig_type(dtype),
                                     y_ptr=sig_type(dtype), n_rows_ptr="*i32", stride_x="i32", stride_z="i32",
                                     stride_y="i32", eps="fp32"),
                      constexprs=dict(HV=hv, DV=dv, BV=next_pow2(dv)), grid=(t, hv), num_warps=4, num_stages=1)


def gated_rms_norm(x, z, w, out=None, *, eps: float, n_rows=None):
    """x: [T, Hv, dv], z: [T, Hv * dv] or [T, Hv, dv] (heads packed, rows strided), w: [dv]
    -> rms_norm(x) * w * silu(z), [T, Hv, dv] in x's dtype."""
    x, z, w = as_buf(x), as_buf(z), as_buf(w)
    t, hv, dv = shape_of(x)
    check(strides_of(x) == (hv * dv, dv, 1) and strides_of(z)[-1] == 1, "gated_rms_norm: x packed, z rows")
    y = _out(out, (t, hv, dv), x)
    spec = gated_rms_norm_spec(t, hv, dv, dtype_name(x), dtype_name(z))
    launch(spec, [x, z, w, y, _rows(n_rows, t), hv * dv, strides_of(z)[0], hv * dv, float(eps)])
    return _unwrap(y)


def sigmoid_mul_spec(t: int, h: int, d: int, dtype: str, gate_dtype: str, *, per_head: bool = False,
                     add: bool = False) -> KernelSpec:
    cx = dict(H=h, D=d, BD=next_pow2(d), GATE_PER_HEAD=per_head, HAS_ADD=add)
    return KernelSpec(module=__name__, kernel="sigmoid_mul_kernel",
                      signature=dict(x_ptr=sig_type(dtype), gate_ptr=sig_type(gate_dtype), y_ptr=sig_type(dtype),
                                     add_ptr=sig_type(dtype), n_rows_ptr="*i32", stride_gt="i32", stride_gh="i32"),
                      constexprs=cx, grid=(t, h), num_warps=1 if d <= 256 else 4, num_stages=1)


def sigmoid_mul(x, gate, out=None, *, n_rows=None, add=None):
    """x: packed [T, H, D]; gate: [T, H, D] (or [T, H, 1]: one gate per head, broadcast over D),
    its rows and heads strided -> x * sigmoid(gate), plus `add` (packed [T, H, D]) if given."""
    x, gate, add = as_buf(x), as_buf(gate), as_buf(add)
    t, h, d = shape_of(x)
    per_head = shape_of(gate) == (t, h, 1)
    check((per_head or (shape_of(gate) == (t, h, d) and strides_of(gate)[-1] == 1))
          and strides_of(x) == (h * d, d, 1),
          "sigmoid_mul: x packed [T, H, D], gate [T, H, D] or [T, H, 1] with packed rows")
    if add is not None:
        check(shape_of(add) == (t, h, d) and strides_of(add) == (h * d, d, 1) and dtype_name(add) == dtype_name(x),
              "sigmoid_mul: add must be packed [T, H, D] in x's dtype")
    y = _out(out, (t, h, d), x)
    spec = sigmoid_mul_spec(t, h, d, dtype_name(x), dtype_name(gate), per_head=per_head, add=add is not None)
    launch(spec, [x, gate, y, add if add is not None else x, _rows(n_rows, t), strides_of(gate)[0],
                  strides_of(gate)[1]])
    return _unwrap(y)
