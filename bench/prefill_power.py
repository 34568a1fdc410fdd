"""A prompt's prefill on the GPU against the clock the power limit leaves it: the bucket's
launches issued back to back --reps times, after --idle seconds without work and then at once,
each run timed between events, nvidia-smi sampling the SM clock and board power meanwhile.

    python bench/prefill_power.py --model /tmp/llama8b --bundle DIR [--tokens 2048] [--reps 40]
        [--idle 1.0 1.0 0.0] [--max-model-len 4096] [--json OUT]

The first runs after idle find the boost clock (1,980 MHz on the H200); within ~0.1 s the board
reaches its 700 W limit and the driver's SW power cap brings the clock down, and with it the
runs' time (2026-12-04, Llama-3.1-8B shape: 46 ms first, 52-53 ms sustained). Every prefill
figure is one or the other, or a mix: `build.py bench --workload prefill` runs its five prompts
back to back, after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main() -> None:
    from kiln import LLM, SamplingParams
    from kiln.bench.device import PowerLog

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--bundle")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--idle", type=float, nargs="+", default=[1.0, 1.0, 0.0],
                    help="seconds without GPU work before each series")
    ap.add_argument("--json")
    a = ap.parse_args()

    llm = LLM(a.model, target=a.target, bundle_dir=a.bundle, max_model_len=a.max_model_len)
    ex = llm.model.executor
    vocab = llm.engine.vocab_size
    rng = np.random.default_rng(0)
    # one real prompt first: it stages that bucket's inputs, which the series below replay
    llm.generate([[int(t) for t in rng.integers(10, vocab - 10, a.tokens)]], SamplingParams(max_tokens=1))
    plan = ex._pick(a.tokens, 1, 1)
    series = []
    for idle in a.idle:
        time.sleep(idle)
        events = [ex.ctx.event() for _ in range(a.reps + 1)]
        with PowerLog(period_ms=20) as power:
            ex.ctx.record(events[0])
            for i in range(a.reps):
                ex._launch_all(plan)
                ex.ctx.record(events[i + 1])
            ex.ctx.synchronize()
        ms = [ex.ctx.elapsed_ms(events[i], events[i + 1]) for i in range(a.reps)]
        series.append({"idle_s": idle, "run_ms": ms, "gpu_power": power.summary()})
        p = power.summary() or {}
        clock = p.get("sm_clock_mhz", {}).get("median")
        print(f"after {idle:.1f} s idle: runs 1-3 {', '.join(f'{v:.1f}' for v in ms[:3])} ms, median "
              f"{float(np.median(ms)):.2f} ms ({a.tokens / np.median(ms) * 1e3:.0f} tok/s); SM clock median "
              f"{clock} MHz, power-capped share {p.get('power_capped')}")
    ex.close()
    if a.json:
        Path(a.json).write_text(json.dumps({"command": vars(a), "series": series}, indent=1))


if __name__ == "__main__":
    main()
