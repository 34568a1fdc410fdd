"""silu_mul: out = silu(gate) * up, the SwiGLU activation, computed in f32.

gate and up are [T, I] with their own row strides, so the two halves of a fused
gate_up GEMM output [T, 2I] are passed as views with no copy. Elementwise, so no
invariance question. Programs of tokens >= *n_rows_ptr return at once.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.configs import DEFAULT, Configs, ElementwiseConfig
from kiln.codegen.triton.launch import (KernelSpec, as_buf, cdiv, check, check_inner_contiguous, dtype_name,
                                        launch, shape_of, sig_type, strides_of)
from kiln.codegen.triton.pdl import pdl_enter


@triton.jit
def silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_rows_ptr, stride_g, stride_u, stride_o,
                    N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # before any global access (pdl.py)
    # grid: (T, cdiv(N, BLOCK)); gate, up, out: [T, N]
    t, pid = tl.program_id(0), tl.program_id(1)
    if t >= tl.load(n_rows_ptr):
        return
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    t64 = t.to(tl.int64)
    g = tl.load(gate_ptr + t64 * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + t64 * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t64 * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_spec(t: int, n: int, dtype: str = "bfloat16", *, config: ElementwiseConfig) -> KernelSpec:
    p = sig_type(dtype)
    return KernelSpec(
        module=__name__, kernel="silu_mul_kernel",
        signature=dict(gate_ptr=p, up_ptr=p, out_ptr=p, n_rows_ptr="*i32", stride_g="i32", stride_u="i32",
                       stride_o="i32"),
        constexprs=dict(N=n, BLOCK=config.block), grid=(t, cdiv(n, config.block)),
        num_warps=config.num_warps, num_stages=1,
        divisible=("gate_ptr", "up_ptr", "out_ptr", "n_rows_ptr"))


def silu_mul(gate, up, out=None, *, n_rows=None, config: ElementwiseConfig | None = None,
             configs: Configs = DEFAULT):
    """gate, up: [T, N] -> silu(gate) * up: [T, N]"""
    gate, up, out, n_rows = map(as_buf, (gate, up, out, n_rows))
    check(len(shape_of(gate)) == 2 and shape_of(gate) == shape_of(up), "silu_mul: gate and up shapes differ")
    check(dtype_name(gate) == dtype_name(up), "silu_mul: gate and up dtypes differ")
    for b, name in ((gate, "gate"), (up, "up")):
        check_inner_contiguous(b, f"silu_mul {name}")
    t, n = shape_of(gate)
    out = out if out is not None else as_buf(np.empty((t, n), dtype=gate.dtype))
    check(shape_of(out) == (t, n) and dtype_name(out) == dtype_name(gate), "silu_mul: bad out")
    check_inner_contiguous(out, "silu_mul out")
    n_rows = n_rows if n_rows is not None else as_buf(np.array([t], dtype=np.int32))
    spec = silu_mul_spec(t, n, dtype_name(gate), config=config or configs.elementwise("silu_mul", n))
    launch(spec, [gate, up, out, n_rows, strides_of(gate)[0], strides_of(up)[0], strides_of(out)[0]])
    return out.array if getattr(out, "on_host", False) else out
