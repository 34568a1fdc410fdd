"""Upper bounds for decode fusions on the GPU: the batch-1 decode bucket's CUDA graph replayed
with some kernels' launches left out (their outputs go stale: timing only, never tokens).

    python bench/make_random_model.py --shape llama-3.1-8b --out /tmp/llama8b
    python bench/decode_drop.py --model /tmp/llama8b --bundle /tmp/b8 [--context 512] [--json OUT]

Prints the graph's time with every launch and without each group (the norms, the attention
preamble, the attention): what fusing a group away could win at most, since a fused kernel
still does the work somewhere. docs/GPU_NOTES.md has a run.
"""
from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from kiln import LLM, SamplingParams

GROUPS = {
    "all launches": lambda name: False,
    "without the attention preambles": lambda name: "preamble" in name,
    "without the norms": lambda name: "rms_norm" in name,
    "without norms and preambles": lambda name: "rms_norm" in name or "preamble" in name,
    "without the attentions": lambda name: "paged_attention" in name,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode step")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--json")
    a = ap.parse_args()
    llm = LLM(a.model, target=a.target, bundle_dir=a.bundle, max_model_len=a.max_model_len)
    ex = llm.model.executor
    ctx = ex.ctx
    vocab = llm.engine.vocab_size
    prompt = np.random.default_rng(1).integers(0, vocab, a.context).tolist()
    llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))  # stages a decode step
    plan = next(p for p in ex.plans.values() if p["decode"] and p["tokens"] == 1)
    launches = plan["launches"]
    print(len(launches), "launches:", dict(collections.Counter(k.name for k, *_ in launches)))

    def graph_us(kept) -> float:
        ctx.begin_capture()
        ex._launch_all({"launches": kept})
        g = ctx.end_capture()
        for _ in range(30):
            ctx.replay(g)
        start, end = ctx.event(), ctx.event()
        ctx.record(start)
        for _ in range(a.replays):
            ctx.replay(g)
        ctx.record(end)
        return ctx.elapsed_ms(start, end) / a.replays * 1000

    res = collections.defaultdict(list)
    for _ in range(3):  # the groups in turn, three rounds
        for group, drop in GROUPS.items():
            res[group].append(graph_us([x for x in launches if not drop(x[0].name)]))
    out = {}
    for group, us in res.items():
        n = sum(1 for x in launches if not GROUPS[group](x[0].name))
        out[group] = {"launches": n, "graph_us": float(np.median(us)), "runs_us": us}
        print(f"{group:32s} {n:4d} launches  {np.median(us):8.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bundle": a.bundle, "context": a.context, "groups": out}, f, indent=1)


if __name__ == "__main__":
    main()
