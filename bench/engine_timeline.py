"""What the GPU does between two batch-1 decode graphs in the engine: the `build.py bench --workload
decode` run's stream, traced, so that TPOT minus the graph's own time has names.

    PYTHONPATH=$PWD python bench/engine_timeline.py --model /tmp/llama8b --target sm_90 --bundle /tmp/b8 \\
        [--context 512] [--steps 64] [--json OUT]   (any `build.py bench` flag)

One greedy request through kiln.LLM as the decode workload runs it, under torch.profiler (CUPTI
records every kernel, copy and memset of the process's primary context, which kiln's cuda-python
launches share). A graph replay is the batch-1 bucket's launches in plan order; for the middle
steps it prints the graph's span, every activity between one graph's last kernel and the next
graph's first (name, duration, the idle time before it) and the step period.

torch is a bench-only dependency (the GPU machine has it), never the runtime's.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys

import numpy as np

from kiln.bench.cli import add_bench_arguments
from kiln.bench.workloads import engine, random_prompts, sampling, with_defaults

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_records(trace_path: str) -> list[tuple[str, str, float, float]]:
    """-> [(category, name, start us, end us)] of a chrome trace's GPU activities, by start."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    rs = [(e["cat"], e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
          if e.get("cat") in GPU_CATS and "dur" in e]
    return sorted(rs, key=lambda r: r[2])


def split_graphs(rs: list, plan: list[str]) -> tuple[list[tuple[int, int]], list]:
    """-> ([(first, last) record index of each graph replay], rs): a replay is len(plan) kernels
    whose names follow the plan's order."""
    spans, i = [], 0
    while i < len(rs):
        if rs[i][0] == "kernel" and rs[i][1] == plan[0]:
            j, ok = i, True
            for want in plan:
                while j < len(rs) and rs[j][0] != "kernel":
                    j += 1
                if j >= len(rs) or rs[j][1] != want:
                    ok = False
                    break
                j += 1
            if ok:
                spans.append((i, j - 1))
                i = j
                continue
        i += 1
    return spans, rs


def between(rs: list, spans: list[tuple[int, int]]) -> dict:
    """Per middle step: graph span, period (graph start to next graph start) and the activities
    from one graph's last kernel's end to the next graph's first kernel's start."""
    mid = spans[len(spans) // 4: len(spans) - len(spans) // 4]
    graph_us, period_us, gap_us, items = [], [], [], collections.OrderedDict()
    for (a, b), (c, _) in zip(mid[:-1], mid[1:]):
        graph_us.append(rs[b][3] - rs[a][2])
        period_us.append(rs[c][2] - rs[a][2])
        gap_us.append(rs[c][2] - rs[b][3])
        prev_end = rs[b][3]
        for k, r in enumerate(rs[b + 1:c]):
            key = f"{k:02d} {r[0]}:{r[1][:60]}"
            d = items.setdefault(key, {"dur": [], "idle_before": []})
            d["dur"].append(r[3] - r[2])
            d["idle_before"].append(r[2] - prev_end)
            prev_end = max(prev_end, r[3])
        d = items.setdefault("zz idle before the next graph", {"dur": [], "idle_before": []})
        d["idle_before"].append(rs[c][2] - prev_end)
        d["dur"].append(0.0)
    med = statistics.median
    return {"steps": len(graph_us), "graph_us": med(graph_us), "period_us": med(period_us),
            "between_us": med(gap_us),
            "items": {k: {"n": len(v["dur"]), "dur_us": med(v["dur"]), "idle_before_us": med(v["idle_before"])}
                      for k, v in items.items()}}


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser()
    add_bench_arguments(ap)
    ap.add_argument("--trace", default="/tmp/kiln_engine_trace.json")
    argv = sys.argv[1:]
    a = ap.parse_args(argv if "--workload" in argv else ["--workload", "decode", *argv])
    if a.steps is None:
        a.steps = 64
    a = with_defaults(a)
    rng = np.random.default_rng(a.seed)
    with engine(a) as llm:
        import torch

        torch.cuda.init()
        vocab = llm.engine.vocab_size
        llm.generate(random_prompts(rng, [8], vocab), sampling(4))  # captures the batch-1 graph
        ex = llm.model.executor
        plan = [k.name for k, *_ in ex._pick(1, 1, 1)["launches"]]
        prompt = random_prompts(rng, [a.context], vocab)
        llm.generate(prompt, sampling(a.steps + 1, a))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = llm.generate(random_prompts(rng, [a.context], vocab), sampling(a.steps + 1, a))
        prof.export_chrome_trace(a.trace)
        tpot = out[0].metrics.tpot
    rs = gpu_records(a.trace)
    spans, rs = split_graphs(rs, plan)
    res = between(rs, spans)
    res.update(tpot_ms=tpot * 1e3, graphs_found=len(spans), context=a.context, steps=a.steps)
    print(f"{len(spans)} batch-1 graphs traced; TPOT {tpot * 1e3:.3f} ms; middle steps: graph {res['graph_us']:.1f} us, "
          f"period {res['period_us']:.1f} us, between graphs {res['between_us']:.1f} us")
    for k, v in res["items"].items():
        print(f"  {k:75s} dur {v['dur_us']:7.2f}  idle before {v['idle_before_us']:7.2f}  (n={v['n']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
