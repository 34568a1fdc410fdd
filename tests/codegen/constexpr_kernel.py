"""A kernel with two defaulted constexprs. test_aot.py proves that a spec setting one and a
spec setting the other compile to different kernels through Triton's cache."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def two_switches_kernel(y_ptr, A: tl.constexpr = 0, B: tl.constexpr = 0):
    tl.store(y_ptr, A * 10 + B)
