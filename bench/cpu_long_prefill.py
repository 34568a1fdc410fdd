"""kiln on CPU: how prefill time grows with the prompt, and how long a short request waits behind
a long one (issue 42 #3). Not a dependency of any test.

    python bench/cpu_long_prefill.py [--model PATH] [--lengths 256,1024,2048,4096] [--budget 2048]
                                     [--behind 2048] [--json OUT]

Prefill: an N-token prompt into an empty cache in chunks of --budget tokens (what the engine does
with max_num_batched_tokens = --budget), wall time of the executor steps. Behind: a --behind-token
prompt (at least two chunks) is submitted, one engine step runs, then a 5-token prompt arrives; its wait is the time
from its arrival to its first token, and the steps that took.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kiln import LLM, SamplingParams
from kiln.loader import default_model_path, load
from kiln.runtime.engine.outputs import OutputKind
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step


def prefill_seconds(lm, n: int, budget: int, rng) -> float:
    prompt = rng.integers(100, lm.source.config.vocab_size, size=n).tolist()
    blocks = list(range(-(-(n + 1) // lm.block_size)))
    t0 = time.perf_counter()
    for s in range(0, n, budget):
        lm.executor.execute(prepare_step([SeqChunk(prompt[s:s + budget], s, blocks)], lm.block_size))
    return time.perf_counter() - t0


def short_behind_long(model: str, n: int, budget: int, rng) -> tuple[float, int]:
    llm = LLM(model, max_num_batched_tokens=budget, kv_cache_tokens=n + 512)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eng.add_request("long", rng.integers(100, 40000, size=n).tolist(), sp, output_kind=OutputKind.DELTA)
    eng.step()
    t0, steps = time.perf_counter(), 0
    eng.add_request("short", [1, 2, 3, 4, 5], sp, output_kind=OutputKind.DELTA)
    while True:
        steps += 1
        if any(o.request_id == "short" and o.outputs[0].token_ids for o in eng.step()):
            return time.perf_counter() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--lengths", default="256,1024,2048,4096")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--behind", type=int, default=2048)
    ap.add_argument("--json")
    a = ap.parse_args()
    model = a.model or str(default_model_path())
    lengths = [int(x) for x in a.lengths.split(",")]
    rng = np.random.default_rng(0)
    lm = load(model, kv_cache_tokens=max(lengths) + 64)
    prefill_seconds(lm, 32, a.budget, rng)  # warm-up
    result = {"model": model, "budget": a.budget, "prefill_s": {}}
    for n in lengths:
        s = prefill_seconds(lm, n, a.budget, rng)
        result["prefill_s"][n] = s
        print(f"prefill {n:5d} tokens: {s:7.2f} s  ({n / s:6.1f} tok/s)", flush=True)
    for budget in sorted({a.budget, 256}):
        behind = max(a.behind, 2 * budget)  # at least two chunks: the short one arrives after the first
        wait, steps = short_behind_long(model, behind, budget, rng)
        result[f"short_behind_{behind}_budget_{budget}"] = {"wait_s": wait, "steps": steps}
        print(f"5-token request behind a {behind}-token prefill, budget {budget}: first token after "
              f"{wait:.2f} s, {steps} step(s)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
