"""The tensor-parallel pieces of GPU plans (docs/TENSOR_PARALLEL.md).

NCCL (the default, codegen/lower.py collective="nccl"): `NcclCall` plan entries the runtime
issues on the step's stream (ncclAllReduce for two ranks; ncclAllGather into a workspace for
the logits and for more ranks), and the kernels below over the gathered copies in this rank's
own memory (`rank_slices`): the rank-order sum and the columns side by side.

The peer-memory design (collective="peer", compiled, no runtime yet):

- `all_reduce_kernel`: out = ((x_0 + x_1) + x_2) + ... over the ranks' partials, in rank order
  in f32 (graph/collective_ops.py all_reduce_reference), each x_r read from rank r's buffer
  (peer memory mapped into this rank: cuMemExportToShareableHandle / IPC, exchanged at start-up).
  The same order on every rank and in every bucket: the results are bit-identical across ranks,
  and a token's sum does not depend on the bucket (NCCL's own reduction of three or more ranks
  follows the message size, which would break DESIGN.md's invariance: with NCCL the kernel runs
  on NCCL-gathered copies instead of peer pointers).
- `all_gather_kernel`: the logits' columns from every rank side by side, cut to the vocabulary.
- `vocab_embedding_kernel`: the masked lookup of a rank's vocabulary rows; the rank's first id
  is read from a device scalar, so one compiled plan serves every rank (the rank is a run-time
  argument, not a compile-time one).

- `barrier_kernel`: the flag barrier ordering a rank's reads after its peers' writes.

Up to 8 ranks (one host's GPUs): the peers are separate pointer arguments, those past WORLD
unused. Not here yet: the executor that maps the peers' buffers. Rows past *n_rows_ptr (bucket
padding) are left alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import triton
import triton.language as tl

from kiln.codegen.triton.launch import (Buf, KernelSpec, as_buf, cdiv, check, check_dtype, dtype_name, launch,
                                        record_call, shape_of, sig_type)

MAX_WORLD = 8
BLOCK = 1024


@triton.jit
def _peer(p0, p1, p2, p3, p4, p5, p6, p7, R: tl.constexpr):
    if R == 0:
        return p0
    elif R == 1:
        return p1
    elif R == 2:
        return p2
    elif R == 3:
        return p3
    elif R == 4:
        return p4
    elif R == 5:
        return p5
    elif R == 6:
        return p6
    else:
        return p7


@triton.jit
def all_reduce_kernel(p0, p1, p2, p3, p4, p5, p6, p7, out_ptr, n_rows_ptr, n_cols,
                      WORLD: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (rows, cdiv(n_cols, BLOCK)); every p_r and out: [rows, n_cols] contiguous
    row, pid = tl.program_id(0), tl.program_id(1)
    if row >= tl.load(n_rows_ptr):
        return
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    off = row.to(tl.int64) * n_cols + cols
    acc = tl.load(p0 + off, mask=mask, other=0.0).to(tl.float32)
    for r in tl.static_range(1, WORLD):  # rank order, unrolled: the reference's order
        acc += tl.load(_peer(p0, p1, p2, p3, p4, p5, p6, p7, r) + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def all_gather_kernel(p0, p1, p2, p3, p4, p5, p6, p7, out_ptr, n_rows_ptr, n_part, size,
                      WORLD: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (rows, cdiv(WORLD * n_part, BLOCK)); p_r: [rows, n_part], out: [rows, size]
    row, pid = tl.program_id(0), tl.program_id(1)
    if row >= tl.load(n_rows_ptr):
        return
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    src = cols % n_part
    rank = cols // n_part
    mask = cols < size
    v = tl.zeros((BLOCK,), tl.float32)
    for r in tl.static_range(0, WORLD):
        part = tl.load(_peer(p0, p1, p2, p3, p4, p5, p6, p7, r) + row.to(tl.int64) * n_part + src,
                       mask=mask & (rank == r), other=0.0).to(tl.float32)
        v = tl.where(rank == r, part, v)
    tl.store(out_ptr + row.to(tl.int64) * size + cols, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def vocab_embedding_kernel(ids_ptr, table_ptr, out_ptr, n_rows_ptr, vocab_start_ptr, n_valid, N: tl.constexpr,
                           BLOCK: tl.constexpr):
    # grid: (T, cdiv(N, BLOCK)); table: this rank's [Vp, N] rows, ids i32[T] whole-vocabulary ids
    i, pid = tl.program_id(0), tl.program_id(1)
    if i >= tl.load(n_rows_ptr):
        return
    row = tl.load(ids_ptr + i) - tl.load(vocab_start_ptr)
    mine = (row >= 0) & (row < n_valid)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    v = tl.load(table_ptr + row.to(tl.int64) * N + cols, mask=mask & mine, other=0.0)
    tl.store(out_ptr + i.to(tl.int64) * N + cols, v, mask=mask)


@triton.jit
def barrier_kernel(f0, f1, f2, f3, f4, f5, f6, f7, own_ptr, epoch_ptr, rank_ptr, WORLD: tl.constexpr):
    # grid: (1,). f_r: rank r's flag array i32[WORLD] (peer memory; f_r[j] = the last epoch rank j
    # announced to r), own_ptr: this rank's own flag array, epoch_ptr: this rank's counter i32[1]
    # (device memory, so each replay of a captured graph advances it), rank_ptr: i32[1], this rank.
    # Announce epoch e to every rank (release: the partials written before are visible to whoever
    # sees e), then wait until every rank has announced e here (acquire). vLLM's custom
    # all-reduce barrier (csrc/custom_all_reduce.cuh) in one program, over Triton's atomics.
    e = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, e)
    me = tl.load(rank_ptr)
    for r in tl.static_range(0, WORLD):
        tl.atomic_xchg(_peer(f0, f1, f2, f3, f4, f5, f6, f7, r) + me, e, sem="release", scope="sys")
    for r in tl.static_range(0, WORLD):
        seen = tl.atomic_add(own_ptr + r, 0, sem="acquire", scope="sys")
        while seen < e:
            seen = tl.atomic_add(own_ptr + r, 0, sem="acquire", scope="sys")


def barrier_spec(world: int) -> KernelSpec:
    return KernelSpec(module=__name__, kernel="barrier_kernel",
                      signature={**{f"f{r}": "*i32" for r in range(MAX_WORLD)}, "own_ptr": "*i32",
                                 "epoch_ptr": "*i32", "rank_ptr": "*i32"},
                      constexprs=dict(WORLD=world), grid=(1,), num_warps=1, num_stages=1)


def barrier(flags: list, own, epoch, rank) -> None:
    """flags: every rank's flag array (rank order; own is this rank's, also among them)."""
    bufs = [as_buf(f) for f in flags]
    launch(barrier_spec(len(bufs)), [*_peers(bufs), as_buf(own), as_buf(epoch), as_buf(rank)])


def _peers(parts: list) -> list:
    check(1 <= len(parts) <= MAX_WORLD, f"collectives take 1..{MAX_WORLD} ranks, got {len(parts)}")
    return list(parts) + [parts[0]] * (MAX_WORLD - len(parts))  # unused slots: any valid pointer


def all_reduce_spec(rows: int, n_cols: int, world: int, dtype: str = "bfloat16") -> KernelSpec:
    p = sig_type(dtype)
    return KernelSpec(module=__name__, kernel="all_reduce_kernel",
                      signature={**{f"p{r}": p for r in range(MAX_WORLD)}, "out_ptr": p, "n_rows_ptr": "*i32",
                                 "n_cols": "i32"},
                      constexprs=dict(WORLD=world, BLOCK=BLOCK), grid=(rows, cdiv(n_cols, BLOCK)), num_warps=4,
                      num_stages=1, divisible=tuple(f"p{r}" for r in range(MAX_WORLD)) + ("out_ptr", "n_rows_ptr"))


def all_gather_spec(rows: int, n_part: int, size: int, world: int, dtype: str = "float32") -> KernelSpec:
    p = sig_type(dtype)
    return KernelSpec(module=__name__, kernel="all_gather_kernel",
                      signature={**{f"p{r}": p for r in range(MAX_WORLD)}, "out_ptr": p, "n_rows_ptr": "*i32",
                                 "n_part": "i32", "size": "i32"},
                      constexprs=dict(WORLD=world, BLOCK=BLOCK), grid=(rows, cdiv(size, BLOCK)), num_warps=4,
                      num_stages=1, divisible=tuple(f"p{r}" for r in range(MAX_WORLD)) + ("out_ptr", "n_rows_ptr"))


def vocab_embedding_spec(t: int, n: int, dtype: str = "bfloat16") -> KernelSpec:
    p = sig_type(dtype)
    block = min(BLOCK, triton.next_power_of_2(n))
    return KernelSpec(module=__name__, kernel="vocab_embedding_kernel",
                      signature=dict(ids_ptr="*i32", table_ptr=p, out_ptr=p, n_rows_ptr="*i32",
                                     vocab_start_ptr="*i32", n_valid="i32"),
                      constexprs=dict(N=n, BLOCK=block), grid=(t, cdiv(n, block)), num_warps=4, num_stages=1,
                      divisible=("ids_ptr", "table_ptr", "out_ptr", "n_rows_ptr", "vocab_start_ptr"))


def _rows(n_rows, rows: int):
    return as_buf(n_rows if n_rows is not None else np.array([rows], np.int32))


def all_reduce(parts: list, out=None, *, n_rows=None):
    """parts: the ranks' [rows, n] partials (rank order) -> out [rows, n]: their rank-order sum."""
    bufs = [as_buf(p) for p in parts]
    rows, n = shape_of(bufs[0])
    check(all(shape_of(b) == (rows, n) and dtype_name(b) == dtype_name(bufs[0]) for b in bufs),
          "all_reduce: the ranks' partials differ in shape or dtype")
    out = as_buf(out if out is not None else np.empty((rows, n), dtype=parts[0].dtype))
    launch(all_reduce_spec(rows, n, len(bufs), dtype_name(bufs[0])), [*_peers(bufs), out, _rows(n_rows, rows), n])
    return out.array if getattr(out, "on_host", False) else out


def all_gather(parts: list, size: int, out=None, *, n_rows=None):
    """parts: the ranks' [rows, Np] columns -> out [rows, size]: side by side, cut to size."""
    bufs = [as_buf(p) for p in parts]
    rows, npart = shape_of(bufs[0])
    check(size <= npart * len(bufs), f"all_gather: {len(bufs)} x {npart} columns cannot hold {size}")
    out = as_buf(out if out is not None else np.empty((rows, size), dtype=parts[0].dtype))
    launch(all_gather_spec(rows, npart, size, len(bufs), dtype_name(bufs[0])),
           [*_peers(bufs), out, _rows(n_rows, rows), npart, size])
    return out.array if getattr(out, "on_host", False) else out


def vocab_embedding(ids, table, vocab_start, n_valid: int, out=None, *, n_rows=None):
    """ids: i32[T], table: [Vp, N] (this rank's rows), vocab_start: i32[1] on the device -> [T, N]"""
    ids, table, vocab_start = as_buf(ids), as_buf(table), as_buf(vocab_start)
    check_dtype(ids, ("int32",), "vocab_embedding ids")
    (t,), (_, n) = shape_of(ids), shape_of(table)
    out = as_buf(out if out is not None else np.empty((t, n), dtype=table.dtype))
    launch(vocab_embedding_spec(t, n, dtype_name(table)), [ids, table, out, _rows(n_rows, t), vocab_start, n_valid])
    return out.array if getattr(out, "on_host", False) else out


# -- NCCL (issue 44; docs/TENSOR_PARALLEL.md "NCCL in the plan") ------------------------------
NCCL_OPS = ("all_reduce", "all_gather")


@dataclass(frozen=True)
class NcclCall:
    """A plan entry that is an NCCL call on this rank's own buffers, not a kernel: the runtime
    issues it on the step's stream in launch order (runtime/worker/cuda_executor.py), so a
    decode plan still captures as one CUDA graph (NCCL's kernels are captured like ours).
    all_reduce: recv[i] = sum over ranks of send[i], `count` elements; all_gather: recv =
    every rank's `count` elements of send one after another, in rank order."""
    op: str
    dtype: str  # numpy name: bfloat16, float32
    count: int
    send: Buf
    recv: Buf
    red: str = "sum"
    kernel = "nccl"  # what code reading a plan's spec.kernel sees (compile.py pdl_launches)
    grid = ()

    def __post_init__(self):
        check(self.op in NCCL_OPS, f"an NCCL plan entry is one of {', '.join(NCCL_OPS)}, not {self.op!r}")
        check(self.count > 0, f"an NCCL {self.op} of {self.count} elements")


def _contiguous(b: Buf, what: str) -> Buf:
    check(b.strides == tuple(int(np.prod(b.shape[i + 1:])) for i in range(len(b.shape))),
          f"NCCL {what}: the buffer must be contiguous (strides {b.strides} for shape {b.shape})")
    return b


def nccl_all_reduce(x: Buf, out: Buf) -> None:
    """Record out = the ranks' x summed by NCCL (every element, padded rows too: the count is
    the bucket's, fixed, so the call captures)."""
    check(x.shape == out.shape and dtype_name(x) == dtype_name(out), "nccl all_reduce: x and out differ")
    record_call(NcclCall("all_reduce", dtype_name(x), int(np.prod(x.shape)), _contiguous(x, "all_reduce"),
                         _contiguous(out, "all_reduce")))


def nccl_all_gather(x: Buf, gathered: Buf) -> None:
    """Record gathered [WORLD, *x.shape] = every rank's x in rank order (a copy: no arithmetic,
    so its bytes cannot depend on NCCL's algorithm)."""
    check(tuple(gathered.shape[1:]) == tuple(x.shape) and dtype_name(x) == dtype_name(gathered),
          "nccl all_gather: the gathered buffer is not [WORLD, *x.shape] of x's dtype")
    record_call(NcclCall("all_gather", dtype_name(x), int(np.prod(x.shape)), _contiguous(x, "all_gather"),
                         _contiguous(gathered, "all_gather")))


def rank_slices(gathered: Buf) -> list[Buf]:
    """[WORLD, rows, n] -> the WORLD [rows, n] buffers inside it (the peers of all_reduce /
    all_gather_kernel, read from this rank's own memory)."""
    world, *shape = gathered.shape
    step = int(np.prod(shape)) * gathered.np_dtype.itemsize
    return [Buf(ptr=gathered.ptr + r * step, shape=tuple(shape), dtype=gathered.np_dtype) for r in range(world)]
