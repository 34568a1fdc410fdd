"""FP8 W8A8 kernels under the interpreter vs graph/fp8_ops.py's numpy references, on fresh
random inputs and scales (never all ones): the quantising producers (codegen/triton/fp8_quant.py)
and the FP8 GEMM in its three layouts (codegen/triton/fp8_gemm.py).

Tolerances, from what may differ and nothing else:
- quant_fp8: none. amax is exact in any order, both divisions are correctly rounded, the e4m3
  rounding is round-to-nearest-even on both sides: the same bits.
- the fused producers: the row before quantisation is the unfused kernel's, whose f32 sums (the
  norm's mean of squares, exp in SiLU) may differ from numpy's in the last bit and so, now and
  then, round to the neighbouring bf16 value; that can move an e4m3 value by one e4m3 step
  (2^-3 of itself at most) and a group's scale by one bf16 step (2^-7). Most values must still
  be the reference's bits; x + residual is one f32 add rounded once: the same bits.
- the GEMM: the operands are identical e4m3 values and every product is exact in f32 (at most
  8 significant bits), so only the f32 summation order differs (the kernel's k blocks against
  numpy's BLAS): per element at most 2 gamma_(K+2) sum_j |P|_j xs ws with gamma_n = n 2^-24
  (Higham's bound for each side, with the scale products and the bias add), and for a bf16 output one bf16
  step (2^-7 of the value) where the two f32 results round to neighbouring bf16 values.
"""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton.fp8_gemm import Fp8Tile, fp8_gemm, fp8_gemm_spec, fp8_tile
from kiln.codegen.triton.fp8_quant import add_rms_norm_quant, quant_fp8, rms_norm_quant, silu_mul_quant
from kiln.graph import fp8_ops as ref
from kiln.models.quant_config import MIN_SCALE_GROUP, MIN_SCALE_TOKEN
from tests.codegen.helpers import BF16, FP8, f32, rand, require_interpreter, same_bits

pytestmark = pytest.mark.usefixtures("interpreter")


@pytest.fixture
def interpreter():
    require_interpreter()


@pytest.fixture
def rng():
    return np.random.default_rng(2024)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _close_quant(got, want, what):
    """(q, s) against the reference's: mostly the same bits, the rest one rounding step away."""
    (q, s), (rq, rs) = got, want
    assert np.isfinite(f32(q)).all() and np.isfinite(s).all(), what
    np.testing.assert_allclose(s, rs, rtol=2.0 ** -7, atol=0, err_msg=f"{what}: scales")
    group = q.shape[1] // s.shape[1]
    deq = f32(q) * np.repeat(s, group, axis=1)
    rdeq = f32(rq) * np.repeat(rs, group, axis=1)
    amax = np.repeat(rs * 448.0, group, axis=1)
    assert (np.abs(deq - rdeq) <= 2.0 ** -3 * np.abs(rdeq) + 2.0 ** -7 * amax).all(), f"{what}: values"
    assert (_bits(q) == _bits(rq)).mean() >= 0.99, f"{what}: too few e4m3 values are the reference's bits"


@pytest.mark.parametrize("group,static", [(16, 0), (64, 0), (64, 1), (64, 3)])
def test_quant_fp8_is_the_references_bits(rng, group, static):
    x = rand(rng, (7, 64), scale=3.0)
    x[2, :group] = 0.0  # a zero group: the min_scale guard, zeros out
    scales = [rng.uniform(0.005, 0.02, 1).astype(np.float32) for _ in range(static)]
    min_scale = 0.0 if static else (MIN_SCALE_GROUP if group < 64 else MIN_SCALE_TOKEN)
    q, s = quant_fp8(x, *scales, group=group, min_scale=min_scale)
    rq, rs = ref.quant_fp8(x, *scales, group=group, min_scale=min_scale)
    assert q.dtype == FP8 and s.shape == rs.shape
    assert same_bits(q, rq) and same_bits(s, rs)
    if static:  # clipped at +-448 where x / s is past it (saturating, never NaN)
        assert np.isfinite(f32(q)).all() and (np.abs(f32(q)) == 448).any()


@pytest.mark.parametrize("group,offset", [(16, 0.0), (96, 0.0), (32, 1.0)])
def test_rms_norm_quant_matches_reference(rng, group, offset):
    n = 96 if group == 96 else 64
    x, w = rand(rng, (9, n), scale=2.0), rand(rng, (n,), scale=0.3)
    kw = dict(eps=1e-6, offset=offset, group=group, min_scale=MIN_SCALE_GROUP)
    _close_quant(rms_norm_quant(x, w, **kw), ref.rms_norm_quant(x, w, **kw), "rms_norm_quant")


@pytest.mark.parametrize("static", [0, 2])
def test_add_rms_norm_quant_matches_reference(rng, static):
    x, r, w = rand(rng, (9, 64)), rand(rng, (9, 64)), rand(rng, (64,), scale=0.3)
    scales = [rng.uniform(0.002, 0.01, 1).astype(np.float32) for _ in range(static)]
    kw = dict(eps=1e-6, group=64 if static else 16, min_scale=0.0 if static else MIN_SCALE_GROUP)
    q, s, h = add_rms_norm_quant(x, r, w, *scales, **kw)
    rq, rs, rh = ref.add_rms_norm_quant(x, r, w, *scales, **kw)
    assert same_bits(h, rh), "x + residual differs"
    _close_quant((q, s), (rq, rs), "add_rms_norm_quant")


@pytest.mark.parametrize("group", [16, 128])
def test_silu_mul_quant_matches_reference(rng, group):
    g, u = rand(rng, (6, 128), scale=2.0), rand(rng, (6, 128))
    kw = dict(group=group, min_scale=MIN_SCALE_TOKEN)
    _close_quant(silu_mul_quant(g, u, **kw), ref.silu_mul_quant(g, u, **kw), "silu_mul_quant")


@pytest.mark.parametrize("mode", ["quant", "rms_norm", "silu_mul"])
def test_a_group_count_that_is_no_power_of_two(rng, mode):
    """N = 5 groups of 32 (as 5,120 = 40 x 128 in the 27B shape): the row is cut into 8 padded
    groups, the 3 past N neither stored nor moving the real groups' scales."""
    n, group = 160, 32
    x, u, w = rand(rng, (7, n), scale=2.0), rand(rng, (7, n)), rand(rng, (n,), scale=0.3)
    x[3, 64:96] = 0.0  # a zero group inside the row
    kw = dict(group=group, min_scale=MIN_SCALE_GROUP)
    if mode == "quant":
        got, want = quant_fp8(x, **kw), ref.quant_fp8(x, **kw)
        assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    elif mode == "rms_norm":
        kw.update(eps=1e-6)
        got, want = rms_norm_quant(x, w, **kw), ref.rms_norm_quant(x, w, **kw)
    else:
        got, want = silu_mul_quant(x, u, **kw), ref.silu_mul_quant(x, u, **kw)
    assert got[1].shape == want[1].shape == (7, n // group)
    _close_quant(got, want, mode)


def test_quant_rows_past_n_rows_are_not_written(rng):
    x = rand(rng, (8, 32))
    q = np.full((8, 32), 7, np.uint8).view(FP8)
    s = np.full((8, 2), -1.0, np.float32)
    quant_fp8(x, q=q, s=s, group=16, min_scale=MIN_SCALE_GROUP, n_rows=np.array([5], np.int32))
    assert (q[5:].view(np.uint8) == 7).all() and (s[5:] == -1).all() and (s[:5] > 0).all()


# (M, N, K, activation groups, weight block): block-wise (a 16-column group narrower than a dot,
# and 128 x 128), per channel (1, K), per tensor (N, K) with a static scale, ragged N and K tails
LAYOUTS = [(5, 48, 64, 4, (16, 16)), (20, 64, 256, 2, (128, 128)), (7, 40, 96, 1, (1, 96)),
           (70, 72, 64, 1, (72, 64)), (3, 200, 160, 1, (200, 160))]


def _gemm_inputs(rng, m, n, k, groups, block):
    x = np.clip(rng.standard_normal((m, k)) * 60, -448, 448).astype(FP8)
    w = np.clip(rng.standard_normal((n, k)) * 60, -448, 448).astype(FP8)
    xs = rng.uniform(0.001, 0.01, (m, groups)).astype(np.float32)
    ws = rng.uniform(0.001, 0.01, (-(-n // block[0]), -(-k // block[1]))).astype(np.float32)
    return x, xs, w, ws


@pytest.mark.parametrize("arch", ["sm_90", "sm_121"])
@pytest.mark.parametrize("m,n,k,groups,block", LAYOUTS)
def test_fp8_gemm_matches_reference(rng, m, n, k, groups, block, arch):
    x, xs, w, ws = _gemm_inputs(rng, m, n, k, groups, block)
    bias = rand(rng, (n,)) if n == 40 else None
    want = ref.linear_fp8(x, xs, w, ws, bias, block=block, out_dtype="f32")
    mag = ref.linear_fp8(np.abs(f32(x)).astype(FP8), xs, np.abs(f32(w)).astype(FP8), ws, block=block, out_dtype="f32")
    # + the bias: one more f32 add on each side
    bound = 2 * (k + 3) * 2.0 ** -24 * (mag + (np.abs(f32(bias)) if bias is not None else 0))
    got = fp8_gemm(x, xs, w, ws, bias, block=block, out_dtype=np.float32, arch=arch)
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= bound).all(), f"worst {np.abs(got - want).max():.3g} past the f32 order bound"
    got16 = fp8_gemm(x, xs, w, ws, bias, block=block, arch=arch)
    want16 = ref.linear_fp8(x, xs, w, ws, bias, block=block, out_dtype="bf16")
    assert got16.dtype == BF16
    assert (np.abs(f32(got16) - f32(want16)) <= 2.0 ** -7 * np.abs(f32(want16)) + 2 * bound).all()


@pytest.mark.parametrize("arch", ["sm_90", "sm_121"])
def test_fp8_gemm_rows_do_not_depend_on_the_bucket(rng, arch):
    """A token's row is the same bits at M = 1 (decode tile) and inside M = 70 (prefill tile)."""
    x, xs, w, ws = _gemm_inputs(rng, 70, 64, 256, 2, (128, 128))
    full = fp8_gemm(x, xs, w, ws, block=(128, 128), arch=arch)
    small = Fp8Tile(64, 32) if arch == "sm_90" else Fp8Tile(16, 32)
    for i in (0, 33, 69):
        one = fp8_gemm(x[i:i + 1], xs[i:i + 1], w, ws, block=(128, 128), tile=small, arch=arch)
        assert same_bits(one[0], full[i]), f"row {i} differs between buckets"


def test_sm_90_tiles_are_wgmma_tiles():
    """Every default sm_90 tile is one e4m3 wgmma takes (64-row warpgroups), and a 16-row tile,
    which Triton runs on f16 mma.sync (other bits), is refused there."""
    for m in (1, 16, 17, 64, 65, 4096):
        t = fp8_tile(m, "sm_90")
        assert t.block_m >= 64 and t.num_warps % 4 == 0
    with pytest.raises(ValueError, match="BLOCK_M >= 64"):
        fp8_gemm_spec(4, 64, 128, 1, (1, 128), tile=Fp8Tile(16, 32), arch="sm_90")
    assert fp8_gemm_spec(4, 64, 128, 1, (1, 128), tile=Fp8Tile(16, 32), arch="sm_121").constexprs["BLOCK_M"] == 16
