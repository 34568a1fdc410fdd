"""FP8 W8A8 ops: activation quantisation to e4m3, the FP8 linear, and their fusions with the
norm and the SwiGLU activation that produce the quantised input (passes/fuse_rmsnorm_quant.py,
passes/fuse_silu_mul_quant.py).

The numpy references do what the GPU will: activations quantised to e4m3 with one f32 scale
per token per `group` columns, the matmul of the e4m3 values accumulated in f32 one activation
group at a time, each group's partial sum times its activation and weight scales. They follow
vLLM's references in tests/kernels/quant_utils.py: `native_per_token_group_quant_fp8` (scale =
max(amax, 1e-10) / 448, q = clamp(x / scale, +-448) cast to e4m3), `ref_dynamic_per_token_quant`
(the same per token, the scale clamped at 1 / (448 * 512)) and `native_w8a8_block_matmul` (for
each k-block, C += (A_q[:, kb] @ B_q[nb, kb]^T) * As[:, kb] * Bs[nb, kb]). A static scale
(ModelOpt's input_scale) is the same quantisation with a given scale.

Why ops of their own and not attrs on `linear`: an fp8 weight on a plain `linear` is exactly the
bug being fixed (e4m3 values used without scales), and a target that does not know these ops
refuses them by name (codegen/lower.py: "no GPU kernel for op ...") instead of running them as
bf16 GEMMs. The quantisation is an op too, so the passes can fuse it into its producer.
"""
from __future__ import annotations

import numpy as np

from kiln.graph.dtype import DType, to_numpy
from kiln.graph.ops import OPS, add_rms_norm, rms_norm, silu_mul

_f32 = np.float32
_FP8 = to_numpy(DType.fp8e4m3)
_FP8_MAX = _f32(448.0)


def quantize_fp8(x: np.ndarray, scales: tuple[np.ndarray, ...], group: int, min_scale: float):
    """x: [T, K] -> (e4m3 [T, K], f32 scales [T, K // group]). Dynamic: each token's group of
    `group` columns gets scale max(amax / 448, min_scale) (a zero group gets min_scale and
    quantises to zeros). Static (scales given): the largest of them, for every token (vLLM's
    merged q/k/v or gate/up layers take the max of their input scales; ModelOpt writes them equal)."""
    xf = x.astype(_f32, copy=False)
    t, k = xf.shape
    if scales:
        s = np.full((t, 1), max(_f32(np.asarray(v, _f32).max()) for v in scales), _f32)
        q = np.clip(xf / s, -_FP8_MAX, _FP8_MAX)
        return q.astype(_FP8), s
    g = xf.reshape(t, k // group, group)
    s = np.maximum(np.abs(g).max(axis=-1) / _FP8_MAX, _f32(min_scale)).astype(_f32)  # [T, K / group]
    q = np.clip(g / s[..., None], -_FP8_MAX, _FP8_MAX).reshape(t, k)
    return q.astype(_FP8), s


def _infer_quant(ins, attrs):
    x = ins[0]
    group, k = attrs["group"], x.shape[-1]
    if len(x.shape) != 2 or not isinstance(k, int) or k % group:
        raise ValueError(f"quant_fp8: {x.name} must be [T, K] with K a multiple of the group {group}")
    n = 1 if len(ins) > 1 else k // group
    return [(DType.fp8e4m3, x.shape), (DType.f32, (x.shape[0], n))]


@OPS.register("quant_fp8", inputs=(1, 4), infer=_infer_quant)
def quant_fp8(x, *scales, group: int, min_scale: float = 0.0):
    """x: [T, K], scales: static per-tensor input scales ([1] each) or none (dynamic)
    -> (e4m3 [T, K], f32 [T, K // group] dynamic or [T, 1] static)."""
    return quantize_fp8(x, scales, group, min_scale)


def _infer_linear_fp8(ins, attrs):
    x, xs, w, ws = ins[:4]
    (n, k), (bn, bk) = w.shape, attrs["block"]
    if x.shape[-1] != k or x.dtype != DType.fp8e4m3 or w.dtype != DType.fp8e4m3:
        raise ValueError(f"linear_fp8: x {x.name} and weight {w.name} must be e4m3 with the same K")
    if -(-n // bn) * -(-k // bk) != int(np.prod(ws.shape)):
        raise ValueError(f"linear_fp8: weight scale {ws.name} {list(ws.shape)} is not one per [{bn}, {bk}] block "
                         f"of {w.name} [{n}, {k}]")
    groups = xs.shape[-1]
    if k % groups or bk % (k // groups):
        raise ValueError(f"linear_fp8: {groups} activation groups do not tile weight {w.name}'s {bk}-column blocks")
    return [(DType(attrs["out_dtype"]), (x.shape[0], n))]


@OPS.register("linear_fp8", inputs=(4, 5), infer=_infer_linear_fp8)
def linear_fp8(x, xs, w, ws, bias=None, *, block, out_dtype):
    """x: e4m3 [T, K] with scales xs: f32 [T, G] (one per K / G columns); w: e4m3 [N, K] with
    scales ws: one per [bn, bk] block (block = (bn, bk); per channel (1, K), per tensor (N, K)),
    bias: [N] -> [T, N] in out_dtype. Accumulates in f32 over the activation groups in order."""
    t, k = x.shape
    n = w.shape[0]
    bn, bk = block
    ws = np.asarray(ws, _f32).reshape(-(-n // bn), -(-k // bk))
    gk = k // xs.shape[1]  # columns per activation scale
    xf, wf = x.astype(_f32), w.astype(_f32)
    acc = np.zeros((t, n), _f32)
    for j in range(xs.shape[1]):
        cols = slice(j * gk, (j + 1) * gk)
        w_scale = np.repeat(ws[:, (j * gk) // bk], bn)[:n]  # [N]: each row's block scale
        acc += (xf[:, cols] @ wf[:, cols].T) * xs[:, j:j + 1] * w_scale[None, :]
    if bias is not None:
        acc += bias.astype(_f32, copy=False)
    return acc.astype(to_numpy(DType(out_dtype)))


# -- fused producers: the op they replace, then quant_fp8, by definition -----------------

def _infer_norm_quant(ins, attrs, n_lead: int):
    x = ins[0]
    q, s = _infer_quant([x, *ins[n_lead:]], attrs)
    return [q, s]


@OPS.register("rms_norm_quant", inputs=(2, 5), infer=lambda ins, a: _infer_norm_quant(ins, a, 2))
def rms_norm_quant(x, w, *scales, eps: float, offset: float = 0.0, group: int, min_scale: float = 0.0):
    """quant_fp8(rms_norm(x, w)): the normalised row rounded to x's dtype, then quantised."""
    return quantize_fp8(rms_norm(x, w, eps=eps, offset=offset), scales, group, min_scale)


def _infer_add_norm_quant(ins, attrs):
    x = ins[0]
    return [*_infer_norm_quant(ins, attrs, 3), (x.dtype, x.shape)]


@OPS.register("add_rms_norm_quant", inputs=(3, 6), infer=_infer_add_norm_quant)
def add_rms_norm_quant(x, residual, w, *scales, eps: float, offset: float = 0.0, group: int,
                       min_scale: float = 0.0):
    """-> (e4m3 [T, H], scales, x + residual): add_rms_norm, its normalised output quantised."""
    normed, summed = add_rms_norm(x, residual, w, eps=eps, offset=offset)
    return (*quantize_fp8(normed, scales, group, min_scale), summed)


@OPS.register("silu_mul_quant", inputs=(2, 5), infer=lambda ins, a: _infer_norm_quant(ins, a, 2))
def silu_mul_quant(gate, up, *scales, group: int, min_scale: float = 0.0):
    """quant_fp8(silu_mul(gate, up)): the SwiGLU activation rounded to gate's dtype, then quantised."""
    return quantize_fp8(silu_mul(gate, up), scales, group, min_scale)


# -- MoE experts in block-wise FP8 (models/moe.py) ------------------------------------------

def _infer_moe_experts_fp8(ins, attrs):
    xq, xs, ids, w, w13, s13, w2, s2 = ins
    bn, bk = attrs["block"]
    if w13.dtype != DType.fp8e4m3 or w2.dtype != DType.fp8e4m3 or xq.dtype != DType.fp8e4m3:
        raise ValueError(f"moe_experts_fp8: x {xq.name}, {w13.name} and {w2.name} must be e4m3")
    if len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError(f"moe_experts_fp8: {w13.name} and {w2.name} must be [E, 2I, H] and [E, H, I]")
    e, two_i, h = w13.shape
    i = two_i // 2
    if two_i % 2 or tuple(w2.shape) != (e, h, i) or xq.shape[-1] != h:
        raise ValueError(f"moe_experts_fp8: w13 {list(w13.shape)} and w2 {list(w2.shape)} are not [E, 2I, H] and "
                         f"[E, H, I] for x [T, {xq.shape[-1]}]")
    if h % bk or i % bk or i % bn or xs.shape[-1] != h // bk:
        raise ValueError(f"moe_experts_fp8: H={h} and I={i} must be whole [{bn}, {bk}] blocks, x's scales "
                         f"{list(xs.shape)} one per {bk} columns")
    for s, (n, k) in ((s13, (two_i, h)), (s2, (h, i))):
        if tuple(s.shape) != (e, -(-n // bn), -(-k // bk)):
            raise ValueError(f"moe_experts_fp8: weight scale {s.name} {list(s.shape)} is not one per [{bn}, {bk}] "
                             f"block of [{e}, {n}, {k}]")
    if tuple(ids.shape) != tuple(w.shape) or ids.shape[0] != xq.shape[0] or ids.dtype != DType.i32:
        raise ValueError(f"moe_experts_fp8: topk ids {list(ids.shape)} ({ids.dtype}) and weights {list(w.shape)} "
                         f"must both be [T, k], ids i32")
    return [(DType(attrs["out_dtype"]), (xq.shape[0], h))]


def _by_expert(topk_ids):
    """(expert, its tokens, their ranks) for each expert some token chose, in expert order."""
    return [(e, *np.nonzero(topk_ids == e)) for e in np.unique(topk_ids)]


def moe_fp8_act(xq, xs, topk_ids, w13, s13, *, block, out_dtype, min_scale: float = 0.0):
    """moe_experts_fp8's quantised intermediate: (aq e4m3 [T*k, I], as f32 [T*k, I / bk]), row
    r = t * k + j the SiLU-and-mul of token t's gate_up through expert ids[t, j], quantised."""
    t, k = topk_ids.shape
    inter = w13.shape[1] // 2
    a = np.zeros((t * k, inter), to_numpy(DType(out_dtype)))
    for e, tok, rank in _by_expert(topk_ids):
        h = linear_fp8(xq[tok], xs[tok], w13[e], s13[e], block=block, out_dtype=out_dtype)
        a[tok * k + rank] = silu_mul(h[:, :inter], h[:, inter:])
    return quantize_fp8(a, (), block[1], min_scale)


@OPS.register("moe_experts_fp8", inputs=8, infer=_infer_moe_experts_fp8)
def moe_experts_fp8(xq, xs, topk_ids, topk_weights, w13, s13, w2, s2, *, block, out_dtype, min_scale: float = 0.0):
    """graph/moe_ops.py moe_experts with block-wise FP8 experts, W8A8 as linear_fp8: xq e4m3 [T, H]
    with xs f32 [T, H / bk] (x quantised once per token per bk columns by a quant_fp8 node: every
    expert of a token reads the same quantised row); w13 e4m3 [E, 2I, H] (each expert's gate rows,
    then its up rows) with s13 f32 [E, 2I / bn, H / bk]; w2 e4m3 [E, H, I] with s2 [E, H / bn, I / bk].
    For assignment r = t * k + j of expert e = ids[t, j]:
        h    = linear_fp8(xq[t], xs[t], w13[e], s13[e])      (rounded to out_dtype, a linear's store)
        a[r] = silu_mul(h[:I], h[I:])                         (rounded to out_dtype)
        aq, as = quantize_fp8(a, group=bk, min_scale)         (per assignment per bk columns)
        o[r] = linear_fp8(aq[r], as[r], w2[e], s2[e])         (rounded)
        y[t] = sum_j w[t, j] * o[t*k + j], j in rank order, in f32, rounded once.
    vLLM's fused_moe with block quantisation does the same: fused_experts_impl quantises the input
    and the SiLU-and-mul output with moe_kernel_quantize_input -> per_token_group_quant_fp8 (block_k
    columns a group), and fused_moe_kernel scales each K block's dot by a_scale * b_scale
    (vllm/model_executor/layers/fused_moe/fused_moe.py, read for its semantics)."""
    t, k = topk_ids.shape
    od = to_numpy(DType(out_dtype))
    aq, as_ = moe_fp8_act(xq, xs, topk_ids, w13, s13, block=block, out_dtype=out_dtype, min_scale=min_scale)
    o = np.zeros((t, k, w2.shape[1]), _f32)
    for e, tok, rank in _by_expert(topk_ids):
        r = tok * k + rank
        o[tok, rank] = linear_fp8(aq[r], as_[r], w2[e], s2[e], block=block, out_dtype=out_dtype)
    wts = topk_weights.astype(_f32)
    y = np.zeros((t, w2.shape[1]), _f32)
    for j in range(k):  # rank order (graph/moe_ops.py: batch invariance)
        y += wts[:, j:j + 1] * o[:, j]
    return y.astype(od)
