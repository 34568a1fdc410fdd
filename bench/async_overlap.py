"""How much of the host's per-step work async scheduling hides behind the model: the executor
is replaced by one that sleeps (releasing the GIL, as a GPU step or numpy's BLAS does) and
returns zero logits; a decode batch runs with async scheduling off and on.

    python bench/make_random_model.py --shape tiny-llama --out /tmp/tinyllama
    python bench/async_overlap.py --model /tmp/tinyllama --requests 128 --steps 100 --model-ms 10

Off, a step costs model + host; on, about max(model, host) (the host's scheduling and output
processing run while the model sleeps). CPU target only.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kiln import LLM, SamplingParams


def run(model: str, requests: int, prompt: int, steps: int, model_ms: float, async_scheduling: bool) -> dict:
    out_len = steps + 50
    llm = LLM(model, max_model_len=prompt + out_len + 16, max_num_seqs=requests, max_num_batched_tokens=8192,
              kv_cache_tokens=requests * (prompt + out_len + 32), async_scheduling=async_scheduling)
    eng, vocab = llm.engine, llm.engine.vocab_size
    in_model = [0.0]

    def execute(inputs):
        t = time.perf_counter()
        time.sleep(model_ms / 1e3)
        logits = np.zeros((len(inputs["logits_indices"]), vocab), np.float32)
        logits[:, 5] = 1.0  # a plain token every step
        in_model[0] += time.perf_counter() - t
        return {"logits": logits}

    llm.model.executor.execute = execute
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for i in range(requests):
        eng.add_request(f"r{i}", rng.integers(10, 200, size=prompt).tolist(), params)
    while eng.core.scheduler.get_request_counts()[1] or eng.core.num_steps < 3:  # admit all, warm up
        eng.step()
    in_model[0] = 0.0
    t0, n0 = time.perf_counter(), eng.core.num_steps
    for _ in range(steps):
        eng.step()
    wall = time.perf_counter() - t0
    n = eng.core.num_steps - n0
    eng.abort_request([f"r{i}" for i in range(requests)])
    return {"step_ms": 1e3 * wall / n, "model_ms": 1e3 * in_model[0] / n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--model-ms", type=float, default=10.0, help="how long the fake model step sleeps")
    a = ap.parse_args()
    base = run(a.model, a.requests, a.prompt, a.steps, 0.0, False)
    print(f"host only (model 0 ms, sync): {base['step_ms']:.2f} ms/step")
    for flag in (False, True):
        r = run(a.model, a.requests, a.prompt, a.steps, a.model_ms, flag)
        print(f"async_scheduling={flag!s:5}: {r['step_ms']:.2f} ms/step (model {r['model_ms']:.2f} ms/step, "
              f"host not hidden {r['step_ms'] - r['model_ms']:.2f} ms/step)")


if __name__ == "__main__":
    main()
