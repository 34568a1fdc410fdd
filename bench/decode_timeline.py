"""Where a batch-1 decode step's time goes inside its CUDA graph: every kernel's start and end
as the GPU ran it (CUPTI kernel records through torch.profiler, which traces the kernels of
kiln's cuda-python launches too: both use the device's primary context), summarised per kernel
kind as its duration and the gap between the end of the kernel before it and its own end.

    PYTHONPATH=$PWD python bench/decode_timeline.py [--context 512] [--replays 20] [--max-model-len 4096]
        [--fuse-rope auto|off] [--fuse-silu auto|off] [--untuned] [--json OUT]

The bundle is bench/gpu_shape_decode.py's (Llama-3.1-8B shape, max_num_seqs 8, the tuned schedules).

torch is a bench-only dependency here (the GPU machine has it), never the runtime's. Timing
only: the weights are random (gpu_shape_decode.random_weights).
"""
from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from kiln.bench import gpu_shape_decode as gsd


def kernel_records(trace_path: str) -> list[tuple[str, float, float]]:
    """-> [(kernel name, start us, end us)] of a chrome trace's GPU kernel events, by start."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ks = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
          if e.get("cat") == "kernel" and "dur" in e]
    return sorted(ks, key=lambda k: k[1])


def middle_steps(ks: list, launches_per_step: int, replays: int) -> list[list]:
    """The middle replays' kernels, as lists of launches_per_step records each."""
    n = len(ks) // launches_per_step
    if n < replays:
        raise SystemExit(f"the trace holds {len(ks)} kernels, fewer than {replays} x {launches_per_step}")
    steps = [ks[i * launches_per_step:(i + 1) * launches_per_step] for i in range(n)]
    return steps[n // 4: n - n // 4]


def summarise(steps: list[list], names: list[str]) -> dict:
    """Per plan position: mean duration and mean 'exposed' time (own end - previous end), then by
    kernel name (with its grid from the plan)."""
    dur = np.array([[e - s for _, s, e in st] for st in steps])
    ends = np.array([[e for _, _, e in st] for st in steps])
    starts = np.array([[s for _, s, _ in st] for st in steps])
    exposed = np.diff(ends, axis=1, prepend=starts[:, :1])  # the first: its own duration
    start_gap = starts[:, 1:] - ends[:, :-1]  # > 0: idle before it; < 0: it started early (PDL)
    by: dict[str, dict] = collections.OrderedDict()
    for i, n in enumerate(names):
        d = by.setdefault(n, {"count": 0, "dur_us": 0.0, "exposed_us": 0.0, "start_gap_us": 0.0})
        d["count"] += 1
        d["dur_us"] += float(dur[:, i].mean())
        d["exposed_us"] += float(exposed[:, i].mean())
        d["start_gap_us"] += float(start_gap[:, i - 1].mean()) if i else 0.0
    step_us = float((ends[:, -1] - starts[:, 0]).mean())
    return {"step_us": step_us, "by_kernel": by,
            "per_launch": [{"kernel": n, "dur_us": float(dur[:, i].mean()), "exposed_us": float(exposed[:, i].mean()),
                            "start_gap_us": float(start_gap[:, i - 1].mean()) if i else 0.0}
                           for i, n in enumerate(names)]}


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser()
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--trace", default="/tmp/kiln_decode_trace.json")
    a, rest = ap.parse_known_args()
    ex, names = build(rest)
    torch.cuda.init()
    graph = ex.graphs["d1x1"]
    for _ in range(20):
        ex.ctx.replay(graph)
    ex.ctx.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.replays):
            ex.ctx.replay(graph)
        ex.ctx.synchronize()
    prof.export_chrome_trace(a.trace)
    ks = kernel_records(a.trace)
    steps = middle_steps(ks, len(names), a.replays)
    res = summarise(steps, names)
    print(f"{len(ks)} kernels traced; step {res['step_us']:.1f} us from the first kernel's start to the last's end")
    print(f"  {'kernel':40s} {'n':>4s} {'dur us':>9s} {'exposed us':>11s} {'start gap us':>13s}")
    for n, d in res["by_kernel"].items():
        print(f"  {n:40s} {d['count']:4d} {d['dur_us']:9.1f} {d['exposed_us']:11.1f} {d['start_gap_us']:13.1f}")
    print("one layer (launches 1-8):")
    for r in res["per_launch"][1:9]:
        print(f"  {r['kernel']:40s} dur {r['dur_us']:6.2f}  exposed {r['exposed_us']:6.2f}  gap {r['start_gap_us']:6.2f}")
    if out := _json_flag(rest):
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


def _json_flag(rest: list[str]) -> str | None:
    return rest[rest.index("--json") + 1] if "--json" in rest else None


def build(rest: list[str]):
    """The batch-1 bundle as gpu_shape_decode builds it, loaded, with a decode step captured."""
    import dataclasses

    from kiln.codegen.compile import compile_bundle
    from kiln.models.config import ModelConfig
    from kiln.runtime.cuda_executor import CudaExecutor
    from kiln.runtime.input_batch import SeqChunk, prepare_step

    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--fuse-rope", default="auto")
    ap.add_argument("--fuse-silu", default="auto")
    ap.add_argument("--json")
    ap.add_argument("--untuned", action="store_true")
    a, _ = ap.parse_known_args(rest)
    for k in ("attn_block_q", "attn_warps", "attn_stages", "attn_maxnreg", "attn_tile", "attn_seg"):
        setattr(a, k, None)
    a.gemm_tma, a.gemm_fold = "auto", "auto"
    cfg = ModelConfig.from_hf_dict(gsd.SHAPES["llama-3.1-8b"])
    graph = gsd.step_graph(cfg, a.fuse_silu, a.fuse_rope)
    bundle = compile_bundle(graph, target="sm_90", model_config=dataclasses.asdict(cfg),
                            config_hash=cfg.compute_hash(), max_model_len=a.max_model_len, max_num_seqs=8,
                            max_num_batched_tokens=2048, block_size=16, configs=gsd.Configs(lookup=gsd._lookup(a)))
    shapes = graph.checkpoint_weights()
    load = gsd.random_weights()
    ex = CudaExecutor(bundle, lambda n: load(n, shapes[n]), num_blocks=(a.max_model_len // 16) * 4)
    blocks = list(range(1, a.max_model_len // 16 + 1))
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, size=a.context).tolist()
    ex.execute(prepare_step([SeqChunk(prompt, 0, blocks)], 16))
    ex.execute(prepare_step([SeqChunk([1], a.context, blocks)], 16))  # captures the decode graph
    plan = ex._pick(1, 1, 1)
    names = [f"{k.name}{list(g)}" for k, g, *_ in plan["launches"]]
    return ex, names


if __name__ == "__main__":
    main()
