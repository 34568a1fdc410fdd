"""Programmatic dependent launch (PDL, sm_90 and later): a kernel's programs may be
scheduled while the kernel before it on the stream is still finishing.

A bundle compiles every plan kernel with PDL=True (codegen/compile.py) and the executor
launches them with the programmatic-stream-serialization attribute
(runtime/worker/cuda_executor.py). Then the next kernel's launch and the placing of its programs
overlap this one's tail instead of following it. A batch-1 decode step is ~330 kernels back to
back; on the H200 this took its graph from 4.45 to 4.39 ms (launch latency only: each kernel
still starts its work after its predecessor ends).

Correctness rests on one rule: a PDL kernel calls `pdl_enter` before it touches global
memory at all, loads or stores (the GEMM's TMA descriptors, built in a scratch buffer
every launch shares, included). One exception: `pdl_step_input` reads a scalar of the
step's inputs, which the host uploads before the step and no kernel writes. `griddepcontrol.wait` returns once the kernel before it
has completed and its writes are visible, so everything after it sees what a plain
stream-ordered launch would. Then `launch_dependents` lets the next kernel be scheduled as
soon as every program of this one has started. Without the launch attribute (the JIT, the
tuner, the profiler's eager launches) both instructions are no-ops; PDL=False (the
interpreter, the sampler's kernels) compiles them out.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


STEP_INPUT_MARK = "kiln:step-input"  # the PTX comment before a step-input load (aot.check_pdl_order)
_STEP_INPUT_ASM = tl.constexpr("// " + STEP_INPUT_MARK + "\n\tld.global.b32 $0, [$1];")


@triton.jit
def pdl_step_input(ptr, PDL: tl.constexpr):
    """*ptr, one i32 of the step's inputs (the live row count, a position, a sequence's offsets
    or length), read *before* pdl_enter. The executor uploads the inputs before the step's
    launches and no kernel writes them, so the read need not wait for the kernel before;
    under PDL it is then no longer a memory round trip on this kernel's path after the wait.
    The load is marked in the PTX (STEP_INPUT_MARK), the one load aot.check_pdl_order lets
    stand before the wait. Only for the inputs region: never for memory a kernel writes."""
    if PDL:
        return tl.inline_asm_elementwise(_STEP_INPUT_ASM, "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.load(ptr)
