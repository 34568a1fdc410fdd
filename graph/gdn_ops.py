"""Ops of the Qwen3-Next / Qwen3.5 hybrids (../shared/specs/qwen3_5.md): the Gated DeltaNet
layer's conv, gates, l2 norm, the gated delta rule and its gated output norm, and the gated
attention's sigmoid gate. Registered into graph/ops.py's OPS; numpy references in float32.

Per-request state lives in graph states with a leading `NS` dim (one slot per running
request): `causal_conv1d`'s conv state [NS, C, K-1] (the last K-1 inputs, in the activation
dtype) and `gated_delta_rule`'s recurrent state [NS, Hv, dk, dv] (float32, HF's K-major
layout). A step input `state_slots` i32[S] names each sequence's slot (-1: a sequence with
no state, skipped); a sequence whose context (seq_lens - its query length) is 0 starts from
zero state whatever its slot holds (vLLM's has_initial_state), so a slot needs no clearing.
"""
from __future__ import annotations

import numpy as np

from kiln.graph.dtype import DType
from kiln.graph.ops import OPS, _as, _like, _silu

_f32 = np.float32
CHUNK = 64  # the chunked form's chunk size (HF torch_chunk_gated_delta_rule, FLA)


def _segments(seq_lens, query_start_loc, state_slots):
    """(seq, q0, q1, context, slot) of every sequence with tokens this step."""
    for s in range(len(seq_lens)):
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if q1 > q0:
            yield s, q0, q1, int(seq_lens[s]) - (q1 - q0), int(state_slots[s])


# -- depthwise causal conv1d with a rolling state ------------------------------------

def _infer_conv(ins, attrs):
    x, state, w = ins[0], ins[1], ins[2]
    c, k = w.shape[0], w.shape[-1]
    if x.shape[-1] != c or tuple(state.shape[1:]) != (c, k - 1):
        raise ValueError(f"causal_conv1d: x {list(x.shape)}, state {list(state.shape)} and weight "
                         f"{list(w.shape)} disagree (want [T, C], [NS, C, K-1], [C, 1, K])")
    return [(x.dtype, x.shape), (state.dtype, state.shape)]


@OPS.register("causal_conv1d", inputs=6, inplace={1: 1}, infer=_infer_conv)
def causal_conv1d(x, conv_state, w, seq_lens, query_start_loc, state_slots, *, activation: str = ""):
    """x: [T, C]; conv_state: [NS, C, K-1] (written in place); w: [C, 1, K], no bias;
    -> (y [T, C], conv_state). y[t, c] = sum_j w[c, 0, j] * x[t - (K-1) + j, c] within the
    sequence, the K-1 inputs before its first token this step coming from its slot (zeros for
    a fresh sequence). The slot then holds the sequence's last K-1 inputs (spec 6.2, 6.9).
    activation "silu" (passes/fuse_conv_silu.py): silu of the f32 sum, rounded once."""
    if activation not in ("", "silu"):
        raise ValueError(f"causal_conv1d: unknown activation {activation!r}")
    wk = w.reshape(w.shape[0], w.shape[-1]).astype(_f32)  # [C, K]
    k = wk.shape[1]
    y = np.zeros(x.shape, dtype=_f32)
    for _, q0, q1, ctx, slot in _segments(seq_lens, query_start_loc, state_slots):
        xs = x[q0:q1].astype(_f32)
        hist = conv_state[slot].T.astype(_f32) if ctx > 0 and slot >= 0 else np.zeros((k - 1, x.shape[1]), _f32)
        full = np.concatenate([hist, xs])  # [K-1 + n, C]
        n = q1 - q0
        for j in range(k):
            y[q0:q1] += full[j:j + n] * wk[:, j]
        if slot >= 0:
            conv_state[slot] = full[-(k - 1):].T.astype(conv_state.dtype)
    return _as(_silu(y) if activation else y, x), conv_state


# -- gates, l2 norm -------------------------------------------------------------------

def _softplus(x):
    # torch's default: beta 1, threshold 20 (x > 20 -> x), as the vLLM kernels (spec 6.3)
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(_f32)


def _sigmoid(x):
    return (1.0 / (1.0 + np.exp(-x.astype(_f32)))).astype(_f32)


def _infer_gates(ins, attrs):
    a, b = ins[0], ins[1]
    return [(DType.f32, a.shape), (DType.f32, b.shape)]


@OPS.register("gdn_gates", inputs=4, infer=_infer_gates)
def gdn_gates(a, b, a_log, dt_bias):
    """a, b: [T, Hv]; a_log, dt_bias: [Hv] -> (g f32, beta f32), both [T, Hv]:
    g = -exp(A_log) * softplus(a + dt_bias) (the log decay), beta = sigmoid(b) rounded to b's
    dtype first (HF computes it on the bf16 tensor; spec 6.3, pitfall 5)."""
    g = -np.exp(a_log.astype(_f32)) * _softplus(a.astype(_f32) + dt_bias.astype(_f32))
    beta = _as(_sigmoid(b), b).astype(_f32)
    return g.astype(_f32), beta


def _infer_l2(ins, attrs):
    return [(DType.f32, ins[0].shape)]


@OPS.register("l2norm", inputs=1, infer=_infer_l2)
def l2norm(x, *, eps: float = 1e-6, scale: float = 1.0):
    """x: [..., d] -> f32 x / sqrt(sum(x^2) + eps) * scale: eps inside the root of the sum,
    not the mean, and the dk^-0.5 scale after the norm (spec 6.5, pitfall 4)."""
    xf = x.astype(_f32)
    return (xf / np.sqrt(np.sum(xf * xf, axis=-1, keepdims=True) + _f32(eps)) * _f32(scale)).astype(_f32)


# -- the gated delta rule --------------------------------------------------------------

def gdr_recurrent(q, k, v, g, beta, state):
    """One sequence, token by token (spec 6.6). q, k: [n, Hv, dk] (GQA already expanded,
    q normed and scaled), v: [n, Hv, dv], g, beta: [n, Hv], state: [Hv, dk, dv]; all f32.
    -> (o [n, Hv, dv], the final state). Decay first, then the delta update, then the read."""
    S = state.astype(_f32, copy=True)
    o = np.empty(v.shape, dtype=_f32)
    for t in range(q.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        u = np.einsum("hkv,hk->hv", S, k[t])
        S += k[t][:, :, None] * (beta[t][:, None] * (v[t] - u))[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, q[t])
    return o, S


def _gdr_one_chunk(q, k, v, g, beta, S):
    """The chunked (WY / UT) form over one chunk of n <= 64 tokens (spec 6.7), all heads at once:
    q, k [n, Hv, dk], v [n, Hv, dv], g, beta [n, Hv], S [Hv, dk, dv] -> (o, S_next)."""
    n = q.shape[0]
    G = np.cumsum(g, axis=0).T  # [Hv, n]
    diff = G[:, :, None] - G[:, None, :]  # G_i - G_j
    lower = np.tril(np.ones((n, n), dtype=bool))
    D = np.where(lower, np.exp(np.where(lower, diff, 0.0)), 0.0).astype(_f32)  # [Hv, n, n]
    qh, kh, vh = q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # head-major
    bh = beta.T[:, :, None]  # [Hv, n, 1]
    A = np.einsum("hid,hjd->hij", kh * bh, kh) * D
    A = np.where(np.tril(np.ones((n, n), dtype=bool), -1), A, 0.0)  # strictly lower
    Tm = np.linalg.inv(np.eye(n, dtype=_f32) + A).astype(_f32)  # unit lower triangular inverse
    U = Tm @ (vh * bh)  # [Hv, n, dv]
    W = Tm @ (kh * bh * np.exp(G)[:, :, None])  # [Hv, n, dk]
    vnew = U - W @ S
    o = (qh * np.exp(G)[:, :, None]) @ S + (np.einsum("hid,hjd->hij", qh, kh) * D) @ vnew
    glast = G[:, -1]
    S_next = np.exp(glast)[:, None, None] * S + \
        (kh * np.exp(glast[:, None] - G)[:, :, None]).transpose(0, 2, 1) @ vnew
    return o.transpose(1, 0, 2).astype(_f32), S_next.astype(_f32)


def gdr_chunked(q, k, v, g, beta, state, start: int = 0, chunk: int = CHUNK):
    """One sequence's tokens at absolute positions start.. through the chunked form, its chunks
    cut at multiples of `chunk` from the sequence's first token (the first may be partial), so
    a prompt prefilled in one step or over several sees the same chunks."""
    S = state.astype(_f32, copy=True)
    o = np.empty(v.shape, dtype=_f32)
    t, n = 0, q.shape[0]
    while t < n:
        e = min(n, t + chunk - (start + t) % chunk)
        o[t:e], S = _gdr_one_chunk(q[t:e], k[t:e], v[t:e], g[t:e], beta[t:e], S)
        t = e
    return o, S


def _infer_gdr(ins, attrs):
    q, k, v, g, beta, state = ins[:6]
    hv, dv = v.shape[1], v.shape[2]
    hk, dk = q.shape[1], q.shape[2]
    if tuple(state.shape[1:]) != (hv, dk, dv) or hv % hk or tuple(k.shape[1:]) != (hk, dk):
        raise ValueError(f"gated_delta_rule: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} and "
                         f"state {list(state.shape)} disagree (want [T, Hk, dk] twice, [T, Hv, dv], "
                         f"[NS, Hv, dk, dv], Hv a multiple of Hk)")
    return [(v.dtype, v.shape), (state.dtype, state.shape)]


@OPS.register("gated_delta_rule", inputs=9, inplace={1: 5}, infer=_infer_gdr)
def gated_delta_rule(q, k, v, g, beta, ssm_state, seq_lens, query_start_loc, state_slots, *, chunk_size: int = CHUNK):
    """q, k: f32 [T, Hk, dk] (l2-normed, q scaled by dk^-0.5); v: [T, Hv, dv]; g, beta: f32
    [T, Hv]; ssm_state: f32 [NS, Hv, dk, dv] (written in place) -> (o [T, Hv, dv] in v's
    dtype, ssm_state). Value head j reads key head j // (Hv / Hk) (repeat_interleave; spec
    6.4). A one-token chunk (decode) takes the recurrent form; longer chunks the chunked form
    in chunks at absolute multiples of chunk_size."""
    r = v.shape[1] // q.shape[1]
    qe, ke = np.repeat(q.astype(_f32), r, axis=1), np.repeat(k.astype(_f32), r, axis=1)
    vf = v.astype(_f32)
    out = np.zeros(v.shape, dtype=_f32)
    for _, q0, q1, ctx, slot in _segments(seq_lens, query_start_loc, state_slots):
        S0 = ssm_state[slot] if ctx > 0 and slot >= 0 else np.zeros(ssm_state.shape[1:], dtype=_f32)
        args = (qe[q0:q1], ke[q0:q1], vf[q0:q1], g[q0:q1].astype(_f32), beta[q0:q1].astype(_f32), S0)
        if q1 - q0 == 1:
            o, S = gdr_recurrent(*args)
        else:
            o, S = gdr_chunked(*args, start=ctx, chunk=chunk_size)
        out[q0:q1] = o
        if slot >= 0:
            ssm_state[slot] = S
    return _as(out, v), ssm_state


def _infer_fused_gdr(ins, attrs):
    q, k, v, a, b, a_log, dt_bias, state = ins[:8]
    if tuple(a.shape) != tuple(b.shape) or a.shape[-1] != v.shape[1]:
        raise ValueError(f"fused_gated_delta_rule: a {list(a.shape)} and b {list(b.shape)} must be [T, Hv] "
                         f"with v {list(v.shape)}")
    return _infer_gdr([q, k, v, a, a, state], attrs)


@OPS.register("fused_gated_delta_rule", inputs=11, inplace={1: 7}, infer=_infer_fused_gdr)
def fused_gated_delta_rule(q, k, v, a, b, a_log, dt_bias, ssm_state, seq_lens, query_start_loc, state_slots, *,
                           q_scale: float, eps: float = 1e-6, chunk_size: int = CHUNK):
    """gated_delta_rule with its preamble folded in (passes/fold_gdn_gates.py): q, k raw
    [T, Hk, dk] (the conv's output), l2-normed here (q times q_scale), the gates from a, b,
    A_log, dt_bias here: the one launch of codegen/triton/gdn.py's kernels. Same numbers as the
    unfused ops, composed."""
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    return gated_delta_rule(l2norm(q, eps=eps, scale=q_scale), l2norm(k, eps=eps), v, g, beta, ssm_state, seq_lens,
                            query_start_loc, state_slots, chunk_size=chunk_size)


def _infer_fused_gdr_norm(ins, attrs):
    (dt, shape), state = _infer_fused_gdr(ins[:11], attrs)
    z, w = ins[11], ins[12]
    if int(np.prod(z.shape[1:])) != shape[1] * shape[2] or z.shape[0] != shape[0] or tuple(w.shape) != (shape[2],):
        raise ValueError(f"fused_gated_delta_rule_norm: z {list(z.shape)} and w {list(w.shape)} must be "
                         f"[T, Hv, dv] and [dv] with the output {list(shape)}")
    return [(dt, shape), state]


@OPS.register("fused_gated_delta_rule_norm", inputs=13, inplace={1: 7}, infer=_infer_fused_gdr_norm)
def fused_gated_delta_rule_norm(q, k, v, a, b, a_log, dt_bias, ssm_state, seq_lens, query_start_loc, state_slots,
                                z, w, *, q_scale: float, norm_eps: float, eps: float = 1e-6,
                                chunk_size: int = CHUNK):
    """fused_gated_delta_rule with the gated RMSNorm of its output folded in (passes/fold_gdn_norm.py):
    -> (gated_rms_norm(o, z, w), ssm_state), the same numbers as the two ops composed."""
    o, state = fused_gated_delta_rule(q, k, v, a, b, a_log, dt_bias, ssm_state, seq_lens, query_start_loc,
                                      state_slots, q_scale=q_scale, eps=eps, chunk_size=chunk_size)
    return gated_rms_norm(o, z.reshape(o.shape), w, eps=norm_eps), state


# -- output norm and gates --------------------------------------------------------------

@OPS.register("gated_rms_norm", inputs=3, infer=_like())
def gated_rms_norm(x, z, w, *, eps: float):
    """x: [T, Hv, dv], z: the same shape, w: [dv] (plain w, not 1 + w; spec 4.2, pitfall 2):
    normalise per head, round, times w, times silu(z) in f32, round once more (pitfall 3)."""
    xf = x.astype(_f32)
    xn = _as(xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + _f32(eps)), x).astype(_f32)
    y = _as(w.astype(_f32) * xn, x).astype(_f32)
    zf = z.astype(_f32)
    return _as(y * (zf / (1.0 + np.exp(-zf))), x)


@OPS.register("sigmoid_mul", inputs=2, infer=_like())
def sigmoid_mul(x, gate):
    """x * sigmoid(gate), sigmoid rounded to x's dtype first (the gated attention's output
    gate, applied before o_proj: spec 5, pitfall 10)."""
    return _as(x.astype(_f32) * _as(_sigmoid(gate), x).astype(_f32), x)
