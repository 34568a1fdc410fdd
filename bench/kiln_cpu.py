"""kiln on CPU: prefill and decode tok/s on a GGUF or HF model (default SmolLM2-135M).

    python bench/kiln_cpu.py [--model PATH] [--prompt-tokens 128] [--gen-tokens 128] [--repeats 3] [--json OUT]

Prefill: one step over a prompt of exactly N tokens into an empty cache. Decode: M greedy steps of
one token after that prompt, EOS ignored. Median over repeats. Not a kiln dependency of any test.
The CPU backend is the loader's (KILN_CPU_BACKEND=compiled|numpy); the JSON names the executor
that ran and the 1-minute load average before the runs (other work on the cores slows both).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from kiln.loader import default_model_path, load
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step


def run_once(lm, prompt: list[int], gen: int) -> tuple[float, float]:
    bs = lm.block_size
    blocks = list(range(-(-(len(prompt) + gen) // bs)))
    t0 = time.perf_counter()
    out = lm.executor.execute(prepare_step([SeqChunk(prompt, 0, blocks)], bs))
    tok = int(next(iter(out.values()))[0].argmax())
    t1 = time.perf_counter()
    seq = list(prompt) + [tok]
    for _ in range(gen - 1):
        out = lm.executor.execute(prepare_step([SeqChunk([seq[-1]], len(seq) - 1, blocks)], bs))
        seq.append(int(next(iter(out.values()))[0].argmax()))
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), (gen - 1) / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    model = a.model or str(default_model_path())
    lm = load(model, kv_cache_tokens=a.prompt_tokens + a.gen_tokens + 64)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, lm.source.config.vocab_size, size=a.prompt_tokens).tolist()
    run_once(lm, prompt[:16], 4)  # warm-up
    run_once(lm, prompt, 4)  # the prefill-sized kernels too
    load_avg = os.getloadavg()[0]
    runs = [run_once(lm, prompt, a.gen_tokens) for _ in range(a.repeats)]
    pre = statistics.median(r[0] for r in runs)
    dec = statistics.median(r[1] for r in runs)
    executor = type(lm.executor).__name__
    act_quant = getattr(lm.executor, "act_quant", "") or "none"  # KILN_CPU_ACT_QUANT
    print(f"kiln cpu ({executor}, activations {act_quant}): prefill {pre:.1f} tok/s ({a.prompt_tokens} tokens), decode {dec:.2f} tok/s "
          f"({a.gen_tokens} tokens); load average {load_avg:.2f} before the runs")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"engine": "kiln", "target": "cpu", "prompt_tokens": a.prompt_tokens,
                       "gen_tokens": a.gen_tokens, "prefill_tok_s": pre, "decode_tok_s": dec,
                       "executor": executor, "act_quant": act_quant, "load_average_1m": load_avg,
                       "model": model}, f, indent=1)


if __name__ == "__main__":
    main()
