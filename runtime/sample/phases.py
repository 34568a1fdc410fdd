"""How a step runs the GPU sampler's sample kernel (codegen/triton/sampling.py sample_kernel):
which of its phases it launches, and the scratch they share. The runtime's GpuSampler and the
kernel's own wrapper (the interpreter tests) both follow this.

A row is split over P programs (BLOCK_V tokens each); one launch per phase, (rows, P)
programs, the last one (rows, 1):
  0       each program's (max, first index); the row's histograms cleared
  1-4     top-k: a radix select, 8 bits a pass, counts added into hist[row, pass]
  5-12    top-p: a radix search, 4 bits a pass, fixed-point masses into hist[row, 4 + pass]
  13      the exponential race over the kept tokens: each program's best
  14      the row's token
"""
from __future__ import annotations

import numpy as np

PHASE_TOKEN = 14
HIST_PASSES = 12  # hist rows per sampled row: 4 top-k passes, 8 top-p passes, 256 i64 each


def sample_phases(temperature, top_k, top_p, vocab: int) -> list[int]:
    """The phases a step launches, in order: the max and the token always; the top-k, top-p and
    race phases only where some row samples (temperature > 0) with top-k or top-p on."""
    rand = np.asarray(temperature) > 0
    return ([0] + (list(range(1, 5)) if (rand & (np.asarray(top_k) < vocab)).any() else [])
            + (list(range(5, 13)) if (rand & (np.asarray(top_p) < 1.0)).any() else [])
            + ([13] if rand.any() else []) + [PHASE_TOKEN])


def sample_scratch(rows: int, np_pad: int) -> tuple[int, int, int]:
    """-> (idx offset, hist offset, total bytes) of the scratch for `rows` rows, val at 0:
    val f32 and idx i32 [rows, 2, np_pad] (phase 0's and 13's partials), hist i64
    [rows, 12, 256] (phase 0 clears a step's rows)."""
    part = 4 * rows * 2 * np_pad
    return part, 2 * part, 2 * part + 8 * rows * HIST_PASSES * 256
