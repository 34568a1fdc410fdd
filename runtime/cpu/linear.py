"""One linear layer over a packed weight: the compiled GEMV for a few tokens, BLAS for many.

The switch (GEMM_MIN_TOKENS = 32): a step of T tokens at or above it dequantises the weight
(bit-exact, linear_kernels.dequant_*_t) into a K-major f32 scratch shared by every layer and
multiplies with numpy's BLAS (OpenBLAS sgemm); below it the compiled GEMV streams the packed codes
once for all T tokens. bench/cpu_linear_switch.py times both on SmolLM2's Q4_1 weights. On one
Zen 3 core (CPU time, OPENBLAS_NUM_THREADS=1, 2026-12-07) the GEMV costs ~0.14 ms per token of
gate/up [3072, 576] and the other path a fixed ~1.2-2 ms of dequantisation (it writes 7 MB of f32:
memory bound) plus sgemm; they cross at 16-24 tokens. With two threads the GEMV halves while the
dequantisation stays serial (a BLAS step leaves numba one thread), which moves the crossing to
~32-64 tokens; 32 keeps decode batches of up to 31 sequences on the GEMV path, whose per-token
sums do not depend on T.
"""
from __future__ import annotations

import numba
import numpy as np

from kiln.runtime.cpu import linear_kernels as K
from kiln.runtime.cpu.packed import PackedWeight

GEMM_MIN_TOKENS = 32
# Below this many multiply-adds a parallel kernel runs on the calling thread alone. Measured on
# the 2-core machine (minimum of 2,000 calls, gemv_q4, batch 1, 2026-12-07, issue 43): a
# fork/join of numba's OpenMP pool costs ~2-3 us, so two threads lose below ~64 K weights
# (16 K: 3.2 -> 4.5 us) and win above (147 K: 12.9 -> 9.5 us; SmolLM2's o [576, 576]: 26.7 ->
# 17.2; q/k/v [960, 576]: 43 -> 25). An earlier limit of 1 M kept q/k/v, o and down on one
# thread: half of a decode step's GEMV work. Where other processes hold the cores, every join
# can wait for one (decode fell to 0.95 tok/s at load average 7.8, 11.3 on one thread): the
# executor's ThreadChooser then runs decode on one thread.
PARALLEL_MIN_WORK = 1 << 17


def run_sized(work: int, fn, *args) -> None:
    """fn(*args) on one thread where `work` is too small to share (see PARALLEL_MIN_WORK)."""
    if work >= PARALLEL_MIN_WORK:
        fn(*args)
        return
    n = numba.get_num_threads()
    if n == 1:
        fn(*args)
        return
    numba.set_num_threads(1)
    try:
        fn(*args)
    finally:
        numba.set_num_threads(n)


class Scratch:
    """One K-major f32 buffer that every layer's dequantised weight borrows in turn."""

    def __init__(self) -> None:
        self.buf = np.empty(0, np.float32)

    def get(self, k: int, n: int) -> np.ndarray:
        if self.buf.size < k * n:
            self.buf = np.empty(k * n, np.float32)
        return self.buf[:k * n].reshape(k, n)


def gemv(w: PackedWeight, x: np.ndarray, y: np.ndarray, T: int) -> None:
    """y[:T] = x[:T] @ W.T with the compiled kernel (y: [>= T, w.n])"""
    work = w.n * w.k * T
    if w.kind == "q4":
        run_sized(work, K.gemv_q4, x, w.q, w.d, w.m, y, T)
    elif w.kind == "q8":
        run_sized(work, K.gemv_q8, x, w.q, w.d, y, T)
    else:
        run_sized(work, K.gemv_f32, x, w.q, y, T)


def dequant_t(w: PackedWeight, out: np.ndarray) -> None:
    """out: f32 [K, >= padded N] <- W.T"""
    if w.kind == "q4":
        K.dequant_q4_t(w.q, w.d, w.m, w.offset, out)
    elif w.kind == "q8":
        K.dequant_q8_t(w.q, w.d, out)
    else:
        K.dequant_f32_t(w.q, out)


def dequant_rows(w: PackedWeight, rows: np.ndarray, out: np.ndarray) -> None:
    """out[i] = row rows[i] of W (an embedding lookup; rows i32/i64 [n], out f32 [>= n, K])"""
    if w.kind == "q4":
        K.dequant_q4_rows(w.q, w.d, w.m, w.offset, rows, out)
    elif w.kind == "q8":
        K.dequant_q8_rows(w.q, w.d, rows, out)
    else:
        K.dequant_f32_rows(w.q, rows, out)


def linear(w: PackedWeight, x: np.ndarray, y: np.ndarray, T: int, scratch: Scratch) -> None:
    """y[:T, :w.n] = x[:T] @ W.T; x: f32 [>= T, K] C-contiguous, y: f32 [>= T, w.n] C-contiguous"""
    if T < GEMM_MIN_TOKENS:
        gemv(w, x, y, T)
        return
    n_pad = w.q.shape[0] * w.q.shape[-1]
    wt = scratch.get(w.k, n_pad)
    dequant_t(w, wt)
    np.matmul(x[:T], wt[:, :w.n], out=y[:T])
