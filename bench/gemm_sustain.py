"""GEMM tiles at one bucket's M, timed in a burst (as `build.py tune` times them) and sustained,
with the board held at its power limit, the way a long prefill or an offline run meets them.

    python bench/gemm_sustain.py --model /tmp/llama8b [--m 2048] [--weight 28672x4096 ...]
        [--candidates stage2 --block-m 128 | --candidates committed --group-m 4 8 16 32]
        [--rounds 2] [--json OUT]

The tuner's own rig and timing (codegen/autotune.py: _GemmRig, Bench.time_us: a CUDA graph of 24
launch lists over rotating weight copies). Burst: after --idle seconds, one warm-up replay and 3
timed, as the tuner does. Sustained: the same candidate replayed for --heat seconds, then timed
over ~--timed seconds. An H200 holds its boost clock for ~0.1 s of tensor-core work, then the
700 W limit brings it to ~1,550-1,700 MHz, so the two differ by ~10-17 %; what this answers is
whether they rank the candidates alike.

--candidates stage2: the tuner's stage-2 candidates at M under the weight's committed reduction
(optionally only those of --block-m rows). committed: the committed tile at M with each --group-m.
Weights are the model's linear shapes N x K (default: every one with M among its buckets, the LM
head aside).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path


def main() -> None:
    from kiln.codegen.autotune import Bench, _GemmRig, gemm_problems, stage2_tiles
    from kiln.codegen.buckets import make_buckets
    from kiln.codegen.triton.configs import Configs
    from kiln.graph import DType
    from kiln.models.config import ModelConfig
    from kiln.models.registry import get_graph_builder
    from kiln.passes.pipeline import run_pipeline
    from kiln.runtime.worker.cuda_driver import CudaContext
    from kiln.schedules import Schedules

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a model directory (its config.json is all it reads)")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--weight", nargs="+", help="N x K shapes, e.g. 28672x4096 (default: all but the LM head)")
    ap.add_argument("--candidates", choices=("stage2", "committed"), default="committed")
    ap.add_argument("--block-m", type=int, help="stage2: only tiles of this many rows")
    ap.add_argument("--group-m", type=int, nargs="+", default=[4, 8, 16, 32], help="committed: GROUP_M values")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--idle", type=float, default=0.3)
    ap.add_argument("--heat", type=float, default=0.3)
    ap.add_argument("--timed", type=float, default=0.15)
    ap.add_argument("--json")
    a = ap.parse_args()

    cfg = ModelConfig.from_hf_dict(json.loads(Path(a.model, "config.json").read_text()))
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16, block_size=16))
    wanted = {tuple(int(v) for v in w.lower().split("x")) for w in a.weight or ()}
    probs = [p for p in gemm_problems(graph, make_buckets(256, max(a.m, 2048))) if a.m in p.ms
             and ((p.n, p.k) in wanted if wanted else p.n != cfg.vocab_size)]
    configs = Configs(lookup=Schedules.read(a.target).lookup)
    ctx = CudaContext()
    bench = Bench(ctx, a.target, progress=lambda s: None)
    out = []
    for p in probs:
        red = configs.gemm_reduction(p.n, p.k)
        if a.candidates == "stage2":
            cands = [t for t in stage2_tiles(a.m, p.n, p.k, red, a.target) if a.block_m in (None, t.block_m)]
        else:
            base = configs.gemm_tile(a.m, p.n, p.k, a.target)
            cands = [dataclasses.replace(base, group_m=g) for g in a.group_m]
        rig = _GemmRig(bench, p)
        timed = [(t, rig.timed(a.m, t, red)) for t in cands]
        bench.compile([s for _, x in timed for s, _ in x.reps[0]])
        rows = {}
        for _ in range(a.rounds):
            for t, x in timed:
                if not all(bench.fits(s) for s, _ in x.reps[0]):
                    continue
                time.sleep(a.idle)
                burst = bench.time_us(x, replays=3)
                per = burst * len(x.reps) / 1e6  # seconds a replay
                bench.time_us(x, replays=max(1, int(a.heat / per)))
                sustained = bench.time_us(x, replays=max(3, int(a.timed / per)))
                rows.setdefault(str(t), []).append({"burst_us": burst, "sustained_us": sustained})
        ranked = sorted(rows.items(), key=lambda kv: min(r["sustained_us"] for r in kv[1]))
        print(f"[{p.n}, {p.k}] M={a.m}, {red}: {len(rows)} candidates, by sustained time")
        for name, rs in ranked[:10]:
            print(f"  {name}: " + "; ".join(f"burst {r['burst_us']:.1f} sustained {r['sustained_us']:.1f} us"
                                            for r in rs))
        out.append({"n": p.n, "k": p.k, "m": a.m, "reduction": str(red), "candidates": rows})
        bench.free_all()
    if a.json:
        Path(a.json).write_text(json.dumps({"command": vars(a), "weights": out}, indent=1))


if __name__ == "__main__":
    main()
