"""A kernel that breaks the PDL rule (codegen/triton/pdl.py): it loads before it waits.
test_aot.py proves that compiling it with PDL=True is refused."""
from __future__ import annotations

import triton
import triton.language as tl

from kiln.codegen.triton.pdl import pdl_enter


@triton.jit
def loads_before_wait_kernel(x_ptr, y_ptr, PDL: tl.constexpr = False):
    v = tl.load(x_ptr)
    pdl_enter(PDL)
    tl.store(y_ptr, v + 1)
