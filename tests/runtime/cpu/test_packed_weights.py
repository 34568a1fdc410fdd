"""Packed GGUF weights (runtime/cpu/packed.py) dequantise bit for bit as gguf-py does, and the
compiled GEMV / BLAS linear over them equals the numpy reference's linear on those values.

Blocks are random bytes (every code pattern) with random finite f16 scales; N is not a multiple
of the 64-row tile, so padding is exercised. The oracle is gguf-py's `dequantize`, and also
kiln's own numpy reference of the blocks (graph/gguf_blocks.py) where it is present.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kiln.graph.ops import linear as linear_ref
from kiln.runtime.cpu import linear as L
from kiln.runtime.cpu.packed import BLOCKS, R, pack_float, pack_gguf

F16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q8_0": (0,), "Q6_K": (208,)}  # f16 fields


def random_blocks(rng, qtype: str, n: int, k: int) -> np.ndarray:
    vals, nbytes = BLOCKS[qtype]
    raw = rng.integers(0, 256, (n, k // vals, nbytes), dtype=np.uint8)
    for at in F16_AT[qtype]:
        f16 = (rng.standard_normal((n, k // vals)) * 0.02).astype(np.float16)
        raw[..., at:at + 2] = f16.view(np.uint8).reshape(n, k // vals, 2)
    return raw.reshape(n, -1)


def oracles(raw: np.ndarray, qtype: str, n: int, k: int) -> list[np.ndarray]:
    out = [dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k)]
    try:
        from kiln.graph import gguf_blocks
    except ImportError:
        return out
    return out + [np.asarray(gguf_blocks.dequantize(raw, qtype), np.float32).reshape(n, k)]


@pytest.mark.parametrize("qtype", sorted(BLOCKS))
def test_dequantise_is_bit_exact(qtype):
    rng = np.random.default_rng(sorted(BLOCKS).index(qtype))
    n, k = 2 * R + 7, 512
    raw = random_blocks(rng, qtype, n, k)
    w = pack_gguf(qtype, raw, k)
    rows = rng.permutation(n).astype(np.int32)
    got_rows = np.empty((n, k), np.float32)
    L.dequant_rows(w, rows, got_rows)
    got_t = np.empty((k, w.q.shape[0] * R), np.float32)
    L.dequant_t(w, got_t)
    for ref in oracles(raw, qtype, n, k):
        assert np.array_equal(got_rows.view(np.uint32), ref[rows].view(np.uint32))
        assert np.array_equal(got_t[:, :n].T.view(np.uint32), ref.view(np.uint32))


def test_bf16_stays_bf16_and_widens_exactly():
    """A bf16 weight is packed as its 16-bit patterns (half the bytes of f32 tiles) and every
    kernel that reads it sees the exactly widened f32 value: dequantised rows and the K-major copy
    equal numpy's widening bit for bit, NaN and infinities included."""
    rng = np.random.default_rng(21)
    n, k = 2 * R + 7, 96
    wb = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
    wb[0, :3] = [np.inf, -np.inf, np.nan]
    w = pack_float(wb)
    assert w.kind == "bf16" and w.q.dtype == np.uint16
    assert w.nbytes * 2 == pack_float(wb.astype(np.float32)).nbytes
    ref = wb.astype(np.float32)
    rows = rng.permutation(n).astype(np.int32)
    got_rows = np.empty((n, k), np.float32)
    L.dequant_rows(w, rows, got_rows)
    got_t = np.empty((k, w.q.shape[0] * R), np.float32)
    L.dequant_t(w, got_t)
    assert np.array_equal(got_rows.view(np.uint32), ref[rows].view(np.uint32))
    assert np.array_equal(got_t[:, :n].T.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", sorted(BLOCKS) + ["F32", "BF16"])
def test_linear_matches_the_reference_on_both_paths(qtype):
    """T below the switch runs the compiled GEMV, T at or above it dequantise + BLAS."""
    rng = np.random.default_rng(10 + len(qtype))
    n, k = R + 24, 256
    if qtype in ("F32", "BF16"):
        ref_w = rng.standard_normal((n, k)).astype(np.float32)
        if qtype == "BF16":
            ref_w = ref_w.astype(ml_dtypes.bfloat16)
        w = pack_float(ref_w)
        ref_w = ref_w.astype(np.float32)
    else:
        raw = random_blocks(rng, qtype, n, k)
        ref_w = oracles(raw, qtype, n, k)[0]
        w = pack_gguf(qtype, raw, k)
    scratch = L.Scratch()
    for T in (1, 3, L.GEMM_MIN_TOKENS - 1, L.GEMM_MIN_TOKENS, 40):
        x = rng.standard_normal((T, k)).astype(np.float32)
        y = np.full((T, n), np.nan, np.float32)
        L.linear(w, x, y, T, scratch)
        ref = linear_ref(x, ref_w)
        err = np.abs(y - ref).max() / np.abs(ref).max()
        assert err < 2e-6, (qtype, T, err)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F32", "BF16"])
def test_gemv_rows_do_not_depend_on_the_batch(qtype):
    """A token's outputs are the same bits alone or among others (below the BLAS switch)."""
    rng = np.random.default_rng(3)
    n, k = R, 128
    dt = {"F32": np.float32, "BF16": ml_dtypes.bfloat16}
    w = pack_float(rng.standard_normal((n, k)).astype(dt[qtype])) if qtype in dt else \
        pack_gguf(qtype, random_blocks(rng, qtype, n, k), k)
    x = rng.standard_normal((L.GEMM_MIN_TOKENS - 1, k)).astype(np.float32)
    batched = np.empty((len(x), n), np.float32)
    L.gemv(w, x, batched, len(x))
    for t in (0, 4, len(x) - 1):
        alone = np.empty((1, n), np.float32)
        L.gemv(w, np.ascontiguousarray(x[t:t + 1]), alone, 1)
        assert np.array_equal(alone[0], batched[t])


def test_q8_1_activation_codes_equal_the_reference():
    """The activation rounding of KILN_CPU_ACT_QUANT=q8_1 gives the numpy reference's codes and
    scales bit for bit (same f32 operations), zero blocks included, and |codes| <= 127."""
    rng = np.random.default_rng(21)
    x = (rng.standard_normal((5, 256)) * rng.choice([1e-3, 1.0, 30.0], (5, 1))).astype(np.float32)
    x[2, 32:64] = 0
    x[3, 5] = -x[3, :32].__abs__().max() * 2  # the block's amax is negative
    xq, dx, sx = L.quantize_act(x, len(x), L.Scratch("q8_1"))
    q, d, s = L.quantize_q8_1_reference(x)
    assert np.array_equal(xq, q) and np.abs(q).max() == 127
    assert np.array_equal(dx.view(np.uint32), d.view(np.uint32))
    assert np.array_equal(sx.view(np.uint32), s.view(np.uint32))
    assert (dx[2, 1] == 0) and (xq[2, 32:64] == 0).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_linear_with_q8_1_activations_matches_its_reference(qtype):
    """Q4 weights under activation rounding: the integer GEMV (T below the switch) and the BLAS
    path (T at or above it) both give linear_q8_1_reference within f32 rounding, and the rounding
    is really there (the f32-activation result differs by far more)."""
    rng = np.random.default_rng(30 + len(qtype))
    n, k = R + 24, 512
    raw = random_blocks(rng, qtype, n, k)
    ref_w = oracles(raw, qtype, n, k)[0]
    w = pack_gguf(qtype, raw, k)
    scratch = L.Scratch("q8_1")
    for T in (1, 3, L.GEMM_MIN_TOKENS - 1, L.GEMM_MIN_TOKENS, 40):
        x = rng.standard_normal((T, k)).astype(np.float32)
        y = np.full((T, n), np.nan, np.float32)
        L.linear(w, x, y, T, scratch)
        ref = L.linear_q8_1_reference(x, ref_w)
        err = np.abs(y - ref).max() / np.abs(ref).max()
        assert err < 2e-6, (qtype, T, err)
        assert np.abs(linear_ref(x, ref_w) - ref).max() / np.abs(ref).max() > 1e-4


def test_q8_1_gemv_rows_do_not_depend_on_the_batch():
    rng = np.random.default_rng(4)
    n, k = R, 128
    w = pack_gguf("Q4_1", random_blocks(rng, "Q4_1", n, k), k)
    x = rng.standard_normal((L.GEMM_MIN_TOKENS - 1, k)).astype(np.float32)
    batched = np.empty((len(x), n), np.float32)
    L.linear(w, x, batched, len(x), L.Scratch("q8_1"))
    for t in (0, 4, len(x) - 1):
        alone = np.empty((1, n), np.float32)
        L.linear(w, np.ascontiguousarray(x[t:t + 1]), alone, 1, L.Scratch("q8_1"))
        assert np.array_equal(alone[0], batched[t])
