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
                      gate_ptr, up_ptr, act_ptr, stride_g, stride_u, stride_a,
                      E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                      RENORM: tl.constexpr, PDL: tl.constexpr = False, SILU_N: tl.constexpr = 0,
                      SILU_BLOCK: tl.constexpr = 16):
    # grid: (T,); logits: [T, E] (rows strided); ids: i32[T, TOPK], w: f32[T, TOPK] packed.
    # SILU_N > 0: also act[t] = silu(gate[t]) * up[t] over SILU_N columns (the shared expert's
    # activation, silu_mul_kernel's formula: elementwise, so the same bits as its own launch)
    pdl_enter(PDL)  # before any global access (pdl.py)
    t = tl.program_id(0)
    if t >= tl.load(n_rows_ptr):
        return
    if SILU_N > 0:
        t64 = t.to(tl.int64)
        for c0 in tl.static_range(0, SILU_N, SILU_BLOCK):
            cols = c0 + tl.arange(0, SILU_BLOCK)
            m = cols < SILU_N
            g = tl.load(gate_ptr + t64 * stride_g + cols, mask=m, other=0.0).to(tl.float32)
            u = tl.load(up_ptr + t64 * stride_u + cols, mask=m, other=0.0).to(tl.float32)
            y = g / (1.0 + tl.exp(-g)) * u
            tl.store(act_ptr + t64 * stride_a + cols, y.to(act_ptr.dtype.element_ty), mask=m)
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
                    num_warps: int | None = None, silu_n: int = 0, silu_dtype: str | None = None) -> KernelSpec:
    """T rows of E logits: one program a row (a handful of warps holds E <= 512 in registers);
    silu_n > 0: the row's silu_mul over silu_n columns too (moe_router_silu_mul)."""
    act = sig_type(silu_dtype or dtype)
    return KernelSpec(
        module=__name__, kernel="moe_router_kernel",
        signature=dict(logits_ptr=sig_type(dtype), ids_ptr="*i32", w_ptr="*fp32", n_rows_ptr="*i32", stride_l="i32",
                       gate_ptr=act, up_ptr=act, act_ptr=act, stride_g="i32", stride_u="i32", stride_a="i32"),
        constexprs=dict(E=e, E_P2=next_pow2(e), TOPK=top_k, TOPK_P2=next_pow2(top_k), RENORM=bool(renormalize),
                        SILU_N=silu_n, SILU_BLOCK=min(1024, next_pow2(max(silu_n, 16)))),
        grid=(t,), num_warps=num_warps or (1 if e <= 128 else 2 if e <= 512 else 4), num_stages=1,
        divisible=("logits_ptr", "ids_ptr", "w_ptr", "n_rows_ptr"))


def moe_router(logits, *, top_k: int, renormalize: bool, ids=None, weights=None, n_rows=None, silu=None):
    """logits: [T, E] (f32 or bf16; rows may be strided) -> (topk_ids i32[T, k], topk_weights f32[T, k]).
    silu: (gate, up, act), [T, I] each (rows strided): act = silu(gate) * up in the same launch."""
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
    if silu is None:  # unused (SILU_N 0): any buffers of the dtype
        spec = moe_router_spec(t, e, top_k, dtype_name(logits), renormalize=renormalize)
        extra = [logits, logits, logits, 0, 0, 0]
    else:
        gate, up, act = map(as_buf, silu)
        check(shape_of(gate) == shape_of(up) == shape_of(act) and shape_of(gate)[0] == t and len(shape_of(gate)) == 2,
              "moe_router silu: gate, up and act must be [T, I] alike")
        check(dtype_name(gate) == dtype_name(up) == dtype_name(act), "moe_router silu: one dtype")
        for b, name in ((gate, "gate"), (up, "up"), (act, "act")):
            check_inner_contiguous(b, f"moe_router silu {name}")
        spec = moe_router_spec(t, e, top_k, dtype_name(logits), renormalize=renormalize, silu_n=shape_of(gate)[1],
                               silu_dtype=dtype_name(act))
        extra = [gate, up, act, strides_of(gate)[0], strides_of(up)[0], strides_of(act)[0]]
    launch(spec, [logits, ids, weights, n_rows, strides_of(logits)[0], *extra])
    unwrap = lambda b: b.array if getattr(b, "on_host", False) else b  # noqa: E731
    return (unwrap(ids), unwrap(weights)) if silu is None else (unwrap(ids), unwrap(weights), unwrap(act))
