"""Row gathers: `embedding` (table[input_ids]) and `gather_rows` (x[logits_indices]).

Both are out[i] = src[idx[i]] over rows of width N, so one kernel serves both. An
index outside [0, n_src) (padding) writes a zero row instead of reading out of
bounds. Programs with i >= *n_rows_ptr return at once.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.configs import DEFAULT, Configs, ElementwiseConfig
from kiln.codegen.triton.launch import (KernelSpec, as_buf, cdiv, check, check_dtype, check_inner_contiguous,
                                        dtype_name, launch, shape_of, sig_type, strides_of)
from kiln.codegen.triton.pdl import pdl_enter


@triton.jit
def gather_rows_kernel(src_ptr, idx_ptr, out_ptr, n_rows_ptr, n_src, stride_s, stride_o,
                       N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # before any global access (pdl.py)
    # grid: (L, cdiv(N, BLOCK)); src: [n_src, N], idx: i32[L], out: [L, N]
    i, pid = tl.program_id(0), tl.program_id(1)
    if i >= tl.load(n_rows_ptr):
        return
    row = tl.load(idx_ptr + i)
    ok = (row >= 0) & (row < n_src)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    v = tl.load(src_ptr + row.to(tl.int64) * stride_s + cols, mask=mask & ok, other=0.0)
    tl.store(out_ptr + i.to(tl.int64) * stride_o + cols, v, mask=mask)


def gather_rows_spec(l: int, n: int, dtype: str = "bfloat16", *, config: ElementwiseConfig) -> KernelSpec:
    p = sig_type(dtype)
    return KernelSpec(
        module=__name__, kernel="gather_rows_kernel",
        signature=dict(src_ptr=p, idx_ptr="*i32", out_ptr=p, n_rows_ptr="*i32", n_src="i32", stride_s="i32",
                       stride_o="i32"),
        constexprs=dict(N=n, BLOCK=config.block), grid=(l, cdiv(n, config.block)),
        num_warps=config.num_warps, num_stages=1,
        divisible=("src_ptr", "idx_ptr", "out_ptr", "n_rows_ptr"))


def gather_rows(x, idx, out=None, *, n_rows=None, config: ElementwiseConfig | None = None,
                configs: Configs = DEFAULT):
    """x: [R, N], idx: i32[L] -> x[idx]: [L, N]"""
    x, idx, out, n_rows = map(as_buf, (x, idx, out, n_rows))
    check(len(shape_of(x)) == 2, f"gather_rows: x must be 2-D, got {list(shape_of(x))}")
    check(len(shape_of(idx)) == 1, "gather_rows: idx must be 1-D")
    check_dtype(idx, ("int32",), "gather_rows idx")
    check_inner_contiguous(x, "gather_rows x")
    (r, n), (l,) = shape_of(x), shape_of(idx)
    out = out if out is not None else as_buf(np.empty((l, n), dtype=x.dtype))
    check(shape_of(out) == (l, n) and dtype_name(out) == dtype_name(x), "gather_rows: bad out")
    check_inner_contiguous(out, "gather_rows out")
    n_rows = n_rows if n_rows is not None else as_buf(np.array([l], dtype=np.int32))
    spec = gather_rows_spec(l, n, dtype_name(x), config=config or configs.elementwise("gather_rows", n))
    launch(spec, [x, idx, out, n_rows, r, strides_of(x)[0], strides_of(out)[0]])
    return out.array if getattr(out, "on_host", False) else out


def embedding(ids, table, out=None, *, n_rows=None, config: ElementwiseConfig | None = None,
              configs: Configs = DEFAULT):
    """ids: i32[T], table: [V, H] -> [T, H]"""
    return gather_rows(table, ids, out, n_rows=n_rows, config=config, configs=configs)
