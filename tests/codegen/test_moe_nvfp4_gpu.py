"""The NVFP4 expert GEMMs (codegen/triton/moe_gemm.py NV, W4A16) on a real GPU, at test_moe_gpu.py's
shape (E 64, k 8, H 512, I 256): numbers vs graph/nvfp4_ops.py moe_experts_nvfp4 (within 2e-2), and a
token's bits the same in the grouped path at 16-, 32- and 64-row tiles (mma.sync and, on sm_90,
wgmma), in the decode and decode_token paths among 300 tokens, and alone. The engine's greedy
alone = batched test of the tiny NVFP4 MoE (tests/gpu/test_gpu_nvfp4_moe.py) stands on this.

    TRITON_INTERPRET=0 pytest -m gpu -s tests/codegen/test_moe_nvfp4_gpu.py
torch (a test dependency) only holds device memory here."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton.moe_gemm import MoeTile
from kiln.graph.nvfp4_ops import moe_experts_nvfp4
from tests.codegen.helpers import assert_close, f32, rand, same_bits

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
from tests.codegen.gpu_torch import cuda, dev  # noqa: E402,F401 (cuda: the autouse skip)
from tests.codegen.test_moe_gpu import E, H, I, K, run_experts  # noqa: E402


def _run(x, ids, w, ex, *, path, tiles=None):
    """test_moe_gpu.run_experts on the device experts ex = (w13, s13, g13, w2, s2, g2)."""
    w13, s13, g13, w2, s2, g2 = ex
    return run_experts(x, ids, w, w13, w2, path=path, tiles=tiles, nvfp4=(s13, g13, s2, g2))


def test_nvfp4_experts_match_the_op_and_a_tokens_bits_its_path_batch_and_tiles():
    from tests.codegen.test_moe_nvfp4_kernels import _experts

    rng = np.random.default_rng(2)
    t = 300
    x = rand(rng, (t, H), scale=2.0)
    host_ex = (*_experts(rng, E, 2 * I, H, 2), *_experts(rng, E, H, I, 1))
    ex = tuple(dev(a) for a in host_ex)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)
    ids[:, 0] = 3  # one expert takes every token
    ww = rng.uniform(0.1, 1.0, (t, K)).astype(np.float32)
    ww /= ww.sum(-1, keepdims=True)
    full = _run(x, ids, ww, ex, path="grouped")
    assert_close(f32(full), f32(moe_experts_nvfp4(x, ids, ww, *host_ex)), rtol=2e-2, what="grouped NVFP4 experts")
    for bm in (16, 32, 64):  # 64: wgmma on sm_90
        tile = MoeTile(block_m=bm, block_n=64, block_k=64 if bm < 64 else 128, num_warps=4, num_stages=3)
        assert same_bits(_run(x, ids, ww, ex, path="grouped", tiles=(tile, tile)), full), f"grouped, {bm}-row tiles"
    for path in ("decode", "decode_token"):
        assert same_bits(_run(x, ids, ww, ex, path=path), full), f"{path} path, 300 tokens"
    for i in (0, 151, 299):
        for path in ("decode", "decode_token"):
            one = _run(x[i:i + 1], ids[i:i + 1], ww[i:i + 1], ex, path=path)
            assert same_bits(one[0], full[i]), f"token {i} alone ({path}) differs from its row among 300"
