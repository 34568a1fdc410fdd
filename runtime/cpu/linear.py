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


ACT_QUANTS = ("", "q8_1")


class Scratch:
    """One K-major f32 buffer that every layer's dequantised weight borrows in turn, the
    activation codes of `act_quant` "q8_1" (see quantize_act), and which activation quantisation
    the plan's Q4 linears use ("" none: f32 activations)."""

    def __init__(self, act_quant: str = "") -> None:
        if act_quant not in ACT_QUANTS:
            raise ValueError(f"activation quantisation {act_quant!r} is not one of {ACT_QUANTS}")
        self.act_quant = act_quant
        self.buf = np.empty(0, np.float32)
        self.xq = np.empty(0, np.int16)
        self.ds = np.empty(0, np.float32)
        self.xf = np.empty(0, np.float32)

    def get(self, k: int, n: int) -> np.ndarray:
        if self.buf.size < k * n:
            self.buf = np.empty(k * n, np.float32)
        return self.buf[:k * n].reshape(k, n)

    def act(self, T: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> xq i16 [T, k], dx, sx f32 [T, k/32]: C-contiguous views of buffers kept for the next
        layer (contiguous whatever k, so the kernels see one array layout and compile once)"""
        if self.xq.size < T * k:
            self.xq = np.empty(T * k, np.int16)
            self.ds = np.empty(2 * T * k // 32, np.float32)
        nb = T * k // 32
        return (self.xq[:T * k].reshape(T, k), self.ds[:nb].reshape(T, k // 32),
                self.ds[nb:2 * nb].reshape(T, k // 32))


def gemv(w: PackedWeight, x: np.ndarray, y: np.ndarray, T: int) -> None:
    """y[:T] = x[:T] @ W.T with the compiled kernel (y: [>= T, w.n])"""
    work = w.n * w.k * T
    if w.kind == "q4":
        run_sized(work, K.gemv_q4, x, w.q, w.d, w.m, y, T)
    elif w.kind == "q8":
        run_sized(work, K.gemv_q8, x, w.q, w.d, y, T)
    elif w.kind == "bf16":
        run_sized(work, K.gemv_bf16, x, w.q, y, T)
    else:
        run_sized(work, K.gemv_f32, x, w.q, y, T)


def dequant_t(w: PackedWeight, out: np.ndarray) -> None:
    """out: f32 [K, >= padded N] <- W.T"""
    if w.kind == "q4":
        K.dequant_q4_t(w.q, w.d, w.m, w.offset, out)
    elif w.kind == "q8":
        K.dequant_q8_t(w.q, w.d, out)
    elif w.kind == "bf16":
        K.dequant_bf16_t(w.q, out)
    else:
        K.dequant_f32_t(w.q, out)


def dequant_rows(w: PackedWeight, rows: np.ndarray, out: np.ndarray) -> None:
    """out[i] = row rows[i] of W (an embedding lookup; rows i32/i64 [n], out f32 [>= n, K])"""
    if w.kind == "q4":
        K.dequant_q4_rows(w.q, w.d, w.m, w.offset, rows, out)
    elif w.kind == "q8":
        K.dequant_q8_rows(w.q, w.d, rows, out)
    elif w.kind == "bf16":
        K.dequant_bf16_rows(w.q, rows, out)
    else:
        K.dequant_f32_rows(w.q, rows, out)


def quantize_q8_1_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy reference of linear_kernels.quantize_q8_1 (same f32 operations, so the same bits):
    x f32 [T, K] -> codes i16 [T, K], d, s f32 [T, K/32]"""
    xb = np.asarray(x, np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(xb).max(-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int16)
    s = d * q.sum(-1).astype(np.float32)
    return q.reshape(x.shape), d.astype(np.float32), s.astype(np.float32)


def linear_q8_1_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The semantics of a linear under KILN_CPU_ACT_QUANT=q8_1: x rounded to q8_1 blocks
    (quantize_q8_1_reference), times the weight's values w [N, K] (exactly as dequantised), summed in
    float64 -> f32 [T, N]. The kernels compute the same sums as integer products per 32-block
    scaled in f32 (GEMV) or an sgemm of the rounded activations (BLAS path): within f32 rounding
    of this (tests/runtime/cpu/test_packed_weights.py)."""
    q, d, _ = quantize_q8_1_reference(x)
    xr = (q.reshape(len(x), -1, 32) * d[..., None].astype(np.float64)).reshape(x.shape)
    return (xr @ np.asarray(w, np.float64).T).astype(np.float32)


def quantize_act(x: np.ndarray, T: int, scratch: Scratch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xq, dx, sx = scratch.act(T, x.shape[1])
    K.quantize_q8_1(x, T, xq, dx, sx)
    return xq, dx, sx


def linear(w: PackedWeight, x: np.ndarray, y: np.ndarray, T: int, scratch: Scratch) -> None:
    """y[:T, :w.n] = x[:T] @ W.T; x: f32 [>= T, K] C-contiguous, y: f32 [>= T, w.n] C-contiguous.
    With scratch.act_quant "q8_1" a Q4 weight (Q4_0, Q4_1, Q4_K) multiplies x rounded to q8_1
    blocks, as llama.cpp's CPU backend does (linear_q8_1_reference defines it): integer dot
    products on the GEMV path (gemv_q4_q8), the rounded activations through BLAS above the switch,
    so a token's values do not depend on which path its step took beyond f32 rounding."""
    q8 = scratch.act_quant == "q8_1" and w.kind == "q4"
    if T < GEMM_MIN_TOKENS:
        if q8:
            xq, dx, sx = quantize_act(x, T, scratch)
            run_sized(w.n * w.k * T, K.gemv_q4_q8, xq, dx, sx, w.q, w.d, w.m, y, T)
        else:
            gemv(w, x, y, T)
        return
    n_pad = w.q.shape[0] * w.q.shape[-1]
    wt = scratch.get(w.k, n_pad)
    dequant_t(w, wt)
    if q8:
        xq, dx, _ = quantize_act(x, T, scratch)
        if scratch.xf.size < T * w.k:
            scratch.xf = np.empty(T * w.k, np.float32)
        xr = scratch.xf[:T * w.k].reshape(T, -1, 32)
        np.multiply(xq.reshape(T, -1, 32), dx[..., None], out=xr)
        x = xr.reshape(T, w.k)
    np.matmul(x[:T], wt[:, :w.n], out=y[:T])
