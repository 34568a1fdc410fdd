"""Recorded launches (what a bundle's cubins are compiled from) carry Triton's integer
specialization: a divisibility-by-16 hint on exactly the integer arguments that are
multiples of 16. Without them the AOT paged attention kernel loaded K/V 2 bytes at a time
and ran at about half the speed of the same kernel under the JIT (H200, 8B shape)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kiln.codegen.triton.configs import AttentionConfig, GemmReduction, GemmTile
from kiln.codegen.triton.gemm import gemm, gemm_specs
from kiln.codegen.triton.launch import recording
from kiln.codegen.triton.paged_attention_launch import paged_attention

BF16 = ml_dtypes.bfloat16


def ints(spec, args):
    return {n: int(a) for n, a in zip(spec.signature, args) if spec.signature[n] in ("i32", "i64")}


@pytest.mark.parametrize("d", [24, 128])
def test_recorded_attention_hints_every_multiple_of_16(d):
    h, hkv, bs = 3, 1, 16
    q = np.zeros((5, h, d), BF16)
    cache = np.zeros((9, 2, bs, hkv, d), BF16)
    bt = np.zeros((2, 3), np.int32)
    with recording() as launches:
        paged_attention(q, cache, bt, np.array([20, 3], np.int32), np.array([0, 2, 5], np.int32),
                        scale=d ** -0.5, config=AttentionConfig())
    (spec, args), = launches
    got = ints(spec, args)
    assert {n for n, v in got.items() if v % 16 == 0} == {n for n in got if n in spec.divisible}
    if d == 24:  # the strides in units of D are not multiples of 16; the block stride is
        assert "stride_cp" not in spec.divisible and "stride_cb" in spec.divisible
    else:
        assert {"stride_qt", "stride_qh", "stride_cb", "stride_ckv", "stride_cp", "stride_ch"} <= set(spec.divisible)


@pytest.mark.parametrize("m, k, x_stride", [(64, 256, 256), (7, 256, 264), (16, 200, 200)])
def test_gemm_specs_are_what_the_launch_records(m, k, x_stride):
    """The autotuner compiles gemm_specs() directly: it must time the binary a bundle runs."""
    n = 96
    x = np.zeros((m, x_stride), BF16)[:, :k]
    w = np.zeros((n, k), BF16)
    tile, red = GemmTile(16, 32, 4, 4), GemmReduction(64, 2)
    with recording() as launches:
        gemm(x, w, None, np.zeros((m, n), np.float32), tile=tile, red=red)
    want = gemm_specs(m, n, k, out_dtype="float32", stride_xm=x_stride, stride_ym=n, tile=tile, red=red)
    assert [s for s, _ in launches] == want
    for spec, args in launches:
        got = ints(spec, args)
        assert {n for n, v in got.items() if v % 16 == 0} == {n for n in got if n in spec.divisible}
