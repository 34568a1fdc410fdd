"""Block-wise FP8 MoE experts in the fused MoE kernels (codegen/triton/moe_gemm.py FP8: e4m3 experts with
their [bn, bk] scales, x quantised per token per bk columns, the SiLU-and-mul intermediate quantised in the
down GEMM's K loop) under the interpreter against the numpy op graph/fp8_ops.py moe_experts_fp8, on fresh
random inputs: scales far from one, steps where some experts get no token and where one expert gets every
token; the decode, decode_token and grouped paths; a token's bits alone and in a batch; the cubins of the
Qwen3-30B-A3B-FP8 and Qwen3.6-35B-A3B-FP8 shapes for sm_90 and sm_121."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton.aot import compile_specs
from kiln.codegen.triton.moe import moe_experts, moe_experts_specs
from kiln.codegen.triton.moe_gemm import Fp8Experts, MoeTile
from kiln.graph.fp8_ops import moe_experts_fp8, quantize_fp8
from kiln.models.quant_config import MIN_SCALE_GROUP
from tests.codegen.helpers import BF16, assert_close, f32, rand, require_interpreter, same_bits
from tests.fp8_checkpoints import quantize_block

pytestmark = pytest.mark.usefixtures("interpreter")

E, K = 8, 2
PATHS = ("decode", "decode_token", "grouped")


@pytest.fixture
def interpreter():
    require_interpreter()


def _experts(rng, e, n, k, block):
    """e4m3 [e, n, k] with f32 block scales [e, n / bn, k / bk]: random weights of random magnitude
    per block (so no scale is near one), quantised per expert as the checkpoints are."""
    bn, bk = block
    mag = rng.uniform(0.2, 2.0, (e, -(-n // bn), -(-k // bk))).astype(np.float32) / np.float32(k ** 0.5)
    w = rng.standard_normal((e, n, k)).astype(np.float32) * np.repeat(np.repeat(mag, bn, 1), bk, 2)[:, :n, :k]
    qs = [quantize_block(w[i], bn, bk) for i in range(e)]
    q, s = np.stack([a for a, _ in qs]), np.stack([b for _, b in qs])
    assert not np.isclose(s, 1.0).any()
    return q, s


def _routing(rng, t, case, e=E, k=K):
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    if case == "some_experts_idle":  # experts 0, 3, 6, 7 get nothing
        ids = np.stack([rng.permutation(np.array([1, 2, 4, 5]))[:k] for _ in range(t)]).astype(np.int32)
    elif case == "one_expert_takes_all":  # expert 5 is every token's first choice
        ids[:, 0] = 5
        ids[:, 1] = (5 + rng.integers(1, e, t)) % e
    w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    return ids, w / w.sum(-1, keepdims=True)


def _layer(rng, t, h, i, block, dtype=BF16):
    x = rand(rng, (t, h), dtype, 2.0)
    xq, xs = quantize_fp8(x, (), block[1], MIN_SCALE_GROUP)  # the graph's quant_fp8 of the layer's input
    w13, s13 = _experts(rng, E, 2 * i, h, block)
    w2, s2 = _experts(rng, E, h, i, block)
    return xq, xs, w13, s13, w2, s2


def _run(xq, xs, ids, w, w13, s13, w2, s2, block, dtype=BF16, **kw):
    out = np.empty((xq.shape[0], w2.shape[1]), dtype)
    return moe_experts(xq, ids, w, w13, w2, out, fp8=(xs, s13, s2), block=block, min_scale=MIN_SCALE_GROUP, **kw)


def _ref(xq, xs, ids, w, w13, s13, w2, s2, block, dtype=BF16):
    return moe_experts_fp8(xq, xs, ids, w, w13, s13, w2, s2, block=block, out_dtype="bf16" if dtype == BF16 else "f32",
                           min_scale=MIN_SCALE_GROUP)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["random", "some_experts_idle", "one_expert_takes_all"])
def test_fp8_experts_match_the_graph_op(path, case):
    """[16, 16] blocks (x's 64 columns in 4 activation groups, the intermediate's 32 in 2) on every path."""
    rng = np.random.default_rng()  # fresh inputs every run
    block, h, i = (16, 16), 64, 32
    t = 24 if path == "grouped" else 5
    layer = _layer(rng, t, h, i, block)
    ids, w = _routing(rng, t, case)
    got = _run(*layer[:2], ids, w, *layer[2:], block, path=path)
    assert_close(f32(got), f32(_ref(*layer[:2], ids, w, *layer[2:], block)), rtol=2e-2, what=f"{path} {case}")


def test_fp8_experts_with_128_blocks_and_f32_activations():
    """The real checkpoints' [128, 128] blocks (a group a 128-column e4m3 dot), and f32 activations."""
    rng = np.random.default_rng()
    block, h, i = (128, 128), 256, 128
    for dtype in (BF16, np.float32):
        layer = _layer(rng, 6, h, i, block, dtype)
        ids, w = _routing(rng, 6, "some_experts_idle")
        for path in ("decode", "grouped"):
            got = _run(*layer[:2], ids, w, *layer[2:], block, dtype, path=path)
            want = _ref(*layer[:2], ids, w, *layer[2:], block, dtype)
            assert_close(f32(got), f32(want), rtol=2e-2 if dtype == BF16 else 1e-3, what=f"{path} {dtype}")


def test_a_tokens_bits_do_not_depend_on_its_batch_path_or_tiles():
    """An FP8 token's row: in a 40-token step (grouped, two tiles), alone (each path) and among 3 others:
    the same bits (f32 activations, where no rounding can hide a reordered sum)."""
    rng = np.random.default_rng()
    block, h, i = (16, 16), 64, 32
    t = 40
    xq, xs, w13, s13, w2, s2 = _layer(rng, t, h, i, block, np.float32)
    ids, w = _routing(rng, t, "random")
    run = lambda a, b, ii, ww, **kw: _run(a, b, ii, ww, w13, s13, w2, s2, block, np.float32, **kw)  # noqa: E731
    full = run(xq, xs, ids, w, path="grouped")
    tile = MoeTile(block_m=128, block_n=32, block_k=64, num_warps=8)
    assert same_bits(run(xq, xs, ids, w, path="grouped", tiles=(tile, tile)), full)
    for j in (0, 23):
        for path in PATHS:
            one = run(xq[j:j + 1], xs[j:j + 1], ids[j:j + 1], w[j:j + 1], path=path)
            assert same_bits(one[0], full[j]), f"token {j} alone ({path}) differs from its row in the batch"
        few = run(xq[j:j + 4], xs[j:j + 4], ids[j:j + 4], w[j:j + 4], path="grouped")
        assert same_bits(few[0], full[j])


def test_sm90_fp8_tiles_are_wgmma_tiles():
    """On sm_90 every FP8 expert GEMM has 64 rows at least and whole warpgroups (decode too), so that
    a token's row has the grouped form's bits (fp8_gemm.py); sm_121 keeps 16-row decode programs."""
    for path in PATHS:
        for arch, rows in (("sm_90", 64), ("sm_121", 16)):
            specs = moe_experts_specs(1 if path != "grouped" else 512, 8, 256, 2048, 512, path=path, arch=arch,
                                      fp8=Fp8Experts((128, 128), MIN_SCALE_GROUP, arch))
            gemms = [s for s in specs if s.kernel in ("moe_gate_up_kernel", "moe_down_kernel")]
            assert all(s.constexprs["FP8"] and s.signature["w_ptr"] == "*fp8e4nv" for s in gemms)
            if arch == "sm_90":
                assert all(s.constexprs["BLOCK_M"] >= 64 and s.num_warps % 4 == 0 for s in gemms), path
            elif path != "grouped":
                assert all(s.constexprs["BLOCK_M"] == rows for s in gemms), path
    with pytest.raises(ValueError, match="whole"):
        moe_experts_specs(1, 8, 256, 2048, 500, path="decode", fp8=Fp8Experts((128, 128)))


def fp8_moe_specs(arch: str):
    """The FP8 expert kernels at the Qwen3.6-35B-A3B-FP8 (E 256, k 8, H 2048, I 512) and Qwen3-30B-A3B-FP8
    (E 128, k 8, H 2048, I 768) shapes, [128, 128] blocks, decode and grouped buckets."""
    fp8 = Fp8Experts((128, 128), MIN_SCALE_GROUP, arch)
    specs = []
    for e, i in ((256, 512), (128, 768)):
        for t in (1, 64, 4096):
            specs += moe_experts_specs(t, 8, e, 2048, i, arch=arch, fp8=fp8)
        specs += moe_experts_specs(1, 8, e, 2048, i, path="decode_token", arch=arch, fp8=fp8)
    return [s for s in specs if s.kernel in ("moe_gate_up_kernel", "moe_down_kernel")]


@pytest.mark.slow
def test_every_fp8_moe_kernel_compiles_for_both_archs(tmp_path):
    jobs = [(s, a) for a in ("sm_90", "sm_121") for s in fp8_moe_specs(a)]
    jobs += [(s.with_pdl(), "sm_90") for s in fp8_moe_specs("sm_90")]
    for (spec, arch), c in zip(jobs, compile_specs(jobs, cache_dir=tmp_path), strict=True):
        where = f"{spec.kernel} {spec.constexprs} @ {arch}"
        assert c.cubin[:4] == b"\x7fELF" and c.name == spec.kernel, where
        assert c.target == {"sm_90": "sm_90a", "sm_121": "sm_121a"}[arch], where
        assert c.shared <= (227 if arch == "sm_90" else 99) * 1024, where
