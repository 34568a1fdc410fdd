"""The NVFP4 W4A16 GEMM (codegen/triton/nvfp4_gemm.py) under the interpreter vs graph/nvfp4_ops.py's
numpy reference, on fresh random inputs: random packed bytes (every e2m1 code, both signs), e4m3
block scales drawn over a wide range (subnormals included, never all ones), a random per-tensor
scale.

Tolerances, from what may differ and nothing else:
- the in-kernel dequantisation: none. With x the identity, y is W = e2m1 * block scale * ws2
  itself, one product a sum, so it must be the reference's dequantised weight value for value.
- the GEMM: the operands the tensor core multiplies are x and e2m1 * scale (exact in bf16), the
  products exact in f32, so only the f32 summation order differs (the kernel's k steps against
  numpy's BLAS): per element at most 2 gamma_(K+2) sum_k |x W| with gamma_n = n 2^-24, and for a
  bf16 output one bf16 step (2^-7 of the value) where the two f32 sums round to neighbours.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kiln.codegen.triton.nvfp4_gemm import Nvfp4Tile, nvfp4_gemm, nvfp4_tile
from kiln.graph.nvfp4_ops import dequantize_nvfp4, linear_nvfp4
from tests.codegen.helpers import BF16, FP8, f32, rand, require_interpreter, same_bits

pytestmark = pytest.mark.usefixtures("interpreter")


@pytest.fixture
def interpreter():
    require_interpreter()


@pytest.fixture
def rng():
    return np.random.default_rng(39)


def _weights(rng, n, k):
    w = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    ws = np.exp2(rng.uniform(-10, 6, (n, k // 16))).astype(np.float32).astype(FP8)  # 2^-10 (subnormal) .. 64
    ws2 = np.array([rng.uniform(0.05, 3.0)], np.float32)
    assert len(np.unique(f32(ws))) > 1 and ws2[0] != 1.0
    return w, ws, ws2


def _bound(x, w, ws, ws2, want):
    wq = np.abs(dequantize_nvfp4(w, ws, ws2))
    k = x.shape[1]
    return 2.0 ** -7 * np.abs(f32(want)) + 2 * (k + 2) * 2.0 ** -24 * (np.abs(f32(x)) @ wq.T)


def test_in_kernel_dequantisation_is_the_references_values(rng):
    """x = I: y is the dequantised weight, transposed; every byte value, both nibbles, each block's scale."""
    k, n = 32, 64
    w = np.arange(256, dtype=np.uint8).reshape(16, 16).repeat(4, axis=0)  # every byte, n = 64 rows of k/2 = 16
    ws = np.exp2(rng.integers(-9, 6, (n, k // 16)).astype(np.float32)).astype(FP8)
    ws2 = np.array([0.375], np.float32)
    x = np.eye(k, dtype=np.float32).astype(BF16)
    got = nvfp4_gemm(x, w, ws, ws2, out=np.empty((k, n), np.float32))
    # the same values (an f32 sum from +0 turns the e2m1 code 8, -0, into +0: equal, not the same bits)
    np.testing.assert_array_equal(got, dequantize_nvfp4(w, ws, ws2).T)


@pytest.mark.parametrize("m,n,k,bias,tile", [
    (1, 48, 64, False, None),  # decode
    (7, 80, 96, True, None),  # N not a multiple of the tile
    (33, 64, 128, False, Nvfp4Tile(16, 32, 32)),  # several row and column tiles
    (20, 32, 48, True, Nvfp4Tile(64, 64, 64)),  # K not a multiple of BLOCK_K
])
def test_nvfp4_gemm_matches_reference(rng, m, n, k, bias, tile):
    x = rand(rng, (m, k))
    w, ws, ws2 = _weights(rng, n, k)
    b = rand(rng, (n,)) if bias else None
    got = nvfp4_gemm(x, w, ws, ws2, b, tile=tile)
    want = linear_nvfp4(x, w, ws, ws2, b)
    assert got.dtype == BF16 and np.isfinite(f32(got)).all()
    err = np.abs(f32(got) - f32(want))
    assert (err <= _bound(x, w, ws, ws2, want) + (0 if b is None else 2.0 ** -8 * np.abs(f32(want)))).all()
    assert (err == 0).mean() > 0.9  # the same bits nearly everywhere: only summation order differs


def test_f32_activations_and_strided_rows(rng):
    """An f32 graph's activations, read from every other row of a wider buffer."""
    m, n, k = 6, 32, 64
    wide = rng.standard_normal((m, 2 * k)).astype(np.float32)
    w, ws, ws2 = _weights(rng, n, k)
    got = nvfp4_gemm(wide[:, :k], w, ws, ws2)
    want = linear_nvfp4(wide[:, :k], w, ws, ws2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_rows_do_not_depend_on_the_bucket(rng):
    """A token's row: the same bits alone (decode tile) as inside a 40-row prefill (64-row tile)."""
    n, k = 64, 96
    x = rand(rng, (40, k))
    w, ws, ws2 = _weights(rng, n, k)
    big = nvfp4_gemm(x, w, ws, ws2, tile=nvfp4_tile(40))
    for i in (0, 17, 39):
        assert same_bits(nvfp4_gemm(x[i:i + 1], w, ws, ws2, tile=nvfp4_tile(1)), big[i:i + 1])


def test_rows_past_n_rows_are_not_written(rng):
    n, k = 32, 32
    x = rand(rng, (32, k))
    w, ws, ws2 = _weights(rng, n, k)
    out = np.full((32, n), 7.0, np.float32).astype(BF16)
    nvfp4_gemm(x, w, ws, ws2, out=out, n_rows=np.array([9], np.int32), tile=Nvfp4Tile(16, 32, 32))
    assert (f32(out[16:]) == 7.0).all()  # whole tiles past the live rows are skipped
    np.testing.assert_array_equal(f32(out[:9]) == 7.0, False)


def test_bad_operands_are_refused(rng):
    x = rand(rng, (2, 32))
    w, ws, ws2 = _weights(rng, 16, 32)
    with pytest.raises(ValueError, match="ws must be e4m3"):
        nvfp4_gemm(x, w, f32(ws), ws2)
    with pytest.raises(ValueError, match="w must be u8"):
        nvfp4_gemm(x, np.zeros((16, 32), np.uint8), ws, ws2)
    assert ml_dtypes  # (imported for FP8 above)
