"""Mixture-of-experts ops (Qwen3-MoE, Qwen3.5/3.6-MoE, Qwen3-Next: ../shared/specs/qwen3_5.md
section 7.2). Registered into graph/ops.py's OPS; numpy references in float32.

    logits = linear(x, gate.weight)                  # [T, E], the router GEMM (a plain linear)
    ids, w = moe_router(logits; top_k, renormalize)  # [T, k] i32, [T, k] f32, ranked best first
    y      = moe_experts(x, ids, w, w13, w2)         # [T, H]

The experts of a layer are two stacked weights, never E separate ones: w13 [E, 2I, H] (each
expert's gate rows, then its up rows: transformers' experts.gate_up_proj) and w2 [E, H, I]
(experts.down_proj). The shared expert of Qwen3.5-MoE / Qwen3-Next is built by the model from
plain linears, silu_mul and sigmoid_mul (models/moe.py).

Batch invariance by definition: a token's output is the sum over its own top-k ranks in rank
order 0..k-1, so it never depends on which other tokens share the step or how a kernel groups
tokens by expert. (transformers' eager loop sums in ascending expert id instead: the same
terms in another order, within f32 rounding of ours.)
"""
from __future__ import annotations

import numpy as np

from kiln.graph.dtype import DType
from kiln.graph.ops import OPS, _as, linear, silu_mul

_f32 = np.float32


def _infer_router(ins, attrs):
    logits = ins[0]
    k, e = attrs["top_k"], logits.shape[-1]
    if logits.rank != 2 or not (isinstance(e, int) and 0 < k <= e):
        raise ValueError(f"moe_router: logits {logits.name} {list(logits.shape)} must be [T, E] with "
                         f"0 < top_k ({k}) <= E")
    return [(DType.i32, (logits.shape[0], k)), (DType.f32, (logits.shape[0], k))]


@OPS.register("moe_router", inputs=1, infer=_infer_router)
def moe_router(logits, *, top_k: int, renormalize: bool):
    """logits: [T, E] -> (topk_ids i32[T, k], topk_weights f32[T, k]). Softmax over all E
    experts in f32; the k largest probabilities, highest first, ties to the lower expert id
    (a stable sort); renormalize (qwen3_moe / qwen3_next norm_topk_prob; qwen3_5_moe always)
    divides them by their sum."""
    z = logits.astype(_f32)
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)  # [T, E]
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]  # stable: equal p keep id order
    w = np.take_along_axis(p, ids, axis=-1)  # [T, k]
    if renormalize:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids.astype(np.int32), w.astype(_f32)


def _infer_router_silu(ins, attrs):
    logits, gate, up = ins
    if tuple(gate.shape) != tuple(up.shape) or gate.rank != 2 or gate.shape[0] != logits.shape[0]:
        raise ValueError(f"moe_router_silu_mul: gate {list(gate.shape)} and up {list(up.shape)} must be "
                         f"[T, I] alike, with logits {list(logits.shape)}")
    return [*_infer_router([logits], attrs), (gate.dtype, gate.shape)]


@OPS.register("moe_router_silu_mul", inputs=3, infer=_infer_router_silu)
def moe_router_silu_mul(logits, gate, up, *, top_k: int, renormalize: bool):
    """moe_router(logits) and the shared expert's silu_mul(gate, up), two per-row ops over the same
    tokens in one (passes/fuse_router_silu.py): -> (topk_ids, topk_weights, act)."""
    return (*moe_router(logits, top_k=top_k, renormalize=renormalize), silu_mul(gate, up))


def _infer_experts(ins, attrs):
    x, ids, w, w13, w2 = ins
    e, two_i, h = w13.shape
    if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"moe_experts: w13 {w13.name} {list(w13.shape)} and w2 {w2.name} {list(w2.shape)} "
                         f"are not [E, 2I, H] and [E, H, I]")
    if x.rank != 2 or x.shape[1] != h:
        raise ValueError(f"moe_experts: x {x.name} {list(x.shape)} is not [T, {h}]")
    if tuple(ids.shape) != tuple(w.shape) or ids.shape[0] != x.shape[0] or ids.dtype != DType.i32:
        raise ValueError(f"moe_experts: topk ids {list(ids.shape)} ({ids.dtype}) and weights {list(w.shape)} "
                         f"must both be [T, k], ids i32")
    return [(x.dtype, x.shape)]


@OPS.register("moe_experts", inputs=5, infer=_infer_experts)
def moe_experts(x, topk_ids, topk_weights, w13, w2):
    """x: [T, H], topk_ids: i32[T, k], topk_weights: f32[T, k], w13: [E, 2I, H], w2: [E, H, I]
    -> y [T, H]. For each token t and rank j: e = ids[t, j]; h = w13[e] @ x[t] (rounded to x's
    dtype, as linear's store); a = silu_mul(h[:I], h[I:]) (rounded once, as the dense MLP's
    silu_mul); o = w2[e] @ a (rounded); y[t] = sum_j weights[t, j] * o_j in f32, j = 0..k-1 in
    order, rounded once. Computed grouped by expert (each row's GEMMs are its own), summed by rank."""
    return experts_by_rank(x, topk_ids, topk_weights, lambda e, xe: linear(xe, w13[e]), lambda e, a: linear(a, w2[e]),
                           w2.shape[1])


def experts_by_rank(x, topk_ids, topk_weights, gate_up, down, hidden: int):
    """moe_experts' definition with the expert GEMMs as functions, for the quantised experts' ops
    (graph/nvfp4_ops.py): gate_up(e, x rows) -> [n, 2I] (gate then up, each rounded as a linear's
    store), down(e, a rows) -> [n, H]; the SiLU-and-mul between them and the rank-order sum here."""
    t, k = topk_ids.shape
    o = np.zeros((t, k, hidden), dtype=_f32)  # o[t, j]: expert ids[t, j]'s output for token t
    for e in np.unique(topk_ids):
        tok, rank = np.nonzero(topk_ids == e)
        h = gate_up(e, x[tok])  # [n, 2I]
        inter = h.shape[1] // 2
        a = silu_mul(h[:, :inter], h[:, inter:])  # [n, I]
        o[tok, rank] = down(e, a)
    wts = topk_weights.astype(_f32)
    y = np.zeros((t, x.shape[1]), dtype=_f32)
    for j in range(k):  # rank order: the fixed order of the sum (batch invariance)
        y += wts[:, j:j + 1] * o[:, j]
    return _as(y, x)
