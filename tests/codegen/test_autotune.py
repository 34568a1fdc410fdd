"""The tuner's selection logic on CPU: a Bench whose device is a stand-in (fake addresses,
an injected timing and read-back), everything else real: candidates, the kernel wrappers'
recorded launches, lowering, the keep-the-best loop, the bits check and what is written.
The sweeps on a real GPU: tests/gpu/test_gpu_tune.py."""
from __future__ import annotations

from collections.abc import Callable

from kiln.codegen.autotune import Bench, GemmTuner, _GemmRig, Timed, Trial, gemm_problems, reductions, tiles
from kiln.codegen.buckets import Bucket, make_buckets
from kiln.codegen.lower import Regions, lower_bucket
from kiln.codegen.triton.aot import cache_key
from kiln.codegen.triton.configs import DEFAULT
from kiln.codegen.triton.launch import cdiv
from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.passes.plan_memory import plan_memory
from tests.tiny_models import BASE


class FakeBench(Bench):
    """No device: allocations are distinct fake addresses, nothing is compiled, and a timing
    is `time_fn(timed)`; a read-back is `bits_fn(the Timed timed last)`."""

    def __init__(self, time_fn: Callable[[Timed], float], bits_fn: Callable[[Timed], bytes] = lambda t: b"same"):
        super().__init__(None, "sm_90", progress=lambda s: None)
        self.time_fn, self.bits_fn = time_fn, bits_fn
        self._next, self.last, self.timed = 1 << 36, None, []

    def malloc(self, nbytes):
        ptr, self._next = self._next, self._next + -(-nbytes // 256) * 256 + 256
        return ptr

    def upload(self, ptr, host):
        pass

    def copy(self, dst, src, nbytes):
        pass

    def read(self, ptr, nbytes):
        return self.bits_fn(self.last)

    def free_all(self):
        pass

    def compile(self, specs):
        for s in specs:
            self._kernels.setdefault(cache_key(s, self.arch), object())

    def time_us(self, timed, replays=3):
        self.last = timed
        self.timed.append(timed)
        return self.time_fn(timed)


def specs_of(timed: Timed):
    return [s for s, _ in timed.reps[0]]


def tiny_graph(**extra):
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, **extra})
    return cfg, run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))


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
    stage1 = sum(len(reductions(p.k)) * len(tiles(p.ms[0], wide=False)) for p in problems)
    assert len(bench.timed) == stage1 + sum(len(tiles(m, wide=True)) for p in problems for m in p.ms)
    for t in bench.timed[stage1:]:  # every tile of stage 2 reduces as stage 1 chose
        c = specs_of(t)[0].constexprs
        assert (c["BLOCK_K"], c["SPLIT_K"]) == (64, 2)


def test_the_gemm_rig_times_the_kernels_a_bundle_runs():
    _, graph = tiny_graph(hidden_size=256, intermediate_size=512)
    buckets = make_buckets(4, 64)
    bundle_keys = {cache_key(s, "sm_90") for b in buckets for s, _ in lowered(graph, b, buckets, 128)
                   if s.kernel.startswith("gemm")}
    bench = FakeBench(lambda t: 1.0)
    rig_keys = set()
    for p in gemm_problems(graph, buckets):
        rig = _GemmRig(bench, p)
        for b in buckets:
            m = b.logits if p.out_dtype == "f32" else b.tokens
            red, tile = DEFAULT.gemm_reduction(p.n, p.k), DEFAULT.gemm_tile(m, p.n, p.k)
            rig_keys |= {cache_key(s, "sm_90") for s in specs_of(rig.timed(m, tile, red))}
    assert rig_keys == bundle_keys  # every GEMM kernel of the bundle, integer hints included
