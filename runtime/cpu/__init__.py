"""The compiled CPU target: numba kernels for the host CPU over a GGUF's quantised blocks.

    packed.py          weights re-tiled for the kernels (quantised codes kept, scales widened)
    linear_kernels.py  GEMV over packed weights, bit-exact dequantisation for BLAS and lookups
    linear.py          one linear layer: GEMV below GEMM_MIN_TOKENS tokens, dequantise + BLAS above
    op_kernels.py      norms, SwiGLU, RoPE + KV write, paged attention
    arena.py, plan.py  the fused step graph as a list of compiled calls over one arena
    sample_kernels.py  the sampler's temperature / min-p / top-k / top-p / race without a sort

runtime/worker/compiled_cpu_executor.py runs a plan; the numpy executor (cpu_executor.py) is
its oracle and the fallback for graphs it refuses (plan.NotCompilable).
"""
