"""The MoE tuner on CPU (as test_autotune.py for the other families): a stand-in device, and
everything else real: the problems found in a tiny MoE graph, the candidates, the wrapper's
recorded launches, the keep-the-best rounds, the bits check, what is written, and that compile
reads it back (a schedules entry changes the plan's path and tiles; a miss is listed)."""
from __future__ import annotations

import json

import pytest

from kiln.codegen.autotune_moe import MoeTuner, _MoeRig, block_ms, moe_problems, paths, tiles
from kiln.codegen.buckets import Bucket, make_buckets
from kiln.codegen.compile import compile_bundle
from kiln.codegen.triton.aot import cache_key
from kiln.codegen.triton.configs import Configs
from kiln.codegen.triton.moe_config import MoeConfig, default_moe_config
from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.schedules import Schedules
from tests.codegen.test_autotune import FakeBench, lowered, specs_of
from tests.tiny_models import BASE

E, K, I = 8, 2, 32
MOE = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": E, "num_experts_per_tok": K,
       "moe_intermediate_size": I, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
H = BASE["hidden_size"]
SHAPE = dict(e=E, h=H, i=I, top_k=K, dtype="bfloat16")
MOE_KERNELS = {"moe_align_kernel", "moe_gate_up_kernel", "moe_down_kernel", "moe_sum_kernel"}


def moe_graph(**extra):
    cfg = ModelConfig.from_hf_dict({**MOE, **extra})
    return run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))


def moe_launches(graph, bucket, buckets, configs=None):
    kw = {"configs": configs} if configs is not None else {}
    return [s for s, _ in lowered(graph, bucket, buckets, 128, **kw) if s.kernel in MOE_KERNELS]


def test_problems_paths_and_row_blocks():
    graph = moe_graph()
    (p,) = moe_problems(graph, make_buckets(8, 64))  # decode 1, 2, 4, 8; mixed 16, 32, 64
    assert (p.e, p.h, p.i, p.top_k, p.dtype) == (E, H, I, K, "bfloat16") and p.ts == [1, 2, 4, 8, 16, 32, 64]
    # the TUNED_MS that covers a bucket, never past the largest bucket
    assert moe_problems(graph, [Bucket(24, 8, 8, False), Bucket(100, 8, 8, False)])[0].ts == [32, 100]
    # both decode forms wherever decode is the default; grouped and decode near the default
    # threshold (64 assignments), the default's first
    assert paths(1, 8) == ["decode", "decode_token"] and paths(4, 8) == ["decode", "decode_token", "grouped"]
    assert paths(16, 8) == ["grouped", "decode", "decode_token"]
    assert paths(2048, 8) == ["grouped"]
    # row blocks up to twice an expert's mean rows: 16 at 2 rows an expert, all at 128
    assert block_ms(8, 8, 128) == [16] and block_ms(2048, 8, 128) == [16, 32, 64, 128]
    assert {t.block_m for t in tiles("decode", 64)} == {16} and {t.block_m for t in tiles("grouped", 32)} == {32}
    assert tiles("decode_token", 16) == tiles("decode", 16)
    assert not moe_problems(moe_graph(architectures=["Qwen3ForCausalLM"]), make_buckets(8, 64))  # dense: none


def test_the_moe_rig_times_the_kernels_a_bundle_runs():
    graph = moe_graph()
    buckets = make_buckets(8, 64)
    (p,) = moe_problems(graph, buckets)
    rig = _MoeRig(FakeBench(lambda t: 1.0), p, [16, 32])
    for b in buckets:  # each bucket's default launches, integer hints included
        plan = [cache_key(s, "sm_90") for s in moe_launches(graph, b, buckets)]
        timed = rig.timed(b.tokens, default_moe_config(b.tokens, K, E, H, I))
        # but the rank-order sum: the rig runs it (moe_sum, so that the bits check can read the
        # layer's output), the plan in the next layer's add_rms_norm (lower.py _norm_takes_moe_sum)
        rigged = [cache_key(s, "sm_90") for s in specs_of(timed)]
        assert specs_of(timed)[-1].kernel == "moe_sum_kernel" and rigged[:-1] == plan, b
        # every layer of the graph routes its tokens another way: REPS routings, one each
        ids = {args[list(s.signature).index("ids_ptr")].data_ptr() for rep in timed.reps for s, args in rep
               if "ids_ptr" in s.signature}
        assert len(ids) == len(timed.reps)


def _tuner_bench(bits=lambda timed: b"same"):
    """grouped beats decode from 8 tokens on; block_m 32 beats 16; gate_up 64-wide with 8 warps wins,
    down 32-wide with 2 stages: each a tenth of a microsecond."""
    def time_fn(timed):
        specs = {s.kernel: s for s in specs_of(timed)}
        gu, dn = specs["moe_gate_up_kernel"], specs["moe_down_kernel"]
        t = gu.grid[1] // K if gu.constexprs["DECODE"] else None
        us = 5.0 if t is not None and t >= 8 else 3.0
        us -= 0.1 * (gu.constexprs["BLOCK_M"] == 32)
        us -= 0.1 * (gu.constexprs["BLOCK_N"] == 64 and gu.num_warps == 8)
        us -= 0.1 * (dn.constexprs["BLOCK_N"] == 32 and dn.num_stages == 2)
        return us
    return FakeBench(time_fn, bits)


def test_the_tuner_writes_the_fastest_schedule_and_compile_reads_it(tmp_path):
    graph = moe_graph()
    buckets = [Bucket(4, 4, 4, True), Bucket(8, 8, 8, True), Bucket(64, 8, 8, False)]
    sched = MoeTuner(_tuner_bench()).tune(moe_problems(graph, buckets))
    at = {e["t"]: e for e in sched.entries["moe_experts"]}
    assert sorted(at) == [4, 8, 64] and all({k: e[k] for k in SHAPE} == SHAPE for e in at.values())
    assert at[4]["path"] == "decode"  # 8 assignments: decode alone is timed
    for t in (8, 64):  # grouped, where it is a candidate and faster
        assert at[t]["path"] == "grouped" and at[t]["gate_up_block_n"] == 64 and at[t]["gate_up_num_warps"] == 8
        assert at[t]["down_block_n"] == 32 and at[t]["down_num_stages"] == 2
    assert at[64]["block_m"] == 32 and at[8]["block_m"] == 16  # 16 rows: one block of 16 an expert at most
    sched.write("moe", tmp_path)
    back = Schedules.read("sm_90", tmp_path)
    assert back.entries == sched.entries
    configs = Configs(back.lookup)
    assert configs.moe(64, K, E, H, I, "bfloat16") == MoeConfig(**{k: v for k, v in at[64].items()
                                                                   if k not in {*SHAPE, "t", "us"}})
    assert configs.moe(16, K, E, H, I, "bfloat16") == configs.moe(64, K, E, H, I, "bfloat16")  # the entry covering it
    assert configs.moe(5000, K, E, H, I, "bfloat16").block_m == 32  # past the largest, the largest
    assert configs.fallbacks == []
    # another shape or dtype, or another arch: kiln's default, and the miss is listed
    assert configs.moe(64, K, E, H, I, "float16") == default_moe_config(64, K, E, H, I)
    assert configs.moe(64, K, E, H, I, "bfloat16", "sm_121") == default_moe_config(64, K, E, H, I, "sm_121")
    assert configs.fallbacks == [("moe_experts", (64, E, H, I, K, "float16", "sm_90")),
                                 ("moe_experts", (64, E, H, I, K, "bfloat16", "sm_121"))]


def test_a_candidate_that_changes_the_bits_is_refused_and_reported():
    """A faster grouped path (or tile) whose output differs from the default's is never written:
    the path and tiles are schedule knobs, so it is a kernel bug."""
    def bits(timed):
        specs = {s.kernel for s in specs_of(timed)}
        return b"other" if "moe_align_kernel" in specs else b"same"
    bench = _tuner_bench(bits)
    graph = moe_graph()
    sched = MoeTuner(bench).tune(moe_problems(graph, [Bucket(8, 8, 8, True), Bucket(64, 8, 8, False)]))
    at = {e["t"]: e for e in sched.entries["moe_experts"]}
    assert at[8]["path"] == "decode"  # the default's path; grouped was faster, with other bits
    assert at[64]["path"] == "grouped"  # the default is grouped here: decode's are the other bits
    assert {(g[1], c.path) for g, c in bench.mismatches} == {(8, "grouped"), (64, "decode"),
                                                               (64, "decode_token")}


def test_a_schedules_entry_changes_the_compiled_plan():
    graph = moe_graph()
    buckets = [Bucket(4, 4, 4, True), Bucket(64, 8, 8, False)]
    tuned = {**SHAPE, "t": 4, **MoeConfig(path="grouped", block_m=32, gate_up_block_n=16, down_num_warps=8).fields()}
    configs = Configs(Schedules("sm_90", {"moe_experts": [tuned]}).lookup)
    default = {s.kernel: s for s in moe_launches(graph, buckets[0], buckets)}
    # 8 assignments: the decode path (GEMMs over assignments; the rank sum in the next layer's add_rms_norm)
    assert set(default) == {"moe_gate_up_kernel", "moe_down_kernel"}
    assert default["moe_down_kernel"].constexprs["SPLIT"]
    plan = {s.kernel: s for s in moe_launches(graph, buckets[0], buckets, configs)}
    assert set(plan) == MOE_KERNELS - {"moe_sum_kernel"}  # the entry's path: align, grouped GEMMs (sum: as above)
    assert plan["moe_align_kernel"].constexprs["BLOCK_M"] == 32 and plan["moe_gate_up_kernel"].constexprs["BLOCK_N"] == 16
    assert plan["moe_down_kernel"].num_warps == 8
    # compiled: the entry serves both buckets (64 tokens: past the largest tuned T, the largest), so
    # no MoE key is among the defaults the manifest lists; without it, both buckets' keys are
    b = compile_bundle(graph, target="sm_90", model_config={}, config_hash="x", max_model_len=128, max_num_seqs=8,
                       max_num_batched_tokens=64, block_size=16, buckets=buckets, configs=configs)
    meta = b.manifest["kernels"]
    launched = [meta[key] for key, _, _ in b.manifest["plans"]["d4x4"]["launches"]]
    assert [m["name"] for m in launched].count("moe_align_kernel") == 1  # one MoE layer (layer 1)
    assert {m["num_warps"] for m in launched if m["name"] == "moe_down_kernel"} == {8}
    assert not [d for d in b.manifest["default_configs"] if d.startswith("moe_experts")]
    untuned = Configs(Schedules("sm_90", {}).lookup)
    for bucket in buckets:
        moe_launches(graph, bucket, buckets, untuned)
    assert [f for f in untuned.fallbacks if f[0] == "moe_experts"] == [
        ("moe_experts", (t, E, H, I, K, "bfloat16", "sm_90")) for t in (4, 64)]


def _model_dir(tmp_path, arch_cfg):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(arch_cfg))
    return str(tmp_path / "model")


def test_tune_moe_writes_moe_yaml_only(tmp_path, monkeypatch):
    from kiln.build import main
    from kiln.codegen import autotune
    from kiln.runtime.worker import cuda_driver

    class Ctx:
        arch = 90
    monkeypatch.setattr(cuda_driver, "CudaContext", Ctx)
    monkeypatch.setattr(autotune, "Bench", lambda ctx, arch, progress: _tuner_bench())
    model = _model_dir(tmp_path, MOE)
    assert main(["tune", "--model", model, "--kernels", "moe", "--out", str(tmp_path / "schedules"),
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "16"]) == 0
    assert sorted(f.name for f in (tmp_path / "schedules" / "sm_90").iterdir()) == ["moe.yaml"]
    sched = Schedules.read("sm_90", tmp_path / "schedules")
    assert [e["t"] for e in sched.entries["moe_experts"]] == [1, 2, 4, 16]


def test_tune_moe_compile_only_needs_no_gpu(tmp_path, monkeypatch, capsys):
    """--compile-only on a tiny MoE config: every candidate's kernels go to the AOT compiler (a
    stand-in here; the real one in test_tune_moe_compile_only_compiles_for_real), nothing is written."""
    from kiln.build import main
    from kiln.codegen import autotune
    from kiln.codegen.triton.aot import Compiled
    from kiln.runtime.worker import cuda_driver

    asked = []

    def compile_specs(jobs, workers=None):
        asked.extend(s for s, _ in jobs)
        return [Compiled(b"", s.kernel, 0, s.num_warps, 2, 0, "sm_90a") for s, _ in jobs]

    def no_gpu():
        raise AssertionError("--compile-only opened a CUDA context")
    monkeypatch.setattr(autotune, "compile_specs", compile_specs)
    monkeypatch.setattr(cuda_driver, "CudaContext", no_gpu)
    model = _model_dir(tmp_path, MOE)
    assert main(["tune", "--model", model, "--kernels", "moe", "--out", str(tmp_path / "schedules"),
                 "--compile-only", "--max-num-seqs", "4", "--max-num-batched-tokens", "16"]) == 0
    assert not (tmp_path / "schedules").exists()
    assert {s.kernel for s in asked} == MOE_KERNELS
    # every decode and grouped tile of both GEMMs was compiled
    gate_up = {(s.constexprs["DECODE"], s.constexprs["BLOCK_N"], s.constexprs["BLOCK_K"], s.num_warps, s.num_stages)
               for s in asked if s.kernel == "moe_gate_up_kernel"}
    assert {(True, t.block_n, t.block_k, t.num_warps, t.num_stages) for t in tiles("decode", 16)} <= gate_up
    assert {(False, t.block_n, t.block_k, t.num_warps, t.num_stages) for t in tiles("grouped", 16)} <= gate_up
    assert "nothing timed, nothing written" in capsys.readouterr().err


@pytest.mark.parametrize("kernels", ["moe", "rows,moe"])
def test_tune_moe_on_a_dense_model_writes_no_moe_file(kernels, tmp_path, monkeypatch):
    from kiln.build import main
    from kiln.codegen import autotune
    from kiln.runtime.worker import cuda_driver

    class Ctx:
        arch = 90
    monkeypatch.setattr(cuda_driver, "CudaContext", Ctx)
    monkeypatch.setattr(autotune, "Bench", lambda ctx, arch, progress: FakeBench(lambda t: 1.0))
    model = _model_dir(tmp_path, {**BASE, "architectures": ["LlamaForCausalLM"]})
    assert main(["tune", "--model", model, "--kernels", kernels, "--out", str(tmp_path / "schedules"),
                 "--max-num-seqs", "4", "--max-num-batched-tokens", "16"]) == 0
    folder = tmp_path / "schedules" / "sm_90"
    assert not (folder / "moe.yaml").exists()
    assert (folder / "rows.yaml").exists() == (kernels == "rows,moe")
