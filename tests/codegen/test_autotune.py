"""The tuner's selection logic on CPU: a Bench whose device is a stand-in (fake addresses,
an injected timing and read-back), everything else real: candidates, the kernel wrappers'
recorded launches, lowering, the keep-the-best loop, the bits check and what is written.
The sweeps on a real GPU: tests/gpu/test_gpu_tune.py."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

from kiln.codegen.autotune import (PREFILL_TILES, DryBench, GemmTuner, Timed, Trial, _GemmRig, gemm_problems,
                                   reductions, stage2_tiles, tiles)
from kiln.codegen.autotune_attention import (AttentionRig, AttentionShape, AttentionTuner, attention_cases,
                                              attention_shapes, decode_candidates, decode_case, parse_case,
                                              prefill_candidates, class_candidates, decode_class_of)
from kiln.codegen.autotune_rows import ROW_OPS, RowTuner, candidates
from kiln.codegen.buckets import Bucket, make_buckets
from kiln.codegen.lower import Regions, lower_bucket
from kiln.codegen.triton.aot import cache_key
from kiln.codegen.triton.configs import (ATTENTION_DECODE_KNOBS, ATTENTION_PREFILL_KNOBS, DEFAULT, Configs,
                                         GemmReduction, GemmTile)
from kiln.codegen.triton.launch import cdiv
from kiln.codegen.triton.paged_attention_launch import (attention_block_q, decode_dv_parts, decode_halves,
                                                            decode_launch, paged_attention_specs)
from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import default_passes, run_pipeline
from kiln.passes.plan_memory import plan_memory
from kiln.schedules import Schedules
from tests.codegen.test_schedules import _sched
from tests.tiny_models import BASE


class FakeBench(DryBench):
    """No device and no compiler: allocations are distinct fake addresses, every kernel fits,
    a timing is `time_fn(timed)` and a read-back `bits_fn(the Timed timed last)`, repeated to
    the bytes asked for."""

    def __init__(self, time_fn: Callable[[Timed], float], bits_fn: Callable[[Timed], bytes] = lambda t: b"same"):
        super().__init__("sm_90", progress=lambda s: None)
        self.time_fn, self.bits_fn = time_fn, bits_fn
        self.last, self.timed = None, []

    def read(self, ptr, nbytes):
        bits = self.bits_fn(self.last)
        return (bits * (nbytes // len(bits) + 1))[:nbytes]

    def compile(self, specs):
        for s in specs:
            self._kernels.setdefault(cache_key(s, self.arch), object())

    def time_us(self, timed, replays=3):
        self.last = timed
        self.timed.append(timed)
        return self.time_fn(timed)


def specs_of(timed: Timed):
    return [s for s, _ in timed.reps[0]]


def tiny_graph(fuse_silu=False, fuse_rope=False, **extra):
    """fuse_silu=False, fuse_rope=False (the tuner tests' graph): silu_mul and the attention
    preamble stay launches, row ops to tune; the gate/up GEMM's SwiGLU epilogue and the q/k/v
    GEMM's preamble epilogue (True) are the default pipeline's."""
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, **extra})
    return cfg, run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16),
                             default_passes(fuse_silu=fuse_silu, fuse_rope=fuse_rope))


def lowered(graph, bucket: Bucket, buckets, max_model_len: int, configs=DEFAULT):
    from kiln.codegen.compile import plan_dims

    mb = -(-max_model_len // 16)
    plan = plan_memory(graph, plan_dims(buckets, mb))
    return lower_bucket(graph, plan, bucket, max_blocks_per_seq=mb, regions=Regions(), max_model_len=max_model_len,
                        configs=configs)


# -- the keep-the-best loop ---------------------------------------------------------------
def test_best_keeps_the_fastest_per_group_and_refuses_other_bits():
    def trial(group, cand, us, bits, baseline=False):  # two Timed of us/2 each (every timing is 1 us)
        return Trial(group, cand, lambda: [Timed([[]], weight=us / 2, output=lambda: bits)] * 2, baseline=baseline)
    bench = FakeBench(lambda timed: 1.0)
    won = bench.best([trial("a", "fast", 2.0, b"x"), trial("a", "faster but other bits", 1.0, b"y"),
                      trial("b", "only", 7.0, b"z"), trial("a", "default", 5.0, b"x", baseline=True)])
    assert won["a"].cand == "fast" and won["a"].us == 2.0 and won["a"].baseline_us == 5.0
    assert won["b"].cand == "only" and won["b"].baseline_us is None
    assert bench.mismatches == [("a", "faster but other bits")]


# -- GEMMs --------------------------------------------------------------------------------
def test_gemm_reductions_never_leave_a_split_empty():
    for k in (64, 96, 4096, 14336):
        for r in reductions(k):
            per = cdiv(cdiv(k, r.block_k), r.split_k) * r.block_k
            assert k % r.block_k == 0 and per * (r.split_k - 1) < k


def test_gemm_stage_two_keeps_the_reduction_stage_one_chose():
    _, graph = tiny_graph(hidden_size=256, intermediate_size=512, head_dim=64)  # every K splits in two
    buckets = [Bucket(1, 1, 1, True), Bucket(4, 4, 4, True), Bucket(64, 4, 4, False)]
    problems = gemm_problems(graph, buckets)

    def time_fn(timed):  # split-K 2 at BLOCK_K 64 wins stage 1; BLOCK_N 64 wins stage 2
        main = specs_of(timed)[0].constexprs
        return 10.0 - (main["SPLIT_K"] == 2 and main["BLOCK_K"] == 64) - (main["BLOCK_N"] == 64) * 0.5

    bench = FakeBench(time_fn)
    sched = GemmTuner(bench).tune(problems)
    assert {(e["n"], e["k"], e["block_k"], e["split_k"]) for e in sched.entries["gemm_reduction"]} == \
        {(p.n, p.k, 64, 2) for p in problems}
    assert {(e["n"], e["k"], e["m"]) for e in sched.entries["gemm_tile"]} == {(p.n, p.k, m) for p in problems
                                                                            for m in p.ms}
    assert {e["block_n"] for e in sched.entries["gemm_tile"]} == {64}
    stage1 = sum(len(reductions(p.k)) * len(tiles(p.ms[0])) for p in problems)
    red = GemmReduction(block_k=64, split_k=2)
    assert len(bench.timed) == stage1 + sum(len(stage2_tiles(m, p.n, p.k, red)) for p in problems for m in p.ms)
    for t in bench.timed[stage1:]:  # every tile of stage 2 reduces as stage 1 chose (its own K block or not)
        c = specs_of(t)[0].constexprs
        assert c["SPLIT_K"] == 2 and c["K_PER_SPLIT"] == cdiv(cdiv(c["K"], 64), 2) * 64 and c["BLOCK_K"] in (64, 128)


def test_gemm_stage_two_sweeps_the_k_block_above_decode_and_refuses_other_bits():
    """Above 16 rows stage 2 also times each tile with the other K block (a schedule knob:
    the same sums), where it cuts every split into whole blocks, and each tile with all of
    M's row blocks in one group where there are more than GROUP_M's 8; a candidate whose output
    differs from the weight's own K block's is refused, and a winner's block_k is written."""
    red = GemmReduction(block_k=128, split_k=1)

    def grouped(m, cands):  # and where M has more row blocks than GROUP_M (8), all of them in one group
        return cands + [dataclasses.replace(t, group_m=cdiv(m, t.block_m)) for t in cands if cdiv(m, t.block_m) > 8]

    assert stage2_tiles(16, 4096, 4096, red) == tiles(16)
    k64 = lambda m: [dataclasses.replace(t, block_k=64) for t in tiles(m)]  # noqa: E731
    assert stage2_tiles(1024, 4096, 4096, red) == grouped(1024, tiles(1024) + k64(1024))
    assert {t.group_m for t in stage2_tiles(1024, 4096, 4096, red) if t.block_m == 128} == {8}  # 8 blocks: one group
    assert stage2_tiles(2048, 4096, 4096, red) == grouped(2048, tiles(2048) + k64(2048))
    assert GemmTile(128, 256, 8, 3, group_m=16) in stage2_tiles(2048, 4096, 4096, red)  # the row blocks: 16
    assert GemmTile(64, 128, 4, 3, group_m=32) in stage2_tiles(2048, 4096, 4096, red)
    unfolded = tiles(2048) + k64(2048)  # 7,168 per split: whole 64s
    down = stage2_tiles(2048, 4096, 14336, GemmReduction(128, 2))
    assert down[:len(unfolded)] == unfolded
    # under split-K, also folded: the tiles the rule leaves unfolded whose output tiles fill the 132 SMs
    folded = [dataclasses.replace(t, fold=True) for t in unfolded
              if not DEFAULT.gemm_fold(2048, 4096, 14336, t, GemmReduction(128, 2))
              and cdiv(2048, t.block_m) * cdiv(4096, t.block_n) >= 132]
    assert down == grouped(2048, unfolded + folded)
    assert GemmTile(128, 256, 8, 3, fold=True) in down  # the 2,048-row prefill's, folded through memory
    assert GemmTile(128, 256, 8, 3, fold=True, group_m=16) in down
    assert GemmTile(128, 128, 8, 3, fold=True) not in down  # the rule folds it already (512 tiles)
    assert not any(t.fold for t in stage2_tiles(32, 4096, 14336, GemmReduction(128, 2)))  # <= 128 output tiles
    assert not any(t.group_m != 8 for t in stage2_tiles(512, 4096, 14336, GemmReduction(128, 2)))  # <= 8 blocks
    # 128 per split: no 128-wide block
    assert stage2_tiles(2048, 64, 192, GemmReduction(64, 2)) == grouped(2048, tiles(2048))
    _, graph = tiny_graph(hidden_size=256, intermediate_size=512, head_dim=64)
    problems = gemm_problems(graph, [Bucket(1, 1, 1, True), Bucket(64, 4, 4, False)])

    def time_fn(timed):  # block_k 128 reduces, and wins stage 1; at 64 rows block_k 64 is faster
        c = specs_of(timed)[0].constexprs
        return 10.0 - (c["BLOCK_K"] == 128 and c["SPLIT_K"] == 1) * (c["BLOCK_M"] <= 16) - (c["BLOCK_K"] == 64) * 0.5

    sched = GemmTuner(FakeBench(time_fn)).tune(problems)
    assert {e["block_k"] for e in sched.entries["gemm_reduction"]} == {128}
    at = {e["m"]: e for e in sched.entries["gemm_tile"]}
    assert "block_k" not in at[1] and at[64]["block_k"] == 64
    assert Configs(sched.lookup).gemm_tile(64, problems[0].n, problems[0].k).block_k == 64  # compile reads it

    def bits(timed):  # the 64-wide K block "changes the bits": never chosen, listed
        return b"other" if specs_of(timed)[0].constexprs["BLOCK_K"] == 64 else b"same"
    bench = FakeBench(time_fn, bits)
    sched = GemmTuner(bench).tune(problems)
    assert all("block_k" not in e for e in sched.entries["gemm_tile"])
    assert bench.mismatches and all(c.block_k == 64 for _, c in bench.mismatches)


def test_gemm_stage_two_writes_a_winning_group_m_and_compile_reads_it():
    """GROUP_M is a stage-2 knob where a bucket has more row blocks than the default group of 8:
    a tile that wins with all of them in one group is written with its group_m, the other
    entries without one, and Configs hands the bundle that tile."""
    _, graph = tiny_graph(hidden_size=256, intermediate_size=512, head_dim=64)
    problems = [p for p in gemm_problems(graph, make_buckets(4, 2048)) if p.n == 256 and p.k == 256]
    assert problems and problems[0].ms[-1] == 2048

    def time_fn(timed):  # 128-row tiles win; among them 16 row blocks in one group, where a candidate
        c = specs_of(timed)[0].constexprs
        return 10.0 - (c["BLOCK_M"] == 128) * 5 - (c["GROUP_M"] == 16)

    sched = GemmTuner(FakeBench(time_fn)).tune(problems)
    at = {e["m"]: e for e in sched.entries["gemm_tile"]}
    assert at[2048]["block_m"] == 128 and at[2048]["group_m"] == 16
    assert all("group_m" not in e for m, e in at.items() if m < 2048)  # at most 8 row blocks of 128
    assert Configs(sched.lookup).gemm_tile(2048, 256, 256).group_m == 16
    assert Configs(sched.lookup).gemm_tile(1024, 256, 256).group_m == 8


@pytest.mark.parametrize("objective,split", [("decode", 4), ("prefill", 1), ("balanced", 2)])
def test_gemm_reduction_follows_the_objective(objective, split):
    """Split-K buys decode programs and costs prefill partials; invariance allows one per
    weight. Decode times (M=1) 10 / 8 / 7 us for split 1 / 2 / 4, prefill (M=2048) 100 / 110 /
    200 us: decode alone takes 4, prefill alone 1, balanced 2 (slowdowns 8/7 + 1.1 against
    10/7 + 1 and 1 + 2)."""
    _, graph = tiny_graph(hidden_size=256, intermediate_size=8192, head_dim=64)
    problems = [p for p in gemm_problems(graph, make_buckets(4, 2048)) if p.k == 8192]  # down (split-K 4 from 8,192)
    assert problems and all(p.ms[0] == 1 and p.ms[-1] == 2048 for p in problems)
    decode_us, prefill_us = {1: 10.0, 2: 8.0, 4: 7.0}, {1: 100.0, 2: 110.0, 4: 200.0}

    def time_fn(timed):
        c = specs_of(timed)[0].constexprs
        if c["BLOCK_K"] != 64 or c["SPLIT_K"] not in decode_us:
            return 1e6
        rows = specs_of(timed)[0].grid[0] // cdiv(c["N"], c["BLOCK_N"]) * c["BLOCK_M"]
        return (decode_us if rows <= 16 else prefill_us)[c["SPLIT_K"]]

    bench = FakeBench(time_fn)
    sched = GemmTuner(bench).tune(problems, objective=objective)
    (entry,) = sched.entries["gemm_reduction"]
    assert (entry["block_k"], entry["split_k"]) == (64, split)
    assert entry["us"] == decode_us[split]
    assert entry.get("prefill_us") == (None if objective == "decode" else prefill_us[split])
    # stage 1 timed the largest M (on the prefill tiles) only when the objective needs it;
    # every stage-2 timing then reduces as stage 1 chose
    stage1 = len(reductions(8192)) * (len(tiles(1)) + (objective != "decode") * len(PREFILL_TILES))
    assert all(specs_of(t)[0].constexprs["SPLIT_K"] == split for t in bench.timed[stage1:])
    red = GemmReduction(block_k=64, split_k=split)
    assert len(bench.timed) == stage1 + sum(len(stage2_tiles(m, problems[0].n, 8192, red)) for m in problems[0].ms)


def test_gemm_objective_keep_re_tunes_only_the_tiles_under_the_known_reductions():
    _, graph = tiny_graph(hidden_size=256, intermediate_size=512, head_dim=64)
    problems = gemm_problems(graph, [Bucket(1, 1, 1, True), Bucket(64, 4, 4, False)])
    keep = GemmReduction(block_k=128, split_k=1)
    first = problems[0]
    bench = FakeBench(lambda timed: 1.0)
    sched = GemmTuner(bench).tune(problems, objective="keep",
                                  known=lambda n, k: keep if (n, k) == (first.n, first.k) else None)
    # the known weight is not timed in stage 1 and keeps its (unwritten) entry; the others are tuned
    assert {(e["n"], e["k"]) for e in sched.entries["gemm_reduction"]} == \
        {(p.n, p.k) for p in problems} - {(first.n, first.k)}
    stage2 = [t for t in bench.timed if specs_of(t)[0].constexprs["N"] == first.n
              and specs_of(t)[0].constexprs["K"] == first.k]
    assert len(stage2) == sum(len(stage2_tiles(m, p.n, p.k, keep)) for p in problems if (p.n, p.k) == (first.n, first.k)
                              for m in p.ms)
    assert all(specs_of(t)[0].constexprs["SPLIT_K"] == 1 for t in stage2)


def loop(spec) -> tuple:
    """A GEMM spec's weight, tile and K loop (what its epilogue leaves alone)."""
    keys = ("N", "K", "K_PER_SPLIT", "SPLIT_K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "TMA", "GROUP_M")
    return tuple(spec.constexprs[k] for k in keys) + (spec.num_warps, spec.num_stages)


def test_the_gemm_rig_times_the_kernels_a_bundle_runs():
    # gate/up with its SwiGLU epilogue, q/k/v with the attention preamble in its epilogue
    _, graph = tiny_graph(fuse_silu=True, fuse_rope=True, hidden_size=256, intermediate_size=512)
    buckets = make_buckets(4, 64)
    bundle = {cache_key(s, "sm_90"): s for b in buckets for s, _ in lowered(graph, b, buckets, 128)
              if s.kernel.startswith("gemm")}
    bench = FakeBench(lambda t: 1.0)
    rig = {}
    for p in gemm_problems(graph, buckets):
        r = _GemmRig(bench, p)
        for b in buckets:
            m = b.logits if p.out_dtype == "f32" else b.tokens
            red, tile = DEFAULT.gemm_reduction(p.n, p.k), DEFAULT.gemm_tile(m, p.n, p.k)
            rig |= {cache_key(s, "sm_90"): s for s in specs_of(r.timed(m, tile, red))}
    rig_keys = set(rig)
    # every GEMM kernel of the bundle, integer hints included; but the last layer's down is a plain
    # linear (its sum is gathered before the final norm), timed as the other layers' residual-epilogue
    # twin: the same tile and main loop plus one load; and q/k/v, with the attention preamble in its
    # epilogue (gemm_rope_kernel), is timed as the plain GEMM of its weight and tile: the same K loop
    rope = {loop(s) for s in bundle.values() if s.kernel == "gemm_rope_kernel"}
    assert rope and all(key in bundle or loop(s) in rope for key, s in rig.items())
    for key in set(bundle) - rig_keys:
        spec = bundle[key]
        if spec.kernel == "gemm_rope_kernel":
            assert loop(spec) in {loop(s) for s in rig.values()}, spec
            continue
        twin = dataclasses.replace(spec, constexprs={**spec.constexprs, "HAS_RES": True})
        assert not spec.constexprs.get("HAS_RES") and cache_key(twin, "sm_90") in rig_keys, spec


def test_the_gemm_rig_leaves_split_k_partials_to_the_norm_at_decode_rows():
    """A split-K linear_add (o_proj, down) whose partials add_rms_norm sums: at up to 16 rows the
    rig times the GEMM kernel the bundle launches and no reduce launch (the bundle has none);
    above, the reduce launch stands in for the partials' bytes through the norm. A plain linear's
    reduce is timed at every M."""
    _, graph = tiny_graph(fuse_silu=True, fuse_rope=True, hidden_size=256, intermediate_size=512)
    buckets = make_buckets(4, 64)
    problems = gemm_problems(graph, buckets)
    res = [p for p in problems if p.residual]
    assert res
    split = {(p.n, p.k) for p in res}
    red = GemmReduction(block_k=32, split_k=2)  # o_proj's K is 64 here
    configs = Configs(lookup=lambda op, key: dataclasses.asdict(red) if op == "gemm_reduction" and key in split
                      else None)
    decode = next(b for b in buckets if b.decode and b.tokens == 1)
    bundle = {cache_key(s, "sm_90"): s for s, _ in lowered(graph, decode, buckets, 128, configs)}
    bench = FakeBench(lambda t: 1.0)
    for p in res:
        r = _GemmRig(bench, p)
        at = {m: specs_of(r.timed(m, configs.gemm_tile(m, p.n, p.k), red)) for m in (1, 64)}
        assert [s.kernel for s in at[1]] == ["gemm_kernel"]
        assert cache_key(at[1][0], "sm_90") in bundle  # the kernel the decode plan launches
        assert [s.kernel for s in at[64]] == ["gemm_kernel", "gemm_reduce_kernel"]
        plain = _GemmRig(bench, dataclasses.replace(p, residual=False))
        assert [s.kernel for s in specs_of(plain.timed(1, configs.gemm_tile(1, p.n, p.k), red))] == \
            ["gemm_kernel", "gemm_reduce_kernel"]


# -- paged attention ----------------------------------------------------------------------
SHAPES = [(32, 8, 128), (4, 2, 16), (64, 8, 128), (16, 16, 64), (24, 4, 256), (16, 2, 256)]


@pytest.mark.parametrize("h,hkv,d", SHAPES)
@pytest.mark.parametrize("max_model_len", [128, 4096, 131072])
def test_attention_candidates_touch_only_schedule_knobs(h, hkv, d, max_model_len):
    shape = AttentionShape(h, hkv, d, 16, max_model_len)
    default = DEFAULT.attention(h, hkv, d, max_model_len)
    for cands, knobs in ((decode_candidates(shape, default), ATTENTION_DECODE_KNOBS),
                         (prefill_candidates(shape, default), ATTENTION_PREFILL_KNOBS)):
        assert cands[0] == default and len(cands) > 4
        for c in cands:  # tile and seg (the reduction knobs) and the other phase's knobs stay the default's
            assert {f for f, v in dataclasses.asdict(c).items() if v != getattr(default, f)} <= set(knobs)
            assert (c.tile, c.seg) == (default.tile, default.seg)
        decode = knobs is ATTENTION_DECODE_KNOBS
        effective = {(attention_block_q(h, hkv, c, decode),) + tuple(getattr(c, k) for k in knobs[1:]) for c in cands}
        assert len(effective) == len(cands)  # no schedule timed twice


def test_an_e4m3_cache_sweeps_its_decode_tile_whole():
    """Over an e4m3 cache the decode tile is 32 keys (Configs.attention), and 16-key halves of it changed
    the bits on the H200, so no decode or class candidate splits it; a bf16 cache's 64-key tiles do."""
    e4m3 = AttentionShape(32, 8, 128, 16, 4096, cache_dtype="float8_e4m3fn")
    default = DEFAULT.attention(32, 8, 128, 4096, "float8_e4m3fn")
    assert default.tile_of_decode == 32
    cands = decode_candidates(e4m3, default) + class_candidates(e4m3, default, "split") + \
        class_candidates(e4m3, default, "one")
    assert {c.num_warps for c in cands} == {1, 2, 4}
    assert all(decode_halves(c, n, split) == 1 for c in cands for n, split in ((512, False), (32, True), (1, True)))
    bf16 = AttentionShape(32, 8, 128, 16, 4096)
    assert any(c.key_halves == 2 for c in decode_candidates(bf16, DEFAULT.attention(32, 8, 128, 4096)))


@pytest.mark.parametrize("heads", [(32, 8, 128), (24, 4, 256)], ids=["d128", "d256"])
@pytest.mark.parametrize("cls", ["split", "one"])
def test_decode_class_candidates_touch_only_their_class_knobs(cls, heads):
    """Each class's own knobs only, each schedule once; at heads of 256 the V column parts too (1-8), on
    2-8 warps (ptxas: 1 warp spills there)."""
    shape = AttentionShape(*heads, 16, 4096)
    default = DEFAULT.attention(*heads, 4096)
    cands = class_candidates(shape, default, cls)
    assert cands[0] == default and len(cands) > 4
    seqs, split = (1, True) if cls == "one" else (32, True)
    launches = [decode_launch(c, seqs, split) + (decode_halves(c, seqs, split), decode_dv_parts(c, seqs, split))
                for c in cands]
    assert len(set(launches)) == len(cands)  # no schedule timed twice
    assert {h for *_, h, _ in launches} == {1, 2}  # whole tiles and key halves
    assert {p for *_, p in launches} == ({1, 2, 4, 8} if heads[2] == 256 else {1})
    assert {w for w, *_ in launches} == ({2, 4, 8} if heads[2] == 256 else {1, 2, 4})
    for c in cands:
        assert {f for f, v in dataclasses.asdict(c).items() if v != getattr(default, f)} <= {
            f"{cls}_num_warps", f"{cls}_num_stages", f"{cls}_maxnreg", f"{cls}_key_halves", f"{cls}_dv_parts"}
        # the other classes launch as the default does
        assert decode_launch(c, 256, False) == decode_launch(default, 256, False)
        assert decode_halves(c, 256, False) == 1
        other = (32, True) if cls == "one" else (1, True)
        assert decode_launch(c, *other) == decode_launch(default, *other)


def test_e4m3_prefill_candidates_keep_the_defaults_instruction():
    """Over an e4m3 cache, 32-row prefill programs (mma.sync) give other bits than the default's
    64 (wgmma): the H200 tuner refused them as a kernel bug. The sweep leaves them out there, and
    only there."""
    rows = lambda sh, c: attention_block_q(sh.h, sh.hkv, c, False) * 4  # noqa: E731 (GQA group of 4)
    bf16 = AttentionShape(32, 8, 128, 16, 4096)
    e4m3 = dataclasses.replace(bf16, cache_dtype="float8_e4m3fn")
    default = DEFAULT.attention(32, 8, 128, 4096, "float8_e4m3fn")
    assert rows(e4m3, default) == 64
    assert min(rows(bf16, c) for c in prefill_candidates(bf16, default)) == 32
    kept = prefill_candidates(e4m3, default)
    assert kept[0] == default and len(kept) > 4 and min(rows(e4m3, c) for c in kept) == 64
    assert max(rows(e4m3, c) for c in kept) == 128


def test_attention_cases_follow_the_bundle():
    """One decode case per size class the bundle has: read whole, split, one sequence."""
    decode, prefill, mixed = attention_cases(make_buckets(256, 2048), 131072)
    assert [(c.name, c.tokens, c.seqs, c.split) for c in decode] == [("decode256@1500", 256, 256, False),
                                                                    ("decode32@1500", 32, 32, True),
                                                                    ("decode1@512", 1, 1, True)]
    assert [decode_class_of(c) for c in decode] == ["decode", "split", "one"]
    assert (prefill.lens, prefill.tokens, prefill.seqs, prefill.decode) == ((2048,), 2048, 256, False)
    # the largest mixed bucket (2,048 tokens, 256 sequences) full: 255 decode rows and a chunk
    assert (mixed.name, mixed.tokens, mixed.seqs, mixed.decode) == ("mixed255@1500+1793", 2048, 256, False)
    assert parse_case(mixed.name) == mixed
    decode, prefill, mixed = attention_cases(make_buckets(8, 512), 1024)  # a small bundle: its own limits
    assert [(c.lens[0], c.seqs, decode_class_of(c)) for c in decode] == [(1024, 8, "split"), (512, 1, "one")]
    assert prefill.lens == (512,) and (mixed.name, mixed.tokens, mixed.seqs) == ("mixed7@1024+505", 512, 8)
    decode, _, mixed = attention_cases(make_buckets(1, 512), 1024)  # batch 1 only
    assert [(c.lens[0], c.seqs) for c in decode] == [(1024, 1)] and mixed is None
    assert parse_case("decode4") == decode_case(4, 1500) and parse_case("prefill300").tokens == 300
    mixed = parse_case("mixed4@100+32")  # 4 decoding sequences and a 32-token first prompt chunk
    assert (mixed.lens, mixed.counts, mixed.tokens, mixed.seqs, mixed.decode, mixed.split) == (
        (100, 100, 100, 100, 32), (1, 1, 1, 1, 32), 36, 5, False, False)
    assert parse_case("mixed8").lens == (1500,) * 8 and parse_case("mixed8").tokens == 8
    with pytest.raises(ValueError, match="mixed<S>"):
        parse_case("chunk8")
    shuffled, longest = parse_case("decode8@1000-2000"), parse_case("decode8@1000-2000v")  # spread lengths
    assert longest.lens == (2000, 1857, 1714, 1571, 1429, 1286, 1143, 1000)
    assert sorted(shuffled.lens) == sorted(longest.lens) and shuffled.lens != longest.lens
    assert shuffled == parse_case("decode8@1000-2000") and shuffled.decode and shuffled.counts == (1,) * 8


def _attention_time(timed, routed_us=0.0):
    """Decode read whole: 4 warps and 3 stages are fastest, then fewer rows; split decode: 2 warps,
    4 stages, a cap of 128 registers; one sequence: 4 warps, 2 stages, no cap; prefill: a cap of
    168 registers, then 32 positions, then fewer stages. A routed launch (a mixed bucket's two)
    adds routed_us."""
    us = 0.0
    for s in specs_of(timed):
        c = s.constexprs
        us += routed_us * c.get("ROUTE", False)
        if s.kernel == "paged_attention_kernel" and c["DECODE"] and s.grid[0] == 1:
            us += 10 - (s.num_warps == 4) - (s.num_stages == 2) - (s.maxnreg is None)
        elif s.kernel == "paged_attention_kernel" and c["DECODE"] and c["SPLIT"]:
            us += 10 - (s.num_warps == 2) - (s.num_stages == 4) - (s.maxnreg == 128)
        elif s.kernel == "paged_attention_kernel" and c["DECODE"]:
            us += 10 - (s.num_warps == 4) - (s.num_stages == 3) + c["BLOCK_Q"] / 100
        elif s.kernel == "paged_attention_kernel":
            us += 10 - (c["BLOCK_Q"] == 32) - 2 * (s.maxnreg == 168) + s.num_stages / 100
        else:
            us += 1
    return us


def test_attention_tuner_picks_the_fastest_schedule_and_writes_only_its_knobs():
    cfg, graph = tiny_graph()
    buckets = make_buckets(128, 256)  # the largest decode bucket runs unsplit, batch 1 split
    shapes = attention_shapes(graph, 16, 512)
    assert shapes == [AttentionShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 16, 512)]
    decode, prefill, mixed = attention_cases(buckets, 512, keys=(300, 100), prompt=200)
    bench = FakeBench(_attention_time)
    sched = AttentionTuner(bench).tune(shapes, decode, prefill, mixed)
    (entry,) = sched.entries["paged_attention"]
    bq0 = attention_block_q(4, 2, dataclasses.replace(DEFAULT.attention(4, 2, 16, 512), block_q=1), decode=True)
    assert entry.pop("us") > 0 and entry.pop("prefill_us") > 0
    assert entry.pop("mixed_us") > 0  # routing lost (two launches of the prefill kernel's time): not written
    assert entry.pop("split_us") > 0 and entry.pop("one_us") > 0
    assert entry == {"h": 4, "hkv": 2, "d": 16, "block_q": bq0, "num_warps": 4, "num_stages": 3,
                     "split_num_warps": 2, "split_num_stages": 4, "split_maxnreg": 128,
                     "one_num_warps": 4, "one_num_stages": 2,
                     "prefill_block_q": 16, "prefill_num_warps": 4, "prefill_num_stages": 1, "prefill_maxnreg": 168}
    # each decode class was timed at its own case, split as the plan splits it
    seen = {(s.constexprs["DECODE"], s.constexprs["SPLIT"], s.grid[0]) for t in bench.timed for s in specs_of(t)
            if s.kernel == "paged_attention_kernel"}
    assert {(True, False, 128), (True, True, 32), (True, True, 1)} <= seen and {x for x in seen if not x[0]}
    # the winner, read back through Configs, launches each class as timed
    got = Configs(lookup=sched.lookup).attention(4, 2, 16, 512)
    assert decode_launch(got, 128, False) == (4, 3, None)
    assert decode_launch(got, 32, True) == (2, 4, 128) and decode_launch(got, 1, True) == (4, 2, None)
    (pre,) = paged_attention_specs(300, 4, 2, 16, 16, 2, split=False, max_model_len=512, config=got)
    assert (pre.constexprs["BLOCK_Q"], pre.num_warps, pre.num_stages, pre.maxnreg) == (16, 4, 1, 168)
    assert not bench.mismatches


def test_the_attention_tuner_routes_mixed_buckets_where_that_is_faster():
    """Round 3: the winners' knobs with and without route_mixed at a full mixed step and the prompt
    alone. Where the routed launches are faster, route_mixed is written, and a bundle's mixed plan
    then launches the decode variant for its decode rows; the bits of the two may differ (an e4m3
    cache), so a routed candidate whose outputs differ still wins."""
    _, graph = tiny_graph()
    decode, prefill, mixed = attention_cases(make_buckets(8, 256), 512, keys=(300, 100), prompt=200)
    bench = FakeBench(lambda t: _attention_time(t, routed_us=-6.0),
                      bits_fn=lambda t: b"routed" if specs_of(t)[0].constexprs.get("ROUTE") else b"plain")
    sched = AttentionTuner(bench).tune(attention_shapes(graph, 16, 512), decode, prefill, mixed)
    (entry,) = sched.entries["paged_attention"]
    assert entry["route_mixed"] is True and entry["mixed_us"] > 0 and not bench.mismatches
    got = Configs(lookup=sched.lookup).attention(4, 2, 16, 512)
    assert got.route_mixed and got.prefill_maxnreg == 168  # with the other winners' knobs
    kinds = [(s.constexprs["DECODE"], s.constexprs.get("ROUTE")) for s, _ in lowered(graph, Bucket(256, 8, 8, False),
             make_buckets(8, 256), 512, configs=Configs(lookup=sched.lookup)) if s.kernel == "paged_attention_kernel"]
    assert kinds == [(True, True), (False, True)] * 2  # two layers
    timed_mixed = [t for t in bench.timed if any(s.grid[0] == mixed.seqs and s.constexprs.get("ROUTE")
                                                 for s in specs_of(t))]
    assert timed_mixed  # the routed decode launch ran over the mixed case's sequence slots


def test_an_attention_schedule_that_changes_the_bits_is_reported_not_chosen():
    _, graph = tiny_graph()
    decode, prefill, _ = attention_cases(make_buckets(8, 256), 512, keys=(300, 100), prompt=200)
    def bits(timed):  # a decode kernel that computes something else with 4 warps
        main = specs_of(timed)[0]
        return b"bug" if main.constexprs["DECODE"] and main.num_warps == 4 else b"ok"
    bench = FakeBench(_attention_time, bits_fn=bits)
    sched = AttentionTuner(bench).tune(attention_shapes(graph, 16, 512), decode, prefill)
    (entry,) = sched.entries["paged_attention"]
    assert entry["split_num_warps"] == 2 and entry["prefill_maxnreg"] == 168  # the fastest with the default's bits
    assert "one_num_warps" not in entry  # one sequence: every 4-warp schedule differed, the default won
    assert bench.mismatches and {(g[-1], c.one_num_warps or c.split_num_warps)
                                 for g, c in bench.mismatches} == {("split", 4), ("one", 4)}


@pytest.mark.parametrize("kv", [None, DType.fp8e4m3])
def test_the_attention_rig_times_the_kernels_a_bundle_runs(kv):
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2})
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16, kv_cache_dtype=kv))
    buckets = make_buckets(8, 256)
    decode, prefill, _ = attention_cases(buckets, 512, keys=(300, 100), prompt=200)
    bench = FakeBench(lambda t: 1.0)
    (shape,) = attention_shapes(graph, 16, 512)
    assert shape.cache_dtype == ("float8_e4m3fn" if kv else "bfloat16")
    default = DEFAULT.attention(shape.h, shape.hkv, shape.d, 512, shape.cache_dtype)  # the cache's own (decode tile)
    for case, bucket in ((decode[0], Bucket(8, 8, 8, True)), (decode[1], Bucket(1, 1, 1, True)),
                         (prefill, Bucket(256, 8, 8, False))):
        rig = AttentionRig(bench, shape, case)
        got = [(cache_key(s, "sm_90"), s.grid) for s in specs_of(rig.timed(default))]
        plan = [(cache_key(s, "sm_90"), s.grid) for s, _ in lowered(graph, bucket, buckets, 512)
                if s.kernel in ("paged_attention_kernel", "attention_merge_kernel")]
        assert got == plan[:len(got)], case.name  # spec, hints and grid of the layer's launches
        if case.split:  # a split decode merges in the attention kernel, as the plan does: one launch
            (main,) = specs_of(rig.timed(default))
            assert main.constexprs["MERGE"] and rig.counter is not None, case.name


# -- row and elementwise kernels ----------------------------------------------------------
@pytest.mark.parametrize("op", sorted(ROW_OPS))
@pytest.mark.parametrize("width", [64, 128, 4096, 14336])
def test_row_candidates_touch_only_their_knobs(op, width):
    cands = candidates(op, width)
    elementwise = ROW_OPS[op].elementwise
    default = DEFAULT.elementwise(op, width) if elementwise else DEFAULT.row(op, width)
    assert cands[0] == dataclasses.asdict(default) and len(cands) > 1
    assert all(c.keys() == ({"block", "num_warps"} if elementwise else {"num_warps"}) for c in cands)
    assert len({tuple(c.items()) for c in cands}) == len(cands)
    for c in cands:  # each is a config Configs accepts for that op
        configs = Configs(lookup=lambda o, k, c=c: c if (o, k) == (op, (width,)) else None)
        got = configs.elementwise(op, width) if elementwise else configs.row(op, width)
        assert dataclasses.asdict(got) == c


@pytest.mark.parametrize("extra", [{}, {"architectures": ["Qwen3ForCausalLM"]}])
def test_row_ops_name_the_kernels_their_configs_reach(extra):
    """ROW_OPS says which kernel a Configs op configures: overriding the op changes those
    launches and no others (the lowering is the oracle). The graph keeps its silu_mul launches
    (fuse_silu=False): the default pipeline moves them into the gate/up GEMM's epilogue."""
    _, graph = tiny_graph(fuse_silu=False, **extra)
    buckets = make_buckets(4, 64)
    base = lowered(graph, buckets[-1], buckets, 128)
    for op, ro in ROW_OPS.items():
        widths = {ro.width(s.constexprs) for s, _ in base if s.kernel == ro.kernel}
        assert widths, f"no {ro.kernel} launch in the plan"
        new = {"block": 32, "num_warps": 16} if ro.elementwise else {"num_warps": 16}
        configs = Configs(lookup=lambda o, k, op=op, widths=widths, new=new: new if o == op and k[0] in widths else None)
        changed = {s.kernel for (s, _), (t, _) in zip(base, lowered(graph, buckets[-1], buckets, 128, configs))
                   if s != t}
        assert changed == {ro.kernel}, op


def _rows_bench(bits_fn=lambda t: b"same"):
    def time_fn(timed):  # 16 warps win the 1-row bucket, 8 warps the sum over the buckets
        (spec, _), = timed.reps[0]
        if spec.grid[0] == 1:
            return {16: 0.1, 8: 0.5}.get(spec.num_warps, 1.0)
        return {8: 0.5}.get(spec.num_warps, 1.0)
    return FakeBench(time_fn, bits_fn)


def test_row_tuner_chooses_once_per_op_and_width_over_the_buckets():
    cfg, graph = tiny_graph(fuse_silu=False)  # with silu_mul launches to tune
    buckets = make_buckets(256, 2048)
    bench = _rows_bench()
    tuner = RowTuner(bench, graph, buckets, lookup=None, max_model_len=512, block_size=16)
    assert [b.name for b in tuner.buckets] == ["d1x1", "d256x256", "m2048x256"]
    sched = tuner.tune()
    widths = {"rms_norm": cfg.hidden_size, "attention_preamble": cfg.num_attention_heads * cfg.head_dim,
              "silu_mul": cfg.intermediate_size, "gather_rows": cfg.hidden_size}
    assert {op: [e["width"] for e in v] for op, v in sched.entries.items()} == {op: [w] for op, w in widths.items()}
    for op, (e,) in sched.entries.items():
        assert e["num_warps"] == 8 and set(e) == {"width", "num_warps", "us"} | ({"block"} if ROW_OPS[op].elementwise
                                                                                else set())
    assert not bench.mismatches
    # each timed launch is weighted by how often a step of its bucket runs it
    launches = sum(s.kernel == "rms_norm_kernel" for b in tuner.buckets for s, _ in lowered(graph, b, buckets, 512))
    default = DEFAULT.row("rms_norm", cfg.hidden_size).num_warps
    assert sum(t.weight for t in bench.timed if specs_of(t)[0].kernel == "rms_norm_kernel"
               and specs_of(t)[0].num_warps == default) == launches
    # the launches point into the device memory the rig allocated, not into the plan's regions
    for t in bench.timed:
        (spec, args), = t.reps[0]
        assert all(a >= 1 << 36 for a, ty in zip(args, spec.signature.values()) if ty.startswith("*"))


@pytest.mark.parametrize("arch,checked", [("LlamaForCausalLM", {"silu_mul", "gather_rows", "attention_preamble"}),
                                          ("Qwen3ForCausalLM", {"silu_mul", "gather_rows"})])  # q/k norm
def test_row_bits_are_checked_where_the_knob_is_a_schedule_knob_only(arch, checked):
    _, graph = tiny_graph(fuse_silu=False, architectures=[arch])  # with silu_mul launches

    def bits(timed):  # every kernel gives other bits with other warps
        return str(specs_of(timed)[0].num_warps).encode()
    bench = _rows_bench(bits)
    sched = RowTuner(bench, graph, make_buckets(256, 2048), lookup=None, max_model_len=512, block_size=16).tune()
    # a norm's warps order its sum, so other bits are expected (the choice holds for every
    # bucket); the elementwise kernels, and the preamble without q/k norm, must keep the default's
    assert {g[0] for g, _ in bench.mismatches} == checked
    assert {op: e[0]["num_warps"] for op, e in sched.entries.items()} == {op: 4 if op in checked else 8
                                                                          for op in ROW_OPS}


def test_row_tuner_times_the_fused_split_k_variants_the_gemm_schedules_make():
    cfg, graph = tiny_graph()
    hidden, attn = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    sched = Schedules("sm_90", {"gemm_reduction": [{"n": hidden, "k": attn, "block_k": 32, "split_k": 2}]})
    bench = _rows_bench()
    RowTuner(bench, graph, make_buckets(4, 64), lookup=sched.lookup, max_model_len=128, block_size=16).tune()
    splits = {specs_of(t)[0].constexprs["X_SPLIT"] for t in bench.timed if specs_of(t)[0].kernel == "rms_norm_kernel"}
    assert splits == {0, 2}  # o_proj's partials summed by the next add_rms_norm, as in the plan


@pytest.mark.parametrize("kernels", ["gemm,foo", ""])
def test_tune_refuses_unknown_kernel_families(kernels, capsys):
    from kiln.build import main

    assert main(["tune", "--kernels", kernels]) == 1
    assert "--kernels takes a comma-separated list of gemm, attention, rows" in capsys.readouterr().err


@pytest.mark.parametrize("buggy", [False, True])
def test_tune_writes_the_families_asked_for_and_leaves_the_others(buggy, tmp_path, monkeypatch, capsys):
    """build.py tune end to end with a stand-in device: --kernels attention,rows writes those two
    files, keeps gemm.yaml as it was, and exits 1 when a schedule knob changed the bits."""
    import json

    from kiln.codegen import autotune
    from kiln.runtime.worker import cuda_driver
    from kiln.build import main

    class Ctx:
        arch = 90

    def bits(timed):  # buggy: gather_rows gives other bits with 8 warps (the default pipeline leaves
        spec = specs_of(timed)[0]  # no silu_mul launch: it is the gate/up GEMM's epilogue)
        return b"bug" if buggy and spec.kernel == "gather_rows_kernel" and spec.num_warps == 8 else b"ok"
    monkeypatch.setattr(cuda_driver, "CudaContext", Ctx)
    monkeypatch.setattr(autotune, "Bench", lambda ctx, arch, progress: FakeBench(
        lambda t: sum(s.num_warps for s in specs_of(t)) + len(t.reps), bits))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**BASE, "architectures": ["LlamaForCausalLM"]}))
    _sched().write("gemm", tmp_path / "schedules")
    gemm = (tmp_path / "schedules" / "sm_90" / "gemm.yaml").read_text()
    rc = main(["tune", "--model", str(tmp_path / "model"), "--kernels", "rows,attention", "--out",
               str(tmp_path / "schedules"), "--max-num-seqs", "8", "--max-num-batched-tokens", "64"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert rc == (1 if buggy else 0)
    assert len(errors) == buggy and all("changed the bits" in e and "gather_rows" in e for e in errors)
    folder = tmp_path / "schedules" / "sm_90"
    assert sorted(f.name for f in folder.iterdir()) == ["attention.yaml", "gemm.yaml", "rows.yaml"]
    assert (folder / "gemm.yaml").read_text() == gemm
    sched = Schedules.read("sm_90", tmp_path / "schedules")
    # the default pipeline leaves no silu_mul (the gate/up GEMM's epilogue) and, for Llama, no
    # attention_preamble launch (the q/k/v GEMM's epilogue) to tune
    assert set(sched.entries) == {"gemm_reduction", "gemm_tile", "paged_attention", *ROW_OPS} - {"silu_mul",
                                                                                                "attention_preamble"}
    assert all(e["num_warps"] == 4 for e in sched.entries["gather_rows"])  # the fewest warps, or the default's bits


def test_compile_only_compiles_every_candidate_and_needs_no_gpu(tmp_path, monkeypatch, capsys):
    """--compile-only: the sweeps run on a DryBench, which hands every candidate's kernels to
    the AOT compiler (here a stand-in) and writes no schedule."""
    import json

    from kiln.build import main
    from kiln.codegen import autotune
    from kiln.codegen.triton.aot import Compiled
    from kiln.runtime.worker import cuda_driver

    asked = set()

    def compile_specs(jobs, workers=None):
        asked.update(s.kernel for s, _ in jobs)
        return [Compiled(b"", s.kernel, 0, s.num_warps, 2, 0, "sm_90a") for s, _ in jobs]

    def no_gpu():
        raise AssertionError("--compile-only opened a CUDA context")
    monkeypatch.setattr(autotune, "compile_specs", compile_specs)
    monkeypatch.setattr(cuda_driver, "CudaContext", no_gpu)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**BASE, "architectures": ["LlamaForCausalLM"]}))
    assert main(["tune", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "schedules"), "--compile-only",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]) == 0
    assert not (tmp_path / "schedules").exists()
    # no silu_mul (the gate/up GEMM's epilogue), no attention_preamble (Llama's is the q/k/v GEMM's
    # epilogue, timed as its plain GEMM) and no attention_merge (split decode merges in the
    # attention kernel; prefill does not split), and no gemm_reduce_kernel: the one weight whose
    # K splits is down, timed split at its decode rows only, where add_rms_norm sums the partials
    assert asked == {"gemm_kernel", "paged_attention_kernel", "rms_norm_kernel", "gather_rows_kernel"}
    assert "nothing timed, nothing written" in capsys.readouterr().err


def test_tune_times_attention_and_the_preamble_over_the_cache_dtype_asked_for(tmp_path, monkeypatch):
    import json

    from kiln.build import main
    from kiln.codegen import autotune
    from kiln.runtime.worker import cuda_driver

    class Ctx:
        arch = 90
    benches = []
    monkeypatch.setattr(cuda_driver, "CudaContext", Ctx)
    monkeypatch.setattr(autotune, "Bench", lambda ctx, arch, progress: benches.append(FakeBench(lambda t: 1.0))
                        or benches[-1])
    (tmp_path / "model").mkdir()  # Qwen3: its q/k norm keeps the attention preamble a launch of its own
    (tmp_path / "model" / "config.json").write_text(json.dumps({**BASE, "architectures": ["Qwen3ForCausalLM"]}))
    assert main(["tune", "--model", str(tmp_path / "model"), "--kernels", "attention,rows", "--kv-cache-dtype", "fp8",
                 "--out", str(tmp_path / "schedules"), "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]) == 0
    caches = {s.kernel: s.signature["cache_ptr"] for t in benches[0].timed for s in specs_of(t)
              if "cache_ptr" in s.signature}
    assert caches == {"paged_attention_kernel": "*fp8e4nv", "attention_preamble_kernel": "*fp8e4nv"}
    # the e4m3 cache's entry is its own (configs.Configs.attention): it says so, and bf16 lookups skip it
    sched = Schedules.read("sm_90", tmp_path / "schedules")
    (entry,) = sched.entries["paged_attention"]
    assert entry["cache"] == "float8_e4m3fn"
    h, hkv, d = BASE["num_attention_heads"], BASE["num_key_value_heads"], entry["d"]
    assert sched.lookup("paged_attention", (h, hkv, d, "float8_e4m3fn", 512)) is not None
    assert sched.lookup("paged_attention", (h, hkv, d, None, 512)) is None


def test_plus_residual_is_the_epilogue_add():
    """The GEMM rig compares a split-K linear_add candidate that does not fold (y, the norm adds
    the residual) with one that folds (y + residual from the epilogue) as _plus_residual(y): the
    interpreter's GEMM with the residual in its epilogue must give those bytes exactly."""
    from kiln.codegen.autotune import _plus_residual
    from kiln.codegen.triton import gemm as k_gemm

    rng = np.random.default_rng()
    m, n, k = 32, 64, 256
    x, w = (rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in ((m, k), (n, k)))
    res = rng.standard_normal((m, n)).astype(ml_dtypes.bfloat16)
    red = GemmReduction(block_k=64, split_k=2)
    tile = GemmTile(block_m=16, block_n=32, num_warps=4, num_stages=2)
    fused = k_gemm.gemm(x, w, tile=dataclasses.replace(tile, fold=True), red=red, residual=res.copy())
    plain = k_gemm.gemm(x, w, tile=dataclasses.replace(tile, fold=False), red=red)
    assert not np.array_equal(fused, plain)
    assert _plus_residual(plain.tobytes(), res.tobytes(), plain.dtype) == fused.tobytes()
