"""Tensor-parallel ops: the collectives and the vocab-parallel embedding (issue 44).

A tensor-parallel step graph (passes/shard_tensor_parallel.py) is one rank's share of the
model; its collectives join the ranks' shares. Their numpy references below are the
definition over *all* ranks' inputs at once (`all_reduce_reference(parts)`): executors bind
the node to a communicator (runtime/worker/shm_communicator.py on the CPU, NCCL on a GPU) that
must give exactly that. The per-node reference registered in OPS is the one-rank case only.

Determinism: all_reduce sums the ranks' tensors in rank order, ((x0 + x1) + x2) + ..., in
f32, on every rank, so every rank holds bit-identical results and a step's numbers do not
depend on which rank finished first (vLLM's NCCL all-reduce gives no such promise across
algorithms; ours fixes the order on the CPU, and the GPU design keeps it per plan).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kiln.graph.ops import OPS

COLLECTIVE_OPS = ("all_reduce", "all_gather")


def all_reduce_reference(parts: Sequence[np.ndarray]) -> np.ndarray:
    """parts: one [...] per rank, in rank order -> their sum, accumulated in rank order in f32,
    returned in the parts' dtype."""
    acc = np.array(parts[0], dtype=np.float32, copy=True)
    for p in parts[1:]:
        acc += p.astype(np.float32, copy=False)
    return acc.astype(parts[0].dtype, copy=False)


def all_gather_reference(parts: Sequence[np.ndarray], *, size: int) -> np.ndarray:
    """parts: one [..., Np] per rank, in rank order -> [..., size]: the parts side by side along
    the last axis, cut to `size` columns (the vocab padded up to a multiple of the ranks)."""
    return np.concatenate(list(parts), axis=-1)[..., :size]


def _infer_all_gather(ins, attrs):
    x = ins[0]
    n, size = int(attrs["world_size"]), int(attrs["size"])
    if isinstance(x.shape[-1], int) and not (x.shape[-1] * (n - 1) < size <= x.shape[-1] * n):
        raise ValueError(f"all_gather: {n} ranks of {x.shape[-1]} columns cannot hold {size}")
    return [(x.dtype, (*x.shape[:-1], size))]


@OPS.register("all_reduce", inputs=1, infer=lambda ins, a: [(ins[0].dtype, ins[0].shape)])
def all_reduce(x, *, world_size: int):
    """x: [...] this rank's partial sum -> [...] the sum over the tensor-parallel group (rank
    order). Run alone (no communicator), only a group of one is defined."""
    if world_size != 1:
        raise RuntimeError(f"all_reduce over {world_size} ranks needs a communicator: run the graph on an "
                           "executor bound to one")
    return x


@OPS.register("all_gather", inputs=1, infer=_infer_all_gather)
def all_gather(x, *, world_size: int, size: int):
    """x: [..., Np] this rank's columns -> [..., size]: every rank's columns in rank order, cut to size."""
    if world_size != 1:
        raise RuntimeError(f"all_gather over {world_size} ranks needs a communicator: run the graph on an "
                           "executor bound to one")
    return x[..., :size]


@OPS.register("vocab_parallel_embedding", inputs=2,
              infer=lambda ins, a: [(ins[1].dtype, (ins[0].shape[0], ins[1].shape[1]))])
def vocab_parallel_embedding(ids, table, *, vocab_start: int, vocab_end: int):
    """ids: i32[T] (whole-vocabulary ids), table: [Vp, H] this rank's rows (vocab ids
    vocab_start .. vocab_end, padded with zero rows to Vp) -> [T, H]: the row of each id this
    rank holds, zeros for the others; the all_reduce after it completes every row (vLLM's
    VocabParallelEmbedding: the masked lookup)."""
    ids = np.asarray(ids)
    mine = (ids >= vocab_start) & (ids < vocab_end)
    out = table[np.where(mine, ids - vocab_start, 0)]
    out[~mine] = 0
    return out


__all__ = ["COLLECTIVE_OPS", "all_reduce_reference", "all_gather_reference"]
