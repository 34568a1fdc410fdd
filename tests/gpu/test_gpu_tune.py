"""`build.py tune` on the GPU, on a small Llama: the attention and row sweeps (and the
GEMM sweep on one weight) run, write their winners, and the winners give the default
config's bits wherever their knobs are schedule knobs.

    pytest -m gpu tests/gpu/test_gpu_tune.py
"""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from kiln.codegen.autotune import Bench, GemmProblem, GemmTuner
from kiln.codegen.autotune_attention import AttentionRig, attention_cases, attention_shapes, decode_class_of
from kiln.codegen.autotune_rows import ROW_OPS, RowTuner
from kiln.codegen.buckets import make_buckets
from kiln.codegen.triton.configs import (ATTENTION_DECODE_KNOBS, ATTENTION_ONE_KNOBS, ATTENTION_PREFILL_KNOBS,
                                         ATTENTION_SPLIT_KNOBS, DEFAULT, Configs)
from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.schedules import Schedules

pytestmark = pytest.mark.gpu

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 512, "intermediate_size": 1536,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
          "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}
SEQS, TOKENS, MAX_LEN = 16, 256, 1024


@pytest.fixture(scope="module")
def bench(gpu_target):
    from kiln.runtime.worker.cuda_driver import CudaContext

    ctx = CudaContext()
    yield Bench(ctx, gpu_target, progress=print)
    ctx.close()


@pytest.fixture(scope="module")
def tuned(gpu_target, tmp_path_factory):
    """`build.py tune --kernels attention,rows` into a fresh schedules folder."""
    from kiln.build import main

    root = tmp_path_factory.mktemp("tune")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(CONFIG))
    rc = main(["tune", "--model", str(root / "model"), "--target", gpu_target, "--kernels", "attention,rows",
               "--out", str(root / "schedules"), "--max-num-seqs", str(SEQS), "--max-num-batched-tokens",
               str(TOKENS), "--max-model-len", str(MAX_LEN)])
    assert rc == 0  # 1 would mean a candidate changed the bits where its knobs must not
    return Schedules.read(gpu_target, root / "schedules"), root / "schedules" / gpu_target


def _graph():
    cfg = ModelConfig.from_hf_dict(CONFIG)
    return run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))


def test_tune_writes_attention_and_row_winners(tuned):
    sched, folder = tuned
    assert sorted(f.name for f in folder.iterdir()) == ["attention.yaml", "rows.yaml"]
    (entry,) = sched.entries["paged_attention"]
    # each decode size class the bundle has gets its timing; a class's knobs left unset (its
    # default won: the decode knobs serve it) are not written
    classes = {"decode": "us", "split": "split_us", "one": "one_us"}
    timings = {classes[decode_class_of(c)] for c in attention_cases(make_buckets(SEQS, TOKENS), MAX_LEN)[0]}
    assert timings | {"prefill_us"} <= set(entry) and not (set(classes.values()) - timings) & set(entry)
    unset = {"prefill_maxnreg", "maxnreg", "key_halves"}  # None where no cap or halves won: not written
    assert {"h", "hkv", "d", *(set(ATTENTION_DECODE_KNOBS) - unset), *(set(ATTENTION_PREFILL_KNOBS) - unset)} \
        <= set(entry)
    assert all(entry[k] is not None for k in unset & set(entry))
    assert "mixed_us" in entry  # the route_mixed round (route_mixed itself only where it won)
    assert set(entry) <= {"h", "hkv", "d", "prefill_us", "mixed_us", "route_mixed", *classes.values(),
                          *ATTENTION_DECODE_KNOBS, *ATTENTION_SPLIT_KNOBS, *ATTENTION_ONE_KNOBS,
                          *ATTENTION_PREFILL_KNOBS}
    # every row op the plans launch: the SwiGLU epilogue (passes/fuse_gate_up_silu.py) leaves this
    # Llama no silu_mul launch, and the q/k/v GEMM's preamble epilogue (passes/fuse_rope_into_linear.py)
    # no attention_preamble launch, so nothing of them to tune
    assert not {"silu_mul", "attention_preamble"} & {n.op for n in _graph().nodes.values()}
    assert {op for op in sched.entries if op != "paged_attention"} == set(ROW_OPS) - {"silu_mul", "attention_preamble"}
    timed = [[v for k, v in e.items() if k.endswith("us")] for items in sched.entries.values() for e in items]
    assert all(t and min(t) > 0 for t in timed)  # (a bundle of 16 sequences has no decode bucket read whole: no "us")


def test_the_attention_winner_gives_the_default_bits(tuned, bench):
    sched, _ = tuned
    graph = _graph()
    (shape,) = attention_shapes(graph, 16, MAX_LEN)
    default = DEFAULT.attention(shape.h, shape.hkv, shape.d, MAX_LEN)
    won = Configs(lookup=sched.lookup).attention(shape.h, shape.hkv, shape.d, MAX_LEN)
    decode, prefill, mixed = attention_cases(make_buckets(SEQS, TOKENS), MAX_LEN)
    for case in decode + [prefill, mixed]:  # (a bf16 cache: routed or not, the same bits)
        rig = AttentionRig(bench, shape, case)
        outs = []
        for cfg in (default, won):
            timed = rig.timed(cfg)
            bench.compile([s for s, _ in timed.reps[0]])
            bench.time_us(timed)
            outs.append(rig.output())
        assert outs[0] == outs[1], f"{case.name}: the tuned schedule {won} changed the bits"
        live = np.frombuffer(outs[0], ml_dtypes.bfloat16)[:sum(case.counts) * shape.h * shape.d]
        assert np.isfinite(live.astype(np.float32)).all()
    bench.free_all()


def test_the_row_winners_give_the_default_bits_where_the_knob_is_a_schedule_knob(tuned, bench):
    sched, _ = tuned
    tuner = RowTuner(bench, _graph(), make_buckets(SEQS, TOKENS), lookup=None, max_model_len=MAX_LEN,
                     block_size=16)
    won = {(op, e["width"]): {k: v for k, v in e.items() if k not in ("width", "us")}
           for op, items in sched.entries.items() if op in ROW_OPS for e in items}
    pairs = [t for t in tuner.trials() if t.baseline or t.cand == won[t.group]]
    assert len(pairs) >= len(won)
    bench.mismatches.clear()
    bench.best(pairs)
    assert bench.mismatches == []
    bench.free_all()


def test_gemm_sweep_on_one_weight(bench):
    sched = GemmTuner(bench).tune([GemmProblem(512, 1536, "bf16", False, [1, 16, 64])])
    assert {(e["n"], e["k"]) for e in sched.entries["gemm_reduction"]} == {(512, 1536)}
    assert sorted(e["m"] for e in sched.entries["gemm_tile"]) == [1, 16, 64]


def test_gemm_sweep_of_a_split_k_linear_add_checks_the_bits_it_feeds_the_norm(bench):
    """o_proj/down (linear_add) under split-K 2 at 2,048 rows: some of stage 2's tiles fold the
    splits and add the residual in their epilogue, the others leave partials, reduced, for the
    norm to add it. Both hand the norm the same h; the bits check must compare h, not y, or it
    refuses every candidate whose fold differs from the baseline's (build.py tune then fails)."""
    from kiln.codegen.autotune import stage2_tiles
    from kiln.codegen.triton.configs import GemmReduction

    n, k, m = 4096, 2048, 2048
    red = GemmReduction(block_k=128, split_k=2)
    folds = {DEFAULT.gemm_fold(m, n, k, t, red, bench.arch) for t in stage2_tiles(m, n, k, red, bench.arch)}
    assert folds == {True, False}  # the case in question: both kinds compete
    bench.mismatches.clear()
    sched = GemmTuner(bench).tune([GemmProblem(n, k, "bf16", False, [m], residual=True)], objective="keep",
                                  known=lambda n_, k_: red)
    assert bench.mismatches == []
    assert [e["m"] for e in sched.entries["gemm_tile"]] == [m]
    bench.free_all()
