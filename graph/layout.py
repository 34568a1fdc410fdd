"""Row layouts of stacked weights (passes/merge_parallel_linears.py), one pure function that
every executor builds its weights from, so tests can check it on the CPU.

A stacked weight is its parts one after another along axis 0, or, with `interleave` G > 0
(passes/fuse_gate_up_silu.py), block-interleaved: G rows of part 0, G rows of part 1, ...,
then the next G rows of each part:

    gate_up rows [g0..g15, u0..u15, g16..g31, u16..u31, ...]   (G = 16, parts gate, up)

so that any GEMM tile of a multiple of 2G columns holds matching gate and up columns.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def part_copies(rows: Sequence[int], interleave: int = 0) -> list[tuple[int, int, int, int]]:
    """Where each part goes, as strided 2-D row copies: one (dst_row, chunk_rows, chunks,
    dst_pitch_rows) per part: `chunks` runs of `chunk_rows` consecutive source rows, the j-th
    landing at dst_row + j * dst_pitch_rows. Plain stacking is one chunk per part."""
    rows = [int(r) for r in rows]
    if not interleave:
        starts = np.cumsum([0] + rows[:-1])
        return [(int(s), r, 1, r) for s, r in zip(starts, rows)]
    g = int(interleave)
    if len(set(rows)) != 1 or rows[0] % g:
        raise ValueError(f"interleaving in groups of {g} rows needs equal parts of a multiple of {g} rows, "
                         f"got {rows}")
    p = len(rows)
    return [(i * g, g, rows[0] // g, p * g) for i in range(p)]


def stacked_row_order(rows: Sequence[int], interleave: int = 0) -> np.ndarray:
    """order[i]: the row of the plain stack (parts one after another) that row i of the
    stored weight holds."""
    total = sum(rows)
    order = np.full(total, -1, np.int64)
    src = 0
    for dst, chunk, chunks, pitch in part_copies(rows, interleave):
        for j in range(chunks):
            order[dst + j * pitch: dst + j * pitch + chunk] = np.arange(src + j * chunk, src + (j + 1) * chunk)
        src += chunk * chunks
    return order


def stack_parts(arrays: Sequence[np.ndarray], interleave: int = 0) -> np.ndarray:
    """The stored stacked weight from its parts (numpy executor, tests), by part_copies."""
    rows = [a.shape[0] for a in arrays]
    out = np.empty((sum(rows), *arrays[0].shape[1:]), dtype=np.result_type(*arrays))
    for a, (dst, chunk, chunks, pitch) in zip(arrays, part_copies(rows, interleave)):
        view = out[dst: dst + (chunks - 1) * pitch + chunk]  # rows dst .. the last chunk's end
        for j in range(chunks):
            view[j * pitch: j * pitch + chunk] = a[j * chunk: (j + 1) * chunk]
    return out
