"""Greedy sampling on the GPU: argmax over the vocabulary, ties to the lowest index.

One program per logits row walks the vocabulary in BLOCK_V chunks in increasing
order: a chunk's winner (tl.argmax, ties left) replaces the running best only if
strictly greater, so the lowest index wins every tie, as numpy's argmax does.
NaN logits are never chosen (numpy would return the first NaN); a row of all -inf
gives 0, as numpy does. Rows >= *n_rows_ptr return at once.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.configs import DEFAULT, Configs, ElementwiseConfig
from kiln.codegen.triton.launch import (KernelSpec, as_buf, check, check_dtype, check_inner_contiguous, dtype_name,
                                        launch, shape_of, sig_type, strides_of)
from kiln.codegen.triton.pdl import pdl_enter


@triton.jit
def argmax_kernel(x_ptr, out_ptr, n_rows_ptr, stride_x, V: tl.constexpr, BLOCK_V: tl.constexpr,
                  PDL: tl.constexpr = False):
    pdl_enter(PDL)  # before any global access (pdl.py)
    # grid: (L,); x: [L, V] logits, out: i32[L]
    row = tl.program_id(0)
    if row >= tl.load(n_rows_ptr):
        return
    base = x_ptr + row.to(tl.int64) * stride_x
    best = -float("inf")
    best_idx = 0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        x = tl.where(x != x, -float("inf"), x)  # NaN never wins
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0, tie_break_left=True)
        better = m > best
        best_idx = tl.where(better, v0 + i, best_idx)
        best = tl.where(better, m, best)
    tl.store(out_ptr + row, best_idx.to(tl.int32))


def argmax_spec(l: int, v: int, dtype: str = "float32", *, config: ElementwiseConfig) -> KernelSpec:
    return KernelSpec(
        module=__name__, kernel="argmax_kernel",
        signature=dict(x_ptr=sig_type(dtype), out_ptr="*i32", n_rows_ptr="*i32", stride_x="i32"),
        constexprs=dict(V=v, BLOCK_V=config.block), grid=(l,), num_warps=config.num_warps, num_stages=2,
        divisible=("x_ptr", "out_ptr", "n_rows_ptr"))


def argmax(logits, out=None, *, n_rows=None, config: ElementwiseConfig | None = None,
           configs: Configs = DEFAULT):
    """logits: [L, V] (f32 or bf16) -> i32[L]"""
    logits, out, n_rows = map(as_buf, (logits, out, n_rows))
    check(len(shape_of(logits)) == 2, "argmax: logits must be [L, V]")
    check_dtype(logits, ("float32", "bfloat16", "float16"), "argmax logits")
    check_inner_contiguous(logits, "argmax logits")
    l, v = shape_of(logits)
    out = out if out is not None else as_buf(np.empty((l,), dtype=np.int32))
    check(shape_of(out) == (l,) and dtype_name(out) == "int32", "argmax: out must be i32[L]")
    n_rows = n_rows if n_rows is not None else as_buf(np.array([l], dtype=np.int32))
    config = config or configs.elementwise("argmax", v)
    launch(argmax_spec(l, v, dtype_name(logits), config=config), [logits, out, n_rows, strides_of(logits)[0]])
    return out.array if getattr(out, "on_host", False) else out
