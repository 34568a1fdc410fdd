"""moe_router: a mixture-of-experts router's softmax, top-k and renormalisation in one launch.

    moe_router(logits[T, E]) -> topk_ids i32[T, k], topk_weights f32[T, k]

The graph op's semantics (graph/ moe_router; ../shared/specs/qwen3_5.md section 7.2):
softmax over all E experts in f32; the k largest probabilities, ranked highest first, a tie
going to the lower expert id (torch.topk's order on distinct values, made deterministic on
ties); with `renormalize` the k weights divided by their sum. One program per token row holds
the whole row in registers (E <= a few hundred), so nothing of a token depends on another
token: batch invariant by construction.

Which bits: the selection is exact (ties included: equal logits give equal probabilities);
the weights are the f32 formula, but the GPU's exp differs from numpy's in the last ulp, so
they match a numpy reference within ~1e-6 relative, not bit for bit. The renormalising sum runs
in rank order (w0 + w1 + ...), as numpy sums fewer than 8 values. Rows >= *n_rows_ptr (padded
tokens) return at once and leave their ids and weights unwritten: every later MoE kernel skips
those tokens (moe_align, moe_gemm).
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.launch import (KernelSpec, as_buf, check, check_dtype, check_inner_contiguous, dtype_name,
                                        launch, next_pow2, shape_of, sig_type, strides_of)
from kiln.codegen.triton.pdl import pdl_enter


@triton.jit
def moe_router_kernel(logits_ptr, ids_ptr, w_ptr, n_rows_ptr, stride_l,
                      E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                      RENORM: tl.constexpr, PDL: tl.constexpr = False):
    # grid: (T,); logits: [T, E] (rows strided); ids: i32[T, TOPK], w: f32[T, TOPK] packed
    pdl_enter(PDL)  # before any global access (pdl.py)
    t = tl.program_id(0)
    if t >= tl.load(n_rows_ptr):
        return
    ar = tl.arange(0, E_P2)
    live = ar < E
    x = tl.load(logits_ptr + t.to(tl.int64) * stride_l + ar, mask=live, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))  # padded columns: exp(-inf) = 0
    p = e / tl.sum(e, axis=0)
    # Probabilities are >= 0, so -1 marks "taken" and -2 "no such expert" below every real one:
    # an expert whose probability underflowed to 0 still outranks the padding.
    p = tl.where(live, p, -2.0)
    kr = tl.arange(0, TOPK_P2)
    ids = tl.zeros((TOPK_P2,), dtype=tl.int32)
    w = tl.zeros((TOPK_P2,), dtype=tl.float32)
    total = 0.0
    for j in tl.static_range(TOPK):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, ar, E_P2), axis=0)  # the lowest id among equals
        ids = tl.where(kr == j, pick, ids)
        w = tl.where(kr == j, best, w)
        if j == 0:  # (static) rank order, from the first term: no 0 + w0 to flip a sign
            total = best
        else:
            total = total + best
        p = tl.where(ar == pick, -1.0, p)
    if RENORM:
        w = w / total
    out = t.to(tl.int64) * TOPK + kr
    tl.store(ids_ptr + out, ids, mask=kr < TOPK)
    tl.store(w_ptr + out, w, mask=kr < TOPK)


def moe_router_spec(t: int, e: int, top_k: int, dtype: str = "bfloat16", *, renormalize: bool,
                    num_warps: int | None = None) -> KernelSpec:
    """T rows of E logits: one program a row (a handful of warps holds E <= 512 in registers)."""
    return KernelSpec(
        module=__name__, kernel="moe_router_kernel",
        signature=dict(logits_ptr=sig_type(dtype), ids_ptr="*i32", w_ptr="*fp32", n_rows_ptr="*i32", stride_l="i32"),
        constexprs=dict(E=e, E_P2=next_pow2(e), TOPK=top_k, TOPK_P2=next_pow2(top_k), RENORM=bool(renormalize)),
        grid=(t,), num_warps=num_warps or (1 if e <= 128 else 2 if e <= 512 else 4), num_stages=1,
        divisible=("logits_ptr", "ids_ptr", "w_ptr", "n_rows_ptr"))


def moe_router(logits, *, top_k: int, renormalize: bool, ids=None, weights=None, n_rows=None):
    """logits: [T, E] (f32 or bf16; rows may be strided) -> (topk_ids i32[T, k], topk_weights f32[T, k])."""
    logits, ids, weights, n_rows = map(as_buf, (logits, ids, weights, n_rows))
    check(len(shape_of(logits)) == 2, "moe_router: logits must be [T, E]")
    check_dtype(logits, ("float32", "bfloat16", "float16"), "moe_router logits")
    check_inner_contiguous(logits, "moe_router logits")
    t, e = shape_of(logits)
    check(1 <= top_k <= e, f"moe_router: top_k {top_k} must be in 1..E ({e})")
    ids = ids if ids is not None else as_buf(np.empty((t, top_k), np.int32))
    weights = weights if weights is not None else as_buf(np.empty((t, top_k), np.float32))
    check(shape_of(ids) == (t, top_k) and dtype_name(ids) == "int32", f"moe_router: ids must be i32[{t}, {top_k}]")
    check(shape_of(weights) == (t, top_k) and dtype_name(weights) == "float32",
          f"moe_router: weights must be f32[{t}, {top_k}]")
    for b, name in ((ids, "ids"), (weights, "weights")):
        check_inner_contiguous(b, f"moe_router {name}", 2)
    n_rows = n_rows if n_rows is not None else as_buf(np.array([t], np.int32))
    spec = moe_router_spec(t, e, top_k, dtype_name(logits), renormalize=renormalize)
    launch(spec, [logits, ids, weights, n_rows, strides_of(logits)[0]])
    unwrap = lambda b: b.array if getattr(b, "on_host", False) else b  # noqa: E731
    return unwrap(ids), unwrap(weights)
