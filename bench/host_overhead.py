"""Host time of an engine step with the model replaced by a no-op, by engine phase: what the GPU
waits on between steps while the engine schedules, stages inputs and processes outputs.

    python bench/make_random_model.py --shape tiny-llama --out /tmp/tinyllama
    python bench/host_overhead.py --model /tmp/tinyllama --requests 128 --prompt 1000 --steps 100

CPU target only (the executor's `execute` is replaced by one returning zero logits), so the numbers
are the engine's Python, whatever the device.
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np

from kiln import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps (all requests running)")
    ap.add_argument("--token", type=int, default=None,
                    help="the token every step samples (default: zero logits, so token 0, which is <unk> in "
                         "tiny-llama: a special token the detokenizer skips)")
    a = ap.parse_args()
    out_len = a.steps + 200
    llm = LLM(a.model, max_model_len=a.prompt + out_len + 16, max_num_seqs=a.requests, max_num_batched_tokens=2048,
              kv_cache_tokens=a.requests * (a.prompt + out_len + 32))
    eng, vocab = llm.engine, llm.engine.vocab_size
    core = eng.core

    def execute(inputs):
        logits = np.zeros((len(inputs["logits_indices"]), vocab), np.float32)
        if a.token is not None:
            logits[:, a.token] = 1.0
        return {"logits": logits}
    llm.model.executor.execute = execute
    spent: collections.Counter = collections.Counter()

    def timed(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def g(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(obj, name, g)
    timed(core.scheduler, "schedule", "scheduler.schedule")
    timed(core.runner, "execute_model", "model_runner.execute_model")
    timed(core.runner, "_metadata", "  of which sampling metadata")
    timed(core.runner, "_chunks", "  of which chunks")
    if hasattr(core.runner, "_step_inputs"):
        timed(core.runner, "_step_inputs", "  of which step inputs")
    timed(core.runner, "_apply", "  of which applying the scheduler's diff")
    timed(core.runner, "_output", "  of which recording sampled tokens")
    timed(core.runner.sampler, "sample", "  of which numpy sampler (greedy)")
    timed(core.scheduler, "update_from_output", "scheduler.update_from_output")
    timed(eng.output_processor, "process_outputs", "output_processor (detokenize, stops)")
    rng = np.random.default_rng(0)
    for i in range(a.requests):
        eng.add_request(str(i), rng.integers(0, vocab, a.prompt).tolist(),
                        SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0))
    while len(core.scheduler.running) < a.requests or core.scheduler.waiting:
        eng.step()  # prefills
    eng.step()
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    per = (time.perf_counter() - t0) / a.steps
    print(f"{a.requests} requests decoding at ~{a.prompt} tokens of context: {per * 1e3:.2f} ms of host time per step")
    for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {k:40s} {v / a.steps * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
