"""The GGUF block kernels (codegen/triton/gguf_gemm.py) under the interpreter, on fresh random blocks
of every format kiln computes in (every byte random but the f16 scales, which are finite random
values of either sign: tests/gguf_blocks.py):

- the in-kernel dequantisation is gguf-py's `dequantize`, bit for bit (the oracle);
- the GEMM is the bf16 GEMM (gemm.py, no split-K) on the weights dequantised at load and stored
  in bf16, bit for bit: the same rounding of each weight, the same K order, decode and prefill
  tiles alike (so a token's row does not depend on its bucket);
- and it matches the f32 reference on the unrounded weights within bf16 tolerance (the weights'
  bf16 rounding, 2^-9 of each, and the output's);
- the blocks of a real GGUF (the SmolLM2 Q4_1 file's q_proj, its Q8_0 embedding) likewise.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kiln.codegen.triton.configs import GemmReduction, GemmTile
from kiln.codegen.triton.gemm import gemm
from kiln.codegen.triton.gguf_gemm import GgufTile, gguf_dequant, gguf_gemm, gguf_tile
from kiln.graph.gguf_blocks import BLOCKS
from kiln.graph.gguf_ops import linear_gguf
from tests.codegen.helpers import BF16, assert_close, f32, rand, require_interpreter, same_bits
from tests.gguf_blocks import random_matrix

pytestmark = pytest.mark.usefixtures("interpreter")
QTYPES = list(BLOCKS)


@pytest.fixture
def interpreter():
    require_interpreter()


@pytest.mark.parametrize("qtype", QTYPES)
def test_in_kernel_dequantisation_is_gguf_py_bit_for_bit(qtype):
    rng = np.random.default_rng(100 + QTYPES.index(qtype))
    raw = random_matrix(qtype, 19, 512, rng)  # 19 rows: a partial row tile
    got = gguf_dequant(raw, qtype=qtype)
    want = gguf_dequantize(raw, GGMLQuantizationType[qtype])
    assert got.shape == want.shape == (19, 512) and not (want == 0).all()
    assert same_bits(got, want)


@pytest.mark.parametrize("qtype", QTYPES)
def test_gemv_and_gemm_are_the_bf16_gemm_on_the_dequantised_weights(qtype):
    rng = np.random.default_rng(200 + QTYPES.index(qtype))
    n, k = 24, 256
    raw = random_matrix(qtype, n, k, rng, scale=0.02)
    w = gguf_dequantize(raw, GGMLQuantizationType[qtype])  # f32 [N, K], gguf-py's
    bias = rand(rng, (n,))
    x = rand(rng, (21, k))
    plain = GemmTile(16, 16, block_k=32)
    want = gemm(x, w.astype(BF16), bias, red=GemmReduction(64, 1), tile=plain)  # no split-K
    # the GEMV (decode tiles, 1 and 3 rows), a 64-row prefill tile, and a 16-row tile with
    # 64-column K steps: every row's bits are the bf16 GEMM's
    for rows, tile in ((1, gguf_tile(1)), (3, gguf_tile(3)), (21, GgufTile(64, 16)), (21, GgufTile(16, 16, 64))):
        got = gguf_gemm(x[:rows], raw, bias, qtype=qtype, tile=tile)
        assert same_bits(got, want[:rows]), (rows, tile)
    ref = linear_gguf(x.astype(np.float32), raw, bias.astype(np.float32), qtype=qtype)  # f32 weights
    assert_close(f32(want), ref, rtol=1e-2, what=qtype)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_f32_logits_out_and_padded_rows(qtype):
    """out f32 (the LM head's folded cast): the unrounded sums; rows past n_rows are left alone."""
    rng = np.random.default_rng(7)
    raw = random_matrix(qtype, 24, 256, rng, scale=0.02)
    x = rand(rng, (20, 256))
    out = np.full((20, 24), 7.0, np.float32)
    gguf_gemm(x, raw, out=out, qtype=qtype, n_rows=np.array([9], np.int32), tile=GgufTile(16, 16))
    want = gemm(x, gguf_dequantize(raw, GGMLQuantizationType[qtype]).astype(BF16), out=np.empty((20, 24), np.float32),
                red=GemmReduction(64, 1), tile=GemmTile(16, 16, block_k=32))
    assert same_bits(out[:9], want[:9])
    assert (out[16:] == 7.0).all()  # the second row tile starts past n_rows: it never ran


def test_a_real_gguf_blocks(smollm2_weights):
    """SmolLM2's Q4_1 q_proj and Q8_0 embedding rows, as the file stores them (rows un-permuted)."""
    raw = smollm2_weights.raw_blocks("model.layers.0.self_attn.q_proj.weight")
    assert smollm2_weights.ggml_type("model.layers.0.self_attn.q_proj.weight").name == "Q4_1"
    got = gguf_dequant(raw[:64], qtype="Q4_1")
    assert same_bits(got, smollm2_weights.get("model.layers.0.self_attn.q_proj.weight")[:64])
    emb = smollm2_weights.raw_blocks("model.embed_tokens.weight")[1000:1040]
    assert same_bits(gguf_dequant(emb, qtype="Q8_0"), smollm2_weights.get("model.embed_tokens.weight")[1000:1040])
    x = rand(np.random.default_rng(3), (2, raw.shape[1] // 20 * 32))
    assert same_bits(gguf_gemm(x, raw[:64], qtype="Q4_1"),
                     gemm(x, got.astype(BF16), red=GemmReduction(64, 1), tile=GemmTile(16, 16, block_k=32)))


def test_moe_experts_in_blocks_are_the_bf16_experts_bit_for_bit():
    """moe_experts over GGUF expert blocks (codegen/triton/moe_gemm.py QT >= 0) gives the bits of the
    bf16 MoE kernels on the experts dequantised at load, on both paths (decode: a program per
    assignment; grouped: sorted into expert blocks), and the numpy op moe_experts_gguf within bf16.
    (The k-quants' in-kernel dequantisation is _dequant's, tested above; a 256-wide expert under the
    interpreter costs minutes. test_bundle_gguf.py compiles Q4_K/Q6_K experts.)"""
    q13, q2, h, i = "Q4_1", "Q8_0", 64, 32
    from kiln.codegen.triton.moe import moe_experts
    from kiln.graph.gguf_ops import moe_experts_gguf

    rng = np.random.default_rng(11)
    e, k, t = 4, 2, 5
    w13 = random_matrix(q13, e * 2 * i, h, rng, scale=0.3 / h ** 0.5).reshape(e, 2 * i, -1)
    w2 = random_matrix(q2, e * h, i, rng, scale=0.3 / i ** 0.5).reshape(e, h, -1)
    d13 = gguf_dequantize(w13, GGMLQuantizationType[q13]).astype(BF16)
    d2 = gguf_dequantize(w2, GGMLQuantizationType[q2]).astype(BF16)
    x = rand(rng, (t, h))
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    for path in ("decode", "grouped"):
        got = moe_experts(x, ids, wts, w13, w2, path=path, qtypes=(q13, q2))
        assert same_bits(got, moe_experts(x, ids, wts, d13, d2, path=path)), path
    assert_close(f32(got), f32(moe_experts_gguf(x, ids, wts, w13, w2, qtypes=(q13, q2))), rtol=2e-2, what=q13)
