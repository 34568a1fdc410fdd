"""The fused MoE kernels on a real GPU: numbers vs graph/moe_ops.py, and a token's bits the same
alone in the decode path (16-row mma.sync tiles) and among 300 tokens in the grouped path
(16-, 32- and 64-row blocks: mma.sync and, on sm_90, wgmma). Then the decode path's weight
bandwidth at a Qwen3.6-35B-A3B shape (printed; run with -s).

    TRITON_INTERPRET=0 pytest -m gpu -s tests/codegen/test_moe_gpu.py
torch (a test dependency) only holds device memory here.
"""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton.moe import moe_experts, moe_tiles, moe_workspace
from kiln.codegen.triton.moe_align import moe_align, moe_align_capacity
from kiln.codegen.triton.moe_gemm import MoeTile
from kiln.codegen.triton.moe_router import moe_router
from kiln.graph import moe_ops
from tests.codegen.helpers import BF16, assert_close, f32, rand, same_bits

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
from tests.codegen.gpu_torch import cuda, dev, host  # noqa: E402,F401 (cuda: the autouse skip)

E, K, H, I = 64, 8, 512, 256




def run_experts(x, ids, w, w13, w2, *, path, tiles=None, **quant):
    """moe_experts on device buffers; x, ids, w: host arrays; w13, w2: device tensors; quant: the
    quantised experts' extra operands (nvfp4=(s13, g13, s2, g2), device tensors)."""
    t = x.shape[0]
    tiles = tiles or moe_tiles(t, K, E, H, I, path=path)
    need = moe_workspace(t, K, E, H, I, "bfloat16", path=path, block_m=tiles[0].block_m)
    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32}
    ws = {n: torch.empty(shape, dtype=tdt[d], device="cuda") for n, (shape, d) in need.items()}
    out = torch.empty((t, H), dtype=torch.bfloat16, device="cuda")
    n_rows = torch.tensor([t], dtype=torch.int32, device="cuda")
    moe_experts(dev(x), dev(ids), dev(w), w13, w2, out, path=path, tiles=tiles, n_rows=n_rows, workspace=ws,
                **quant)
    return host(out)


def test_router_and_align_on_gpu():
    rng = np.random.default_rng(0)
    t = 300
    logits = rand(rng, (t, E), BF16, 2.0)
    logits[0] = logits[0, 0]  # every expert tied
    ids = torch.empty((t, K), dtype=torch.int32, device="cuda")
    w = torch.empty((t, K), dtype=torch.float32, device="cuda")
    nr = torch.tensor([t], dtype=torch.int32, device="cuda")
    moe_router(dev(logits), top_k=K, renormalize=True, ids=ids, weights=w, n_rows=nr)
    want_ids, want_w = moe_ops.moe_router(logits, top_k=K, renormalize=True)
    np.testing.assert_array_equal(host(ids), want_ids)
    assert_close(host(w), want_w, rtol=1e-5, what="router weights")
    bm = 32
    em = moe_align_capacity(t, K, E, bm)
    srt, blk, npost = (torch.empty(n, dtype=torch.int32, device="cuda") for n in (em, em // bm, 1))
    moe_align(ids, num_experts=E, block_m=bm, n_rows=nr, sorted_ids=srt, block_expert=blk, n_post=npost)
    srt, blk, npost = host(srt), host(blk), int(host(npost)[0])
    counts = np.bincount(want_ids.reshape(-1), minlength=E)
    padded = -(-counts // bm) * bm
    assert npost == padded.sum()
    at = 0
    for e in range(E):
        np.testing.assert_array_equal(srt[at:at + counts[e]], np.flatnonzero(want_ids.reshape(-1) == e))
        assert (srt[at + counts[e]:at + padded[e]] == t * K).all() and (blk[at // bm:(at + padded[e]) // bm] == e).all()
        at += padded[e]


def test_experts_match_reference_and_a_tokens_bits_its_path_batch_and_tiles():
    rng = np.random.default_rng(1)
    t = 300
    x = rand(rng, (t, H))
    w13n, w2n = rand(rng, (E, 2 * I, H), BF16, 0.1), rand(rng, (E, H, I), BF16, 0.1)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)
    ids[:, 0] = 3  # one expert takes every token
    ww = rng.uniform(0.1, 1.0, (t, K)).astype(np.float32)
    ww /= ww.sum(-1, keepdims=True)
    w13, w2 = dev(w13n), dev(w2n)
    full = run_experts(x, ids, ww, w13, w2, path="grouped")
    assert_close(full, moe_ops.moe_experts(x, ids, ww, w13n, w2n), what="moe_experts grouped")
    for bm in (16, 32, 64):  # 64: wgmma on sm_90
        tile = MoeTile(block_m=bm, block_n=64, block_k=64 if bm < 64 else 128, num_warps=4, num_stages=3)
        assert same_bits(run_experts(x, ids, ww, w13, w2, path="grouped", tiles=(tile, tile)), full), bm
    for path in ("decode", "decode_token"):
        assert same_bits(run_experts(x, ids, ww, w13, w2, path=path), full), f"{path} path, 300 tokens"
    # decode tiles the tuner sweeps: narrow and wide columns, K in one step or several
    for gu, dn in ((MoeTile(16, 16, 128, 2, 5), MoeTile(16, 16, 256, 2, 2)),
                   (MoeTile(16, 64, 64), MoeTile(16, 32, 512))):
        assert same_bits(run_experts(x, ids, ww, w13, w2, path="decode", tiles=(gu, dn)), full), (gu, dn)
    for i in (0, 151, 299):
        for path in ("decode", "decode_token"):
            one = run_experts(x[i:i + 1], ids[i:i + 1], ww[i:i + 1], w13, w2, path=path)
            assert same_bits(one[0], full[i]), f"token {i} alone ({path}) differs from its row among 300"


def test_the_folded_shared_expert_add_gives_sigmoid_mul_then_add_bits():
    """moe_sum with the shared expert (SHARED: the lowering folds sigmoid_mul and the add into the
    routed sum, lower.py _defer_moe_sum) against the routed layer's own sum then gdn.sigmoid_mul
    with add, as a decode_token bucket (no fold) runs them: the same bits, so a schedule may mix
    folding and non-folding paths across buckets."""
    from kiln.codegen.triton.gdn import sigmoid_mul
    from kiln.codegen.triton.moe import moe_sum

    rng = np.random.default_rng(3)
    t = 40
    x, shared = dev(rand(rng, (t, H))), dev(rand(rng, (t, H)))
    gate = dev(rand(rng, (t, 5), BF16, 2.0))[:, 3:4]  # a strided column, as the merged GEMM's output holds it
    w13, w2 = dev(rand(rng, (E, 2 * I, H), BF16, 0.1)), dev(rand(rng, (E, H, I), BF16, 0.1))
    ids = dev(np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32))
    ww = rng.uniform(0.1, 1.0, (t, K)).astype(np.float32)
    ww = dev(ww / ww.sum(-1, keepdims=True))
    n_rows = torch.tensor([t], dtype=torch.int32, device="cuda")
    routed = torch.empty((t, H), dtype=torch.bfloat16, device="cuda")
    moe_experts(x, ids, ww, w13, w2, routed, path="decode_token", n_rows=n_rows,
                workspace={"a": torch.empty((t * K, I), dtype=torch.bfloat16, device="cuda")})
    want = torch.empty((t, 1, H), dtype=torch.bfloat16, device="cuda")
    sigmoid_mul(shared.view(t, 1, H), gate.unsqueeze(-1), want, n_rows=n_rows, add=routed.view(t, 1, H))
    for path in ("decode", "grouped"):
        need = moe_workspace(t, K, E, H, I, "bfloat16", path=path, block_m=16)
        tdt = {"bfloat16": torch.bfloat16, "int32": torch.int32}
        ws = {n: torch.empty(shape, dtype=tdt[d], device="cuda") for n, (shape, d) in need.items()}
        out = torch.empty((t, H), dtype=torch.bfloat16, device="cuda")
        moe_experts(x, ids, ww, w13, w2, out, path=path, n_rows=n_rows, workspace=ws, defer_sum=True)
        moe_sum(ws["o"], ww, out, n_rows=n_rows, shared=(shared, gate))
        assert same_bits(host(out), host(want[:, 0])), path


def test_decode_bandwidth_at_35b_a3b_shape():
    """E 256, k 8, H 2048, I 512 (bf16): a batch-1 step reads its k experts' w13 and w2, 8 x (2 x 512
    + 512) x 2048 x 2 bytes = 48 MiB. Prints us and GB/s of distinct expert weights for T = 1, 4, 8."""
    import triton

    e, k, h, i = 256, 8, 2048, 512
    rng = np.random.default_rng(2)
    w13 = torch.randn((e, 2 * i, h), device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn((e, h, i), device="cuda", dtype=torch.bfloat16) * 0.05
    for t in (1, 4, 8):
        x = torch.randn((t, h), device="cuda", dtype=torch.bfloat16)
        ids = torch.from_numpy(np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)).cuda()
        w = torch.full((t, k), 1.0 / k, device="cuda")
        out = torch.empty((t, h), device="cuda", dtype=torch.bfloat16)
        nr = torch.tensor([t], dtype=torch.int32, device="cuda")
        for path in ("decode", "decode_token"):
            ws = {n: torch.empty(shape, device="cuda", dtype=torch.bfloat16)
                  for n, (shape, _) in moe_workspace(t, k, e, h, i, "bfloat16", path=path, block_m=16).items()}
            fn = lambda: moe_experts(x, ids, w, w13, w2, out, path=path, n_rows=nr, workspace=ws)  # noqa: E731
            fn()
            us = triton.testing.do_bench_cudagraph(fn) * 1e3
            nbytes = len(set(ids.cpu().numpy().reshape(-1).tolist())) * 3 * i * h * 2
            print(f"\nmoe {path} T={t}: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s of expert weights")
