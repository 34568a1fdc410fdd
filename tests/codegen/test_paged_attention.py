"""paged_attention under the interpreter: vs ops.paged_attention, and bit-exact
invariance of a token's output to how its queries are grouped (prefill chunk,
chunked prefill, decode, split-KV or not, padded bucket)."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from kiln.codegen.triton.configs import DEFAULT, AttentionConfig
from kiln.codegen.triton.paged_attention_launch import paged_attention, paged_attention_specs
from kiln.graph import ops
from tests.codegen.helpers import BF16, FP8, assert_close, f32, rand, require_interpreter, same_bits

CFG = AttentionConfig(block_q=4, tile=16, seg=32, prefill_block_q=4)  # small seg: several segments per sequence
ROUTED = dataclasses.replace(CFG, route_mixed=True)  # a mixed batch's decode rows in a launch of their own
BS, NB, MB = 4, 128, 32


@pytest.fixture(autouse=True)
def interpreter():
    require_interpreter()


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def make_batch(rng, seqs, h, hkv, d, cache=None):
    """seqs: [(context length L, new tokens n)] -> (q, cache, block_table, seq_lens, qsl).
    Each sequence owns a scattered set of physical blocks; the whole cache is random,
    so the prefix (positions < L - n) plays the prefix-cached blocks."""
    cache = rand(rng, (NB, 2, BS, hkv, d)) if cache is None else cache
    perm = rng.permutation(NB)
    bt = np.stack([perm[i * MB:(i + 1) * MB] if (i + 1) * MB <= NB else np.roll(perm, i)[:MB]
                   for i in range(len(seqs))]).astype(np.int32)
    seq_lens = np.array([L for L, _ in seqs], np.int32)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    q = rand(rng, (int(qsl[-1]), h, d))
    return q, cache, bt, seq_lens, qsl


def run(q, cache, bt, sl, qsl, f32_out=True, config=CFG, **kw):
    """f32 output by default: the invariance checks compare f32 bits, which a change in
    summation order flips far more often than the rounded bf16 would."""
    if f32_out and "out" not in kw:
        kw["out"] = np.empty(q.shape, np.float32)
    return paged_attention(q, cache, bt, sl, qsl, scale=q.shape[-1] ** -0.5, config=config, **kw)


@pytest.mark.parametrize("h,hkv,d", [(8, 2, 32), (3, 3, 16), (6, 2, 48)])  # GQA 4, MHA, G=3 / D=48 padded
def test_mixed_batch_matches_reference(rng, h, hkv, d):
    # prefix-cached prefill chunk, decode, fresh prefill, long context with a short chunk
    seqs = [(29, 11), (17, 1), (9, 9), (70, 3)]
    q, cache, bt, sl, qsl = make_batch(rng, seqs, h, hkv, d)
    ref = ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5)
    assert_close(run(q, cache, bt, sl, qsl, f32_out=False), ref, what="attention, bf16 out")
    out = run(q, cache, bt, sl, qsl)
    assert_close(out, ref, what="attention, f32 out")
    assert same_bits(run(q, cache, bt, sl, qsl, split=True), out), "split-KV changed the bits"
    # a mixed bucket's two launches (its sequence of one query by the decode variant) write
    # every row once, with the one-launch bits
    routed = run(q, cache, bt, sl, qsl, out=np.full(q.shape, np.nan, np.float32), config=ROUTED)
    assert same_bits(routed, out), "routing the decode row to the decode kernel changed the bits"


@pytest.mark.parametrize("h,hkv,d", [(8, 2, 32), (6, 2, 48)])
def test_fp8_cache(rng, h, hkv, d):
    """--kv-cache-dtype fp8: the numbers of ops.paged_attention reading the e4m3 cache (the
    kernel's dots run in f16 there), and the invariances: split-KV, decode kernel == prefill."""
    seqs = [(29, 11), (17, 1), (9, 9), (70, 3)]
    q, cache, bt, sl, qsl = make_batch(rng, seqs, h, hkv, d, cache=rand(rng, (NB, 2, BS, hkv, d), FP8, scale=4.0))
    ref = ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5)
    out = run(q, cache, bt, sl, qsl)
    assert_close(out, ref, what="attention over an fp8 cache")
    assert_close(run(q, cache, bt, sl, qsl, f32_out=False), ref, what="attention over an fp8 cache, bf16 out")
    assert same_bits(run(q, cache, bt, sl, qsl, split=True), out), "split-KV changed the bits"
    last = qsl[1:] - 1  # each sequence's last query, as a decode batch
    dec = run(np.ascontiguousarray(q[last]), cache, bt, sl, np.arange(len(seqs) + 1, dtype=np.int32),
              decode=True, split=True)
    assert same_bits(dec, out[last]), "the decode kernel differs from the prefill one"
    routed = run(q, cache, bt, sl, qsl, out=np.full(q.shape, np.nan, np.float32), config=ROUTED)
    assert same_bits(routed, out), "a routed mixed batch differs from the one launch"


@pytest.mark.parametrize("cfg", [CFG, AttentionConfig(block_q=4, tile=16, seg=16, prefill_block_q=4)],
                         ids=["seg>tile", "seg==tile"])
def test_decode_equals_prefill_bit_exact(rng, cfg):
    """The last position of a 100-token sequence (4 segments, 7 tiles; with seg == tile, 7
    one-tile segments): in a full prefill inside a mixed batch, in the second chunk of a
    chunked prefill, and as a decode step, split or not. Four segments make the fold order
    matter (with two, a + b commutes)."""
    h, hkv, d, n = 8, 2, 32, 100
    q, cache, bt, sl, qsl = make_batch(rng, [(13, 5), (n, n), (30, 2)], h, hkv, d)
    attend = functools.partial(run, config=cfg)
    full = attend(q, cache, bt, sl, qsl)
    seq = q[qsl[1]:qsl[2]]  # [n, H, D]: this sequence's queries
    one = lambda x: np.ascontiguousarray(x)
    chunk2 = attend(one(seq[41:]), cache, bt[1:2], np.array([n], np.int32), np.array([0, n - 41], np.int32))
    for p in (41, 66, n - 1):
        assert same_bits(chunk2[p - 41], full[qsl[1] + p]), f"chunked prefill changed position {p}"
    for split in (False, True):
        for decode in (False, True):
            dec = attend(one(seq[n - 1:]), cache, bt[1:2], np.array([n], np.int32), np.array([0, 1], np.int32),
                      split=split, decode=decode)
            assert same_bits(dec[0], full[qsl[1] + n - 1]), \
                f"decode (split={split}, decode kernel={decode}) differs from prefill"
    # decode inside a batch of other decodes: the neighbours must not matter either
    qd = one(np.stack([q[qsl[1] + n - 1], q[qsl[0] + 4], q[qsl[2] + 1]]))
    for decode in (False, True):
        dec = attend(qd, cache, bt[[1, 0, 2]], sl[[1, 0, 2]], np.arange(4, dtype=np.int32),
                  split=True, decode=decode)
        assert same_bits(dec[0], full[qsl[1] + n - 1])
        assert same_bits(dec[1], full[qsl[0] + 4])
        assert same_bits(dec[2], full[qsl[2] + 1])


@pytest.mark.parametrize("seg", [64, 32], ids=["seg>tile", "seg==tile"])
@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8"])
def test_decode_in_key_halves_matches_reference(rng, seg, cache_dtype):
    """key_halves=2: a decode program loads and multiplies each 32-key tile as two 16-key halves
    (masked tails, segments of one and several tiles; each decode class its own knob). Here the numbers;
    the bits equal whole tiles' on the GPU only (the tensor core adds the halves' k-chunks in the
    whole tile's order; the interpreter's dot model sums each half whole: test_triton_gpu.py)."""
    h, hkv, d = 8, 2, 32
    cache = rand(rng, (NB, 2, BS, hkv, d), FP8, scale=4.0) if cache_dtype == "fp8" else None
    seqs = [(45, 1), (70, 1), (9, 1), (33, 1)]
    q, cache, bt, sl, qsl = make_batch(rng, seqs, h, hkv, d, cache=cache)
    ref = ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5)
    whole = AttentionConfig(block_q=4, tile=32, seg=seg)
    halves = dataclasses.replace(whole, key_halves=2)
    spec = lambda cfg, split: paged_attention_specs(4, h, hkv, d, BS, 4, split=split, max_model_len=MB * BS,  # noqa: E731
                                                    config=cfg, decode=True)[0].constexprs.get("HALVES", 1)
    assert (spec(halves, False), spec(halves, True), spec(whole, False)) == (2, 1, 1)  # the split class: its own
    split_halves = dataclasses.replace(whole, split_key_halves=2, one_key_halves=2)
    assert (spec(split_halves, True), spec(split_halves, False)) == (2, 1)
    for cfg, split in ((halves, False), (split_halves, True)):
        got = run(q, cache, bt, sl, qsl, config=cfg, decode=True, split=split)
        assert_close(got, ref, what=f"decode in key halves, split={split}")
        assert_close(got, run(q, cache, bt, sl, qsl, config=whole, decode=True, split=split),
                     what="halves vs whole tiles")
    one = run(np.ascontiguousarray(q[1:2]), cache, bt[1:2], sl[1:2], np.array([0, 1], np.int32),
              config=split_halves, decode=True, split=True)
    assert_close(one, ref[1:2], what="one sequence in key halves")
    with pytest.raises(ValueError, match="key_halves"):
        run(q, cache, bt, sl, qsl, config=dataclasses.replace(halves, tile=16), decode=True)


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8"])
def test_a_decode_tile_of_its_own_serves_every_decode_row(rng, cache_dtype):
    """AttentionConfig.decode_tile (Configs.attention sets 32 over an e4m3 cache): decode steps,
    split or not, one sequence or several, and a routed mixed batch's decode rows all take the
    decode tile and agree bit for bit; the prompt rows keep the prefill tile's bits; a mixed batch
    that would run a decode row in the prefill variant is refused."""
    h, hkv, d = 8, 2, 32
    cache = rand(rng, (NB, 2, BS, hkv, d), FP8, scale=4.0) if cache_dtype == "fp8" else None
    q, cache, bt, sl, qsl = make_batch(rng, [(45, 23), (70, 1), (9, 9), (33, 1)], h, hkv, d, cache=cache)
    ref = ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5)
    cfg = dataclasses.replace(ROUTED, tile=32, seg=64, decode_tile=16)
    tiles = [s.constexprs["TILE"] for s in paged_attention_specs(len(q), h, hkv, d, BS, 4, split=False,
                                                                    max_model_len=MB * BS, config=cfg)]
    assert tiles == [16, 32]  # the routed decode launch, the prompt rows' launch
    mixed = run(q, cache, bt, sl, qsl, out=np.full(q.shape, np.nan, np.float32), config=cfg)
    assert_close(mixed, ref, what="a mixed batch with a decode tile of its own")
    prompt_rows = np.repeat([True, False, True, False], np.diff(qsl))
    plain = run(q, cache, bt, sl, qsl, config=dataclasses.replace(cfg, decode_tile=None))
    assert same_bits(mixed[prompt_rows], plain[prompt_rows]), "the decode tile changed a prompt row"
    rows = [int(qsl[1]), int(qsl[3])]  # the two sequences of one query
    one = lambda x: np.ascontiguousarray(x)  # noqa: E731
    for split in (False, True):
        dec = run(one(q[rows]), cache, bt[[1, 3]], sl[[1, 3]], np.arange(3, dtype=np.int32), config=cfg,
                  decode=True, split=split)
        assert same_bits(dec, mixed[rows]), f"a decode step (split={split}) differs from the routed rows"
        solo = run(one(q[rows[0]:rows[0] + 1]), cache, bt[1:2], sl[1:2], np.array([0, 1], np.int32), config=cfg,
                   decode=True, split=split)
        assert same_bits(solo[0], mixed[rows[0]]), f"one sequence (split={split}) differs from the routed row"
    with pytest.raises(ValueError, match="route_mixed"):
        run(q, cache, bt, sl, qsl, config=dataclasses.replace(cfg, route_mixed=False))
    for bad, what in ((8, "power of 2"), (128, "multiple of decode_tile")):
        with pytest.raises(ValueError, match=what):
            run(one(q[rows]), cache, bt[[1, 3]], sl[[1, 3]], np.arange(3, dtype=np.int32),
                config=dataclasses.replace(cfg, decode_tile=bad), decode=True)


def test_rows_per_program_do_not_change_bits(rng):
    """Rows never mix (the row sums are P @ ones on the tensor core), so how many query
    positions a program takes is a schedule knob: prefill blocks of 4, 8 and 16 positions
    and the decode kernel give the same bits."""

    h, hkv, d = 8, 2, 32
    q, cache, bt, sl, qsl = make_batch(rng, [(45, 23), (70, 70), (9, 1)], h, hkv, d)
    base = run(q, cache, bt, sl, qsl)
    for bq in (8, 16):
        cfg = dataclasses.replace(CFG, prefill_block_q=bq)
        got = paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5, config=cfg, out=np.empty(q.shape, np.float32))
        assert same_bits(got, base), f"prefill_block_q={bq} changed the bits"
    assert_close(base, ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5), what="attention")


def test_sliding_window(rng):
    h, hkv, d, w = 4, 2, 16, 20
    q, cache, bt, sl, qsl = make_batch(rng, [(50, 12), (41, 1)], h, hkv, d)
    out = run(q, cache, bt, sl, qsl, sliding_window=w)
    ref = ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5, sliding_window=w)
    assert_close(out, ref, what="sliding window")
    dec = run(np.ascontiguousarray(q[11:12]), cache, bt[:1], sl[:1], np.array([0, 1], np.int32),
              split=True, sliding_window=w)
    assert same_bits(dec[0], out[11])


def test_merge_walks_segments_in_chunks(rng):
    """A bundle of many segments (40 here; 256 at 131,072 tokens): the merge unrolls 16 at a time
    and skips whole chunks outside a query's segments; split-KV still gives the unsplit bits,
    with a window that starts past the first chunk too."""
    h, hkv, d, mb = 4, 2, 16, 100
    cfg = AttentionConfig(block_q=4, tile=16, seg=16, prefill_block_q=4)
    sl = np.array([390, 37, 275, 256], np.int32)  # segments 0..24, 0..2, 0..17, 0..15
    cache = rand(rng, (2 * mb, 2, BS, hkv, d))
    bt = np.stack([rng.permutation(2 * mb)[:mb] for _ in sl]).astype(np.int32)
    qsl = np.arange(len(sl) + 1, dtype=np.int32)
    q = rand(rng, (len(sl), h, d))
    for window in (0, 300):  # 300: the longest query's segments start in the second chunk
        full = run(q, cache, bt, sl, qsl, config=cfg, sliding_window=window)
        ref = ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5, sliding_window=window)
        assert_close(full, ref, what=f"window {window}")
        split = run(q, cache, bt, sl, qsl, config=cfg, split=True, max_model_len=640, sliding_window=window,
                    decode=True)
        assert same_bits(split, full), f"window {window}: the chunked merge changed the bits"


def test_padded_bucket_writes_only_live_rows(rng):
    """T and S padded up to a bucket: padded tokens belong to no sequence (qsl stops at
    the live count, padded sequences are empty) and their rows are never written."""
    h, hkv, d = 4, 1, 16
    q, cache, bt, sl, qsl = make_batch(rng, [(21, 6), (8, 1)], h, hkv, d)
    live = run(q, cache, bt, sl, qsl, f32_out=False)
    t, pad_t, pad_s = q.shape[0], 5, 2
    qp = np.concatenate([q, rand(rng, (pad_t, h, d))])
    btp = np.concatenate([bt, np.zeros((pad_s, MB), np.int32)])
    slp = np.concatenate([sl, np.zeros(pad_s, np.int32)])
    qslp = np.concatenate([qsl, np.full(pad_s, qsl[-1], np.int32)])
    for split in (False, True):
        out = np.full((t + pad_t, h, d), 3.0, BF16)
        pos = np.zeros(t + pad_t, np.int32)
        pos[:t] = np.concatenate([np.arange(L - n, L) for L, n in ((21, 6), (8, 1))])
        run(qp, cache, btp, slp, qslp, out=out, split=split, positions=pos)
        assert same_bits(out[:t], live)
        assert (f32(out[t:]) == 3.0).all()


@pytest.mark.parametrize("cache_dtype,window", [(BF16, 0), (FP8, 0), (BF16, 40)], ids=["bf16", "fp8", "bf16-window"])
def test_merge_in_kernel_gives_the_merge_launch_bits(rng, cache_dtype, window):
    """A split decode merges its segments in the attention kernel (the default): the same bits
    as the attention kernel + attention_merge_kernel, f32 and bf16 out, for sequences shorter
    than a segment, ending on a segment boundary or just past one, and leaving most of the 10
    segments empty (with a window, leading ones too); padded sequences (T = S padded, as in a
    decode bucket) leave their rows untouched; the counters are all zero after the launch."""
    from kiln.codegen.triton.paged_attention_launch import paged_attention_specs

    h, hkv, d, mb, mml = 8, 2, 32, 80, 320
    cfg = AttentionConfig(block_q=4, tile=16, seg=32)  # 10 segments of 2 tiles
    lens = [1, 7, 32, 33, 100, 127, 300]
    pad = 2
    s = len(lens) + pad
    specs = paged_attention_specs(s, h, hkv, d, BS, s, split=True, max_model_len=mml, config=cfg, decode=True)
    assert [x.kernel for x in specs] == ["paged_attention_kernel"] and specs[0].constexprs["MERGE"]
    scale = 4.0 if cache_dtype == FP8 else 1.0
    cache = rand(rng, (2 * mb, 2, BS, hkv, d), cache_dtype, scale=scale)
    bt = np.stack([rng.permutation(2 * mb)[:mb] for _ in range(s)]).astype(np.int32)
    sl = np.array(lens + [0] * pad, np.int32)
    qsl = np.array(list(range(len(lens) + 1)) + [len(lens)] * pad, np.int32)
    q = rand(rng, (s, h, d))
    pos = np.array([n - 1 for n in lens] + [0] * pad, np.int32)
    for out_dtype in (np.float32, BF16):
        outs = {}
        for fuse in (True, False):
            out = np.full((s, h, d), 3.0, out_dtype)
            counter = np.zeros((s, hkv), np.int32)
            segs = mml // cfg.seg  # NaN workspaces: a read of a partial nobody stored shows
            ws = (np.full((s, segs, h, d), np.nan, np.float32), np.full((s, segs, h, 2), np.nan, np.float32))
            paged_attention(q, cache, bt, sl, qsl, out, scale=d ** -0.5, sliding_window=window, split=True,
                            max_model_len=mml, positions=pos, workspace=ws, counter=counter, config=cfg,
                            decode=True, fuse_merge=fuse)
            assert not counter.any(), "a merge counter was left nonzero"
            assert (f32(out[len(lens):]) == 3.0).all(), "a padded row was written"
            outs[fuse] = out
        assert same_bits(outs[True], outs[False]), f"{np.dtype(out_dtype).name} out: the fused merge changed the bits"
    ref = ops.paged_attention(q[:len(lens)], cache, bt[:len(lens)], sl[:len(lens)], qsl[:len(lens) + 1],
                              scale=d ** -0.5, sliding_window=window)
    assert_close(outs[True][:len(lens)], ref, what="fused split decode, bf16 out")


@pytest.mark.parametrize("h,hkv", [(24, 4), (16, 2)], ids=["gqa6", "gqa8"])  # Qwen3.6-27B's and 35B-A3B's heads
def test_head_dim_256_decode_in_column_parts(h, hkv):
    """Heads of 256 (configs.wide_head: 16-row decode programs, 4 warps, a KV head's V columns in
    DV_PARTS programs): one sequence and a split batch at 16-token blocks, every length ending in a
    partial block, against the reference; column splits of 1 to 8 parts, seg == tile (the default)
    and seg > tile, the merge in the kernel or as a launch, one sequence and a bucket read whole
    all give the prefill kernel's bits."""
    d, bs, mb = 256, 16, 32  # max_model_len 512: seg 64 == tile (8 segments, as 4,096 gives)
    rng = np.random.default_rng(25_600 + h)  # inputs of this test's own
    lens = [509, 1, 77, 300]  # 31 blocks and 13 keys; under one block; 4 + 13; 18 + 12
    nb = sum(-(-n // bs) for n in lens) + 8
    cache = rand(rng, (nb, 2, bs, hkv, d))
    perm = rng.permutation(nb)
    bt = np.zeros((len(lens), mb), np.int32)
    at = 0
    for i, n in enumerate(lens):  # each sequence on its own scattered blocks
        blocks = -(-n // bs)
        bt[i, :blocks] = perm[at:at + blocks]
        at += blocks
    sl = np.array(lens, np.int32)
    qsl = np.arange(len(lens) + 1, dtype=np.int32)
    q = rand(rng, (len(lens), h, d))
    ref = ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5)
    # prefill programs of 16 rows: the interpreter's dot model of 64 (the default: 128 rows here) would
    # exceed its tensor limit; rows per program do not change the bits (test_rows_per_program...)
    cfg = dataclasses.replace(DEFAULT.attention(h, hkv, d, mb * bs), prefill_block_q=2)
    assert (cfg.tile, cfg.seg) == (64, 64)
    prefill = run(q, cache, bt, sl, qsl, config=cfg)  # the prefill kernel: every sequence a 1-query chunk
    assert_close(prefill, ref, what="head_dim 256, prefill kernel")
    for seg, split_parts in ((64, (1, 2, 8)), (128, (1, 4))):
        c = dataclasses.replace(cfg, seg=seg)
        want = prefill if seg == 64 else run(q, cache, bt, sl, qsl, config=c)
        assert_close(want, ref, what=f"head_dim 256, seg {seg}")
        for parts in split_parts:
            pc = dataclasses.replace(c, one_dv_parts=parts, split_dv_parts=parts)
            specs = paged_attention_specs(len(lens), h, hkv, d, bs, len(lens), split=True, max_model_len=mb * bs,
                                          config=pc, decode=True)
            assert specs[0].grid[1] == hkv * parts
            for fuse in (True, False) if parts == 2 else (True,):
                got = run(q, cache, bt, sl, qsl, config=pc, decode=True, split=True, fuse_merge=fuse)
                assert same_bits(got, want), f"seg {seg}, {parts} parts, fused merge {fuse}: other bits"
        for split in (True, False):  # one sequence: its own size class (the default's parts), split or not
            one = run(np.ascontiguousarray(q[:1]), cache, bt[:1], sl[:1], np.array([0, 1], np.int32), config=c,
                      decode=True, split=split)
            assert same_bits(one[0], want[0]), f"seg {seg}: one sequence of {lens[0]} keys (split={split}), other bits"
        whole = run(q, cache, bt, sl, qsl, config=c, decode=True, split=False)  # a bucket read whole
        assert same_bits(whole, want), f"seg {seg}: the decode kernel read whole differs"
    assert_close(run(q, cache, bt, sl, qsl, f32_out=False, config=cfg, decode=True, split=True), ref,
                 what="head_dim 256, split decode, bf16 out")
    with pytest.raises(ValueError, match="dv_parts"):
        run(q, cache, bt, sl, qsl, config=dataclasses.replace(cfg, split_dv_parts=3), decode=True, split=True)


def test_head_dim_256_defaults_fill_a_short_decode():
    """The defaults at heads of 256 (configs.wide_head): 16-row decode programs, and one
    sequence at 512 keys (8 segments at max_model_len 4,096) launching 128 live programs for 2 or 4
    KV heads, where the head_dim-128 defaults launched 16-32 programs of 32 rows. Heads of 128 keep
    the defaults their schedules were tuned from."""
    from kiln.codegen.triton.paged_attention_launch import decode_dv_parts

    for h, hkv in ((24, 4), (16, 2)):
        cfg = DEFAULT.attention(h, hkv, 256, 4096)
        spec = paged_attention_specs(1, h, hkv, 256, 16, 1, split=True, max_model_len=4096, config=cfg,
                                     decode=True)[0]
        c = spec.constexprs
        assert c["BLOCK_Q"] * c["G_PAD"] == 16 and spec.num_warps == 4
        assert spec.grid[1] * (512 // c["SEG"]) == 128 and c["DV_PARTS"] == decode_dv_parts(cfg, 1, True)
        assert 256 // c["DV_PARTS"] >= 32
    assert DEFAULT.attention(32, 8, 128, 4096) == dataclasses.replace(AttentionConfig(), seg=64)


def test_dv_parts_of_a_padded_head(rng):
    """V column parts of a head padded to a power of 2 (48 -> 64 columns: the last part partly, with
    4 parts wholly, past D; a column past D written would land on the next head's): every split gives
    the one-part bits, split (merged in the kernel or by the merge launch) or one sequence read whole."""
    h, hkv, d = 6, 2, 48
    q, cache, bt, sl, qsl = make_batch(rng, [(45, 1), (70, 1), (9, 1), (33, 1)], h, hkv, d)
    ref = ops.paged_attention(q, cache, bt, sl, qsl, scale=d ** -0.5)
    base = run(q, cache, bt, sl, qsl, decode=True, split=True)
    assert_close(base, ref, what="decode, one part")
    for parts in (2, 4):
        cfg = dataclasses.replace(CFG, split_dv_parts=parts, one_dv_parts=parts)
        for fuse in (True, False):
            got = run(q, cache, bt, sl, qsl, config=cfg, decode=True, split=True, fuse_merge=fuse)
            assert same_bits(got, base), f"{parts} parts, fused merge {fuse}: other bits"
        one = run(np.ascontiguousarray(q[1:2]), cache, bt[1:2], sl[1:2], np.array([0, 1], np.int32), config=cfg,
                  decode=True, split=False)
        assert same_bits(one[0], base[1]), f"{parts} parts, one sequence read whole: other bits"
