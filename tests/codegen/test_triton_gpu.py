"""The kernels on a real GPU: numbers vs graph/ops.py, bit-exact invariance with the
hardware's own MMA instructions, and an AOT cubin launched through cuda.bindings.

Needs CUDA and triton in compile mode, so run it apart from the interpreter tests:
    TRITON_INTERPRET=0 pytest -m gpu tests/codegen/test_triton_gpu.py
torch (a test dependency) only holds device memory here.
"""
from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest

from kiln.codegen.triton.configs import DEFAULT, AttentionConfig, GemmReduction, GemmTile
from kiln.graph import ops
from tests.codegen.helpers import BF16, FP8, assert_close, f32, rand, same_bits

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
from tests.codegen.gpu_torch import cuda, dev, host  # noqa: E402,F401 (cuda: the autouse skip)


@pytest.fixture(scope="module", autouse=True)
def allocator(cuda):
    import triton

    # the JIT launcher's global scratch (the GEMM's TMA descriptors, built on the device)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


TILES = {  # on sm_90: BLOCK_M 16 -> mma.sync; 64 and 128 -> wgmma
    "decode": GemmTile(16, 32, 4, 4), "mid": GemmTile(64, 64, 4, 3), "prefill": GemmTile(128, 128, 8, 3)}


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("split", [1, 2])
def test_gemm_rows_invariant_across_tiles_and_instructions(split, tma):
    """Every row's bits are the same whatever the tile, the MMA instruction, the batch,
    whether the tiles come in through TMA descriptors or pointer loads (M = 300 is ragged:
    the TMA unit zero-fills the rows past it, as the masks do), however the programs are
    grouped over the tiles (GROUP_M), and whether split-K's partials are added by the reduce
    kernel or inside the program (gemm.py FOLD)."""
    from kiln.codegen.triton.gemm import gemm

    rng = np.random.default_rng(0)
    m, n, k = 300, 512, 1024
    x, w, b = rand(rng, (m, k)), rand(rng, (n, k)), rand(rng, (n,))
    red = GemmReduction(64, split)

    def run(rows, tile):
        out = torch.empty((len(rows), n), dtype=torch.float32, device="cuda")
        ws = torch.empty((split, len(rows), n), dtype=torch.float32, device="cuda")
        nr = torch.tensor([len(rows)], dtype=torch.int32, device="cuda")
        gemm(dev(np.ascontiguousarray(x[rows])), dev(w), dev(b), out, n_rows=nr, workspace=ws, tile=tile, red=red)
        return host(out)

    full = run(np.arange(m), dataclasses.replace(TILES["prefill"], tma=False, fold=False))
    assert_close(full, ops.linear(x, w, b).astype(np.float32), what="gemm")
    for name, rows in (("decode", [7]), ("decode", [0, 1, 2]), ("mid", list(range(37))), ("prefill", [299]),
                       ("prefill", list(range(m)))):
        got = run(np.array(rows), dataclasses.replace(TILES[name], tma=tma, fold=False))
        assert same_bits(got, full[rows]), f"{name} tile, tma={tma}, M={len(rows)}: rows differ from M=300"
    for g in (1, 2, 16):  # GROUP_M maps programs to tiles (M = 300: three row blocks; 2 leaves one alone)
        got = run(np.arange(m), dataclasses.replace(TILES["prefill"], tma=tma, fold=False, group_m=g))
        assert same_bits(got, full), f"prefill tile, tma={tma}, group_m {g}: rows differ"
    if split > 1:  # the splits added in the program instead of by the reduce kernel
        for name, rows in (("mid", list(range(37))), ("prefill", [299]), ("prefill", list(range(m)))):
            got = run(np.array(rows), dataclasses.replace(TILES[name], tma=tma, fold=True))
            assert same_bits(got, full[rows]), f"{name} tile, tma={tma}, folded, M={len(rows)}: rows differ"



@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("split", [1, 2])
def test_gemm_rows_invariant_across_block_k(split, tma):
    """BLOCK_K is a schedule knob on sm_90 (GemmTile.block_k): the tensor core chains a tile's
    K in k=16 steps through the accumulator whatever BLOCK_K holds, so a row gets the same bits
    from 32-, 64- and 128-wide K blocks, in decode and prefill tiles, through TMA or pointers,
    split-K folded or not (the splits' boundaries fixed by the weight's reduction). Unsplit,
    K = 1,088 is no multiple of 128 (the last block is part zero-filled); split in two, K =
    1,280 gives each split 640 columns, whole blocks of all three widths."""
    from kiln.codegen.triton.gemm import gemm

    rng = np.random.default_rng(1)
    m, n, k = 300, 512, 1088 if split == 1 else 1280
    x, w = rand(rng, (m, k)), rand(rng, (n, k))
    base = GemmReduction(64, split)

    def run(rows, tile, fold=False):
        out = torch.empty((len(rows), n), dtype=torch.float32, device="cuda")
        ws = torch.empty((split, len(rows), n), dtype=torch.float32, device="cuda")
        nr = torch.tensor([len(rows)], dtype=torch.int32, device="cuda")
        gemm(dev(np.ascontiguousarray(x[rows])), dev(w), None, out, n_rows=nr, workspace=ws,
             tile=dataclasses.replace(tile, tma=tma, fold=fold and split > 1), red=base)
        return host(out)

    full = run(np.arange(m), TILES["prefill"])
    assert_close(full, ops.linear(x, w).astype(np.float32), what="gemm")
    for bk in (32, 128):
        for name, rows in (("decode", [7]), ("decode", [0, 1, 2]), ("mid", list(range(37))),
                           ("prefill", list(range(m)))):
            tile = dataclasses.replace(TILES[name], block_k=bk)
            assert same_bits(run(np.array(rows), tile), full[rows]), \
                f"{name} tile, block_k {bk}, tma={tma}, M={len(rows)}: rows differ from block_k 64"
            if split > 1 and name != "decode":
                assert same_bits(run(np.array(rows), tile, fold=True), full[rows]), \
                    f"{name} tile, block_k {bk}, tma={tma}, folded, M={len(rows)}: rows differ"


@pytest.mark.parametrize("tma", [False, True])
def test_gemm_fold_through_memory_gives_the_partials_bits_on_gpu(tma):
    """down's 2,048-row prefill tile (128 x 256, 8 warps, K block 64) under its decode split-K 2:
    folded, its running sum goes through the workspace between splits (gemm.fold_through_memory),
    and gives the bits of the unfolded partials summed by the reduce, with and without the
    residual epilogue; a decode row (partials + reduce, 16-row tile) matches too."""
    from kiln.codegen.triton.gemm import fold_through_memory, gemm, gemm_specs

    rng = np.random.default_rng(5)
    m, n, k = 2048, 4096, 14336
    x, w, r = rand(rng, (m, k)), rand(rng, (n, k)), rand(rng, (m, n))
    red = GemmReduction(128, 2)
    tile = GemmTile(128, 256, 8, 3, block_k=64, tma=tma)
    assert fold_through_memory(tile)
    xd, wd, rd = dev(x), dev(w), dev(r)

    def run(fold, residual=None, rows=m, t=tile):
        out = torch.empty((rows, n), dtype=torch.bfloat16, device="cuda")
        ws = torch.full((2, rows, n), float("nan"), dtype=torch.float32, device="cuda")
        gemm(xd[:rows], wd, None, out, n_rows=torch.tensor([rows], dtype=torch.int32, device="cuda"), workspace=ws,
             tile=dataclasses.replace(t, fold=fold), red=red, residual=residual)
        return host(out)

    assert gemm_specs(m, n, k, tile=dataclasses.replace(tile, fold=True), red=red)[0].constexprs.get("FOLD_MEM")
    want = run(False)
    assert same_bits(run(True), want), f"tma={tma}: folding through memory changed the bits"
    assert same_bits(run(True, rd), ops.add(want, r)), f"tma={tma}: the folded residual epilogue differs"
    one = run(False, rows=1, t=TILES["decode"])
    assert same_bits(one[0], want[0]), "a decode row differs from the folded prefill's"


@pytest.mark.parametrize("tma", [False, True])
def test_gemm_residual_epilogue_gives_gemm_then_add_bits_on_gpu(tma):
    """The residual epilogue (linear_add) against the plain GEMM's bf16 output plus the residual,
    as add_rms_norm_kernel adds them: the same bits, decode and prefill tiles, split-K folded."""
    from kiln.codegen.triton.gemm import gemm
    from kiln.codegen.triton.rms_norm import add_rms_norm

    rng = np.random.default_rng(2)
    m, n, k = 300, 512, 1024
    x, w, r, g = rand(rng, (m, k)), rand(rng, (n, k)), rand(rng, (m, n)), rand(rng, (n,))
    nr = torch.tensor([m], dtype=torch.int32, device="cuda")
    for name, split, fold in (("decode", 1, False), ("prefill", 1, False), ("prefill", 2, True)):
        tile, red = dataclasses.replace(TILES[name], tma=tma, fold=fold), GemmReduction(64, split)
        y = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        gemm(dev(x), dev(w), None, y, n_rows=nr, tile=tile, red=red)
        want = torch.empty_like(y)
        add_rms_norm(y, dev(r), dev(g), torch.empty_like(y), want, eps=1e-6, n_rows=nr)
        got = dev(r)  # in place, as a plan may place the sum over the residual
        gemm(dev(x), dev(w), None, got, n_rows=nr, tile=tile, red=red, residual=got)
        assert same_bits(host(got), host(want)), f"{name} tile, split {split}, tma={tma}: bits differ"


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("split", [1, 2])
def test_gemm_silu_epilogue_gives_gemm_then_silu_mul_bits_on_gpu(split, tma):
    """The SwiGLU epilogue (gemm silu_group=16 over the interleaved gate/up stack) against the
    plain GEMM over [Wg; Wu] then silu_mul_kernel: the same bits for every tile and M (ragged
    too), TMA or pointer loads, split-K folded or reduced (the reduce kernel's epilogue); so
    the compiled exp/divide of the fused epilogue round as silu_mul_kernel's do."""
    from kiln.codegen.triton.gemm import gemm
    from kiln.codegen.triton.silu_mul import silu_mul
    from kiln.graph.layout import stack_parts

    rng = np.random.default_rng(0)
    i, k = 1024, 1024
    wg, wu = rand(rng, (i, k), scale=0.12), rand(rng, (i, k), scale=0.06)
    plain, inter = dev(np.concatenate([wg, wu])), dev(stack_parts([wg, wu], 16))
    red = GemmReduction(64, split)
    for name, m in (("decode", 1), ("decode", 5), ("mid", 37), ("prefill", 300), ("prefill", 2048)):
        x = dev(rand(rng, (m, k)))
        folds = (False, True) if split > 1 and name != "decode" else (False,)
        for fold in folds:
            tile = dataclasses.replace(TILES[name], tma=tma, fold=fold)
            ws = torch.empty((split, m, 2 * i), dtype=torch.float32, device="cuda")
            nr = torch.tensor([m], dtype=torch.int32, device="cuda")
            y = torch.empty((m, 2 * i), dtype=torch.bfloat16, device="cuda")
            gemm(x, plain, None, y, n_rows=nr, workspace=ws, tile=tile, red=red)
            want = torch.empty((m, i), dtype=torch.bfloat16, device="cuda")
            silu_mul(y[:, :i], y[:, i:], want, n_rows=nr)
            got = torch.empty((m, i), dtype=torch.bfloat16, device="cuda")
            gemm(x, inter, None, got, n_rows=nr, workspace=ws, tile=tile, red=red, silu_group=16)
            assert same_bits(host(got), host(want)), f"{name} tile, M={m}, tma={tma}, fold={fold}: bits differ"

@pytest.mark.parametrize("cache_dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_gemm_rope_epilogue_gives_gemm_then_preamble_bits_on_gpu(cache_dtype):
    """The q/k/v GEMM with RoPE and the cache write in its epilogue (gemm_rope_kernel) against the
    plain GEMM into qkv then attention_preamble_kernel, at Llama-8B's heads: the same q and cache
    bytes for decode tiles narrower than a head (pointer loads, each program half of a head's
    pairs), a 128 x 256 TMA tile (two heads), split-K folded, ragged M; so the epilogue's
    explicit fma rounds as the preamble's does on the GPU."""
    from kiln.codegen.triton import reference as R
    from kiln.codegen.triton.attention_preamble import attention_preamble
    from kiln.codegen.triton.gemm import gemm, gemm_rope

    rng = np.random.default_rng(5)
    h, hkv, d, bs, k, max_pos = 32, 8, 128, 16, 1024, 4096
    n = (h + 2 * hkv) * d
    w = dev(rand(rng, (n, k), scale=0.05))
    cos, sin = (dev(a) for a in R.rope_tables(d, 5e5, (), max_pos))
    cases = [(1, GemmTile(16, 64, 4, 6), 1), (5, GemmTile(16, 32, 4, 4), 2), (300, GemmTile(64, 128, 4, 3), 1),
             (2048, GemmTile(128, 256, 8, 3, tma=True), 1), (2048, GemmTile(128, 256, 8, 3, tma=True), 2)]
    for m, tile, split in cases:
        nb = -(-m // bs) + 2
        x = dev(rand(rng, (m, k)))
        pos, slots = dev(rng.integers(0, max_pos, m).astype(np.int32)), rng.permutation(nb * bs)[:m].astype(np.int32)
        slots[m // 2] = -1
        slots = dev(slots)
        cache = rand(rng, (nb, 2, bs, hkv, d)).astype(cache_dtype)
        want_cache, got_cache = dev(cache), dev(cache)
        red = GemmReduction(64, split)
        nr = torch.tensor([m], dtype=torch.int32, device="cuda")
        ws = torch.empty((split, m, n), dtype=torch.float32, device="cuda")
        qkv = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        gemm(x, w, None, qkv, n_rows=nr, workspace=ws, tile=dataclasses.replace(tile, fold=split > 1), red=red)
        want_q = torch.empty((m, h, d), dtype=torch.bfloat16, device="cuda")
        attention_preamble(qkv[:, :h * d].view(m, h, d), qkv[:, h * d:(h + hkv) * d].view(m, hkv, d),
                           qkv[:, (h + hkv) * d:].view(m, hkv, d), want_cache, pos, slots, cos, sin, None, None,
                           want_q, n_rows=nr)
        got_q = torch.empty((m, h, d), dtype=torch.bfloat16, device="cuda")
        gemm_rope(x, w, None, got_q, got_cache, pos, slots, cos, sin, h=h, hkv=hkv, n_rows=nr, workspace=ws,
                  tile=tile, red=red)
        what = f"M={m}, {tile.block_m}x{tile.block_n}, split {split}"
        assert same_bits(host(got_q), host(want_q)), f"{what}: rotated q differs"
        assert same_bits(host(got_cache), host(want_cache)), f"{what}: cache differs"


def attention(q, cache, bt, sl, qsl, split, cfg, decode=False):
    from kiln.codegen.triton.paged_attention_launch import paged_attention

    t, h, d = q.shape
    segs = -(-bt.shape[1] * cache.shape[2] // cfg.seg)
    out = torch.empty((t, h, d), dtype=torch.float32, device="cuda")
    ws = (torch.empty((t, segs, h, d), dtype=torch.float32, device="cuda"),
          torch.empty((t, segs, h, 2), dtype=torch.float32, device="cuda"))
    counter = torch.zeros((len(sl), cache.shape[3]), dtype=torch.int32, device="cuda")  # split decode merges in-kernel
    pos = np.concatenate([np.arange(L - (qsl[i + 1] - qsl[i]), L) for i, L in enumerate(sl)]).astype(np.int32)
    paged_attention(dev(q), dev(cache), dev(bt), dev(sl), dev(qsl), out, scale=d ** -0.5, split=split,
                    positions=dev(pos), workspace=ws, counter=counter, config=cfg, decode=decode)
    assert not counter.any().item(), "a merge counter was left nonzero"
    return host(out)


def three_seqs(seed: int, seqs: list[tuple[int, int]], cache_dtype):
    """Llama-8B heads (32 / 8 / 128), 16-token blocks: a random cache of 256 blocks (e4m3 scaled by 8),
    each of the three sequences (context L, new tokens n) on 48 scattered blocks, and their queries
    -> (q, cache, block_table, seq_lens, query_start_loc)."""
    rng = np.random.default_rng(seed)
    h, hkv, d, bs, nb, mb = 32, 8, 128, 16, 256, 48
    cache = rand(rng, (nb, 2, bs, hkv, d), cache_dtype, scale=8.0 if cache_dtype == FP8 else 1.0)
    perm = rng.permutation(nb)
    bt = np.stack([perm[:mb], perm[mb:2 * mb], perm[2 * mb:3 * mb]]).astype(np.int32)
    sl = np.array([L for L, _ in seqs], np.int32)
    qsl = np.concatenate([[0], np.cumsum([c for _, c in seqs])]).astype(np.int32)
    q = rand(rng, (int(qsl[-1]), h, d))
    return q, cache, bt, sl, qsl


FP8_NOT_INVARIANT = pytest.mark.xfail(strict=True, reason=(
    "known gap: over an e4m3 cache (f16 dots) the decode kernel's output differs from the prefill "
    "kernel's in the last f32 places (H200: 'decode (split=False, kernel=True) differs from prefill'); "
    "prefill vs split prefill agree"))


@pytest.mark.parametrize("cfg,cache_dtype", [
    (AttentionConfig(4, 32, 256), BF16), (AttentionConfig(4, 16, 64), BF16), (AttentionConfig(4, 64, 64), BF16),
    pytest.param(AttentionConfig(), FP8, marks=FP8_NOT_INVARIANT)],
    ids=["tile32-seg256", "tile16-seg64", "seg==tile", "default-fp8-cache"])
def test_attention_decode_equals_prefill_on_gpu(cfg, cache_dtype):
    """Every grouping of a token's query gives the same bits; with an e4m3 cache
    (--kv-cache-dtype fp8) not yet (FP8_NOT_INVARIANT)."""
    d, n = 128, 700
    q, cache, bt, sl, qsl = three_seqs(1, [(90, 17), (n, n), (400, 1)], cache_dtype)
    full = attention(q, cache, bt, sl, qsl, False, cfg)
    assert_close(full, ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5).astype(np.float32))
    assert same_bits(attention(q, cache, bt, sl, qsl, True, cfg), full), "split-KV changed the bits"
    last = qsl[1] + n - 1
    for split in (False, True):
        for decode in (False, True):
            dec = attention(np.ascontiguousarray(q[last:last + 1]), cache, bt[1:2], sl[1:2],
                            np.array([0, 1], np.int32), split, cfg, decode)
            assert same_bits(dec[0], full[last]), f"decode (split={split}, kernel={decode}) differs from prefill"
    # rows per program, warps, stages and a register cap only group rows (16-row mma.sync to
    # 128-row wgmma programs)
    for bq, warps, stages, cap in ((4, 4, 2, None), (32, 8, 3, None), (16, 8, 2, None), (16, 4, 1, 168)):
        other = dataclasses.replace(cfg, prefill_block_q=bq, prefill_num_warps=warps, prefill_num_stages=stages,
                                    prefill_maxnreg=cap)
        assert same_bits(attention(q, cache, bt, sl, qsl, False, other), full), \
            f"prefill_block_q={bq}, {warps} warps, {stages} stages, cap {cap} changed the bits"
    many = np.array([[last]] * 5).ravel()  # a decode batch: five copies of the last query
    dec = attention(np.ascontiguousarray(q[many]), cache, np.repeat(bt[1:2], 5, 0), np.repeat(sl[1:2], 5),
                    np.arange(6, dtype=np.int32), True, cfg, True)
    assert all(same_bits(dec[i], full[last]) for i in range(5)), "a batched decode differs from prefill"
    # the decode size classes' knobs (one sequence; split buckets, register cap included) group rows too
    cls = dataclasses.replace(cfg, one_num_warps=4, one_num_stages=2, one_maxnreg=128, split_num_warps=2,
                              split_num_stages=4, split_maxnreg=168)
    one = attention(np.ascontiguousarray(q[last:last + 1]), cache, bt[1:2], sl[1:2], np.array([0, 1], np.int32),
                    True, cls, True)
    dec = attention(np.ascontiguousarray(q[many]), cache, np.repeat(bt[1:2], 5, 0), np.repeat(sl[1:2], 5),
                    np.arange(6, dtype=np.int32), True, cls, True)
    assert same_bits(one[0], full[last]) and all(same_bits(dec[i], full[last]) for i in range(5)), \
        "a decode size class's knobs changed the bits"
    # key halves (two dots chained through the accumulators) and the read-whole register cap too
    halves = dataclasses.replace(cfg, key_halves=2, maxnreg=168, one_key_halves=2, split_key_halves=2)
    if cfg.tile // 2 >= 16:
        for n_seqs, split in ((1, True), (5, True), (5, False)):
            dec = attention(np.ascontiguousarray(q[many[:n_seqs]]), cache, np.repeat(bt[1:2], n_seqs, 0),
                            np.repeat(sl[1:2], n_seqs), np.arange(n_seqs + 1, dtype=np.int32), split, halves, True)
            assert all(same_bits(dec[i], full[last]) for i in range(n_seqs)), \
                f"key halves changed the bits ({n_seqs} sequences, split={split})"
    chunk = attention(np.ascontiguousarray(q[qsl[1] + 300:qsl[2]]), cache, bt[1:2], sl[1:2],
                      np.array([0, n - 300], np.int32), False, cfg)
    assert same_bits(chunk, full[qsl[1] + 300:qsl[2]]), "chunked prefill differs"


@pytest.mark.parametrize("cache_dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_routed_mixed_batch_gives_its_decode_row_the_decode_kernels_bits_on_gpu(cache_dtype):
    """AttentionConfig.route_mixed: in a mixed batch, the sequence of one query gets the decode
    kernel's bits (a decode step's, also over an e4m3 cache, where the prefill kernel's differ:
    FP8_NOT_INVARIANT), every other row the one launch's."""
    d = 128
    q, cache, bt, sl, qsl = three_seqs(3, [(90, 17), (400, 1), (700, 300)], cache_dtype)
    cfg = AttentionConfig()
    full = attention(q, cache, bt, sl, qsl, False, cfg)
    routed = attention(q, cache, bt, sl, qsl, False, dataclasses.replace(cfg, route_mixed=True))
    one = int(qsl[1])
    dec = attention(np.ascontiguousarray(q[one:one + 1]), cache, bt[1:2], sl[1:2], np.array([0, 1], np.int32),
                    True, cfg, True)
    assert same_bits(routed[one], dec[0]), "the routed decode row differs from a decode step's"
    rest = np.arange(len(q)) != one
    assert same_bits(routed[rest], full[rest]), "routing changed the other sequences' rows"
    assert_close(routed, ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5).astype(np.float32))


def test_e4m3_decode_tile_gives_every_decode_row_one_set_of_bits_on_gpu():
    """An e4m3 cache's default schedule (Configs.attention: 32-key decode tiles, 1-warp programs,
    routed mixed buckets): a token's decode output has the same bits in a routed mixed batch, one
    sequence or five, split or not, under each size class's knobs (warps, stages, register caps),
    and stays close to the reference. (Not key halves: 16-key halves of an e4m3 tile changed the
    bits in `build.py tune` on the H200, which therefore never picks them.)"""
    h, hkv, d = 32, 8, 128
    q, cache, bt, sl, qsl = three_seqs(5, [(90, 17), (700, 1), (400, 300)], FP8)
    cfg = DEFAULT.attention(h, hkv, d, bt.shape[1] * cache.shape[2], "float8_e4m3fn")
    assert (cfg.tile_of_decode, cfg.tile, cfg.num_warps, cfg.route_mixed) == (32, 64, 1, True)
    mixed = attention(q, cache, bt, sl, qsl, False, cfg)
    assert_close(mixed, ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5).astype(np.float32))
    row = int(qsl[1])
    want = mixed[row]
    knobs = [cfg, dataclasses.replace(cfg, num_warps=2, num_stages=3, one_num_warps=4, split_num_warps=2,
                                      split_maxnreg=168),
             dataclasses.replace(cfg, maxnreg=168, one_num_warps=2, one_maxnreg=168, split_num_stages=3)]
    for k in knobs:
        for n_seqs, split in ((1, True), (1, False), (5, True), (5, False)):
            qs = np.ascontiguousarray(np.repeat(q[row:row + 1], n_seqs, 0))
            dec = attention(qs, cache, np.repeat(bt[1:2], n_seqs, 0), np.repeat(sl[1:2], n_seqs),
                            np.arange(n_seqs + 1, dtype=np.int32), split, k, True)
            assert all(same_bits(dec[i], want) for i in range(n_seqs)), \
                f"{n_seqs} sequences, split={split}, knobs {knobs.index(k)}: other bits"


@pytest.mark.parametrize("h,hkv", [(24, 4), (16, 2)], ids=["gqa6", "gqa8"])  # Qwen3.6-27B's, 35B-A3B's heads
def test_head_dim_256_attention_gives_one_set_of_bits_on_gpu(h, hkv):
    """Heads of 256 under their defaults (configs.wide_head: 16-row decode programs on 4 warps, V
    column parts, 64-row prefill programs on 8 warps): a token's output has the prefill kernel's bits
    as a decode step (one sequence or five, split or read whole), under V column parts of 1 to 8
    (paged_attention.py DV_PARTS: the tensor core sums each output column alone) and under other rows,
    warps and stages; close to the reference."""
    rng = np.random.default_rng(256 + h)
    d, bs, nb, mb, n = 256, 16, 160, 48, 700
    seqs = [(90, 17), (n, n), (403, 1)]  # 700 and 403 end in partial blocks
    cache = rand(rng, (nb, 2, bs, hkv, d))
    perm = rng.permutation(nb)
    bt = np.stack([perm[:mb], perm[mb:2 * mb], perm[2 * mb:3 * mb]]).astype(np.int32)
    sl = np.array([L for L, _ in seqs], np.int32)
    qsl = np.concatenate([[0], np.cumsum([c for _, c in seqs])]).astype(np.int32)
    q = rand(rng, (int(qsl[-1]), h, d))
    cfg = DEFAULT.attention(h, hkv, d, mb * bs)
    full = attention(q, cache, bt, sl, qsl, False, cfg)
    assert_close(full, ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5).astype(np.float32))
    last = int(qsl[1]) + n - 1
    many = np.array([last] * 5)
    for parts in (None, 1, 2, 4, 8):  # None: the defaults' parts
        c = cfg if parts is None else dataclasses.replace(cfg, one_dv_parts=parts, split_dv_parts=parts)
        for n_seqs, split in ((1, True), (1, False), (5, True), (5, False)):
            dec = attention(np.ascontiguousarray(q[many[:n_seqs]]), cache, np.repeat(bt[1:2], n_seqs, 0),
                            np.repeat(sl[1:2], n_seqs), np.arange(n_seqs + 1, dtype=np.int32), split, c, True)
            assert all(same_bits(dec[i], full[last]) for i in range(n_seqs)), \
                f"{parts} parts, {n_seqs} sequences, split={split}: other bits than the prefill kernel's"
    other = dataclasses.replace(cfg, block_q=4, num_warps=8, num_stages=3, one_num_warps=8, one_maxnreg=168,
                                split_num_warps=2, split_key_halves=2, prefill_block_q=4, prefill_num_warps=4,
                                prefill_num_stages=1)
    assert same_bits(attention(q, cache, bt, sl, qsl, False, other), full), "prefill rows/warps changed the bits"
    for n_seqs in (1, 5):
        dec = attention(np.ascontiguousarray(q[many[:n_seqs]]), cache, np.repeat(bt[1:2], n_seqs, 0),
                        np.repeat(sl[1:2], n_seqs), np.arange(n_seqs + 1, dtype=np.int32), True, other, True)
        assert all(same_bits(dec[i], full[last]) for i in range(n_seqs)), f"{n_seqs} sequences: other knobs' bits"


@pytest.mark.parametrize("cache_dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_attention_merge_in_kernel_gives_the_merge_launch_bits_on_gpu(cache_dtype):
    """A split decode merged in the attention kernel (the last segment program of each
    (sequence, KV head) to count itself in merges, then zeroes the counter) against the
    attention kernel + attention_merge_kernel: the same bits, f32 and bf16 out, with and
    without a window; sequences shorter than a segment, on and just past segment boundaries,
    and up to all 64 segments; padded sequences untouched; the counters zero after every
    launch. Ten launches each on one counter buffer, to give a missed ordering a chance."""
    from kiln.codegen.triton.paged_attention_launch import paged_attention

    rng = np.random.default_rng(4)
    h, hkv, d, bs, mml = 32, 8, 128, 16, 8192
    cfg = AttentionConfig(seg=128)  # tile 64: 64 segments of 2 tiles
    lens = [1, 50, 128, 129, 700, 1000, 3000, 4095, 4096, 8192, 6001, 256]
    pad = 4
    s, mb, nb = len(lens) + pad, mml // bs, 1024
    cache = dev(rand(rng, (nb, 2, bs, hkv, d), cache_dtype, scale=8.0 if cache_dtype == FP8 else 1.0))
    bt = dev(np.stack([rng.permutation(nb)[:mb] for _ in range(s)]).astype(np.int32))
    sl = dev(np.array(lens + [0] * pad, np.int32))
    qsl = dev(np.array(list(range(len(lens) + 1)) + [len(lens)] * pad, np.int32))
    pos = dev(np.array([n - 1 for n in lens] + [0] * pad, np.int32))
    q = dev(rand(rng, (s, h, d)))
    segs = mml // cfg.seg
    ws = (torch.full((s, segs, h, d), float("nan"), dtype=torch.float32, device="cuda"),
          torch.full((s, segs, h, 2), float("nan"), dtype=torch.float32, device="cuda"))
    counter = torch.zeros((s, hkv), dtype=torch.int32, device="cuda")
    for window in (0, 1000):
        for out_dtype in (torch.float32, torch.bfloat16):
            def run(fuse):
                out = torch.full((s, h, d), 3.0, dtype=out_dtype, device="cuda")
                paged_attention(q, cache, bt, sl, qsl, out, scale=d ** -0.5, sliding_window=window, split=True,
                                max_model_len=mml, positions=pos, workspace=ws, counter=counter, config=cfg,
                                decode=True, fuse_merge=fuse)
                return host(out)
            want = run(False)
            assert np.isfinite(f32(want[:len(lens)])).all() and (f32(want[len(lens):]) == 3.0).all()
            for i in range(10):
                got = run(True)
                assert not counter.any().item(), f"window {window}, {out_dtype}: a counter was left nonzero"
                assert same_bits(got, want), f"window {window}, {out_dtype}, launch {i}: the fused merge differs"


def test_elementwise_kernels_on_gpu():
    from kiln.codegen.triton.argmax import argmax
    from kiln.codegen.triton.gather import embedding
    from kiln.codegen.triton.rms_norm import add_rms_norm
    from kiln.codegen.triton.silu_mul import silu_mul

    rng = np.random.default_rng(2)
    x, r, w = rand(rng, (33, 4096)), rand(rng, (33, 4096)), rand(rng, (4096,))
    y, s = torch.empty_like(dev(x)), torch.empty_like(dev(x))
    add_rms_norm(dev(x), dev(r), dev(w), y, s, eps=1e-6, n_rows=dev(np.array([33], np.int32)))
    ry, rs = ops.add_rms_norm(x, r, w, eps=1e-6)
    assert_close(host(y), ry)
    assert same_bits(host(s), rs)
    g, u = rand(rng, (33, 1000)), rand(rng, (33, 1000))
    o = torch.empty_like(dev(g))
    silu_mul(dev(g), dev(u), o, n_rows=dev(np.array([33], np.int32)))
    assert_close(host(o), ops.silu_mul(g, u))
    table, ids = rand(rng, (1000, 256)), rng.integers(0, 1000, 9).astype(np.int32)
    e = torch.empty((9, 256), dtype=torch.bfloat16, device="cuda")
    embedding(dev(ids), dev(table), e, n_rows=dev(np.array([9], np.int32)))
    assert same_bits(host(e), table[ids])
    logits = rand(rng, (4, 50000), np.float32)
    logits[1, [3, 40000]] = 99.0
    am = torch.empty((4,), dtype=torch.int32, device="cuda")
    argmax(dev(logits), am, n_rows=dev(np.array([4], np.int32)))
    assert host(am).tolist() == np.argmax(logits, axis=1).tolist()


@pytest.mark.parametrize("is_neox,rot,qk_norm", [(True, 128, False), (False, 64, True)])
def test_attention_preamble_on_gpu(is_neox, rot, qk_norm):
    from kiln.codegen.triton import reference as R
    from kiln.codegen.triton.attention_preamble import attention_preamble

    rng = np.random.default_rng(4)
    t, h, hkv, d, bs, nb, max_pos = 40, 32, 8, 128, 16, 8, 4096
    qkv = rand(rng, (t, (h + 2 * hkv) * d))
    pos = rng.integers(0, max_pos, t).astype(np.int32)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[5] = -1
    cache = rand(rng, (nb, 2, bs, hkv, d))
    qw, kw = (rand(rng, (d,)), rand(rng, (d,))) if qk_norm else (None, None)
    cos, sin = R.rope_tables(rot, 1e6, (), max_pos)
    qkv_d, cache_d = dev(qkv), dev(cache)
    views = (qkv_d[:, :h * d].view(t, h, d), qkv_d[:, h * d:(h + hkv) * d].view(t, hkv, d),
             qkv_d[:, (h + hkv) * d:].view(t, hkv, d))
    q_out = torch.empty((t, h, d), dtype=torch.bfloat16, device="cuda")
    attention_preamble(*views, cache_d, dev(pos), dev(slots), dev(cos), dev(sin),
                       *((dev(qw), dev(kw)) if qk_norm else (None, None)), q_out, is_neox=is_neox,
                       n_rows=dev(np.array([t], np.int32)))
    q, k, v = (np.ascontiguousarray(a) for a in (qkv[:, :h * d].reshape(t, h, d),
                                                  qkv[:, h * d:(h + hkv) * d].reshape(t, hkv, d),
                                                  qkv[:, (h + hkv) * d:].reshape(t, hkv, d)))
    ref_q, ref_cache = R.attention_preamble(q, k, v, cache.copy(), pos, slots, qw, kw, theta=1e6,
                                            rotary_dim=rot, is_neox=is_neox, max_position=max_pos)
    assert_close(host(q_out), ref_q, what="rotated q")
    assert_close(host(cache_d), ref_cache, what="cache")


def test_attention_preamble_fp8_cache_on_gpu():
    """The e4m3 bytes the preamble writes against ops.to_cache's: equal, but where the GPU's
    RoPE (fma-contracted) lands k one bf16 step from the reference and that step crosses an e4m3
    rounding boundary; saturation at +-448 as the reference."""
    from kiln.codegen.triton import reference as R
    from kiln.codegen.triton.attention_preamble import attention_preamble

    rng = np.random.default_rng(6)
    t, h, hkv, d, bs, nb, max_pos = 40, 32, 8, 128, 16, 8, 4096
    q, k, v = rand(rng, (t, h, d), scale=4.0), rand(rng, (t, hkv, d), scale=4.0), rand(rng, (t, hkv, d), scale=4.0)
    v[0, 0, :4] = np.array([600.0, -600.0, 460.0, -1e4], np.float32).astype(BF16)
    k[1] = (f32(k[1]) * 200).astype(BF16)
    pos = rng.integers(0, max_pos, t).astype(np.int32)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    cache = rand(rng, (nb, 2, bs, hkv, d), FP8)
    cos, sin = R.rope_tables(d, 5e5, (), max_pos)
    cache_d, q_out = dev(cache), torch.empty((t, h, d), dtype=torch.bfloat16, device="cuda")
    attention_preamble(dev(q), dev(k), dev(v), cache_d, dev(pos), dev(slots), dev(cos), dev(sin), None, None,
                       q_out, n_rows=dev(np.array([t], np.int32)))
    ref_q, ref_cache = R.attention_preamble(q, k, v, cache.copy(), pos, slots, theta=5e5, rotary_dim=d,
                                            max_position=max_pos)
    got = host(cache_d)
    assert_close(host(q_out), ref_q, what="rotated q")
    assert same_bits(got[:, 1], ref_cache[:, 1]), "v: a plain conversion, the same bytes"
    differ = got.view(np.uint8) != ref_cache.view(np.uint8)
    assert differ.mean() < 1e-3, f"{int(differ.sum())} of {differ.size} e4m3 bytes differ"
    gap = np.abs(f32(got) - f32(ref_cache))[differ]
    assert (gap <= np.abs(f32(ref_cache))[differ] * 0.125 + 2.0 ** -9).all(), "more than one e4m3 step apart"
    assert np.abs(f32(got)).max() == 448.0 and np.isfinite(f32(got)).all()


def test_aot_cubin_launches_through_cuda_bindings(tmp_path):
    """The runtime's path: compile_spec -> cuModuleLoadData -> cuLaunchKernel with the
    spec's args and null hidden scratch pointers (a GEMM tile with > 48 KiB smem)."""
    from cuda.bindings import driver as cu

    from kiln.codegen.triton.aot import compile_spec
    from kiln.codegen.triton.gemm import gemm_specs

    rng = np.random.default_rng(3)
    m, n, k = 256, 512, 1024
    x, w = rand(rng, (m, k)), rand(rng, (n, k))
    spec = gemm_specs(m, n, k, tile=TILES["prefill"], red=GemmReduction(64, 1))[0]
    c = compile_spec(spec, "sm_90", cache_dir=tmp_path)
    assert c.shared > 48 * 1024
    xd, wd, yd = dev(x), dev(w), torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
    nr = dev(np.array([m], np.int32))
    torch.cuda.synchronize()  # torch made the primary context current on this thread

    def ok(res):
        assert res[0] == cu.CUresult.CUDA_SUCCESS, res
        return res[1] if len(res) > 1 else None

    ok(cu.cuInit(0))
    fn = ok(cu.cuModuleGetFunction(ok(cu.cuModuleLoadData(c.cubin)), c.name.encode()))
    ok(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                             c.shared))
    p64, i32 = ctypes.c_uint64, ctypes.c_int32
    y = p64(yd.data_ptr())  # also fills the unused bias, residual and split-K workspace slots
    by_name = dict(x_ptr=p64(xd.data_ptr()), w_ptr=p64(wd.data_ptr()), n_rows_ptr=p64(nr.data_ptr()),
                   M=i32(m), stride_xm=i32(k), stride_ym=i32(n))
    vals = [by_name.get(a, y) for a in spec.signature]  # in the spec's order, as the runtime packs them
    assert set(spec.signature) - set(by_name) <= {"bias_ptr", "res_ptr", "y_ptr", "part_ptr"}, spec.signature
    vals += [p64(0)] * c.n_hidden  # hidden scratch pointers: null, their sizes are 0
    params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    gx, gy, gz = spec.grid
    ok(cu.cuLaunchKernel(fn, gx, gy, gz, 32 * c.num_warps, 1, 1, c.shared, 0, ctypes.addressof(params), 0))
    ok(cu.cuCtxSynchronize())
    assert_close(host(yd), ops.linear(x, w), what="AOT gemm")
