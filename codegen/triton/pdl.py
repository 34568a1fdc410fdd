"""Programmatic dependent launch (PDL, sm_90 and later): a kernel's programs may be
scheduled while the kernel before it on the stream is still finishing.

A bundle compiles every plan kernel with PDL=True (codegen/compile.py) and the executor
launches them with the programmatic-stream-serialization attribute
(runtime/cuda_executor.py). Then the next kernel's launch and the placing of its programs
overlap this one's tail instead of following it. A batch-1 decode step is ~330 kernels back to
back; on the H200 this took its graph from 4.45 to 4.39 ms (launch latency only: each kernel
still starts its work after its predecessor ends).

Correctness rests on one rule: a PDL kernel calls `pdl_enter` before it touches global
memory at all, loads or stores (the GEMM's TMA descriptors, built in a scratch buffer
every launch shares, included). `griddepcontrol.wait` returns once the kernel before it
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
