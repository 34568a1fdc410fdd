"""Triton kernels under the interpreter vs graph/ops.py (attention: test_paged_attention.py).

Every input is fresh random (never zeros), storage bf16, tolerances per DESIGN
(bf16: 1e-2 relative; NaN never passes). The GEMM invariance test is bit-exact.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kiln.codegen.triton import reference as R
from kiln.codegen.triton.argmax import argmax
from kiln.codegen.triton.attention_preamble import attention_preamble
from kiln.codegen.triton.configs import DEFAULT, GemmReduction, GemmTile
from kiln.codegen.triton.gather import embedding, gather_rows
from kiln.codegen.triton.gemm import fold_through_memory, gemm, gemm_rope, gemm_specs, needs_workspace
from kiln.codegen.triton.launch import recording
from kiln.codegen.triton.rms_norm import add_rms_norm, rms_norm
from kiln.codegen.triton.silu_mul import silu_mul
from kiln.graph import ops
from tests.codegen.helpers import BF16, FP8, assert_close, f32, rand, require_interpreter, same_bits

pytestmark = pytest.mark.usefixtures("interpreter")

DECODE = GemmTile(block_m=16, block_n=32, num_warps=4, num_stages=4)
PREFILL = GemmTile(block_m=64, block_n=64, num_warps=4, num_stages=3)


@pytest.fixture
def interpreter():
    require_interpreter()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# -- gemm --------------------------------------------------------------------------------

@pytest.mark.parametrize("bias,out_dtype,split", [(True, BF16, 1), (False, np.float32, 1), (True, BF16, 2)])
def test_gemm_matches_reference(rng, bias, out_dtype, split):
    m, n, k = 37, 80, 192
    x, w = rand(rng, (m, k)), rand(rng, (n, k))
    b = rand(rng, (n,)) if bias else None
    out = np.empty((m, n), out_dtype)
    y = gemm(x, w, b, out, tile=PREFILL, red=GemmReduction(block_k=64, split_k=split))
    ref = ops.linear(x, w, *([b] if bias else []))
    assert_close(y, ref, what="gemm")


@pytest.mark.parametrize("split", [1, 2])
def test_gemm_row_is_invariant_to_batch(rng, split):
    """Row i alone (M=1, decode tile) and inside M=37 (prefill tile): the same bits,
    because both reduce K in the same order with the same split, whatever K block each
    program loads (GemmTile.block_k: the interpreter, like the tensor core, chains k=16
    steps) and however the programs are grouped over the tiles (GemmTile.group_m: M=37 is
    three 16-row blocks). f32 output, so a reordered sum cannot hide behind the bf16 rounding."""
    m, n, k = 37, 96, 256
    x, w, b = rand(rng, (m, k)), rand(rng, (n, k)), rand(rng, (n,))
    red = GemmReduction(block_k=64, split_k=split)
    y = lambda rows: np.empty((rows, n), np.float32)
    full = gemm(x, w, b, y(m), tile=PREFILL, red=red)
    for i in (0, 17, 36):
        one = gemm(x[i:i + 1], w, b, y(1), tile=DECODE, red=red)
        assert same_bits(one[0], full[i]), f"row {i} differs between M=1 and M=37"
    assert same_bits(gemm(x, w, b, y(m), tile=DECODE, red=red), full)
    for bk in (16, 32, 128):
        assert same_bits(gemm(x, w, b, y(m), tile=replace(PREFILL, block_k=bk), red=red), full), \
            f"block_k {bk} changed the bits"
    for g in (1, 2, 16):  # GROUP_M only maps programs to tiles; 2 leaves a ragged last group of one
        assert same_bits(gemm(x, w, b, y(m), tile=replace(DECODE, group_m=g), red=red), full), \
            f"group_m {g} changed the bits or missed a tile"
    other = gemm(x, w, b, y(m), tile=PREFILL, red=GemmReduction(block_k=64, split_k=3 - split))
    assert not same_bits(other, full), "the test cannot see a change of reduction order"


@pytest.mark.parametrize("split,fold", [(1, False), (2, True)])
def test_gemm_residual_epilogue_gives_gemm_then_add_bits(rng, split, fold):
    """gemm(residual=r) stores bf16(bf16(x @ w) + r): linear then add_rms_norm's residual add, on
    the rounded value the plain store writes (linear_add). Also in place (r is the output)."""
    m, n, k = 37, 96, 256
    x, w, r = rand(rng, (m, k)), rand(rng, (n, k)), rand(rng, (m, n))
    red = GemmReduction(block_k=64, split_k=split)
    for tile in (DECODE, PREFILL):
        tile = replace(tile, fold=fold)
        y = gemm(x, w, None, np.empty((m, n), BF16), tile=tile, red=red)
        got = gemm(x, w, None, np.empty((m, n), BF16), tile=tile, red=red, residual=r)
        assert same_bits(got, ops.add(y, r)), f"{tile}: the residual epilogue differs from gemm + add"
        inplace = r.copy()
        assert same_bits(gemm(x, w, None, inplace, tile=tile, red=red, residual=inplace), got)
    with pytest.raises(ValueError, match="residual epilogue"):  # unfolded partials: the norm adds it
        gemm(x, w, None, np.empty((m, n), BF16), tile=replace(PREFILL, fold=False), red=GemmReduction(64, 2),
             residual=r)


@pytest.mark.parametrize("split,bias", [(2, True), (4, False)])
def test_gemm_fold_gives_the_reduce_kernels_bits(rng, split, bias):
    """FOLD: each program computes its tile's K splits one after the other, each from zero, and
    adds them in order in f32: the same bits as the partials summed by gemm_reduce_kernel (f32
    and bf16 out), in one launch. Decode rows (partials + reduce) match the folded prefill rows."""
    m, n, k = 37, 96, 256
    x, w = rand(rng, (m, k)), rand(rng, (n, k))
    b = rand(rng, (n,)) if bias else None
    red = GemmReduction(block_k=32, split_k=split)
    unfolded, folded = replace(PREFILL, fold=False), replace(PREFILL, fold=True)
    for dt in (np.float32, BF16):
        want = gemm(x, w, b, np.empty((m, n), dt), tile=unfolded, red=red)
        got = gemm(x, w, b, np.empty((m, n), dt), tile=folded, red=red)
        assert same_bits(got, want), f"split {split}, {dt}: folding changed the bits"
    row = gemm(x, w, b, np.empty((m, n), np.float32), tile=folded, red=red)[5]
    one = gemm(x[5:6], w, b, np.empty((1, n), np.float32), tile=DECODE, red=red)
    assert same_bits(one[0], row), "a decode row (partials + reduce) differs from the folded prefill's"
    unsplit = gemm(x[5:6], w, b, np.empty((1, n), np.float32), tile=DECODE, red=GemmReduction(32, 1))
    assert not same_bits(unsplit[0], row), "the test cannot tell the splits' sum from one chain over K"
    with recording() as launches:  # and it was the fold that ran: one launch, one program per tile
        gemm(x, w, b, np.empty((m, n), BF16), tile=folded, red=red)
    (spec, _), = launches
    assert spec.constexprs["FOLD"] and spec.grid == (2, 1, 1)  # 96 / 64 column tiles x 1 row tile
    assert "FOLD_MEM" not in spec.constexprs


@pytest.mark.parametrize("split,residual", [(2, True), (3, False)])
def test_gemm_fold_through_memory_gives_the_reduce_kernels_bits(rng, split, residual):
    """A folded tile too large for two accumulators in registers (gemm.fold_through_memory: 128 x
    128 with 4 warps is 128 f32 a thread) parks its running sum in its workspace slot between
    splits: the partials' bits, with the residual epilogue too; the workspace is required."""
    m, n, k = 37, 96, 384
    x, w = rand(rng, (m, k)), rand(rng, (n, k))
    r = rand(rng, (m, n)) if residual else None
    red = GemmReduction(block_k=64, split_k=split)
    big = GemmTile(block_m=128, block_n=128, num_warps=4, num_stages=2)
    assert fold_through_memory(big) and not fold_through_memory(PREFILL)
    want = gemm(x, w, None, np.empty((m, n), BF16), tile=replace(big, fold=False), red=red)
    if residual:
        want = ops.add(want, r)
    ws = np.full((split, m, n), np.nan, np.float32)
    got = gemm(x, w, None, np.empty((m, n), BF16), tile=replace(big, fold=True), red=red, workspace=ws, residual=r)
    assert same_bits(got, want), f"split {split}: folding through memory changed the bits"
    with recording() as launches:
        gemm(x, w, None, np.empty((m, n), BF16), tile=replace(big, fold=True), red=red, residual=r)
    (spec, _), = launches
    assert spec.constexprs["FOLD"] and spec.constexprs["FOLD_MEM"] and spec.grid == (1, 1, 1)
    assert np.isfinite(ws[0]).all() and np.isnan(ws[1:]).all()  # its running sum, in slot 0 only
    assert needs_workspace(red, replace(big, fold=True), True) and not needs_workspace(red, PREFILL, True)


def test_gemm_folds_by_the_configs_rule_and_never_a_one_block_split():
    """Configs.gemm_fold: where the output tiles fill the GPU twice (132 SMs on sm_90) and two
    accumulators fit in registers, or as the tile says; never a split of one K block, which
    Triton's combine pass would turn into dot(a, b, acc) (another rounding than the reduce
    kernel's add)."""
    red = GemmReduction(block_k=128, split_k=2)
    tile = GemmTile(128, 128, 8, 3)
    assert DEFAULT.gemm_fold(2048, 4096, 4096, tile, red)  # 16 x 32 = 512 tiles >= 264
    assert not DEFAULT.gemm_fold(1024, 4096, 4096, tile, red)  # 256 tiles
    assert not DEFAULT.gemm_fold(2048, 4096, 4096, replace(tile, block_n=256), red)  # 2 x 128 registers a thread
    assert DEFAULT.gemm_fold(4096, 4096, 4096, GemmTile(64, 64, 4, 3), red)  # 2 x 32
    assert not DEFAULT.gemm_fold(1, 6144, 4096, DEFAULT.gemm_tile(1, 6144, 4096), red)  # decode
    assert not DEFAULT.gemm_fold(2048, 4096, 4096, tile, GemmReduction(128, 1))  # nothing to fold
    assert not DEFAULT.gemm_fold(2048, 4096, 4096, replace(tile, fold=False), red)  # the tile's word
    assert DEFAULT.gemm_fold(16, 64, 4096, replace(tile, fold=True), red)
    assert not DEFAULT.gemm_fold(2048, 4096, 256, replace(tile, fold=True), red)  # 2 blocks, 1 per split
    assert DEFAULT.gemm_fold(2048, 4096, 384, replace(tile, fold=True), red)  # 3 blocks: 2 + 1 (masked)
    with pytest.raises(ValueError, match="fold needs >= 2 K blocks per split"):
        gemm_specs(2048, 4096, 256, tile=replace(tile, fold=True), red=red)
    # the fused norm's consumer asks for the partials: a folding tile cannot give them
    x, w = np.zeros((4, 128), BF16), np.zeros((8, 128), BF16)
    with pytest.raises(ValueError, match="reduce=False"):
        gemm(x, w, tile=replace(PREFILL, fold=True), red=GemmReduction(32, 2), reduce=False)


def test_folded_gemm_then_add_rms_norm_gives_the_fused_norms_bits(rng):
    """Where split-K partials would go to add_rms_norm (x_split: summed in order in f32, rounded
    to bf16, plus the residual in f32, rounded), a folded GEMM writes the bf16 sum itself and the
    norm reads it: the same rounding at the same place, so the same normed rows and residual."""
    t, n, k = 21, 96, 256
    x, w, res, nw = rand(rng, (t, k)), rand(rng, (n, k)), rand(rng, (t, n)), rand(rng, (n,))
    for split in (2, 4):
        red = GemmReduction(block_k=32, split_k=split)
        parts = np.empty((split, t, n), np.float32)
        gemm(x, w, None, np.empty((t, n), BF16), workspace=parts, tile=replace(PREFILL, fold=False), red=red,
             reduce=False)
        want_y, want_r = add_rms_norm(parts, res.copy(), nw, eps=1e-5, x_split=split)
        y = gemm(x, w, None, np.empty((t, n), BF16), tile=replace(PREFILL, fold=True), red=red)
        got_y, got_r = add_rms_norm(y, res.copy(), nw, eps=1e-5)
        assert same_bits(got_r, want_r) and same_bits(got_y, want_y), f"split {split}"
        got_y, got_r = add_rms_norm(res, y, nw, eps=1e-5)  # the GEMM as the norm's second input
        assert same_bits(got_r, want_r) and same_bits(got_y, want_y), f"split {split}, swapped"


def test_gemm_strided_rows_and_padding(rng):
    """x as a column slice of a wider buffer; rows past n_rows are left untouched."""
    m, n, k = 40, 48, 64
    wide = rand(rng, (m, 3 * k))
    x, w = wide[:, k:2 * k], rand(rng, (n, k))
    out = np.full((m, n), 7.0, BF16)
    gemm(x, w, None, out, n_rows=np.array([16], np.int32), tile=DECODE, red=GemmReduction(32, 1))
    assert_close(out[:16], ops.linear(np.ascontiguousarray(x[:16]), w), what="gemm live rows")
    assert (f32(out[16:]) == 7.0).all()


# -- norms and activation ----------------------------------------------------------------

@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(rng, offset):
    x, w = rand(rng, (9, 136), scale=3.0), rand(rng, (136,))
    assert_close(rms_norm(x, w, eps=1e-5, offset=offset), ops.rms_norm(x, w, eps=1e-5, offset=offset))


def test_rms_norm_per_head_on_a_strided_view(rng):
    """q/k norm: [T, heads, D] rows of D, q being a view into a fused qkv buffer."""
    t, h, d = 5, 3, 64
    qkv = rand(rng, (t, (h + 2) * d))
    q, w = qkv[:, :h * d].reshape(t, h, d), rand(rng, (d,))
    assert_close(rms_norm(q, w, eps=1e-6), ops.rms_norm(np.ascontiguousarray(q), w, eps=1e-6))


def test_add_rms_norm_in_place(rng):
    x, res, w = rand(rng, (6, 200)), rand(rng, (6, 200)), rand(rng, (200,))
    ref_y, ref_s = ops.add_rms_norm(x, res, w, eps=1e-6)
    y, s = add_rms_norm(x, res, w, res_out=res, eps=1e-6)
    assert s is res
    assert_close(y, ref_y, what="normed")
    assert same_bits(s, ref_s)  # one rounding of an f32 sum: exact


def test_silu_mul_on_gate_up_halves(rng):
    t, i = 7, 300
    gate_up = rand(rng, (t, 2 * i), scale=2.0)
    gate, up = gate_up[:, :i], gate_up[:, i:]
    assert_close(silu_mul(gate, up), ops.silu_mul(np.ascontiguousarray(gate), np.ascontiguousarray(up)))



# -- the SwiGLU epilogue (gemm silu_group) ------------------------------------------------

def _gate_up(rng, i, k, scale=3.0):
    """x and a gate/up pair whose products reach silu's curved part (|g| up to ~6)"""
    return rand(rng, (i, k), scale=scale / k ** 0.5 * 2), rand(rng, (i, k), scale=1.0 / k ** 0.5 * 2)


@pytest.mark.parametrize("tile,red", [
    (DECODE, GemmReduction(32, 1)),
    (PREFILL, GemmReduction(32, 1)),
    (GemmTile(32, 128, 4, 3), GemmReduction(64, 1)),  # a tile wider than a 2G group pair, ragged N
    (replace(PREFILL, fold=True), GemmReduction(32, 2)),  # folded split-K: epilogue in the main kernel
    (replace(DECODE, fold=False), GemmReduction(32, 2)),  # partials: epilogue in the reduce kernel
    (replace(PREFILL, fold=False), GemmReduction(32, 4)),
])
def test_gemm_silu_epilogue_gives_gemm_then_silu_mul_bits(rng, tile, red):
    """gemm(x, interleaved [Wg; Wu], silu_group=16) is bit for bit gemm(x, [Wg; Wu]) then
    silu_mul on its two halves (bf16 g and u, silu_mul's f32 formula), for ragged M and N
    (I = 160: 320 stacked rows, not a multiple of the 128-column tile)."""
    from kiln.graph.layout import stack_parts
    i, k = 160, 256
    wg, wu = _gate_up(rng, i, k)
    plain, inter = np.concatenate([wg, wu]), stack_parts([wg, wu], 16)
    for m in (1, 5, 37, 64):
        x = rand(rng, (m, k))
        y = gemm(x, plain, None, np.empty((m, 2 * i), BF16), tile=tile, red=red)
        want = silu_mul(y[:, :i], y[:, i:])
        got = gemm(x, inter, None, np.empty((m, i), BF16), tile=tile, red=red, silu_group=16)
        assert same_bits(got, want), f"M={m}: the SwiGLU epilogue differs from gemm + silu_mul"
    assert_close(got, ops.silu_mul(ops.linear(x, wg), ops.linear(x, wu)), what="gemm silu")
    # the test sees a wrong layout: the plain stack through the epilogue mixes gate and up columns
    bad = gemm(x, plain, None, np.empty((m, i), BF16), tile=tile, red=red, silu_group=16)
    assert not same_bits(bad, want)


def test_gemm_silu_epilogue_row_is_invariant_to_batch(rng):
    """A row through the decode tile at M=1 and inside M=37 through the prefill tile: the same
    bits (so a token's MLP does not depend on its bucket); and live rows only (n_rows)."""
    from kiln.graph.layout import stack_parts
    i, k = 96, 192
    wg, wu = _gate_up(rng, i, k)
    w = stack_parts([wg, wu], 16)
    red = GemmReduction(64, 1)
    x = rand(rng, (37, k))
    full = gemm(x, w, None, np.empty((37, i), BF16), tile=PREFILL, red=red, silu_group=16)
    for r in (0, 17, 36):
        one = gemm(x[r:r + 1], w, None, np.empty((1, i), BF16), tile=DECODE, red=red, silu_group=16)
        assert same_bits(one[0], full[r]), f"row {r} differs between M=1 and M=37"
    out = np.full((37, i), np.nan, BF16)
    gemm(x, w, None, out, n_rows=np.array([16], np.int32), tile=DECODE, red=red, silu_group=16)
    assert same_bits(out[:16], full[:16]) and np.isnan(f32(out[16:])).all()
    with pytest.raises(Exception, match="multiples of 2G"):
        gemm(x, w, None, np.empty((37, i), BF16), tile=GemmTile(16, 16), red=red, silu_group=16)
    with pytest.raises(Exception, match="no bias"):
        gemm(x, w, rand(rng, (2 * i,)), np.empty((37, i), BF16), tile=DECODE, red=red, silu_group=16)

# -- gathers and argmax ------------------------------------------------------------------

def test_embedding_and_gather_rows(rng):
    table = rand(rng, (50, 72))
    ids = rng.integers(0, 50, 11).astype(np.int32)
    assert same_bits(embedding(ids, table), ops.embedding(ids, table))
    h = rand(rng, (11, 72))
    idx = np.array([10, 3, -1], np.int32)  # -1: a padded logits row
    got = gather_rows(h, idx)
    assert same_bits(got[:2], ops.gather_rows(h, idx[:2]))
    assert (f32(got[2]) == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_argmax_ties_to_lowest_index(rng, dtype):
    logits = rand(rng, (5, 3000), dtype)
    logits[1, [7, 1500, 2999]] = 50  # a tie across chunks
    logits[2, [1024, 1025]] = 50  # a tie inside a chunk
    logits[3, 2999] = 60  # the last column
    got = argmax(logits)
    assert got.tolist() == np.argmax(f32(logits), axis=1).tolist()
    assert got[1] == 7 and got[2] == 1024 and got[3] == 2999


# -- attention preamble ------------------------------------------------------------------

@pytest.mark.parametrize("is_neox,rot,qk_norm,offset", [
    (True, 64, False, 0.0),    # Llama: full rotary, neox
    (False, 32, True, 0.0),    # gpt-j pairs, partial rotary, Qwen3 q/k norm
    (True, 16, True, 1.0),     # partial rotary, (1 + w) norm
])
def test_attention_preamble(rng, is_neox, rot, qk_norm, offset):
    t, h, hkv, d, bs, nb, max_pos = 7, 4, 2, 64, 4, 10, 64
    qkv = rand(rng, (t, (h + 2 * hkv) * d), scale=2.0)  # one fused projection, three views
    q = qkv[:, :h * d].reshape(t, h, d)
    k = qkv[:, h * d:(h + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (h + hkv) * d:].reshape(t, hkv, d)
    pos = rng.integers(0, max_pos, t).astype(np.int32)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[3] = -1  # padding writes nothing
    cache = rand(rng, (nb, 2, bs, hkv, d))
    ref_cache = cache.copy()
    qw, kw = (rand(rng, (d,)), rand(rng, (d,))) if qk_norm else (None, None)
    cos, sin = R.rope_tables(rot, 10000.0, (), max_pos)
    q_out = attention_preamble(q, k, v, cache, pos, slots, cos, sin, qw, kw, is_neox=is_neox, offset=offset)
    cont = np.ascontiguousarray
    ref_q, ref_cache = R.attention_preamble(cont(q), cont(k), cont(v), ref_cache, pos, slots, qw, kw,
                                            offset=offset, theta=10000.0, rotary_dim=rot, is_neox=is_neox,
                                            max_position=max_pos)
    assert_close(q_out, ref_q, what="rotated q")
    assert_close(cache, ref_cache, what="cache")
    untouched = np.ones(nb * bs, bool)
    untouched[slots[slots >= 0]] = False
    flat, ref_flat = cache.transpose(0, 2, 1, 3, 4).reshape(nb * bs, -1), ref_cache.transpose(0, 2, 1, 3, 4)
    assert same_bits(flat[untouched], ref_flat.reshape(nb * bs, -1)[untouched])  # incl. slot -1's row


@pytest.mark.parametrize("tile,split,bias,cache_dtype", [
    (GemmTile(16, 32, 4, 3), 1, False, BF16),   # half a head's pairs per program (BLOCK_N < D)
    (GemmTile(16, 16, 2, 3), 2, True, FP8),     # a quarter of them; split-K folded; e4m3 cache
    (GemmTile(32, 128, 4, 3), 1, True, BF16),   # two whole heads per program (BLOCK_N > D)
])
def test_gemm_rope_gives_gemm_then_preamble_bits(rng, tile, split, bias, cache_dtype):
    """The q/k/v projection with RoPE and the cache write in its epilogue (gemm_rope_kernel)
    writes the bytes a qkv GEMM followed by attention_preamble writes: rotated q, the cache's
    k and v rows (slot -1 and rows past M untouched), whatever the tile."""
    t, h, hkv, d, bs, nb, max_pos, k = 21, 4, 2, 64, 4, 12, 64, 128
    n = (h + 2 * hkv) * d
    x, w = rand(rng, (t, k)), rand(rng, (n, k))
    b = rand(rng, (n,)) if bias else None
    pos = rng.integers(0, max_pos, t).astype(np.int32)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[3] = -1
    cache = rand(rng, (nb, 2, bs, hkv, d)).astype(cache_dtype)
    want_cache = cache.copy()
    cos, sin = R.rope_tables(d, 10000.0, (), max_pos)
    red = GemmReduction(block_k=32, split_k=split)
    qkv = gemm(x, w, b, np.empty((t, n), BF16), tile=replace(tile, fold=split > 1), red=red)
    q = qkv[:, :h * d].reshape(t, h, d)
    kk = qkv[:, h * d:(h + hkv) * d].reshape(t, hkv, d)
    v = qkv[:, (h + hkv) * d:].reshape(t, hkv, d)
    want_q = attention_preamble(q, kk, v, want_cache, pos, slots, cos, sin)
    q_out = gemm_rope(x, w, b, np.empty((t, h, d), BF16), cache, pos, slots, cos, sin, h=h, hkv=hkv, tile=tile,
                      red=red)
    assert same_bits(q_out, want_q)
    assert same_bits(cache, want_cache)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_preamble_fp8_cache(rng, qk_norm):
    """--kv-cache-dtype fp8: the kernel writes exactly ops.to_cache's e4m3 bytes (k rounded to
    bf16 by RoPE first, then to e4m3; values past +-448 saturate), q as with a bf16 cache."""
    t, h, hkv, d, bs, nb, max_pos = 6, 4, 2, 64, 4, 8, 64
    q, k, v = rand(rng, (t, h, d), scale=3.0), rand(rng, (t, hkv, d), scale=3.0), rand(rng, (t, hkv, d), scale=3.0)
    v[0, 0, :5] = np.array([600.0, -600.0, 448.0, 460.0, -1e4], np.float32).astype(BF16)  # saturate
    if not qk_norm:
        k[1] = (f32(k[1]) * 200).astype(BF16)  # rotated k past 448 too
    pos = rng.integers(0, max_pos, t).astype(np.int32)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    cache = rand(rng, (nb, 2, bs, hkv, d)).astype(FP8)
    ref_cache = cache.copy()
    qw, kw = (rand(rng, (d,)), rand(rng, (d,))) if qk_norm else (None, None)
    cos, sin = R.rope_tables(d, 10000.0, (), max_pos)
    q_out = attention_preamble(q, k, v, cache, pos, slots, cos, sin, qw, kw)
    ref_q, ref_cache = R.attention_preamble(q, k, v, ref_cache, pos, slots, qw, kw, theta=10000.0, rotary_dim=d,
                                            max_position=max_pos)
    assert same_bits(q_out, ref_q), "rotated q"
    assert same_bits(cache, ref_cache), "fp8 cache bytes"
    assert np.abs(f32(cache)).max() == 448.0 and np.isfinite(f32(cache)).all()


def test_rope_tables_match_ops_rope(rng):
    """A table row is exactly what ops.rope uses for that position (llama3 scaling)."""
    scaling = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
               ("original_max_position_embeddings", 64), ("rope_type", "llama3"))
    cos, sin = R.rope_tables(32, 500000.0, scaling, 256)
    x = rand(rng, (3, 1, 32))
    pos = np.array([0, 77, 255], np.int32)
    got = ops.rope(x, pos, theta=500000.0, rotary_dim=32, scaling=scaling, max_position=256)
    xf = f32(x)[:, 0]
    c, s = cos[pos], sin[pos]
    want = np.concatenate([xf[:, :16] * c - xf[:, 16:] * s, xf[:, 16:] * c + xf[:, :16] * s], axis=1)
    assert same_bits(got[:, 0], want.astype(BF16))


def test_add_rms_norm_reduces_split_k_partials_like_the_reduce_kernel():
    """x_split: the same bits as gemm_reduce_kernel followed by add_rms_norm."""
    from kiln.codegen.triton.configs import GemmReduction, GemmTile
    from kiln.codegen.triton.gemm import gemm_specs
    from kiln.codegen.triton.launch import as_buf
    from kiln.codegen.triton.launch import launch as run
    from kiln.codegen.triton.rms_norm import add_rms_norm

    rng = np.random.default_rng(7)
    for split, t, n in ((2, 5, 96), (4, 3, 200)):
        parts = rng.standard_normal((split, t, n)).astype(np.float32) * 3
        res = rand(rng, (t, n))
        w = rand(rng, (n,))
        reduced = np.empty((t, n), BF16)
        spec = gemm_specs(t, n, 256, tile=GemmTile(16, 32), red=GemmReduction(32, split))[1]
        run(spec, [as_buf(parts), as_buf(reduced), as_buf(reduced), as_buf(np.array([t], np.int32)), t, n])
        want_y, want_r = add_rms_norm(reduced, res.copy(), w, eps=1e-5)
        got_y, got_r = add_rms_norm(parts, res.copy(), w, eps=1e-5, x_split=split)
        assert same_bits(got_r, want_r) and same_bits(got_y, want_y)
