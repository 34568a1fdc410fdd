"""Where a batch-1 decode step's time goes inside its CUDA graph: every kernel's start and end
as the GPU ran it (CUPTI kernel records through torch.profiler, which traces the kernels of
kiln's cuda-python launches too: both use the device's primary context), summarised per kernel
kind as its duration and the gap between the end of the kernel before it and its own end.

    PYTHONPATH=$PWD python bench/decode_timeline.py [--replays 20] [any bench/gpu_shape_decode.py flag]

The bundle is bench/gpu_shape_decode.py's, compiled from the same flags (default: Llama-3.1-8B
shape, max_num_seqs 8, the tuned schedules).

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
    """The batch-1 bundle as gpu_shape_decode builds it from the same flags, loaded, with a decode
    step captured -> (executor, the plan's kernel names with their grids)."""
    a, _ = gsd.parser().parse_known_args(rest)
    cfg, graph, bundle = gsd.compile_for(a, {})
    ex, _ = gsd.load_for(a, {}, cfg, graph, bundle, np.random.default_rng(1))
    plan = ex._pick(1, 1, 1)
    names = [f"{k.name}{list(g)}" for k, g, *_ in plan["launches"]]
    return ex, names


if __name__ == "__main__":
    main()
