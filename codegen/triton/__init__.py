"""The Triton target: one kernel template per op of the fused Llama/Qwen3 step graph.

Each op file holds three things: the @triton.jit kernel(s), a `*_spec(...)` that
describes a launch (typed signature, constexprs, grid, warps) and a wrapper that
checks shapes/dtypes/strides and launches it (numpy arrays under TRITON_INTERPRET=1,
device buffers otherwise). `aot.py` compiles the same specs to cubins for sm_90 /
sm_121a without a GPU; `configs.py` holds the default launch configs.

  gemm.py                 linear: y = x @ w^T (+ bias), split-K with an ordered reduce
  rms_norm.py             rms_norm, add_rms_norm (also per-head q/k norm over [T, heads, D])
  silu_mul.py             silu(gate) * up
  attention_preamble.py   [q/k norm] + RoPE + paged KV-cache write
  paged_attention.py      varlen causal GQA attention over the paged cache (+ split-KV merge);
                          its wrapper is paged_attention_launch.py
  gather.py               embedding, gather_rows
  argmax.py               greedy sampling
  reference.py            numpy references of fused ops not yet in graph/ops.py

Conventions every kernel keeps: the grid is fixed by the bucket; the live token count
comes from a device scalar (`n_rows_ptr`, e.g. &query_start_loc[S]) and programs past
it return; padded tokens carry slot -1 and write nothing to the cache; reductions are
ordered by the weight or model shape, never by the bucket (DESIGN "Invariance by
construction"); @triton.jit helpers live in the file of the kernels that call them.
"""
