"""A MoE layer's rank-order sum run inside the next norm's launch (add_rms_norm's and
add_rms_norm_quant's moe=, lower.py _norm_takes_moe_sum) against moe_sum then the plain norm,
under the interpreter: the same bits for the normed row, the new residual (and the FP8 scales),
with and without the shared expert's product; rows past n_rows untouched."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton.fp8_quant import add_rms_norm_quant
from kiln.codegen.triton.moe import moe_sum
from kiln.codegen.triton.rms_norm import add_rms_norm
from tests.codegen.helpers import BF16, FP8, assert_close, f32, rand, require_interpreter, same_bits

pytestmark = pytest.mark.usefixtures("interpreter")
MIN_SCALE_GROUP = 1e-10


@pytest.fixture
def interpreter():
    require_interpreter()


@pytest.fixture
def rng():
    return np.random.default_rng(4321)


def _layer(rng, t, h, k, dtype, shared):
    """The operands of a MoE layer's sum (expert rows o [T*k, H], routing weights f32 [T, k], the
    shared expert's x and its [T, 1] gate: a strided column of a merged GEMM's output) and of the norm
    after it (residual, weight)."""
    o = rand(rng, (t * k, h), dtype)
    tw = rng.uniform(0.05, 1.0, (t, k)).astype(np.float32)
    sx = rand(rng, (t, h), dtype)
    gate = rand(rng, (t, 5), dtype, 2.0)[:, 2:3]
    res = rand(rng, (t, h), dtype)
    w = rand(rng, (h,), dtype, 0.3)
    return o, tw, (sx, gate) if shared else None, res, w


def _reference_layer_output(o, tw, sh, t, h, k):
    """The layer's output in f32, to rounding: sum_j w_j o_j (+ x * sigmoid(gate))."""
    y = (f32(o).reshape(t, k, h) * tw[:, :, None]).sum(1)
    if sh is not None:
        y = y + f32(sh[0]) / (1 + np.exp(-f32(sh[1])))
    return y


@pytest.mark.parametrize("t,h,k,live", [(1, 64, 8, 1), (5, 96, 2, 3), (4, 160, 3, 4)])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_add_rms_norm_with_the_moe_sum_gives_moe_sum_then_add_rms_norms_bits(rng, t, h, k, live, shared, dtype):
    o, tw, sh, res, w = _layer(rng, t, h, k, dtype, shared)
    n = np.array([live], np.int32)
    kw = dict(eps=1e-6, offset=1.0 if shared else 0.0, n_rows=n)
    y = np.full((t, h), 3.0, dtype)
    moe_sum(o, tw, y, n_rows=n, shared=sh)
    want_out, want_res = np.full((t, h), 7.0, dtype), np.full((t, h), 5.0, dtype)
    add_rms_norm(y, res, w, want_out, want_res, **kw)
    out, new_res = np.full((t, h), 7.0, dtype), np.full((t, h), 5.0, dtype)
    add_rms_norm(o, res, w, out, new_res, moe=(tw, sh), **kw)
    assert same_bits(new_res[:live], want_res[:live]), "the new residual differs"
    assert same_bits(out[:live], want_out[:live]), "the normed row differs"
    assert (f32(out[live:]) == 7.0).all() and (f32(new_res[live:]) == 5.0).all(), "a padded row was written"
    ref = _reference_layer_output(o, tw, sh, t, h, k) + f32(res)
    assert_close(new_res[:live], ref[:live], rtol=2e-2 if dtype == BF16 else 1e-5, what="layer output + residual")


@pytest.mark.parametrize("t,h,k,live,group", [(1, 64, 8, 1, 16), (6, 128, 2, 4, 64)])
@pytest.mark.parametrize("shared", [False, True])
def test_add_rms_norm_quant_with_the_moe_sum_gives_moe_sum_then_add_rms_norm_quants_bits(rng, t, h, k, live, group,
                                                                                         shared):
    o, tw, sh, res, w = _layer(rng, t, h, k, BF16, shared)
    n = np.array([live], np.int32)
    kw = dict(eps=1e-6, group=group, min_scale=MIN_SCALE_GROUP, n_rows=n)
    y = np.full((t, h), 3.0, BF16)
    moe_sum(o, tw, y, n_rows=n, shared=sh)

    def outs():
        return np.full((t, h), 9.0, FP8), np.full((t, h // group), 7.0, np.float32), np.full((t, h), 5.0, BF16)

    wq, ws, wr = outs()
    add_rms_norm_quant(res, y, w, q=wq, s=ws, res_out=wr, **kw)  # y as the norm's res: the add is symmetric
    q, s, r = outs()
    add_rms_norm_quant(o, res, w, q=q, s=s, res_out=r, moe=(tw, sh), **kw)
    assert same_bits(r[:live], wr[:live]), "the new residual differs"
    assert same_bits(q[:live], wq[:live]) and same_bits(s[:live], ws[:live]), "the quantised row differs"
    assert (f32(q[live:]) == 9.0).all() and (s[live:] == 7.0).all() and (f32(r[live:]) == 5.0).all()
    ref = _reference_layer_output(o, tw, sh, t, h, k) + f32(res)
    assert_close(r[:live], ref[:live], rtol=2e-2, what="layer output + residual")
