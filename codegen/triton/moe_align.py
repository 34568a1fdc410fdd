"""moe_align: a step's (token, rank) assignments sorted by expert, each expert's run padded to
BLOCK_M rows, on the device: the grouped MoE GEMMs' row lists (codegen/triton/moe_gemm.py).

Behaviour ported from vLLM's fused_moe `moe_align_block_size` (its Triton stages and CUDA
kernel; the code here is kiln's own):
- the T*k assignments are flat indices r = t * k + j into topk_ids [T, k];
- sorted_ids [EM]: expert 0's assignments, then expert 1's, ..., each run padded with the
  sentinel T*k up to a multiple of BLOCK_M; within a run in increasing r (stable), so the
  order is a function of the step's ids alone;
- block_expert [EM / BLOCK_M]: the expert of each BLOCK_M-row block of sorted_ids;
- n_post [1]: the padded total, sum over experts of round_up(count, BLOCK_M). An expert with
  no token gets no block.
EM (the capacity, moe_align_capacity) is fixed by the bucket, so the grid of every MoE launch
is too and a step can be captured as a CUDA graph; the real counts live in device memory,
and blocks at or past n_post return at once. Only live tokens (t < *n_rows_ptr) are sorted.

One launch, one program per expert: each program histograms all live ids (tl.histogram),
which gives its run's offset (an exclusive scan of the padded counts) without a second
launch, then scatters its own assignments in order (a running count plus an in-chunk
cumsum). E programs each read the T*k ids twice, from L2: cheap next to the GEMMs it feeds.
Which block a row lands in never changes its bits (moe_gemm.py), so the order is for
determinism and reproducible debugging, not invariance.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.launch import (KernelSpec, as_buf, cdiv, check, dtype_name, launch, next_pow2, shape_of)
from kiln.codegen.triton.pdl import pdl_enter


@triton.jit
def moe_align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, n_post_ptr, n_rows_ptr, NUM_ROWS,
                     E: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # grid: (E,); ids: i32[T * TOPK] (topk_ids flat); sorted: i32[EM]; block_expert: i32[EM / BLOCK_M]
    pdl_enter(PDL)  # before any global access (pdl.py)
    me = tl.program_id(0)
    live = tl.minimum(tl.load(n_rows_ptr) * TOPK, NUM_ROWS)  # live assignments: a prefix of the flat ids
    cr = tl.arange(0, BLOCK)
    hist = tl.zeros((E_P2,), dtype=tl.int32)
    for c0 in range(0, live, BLOCK):
        r = c0 + cr
        ids = tl.load(ids_ptr + r, mask=r < live, other=0)
        hist += tl.histogram(ids, E_P2, mask=(r < live) & (ids >= 0) & (ids < E))
    er = tl.arange(0, E_P2)
    padded = (hist + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_P2]
    start = tl.cumsum(padded, axis=0) - padded  # each run's first row
    off = tl.sum(tl.where(er == me, start, 0), axis=0)
    count = tl.sum(tl.where(er == me, hist, 0), axis=0)
    mine = tl.sum(tl.where(er == me, padded, 0), axis=0)
    if me == 0:
        tl.store(n_post_ptr, tl.sum(padded, axis=0))
    # this run's blocks, and the sentinel in its padding rows (fewer than BLOCK_M of them)
    br = tl.arange(0, BLOCK)
    for b0 in range(0, mine // BLOCK_M, BLOCK):
        tl.store(block_expert_ptr + off // BLOCK_M + b0 + br, me, mask=b0 + br < mine // BLOCK_M)
    pr = count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + off + pr, NUM_ROWS, mask=pr < mine)
    # the scatter: assignment r of this expert goes to off + (its rank among this expert's, by r)
    seen = 0
    for c0 in range(0, live, BLOCK):
        r = c0 + cr
        ids = tl.load(ids_ptr + r, mask=r < live, other=-1)
        hit = ((ids == me) & (r < live)).to(tl.int32)
        rank = seen + tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_ptr + off + rank, r, mask=hit != 0)
        seen += tl.sum(hit, axis=0)


def moe_align_capacity(t: int, top_k: int, e: int, block_m: int) -> int:
    """EM: the most rows a step of T tokens can pad to. Every expert that gets a token pads
    fewer than BLOCK_M rows, and at most min(E, T * k) experts get one (vLLM's bound, tightened
    for small steps as vLLM also does), rounded up to whole blocks."""
    n = t * top_k
    return cdiv(n + min(e, n) * (block_m - 1), block_m) * block_m


def moe_align_spec(t: int, top_k: int, e: int, block_m: int, *, block: int | None = None,
                   num_warps: int = 4) -> KernelSpec:
    """block: ids per chunk of the two passes (default: the bucket's T*k up to 1,024); a schedule
    knob, like num_warps: the output is a function of the ids alone."""
    check(block_m >= 16 and block_m & (block_m - 1) == 0, f"moe_align: BLOCK_M {block_m} must be a power of two >= 16")
    block = block or max(16, min(1024, next_pow2(t * top_k)))
    return KernelSpec(
        module=__name__, kernel="moe_align_kernel",
        signature=dict(ids_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32", n_post_ptr="*i32",
                       n_rows_ptr="*i32", NUM_ROWS="i32"),
        constexprs=dict(E=e, E_P2=next_pow2(e), TOPK=top_k, BLOCK_M=block_m, BLOCK=block),
        grid=(e,), num_warps=num_warps, num_stages=1,
        divisible=("ids_ptr", "sorted_ptr", "block_expert_ptr", "n_post_ptr", "n_rows_ptr"))


def moe_align(topk_ids, *, num_experts: int, block_m: int, n_rows=None, sorted_ids=None, block_expert=None,
              n_post=None):
    """topk_ids: i32[T, k] -> (sorted_ids i32[EM], block_expert i32[EM / BLOCK_M], n_post i32[1]).
    Entries past n_post (and of blocks past it) are left unwritten: consumers stop at n_post."""
    topk_ids, n_rows, sorted_ids, block_expert, n_post = map(as_buf, (topk_ids, n_rows, sorted_ids, block_expert,
                                                                     n_post))
    check(len(shape_of(topk_ids)) == 2 and dtype_name(topk_ids) == "int32", "moe_align: topk_ids must be i32[T, k]")
    t, k = shape_of(topk_ids)
    check(tuple(topk_ids.stride()) == (k, 1), "moe_align: topk_ids must be packed")
    em = moe_align_capacity(t, k, num_experts, block_m)
    new = lambda shape: as_buf(np.empty(shape, np.int32))  # noqa: E731
    sorted_ids = sorted_ids if sorted_ids is not None else new((em,))
    block_expert = block_expert if block_expert is not None else new((em // block_m,))
    n_post = n_post if n_post is not None else new((1,))
    for b, shape, name in ((sorted_ids, (em,), "sorted_ids"), (block_expert, (em // block_m,), "block_expert"),
                           (n_post, (1,), "n_post")):
        check(shape_of(b) == shape and dtype_name(b) == "int32", f"moe_align: {name} must be i32{list(shape)}")
    n_rows = n_rows if n_rows is not None else as_buf(np.array([t], np.int32))
    launch(moe_align_spec(t, k, num_experts, block_m), [topk_ids, sorted_ids, block_expert, n_post, n_rows, t * k])
    unwrap = lambda b: b.array if getattr(b, "on_host", False) else b  # noqa: E731
    return unwrap(sorted_ids), unwrap(block_expert), unwrap(n_post)
