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
import gc
import pickle
import time

import numpy as np

from kiln import LLM, SamplingParams
from kiln.runtime.core.scheduler_stats import SchedulerStats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps (all requests running)")
    ap.add_argument("--ipc", action="store_true",
                    help="also time pickling each step's message as the engine core process would send it "
                         "(outside the per-step figures: the offline LLM does not pay it)")
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
    # What build_engine_process's core would ship per step (the offline LLM pays none of it):
    # the step message pickled in the core, unpickled in the front.
    try:
        from kiln.runtime.engine.core_client import pack_outputs, unpack_outputs
    except ImportError:  # before the outputs were packed: the list as it is
        pack_outputs = unpack_outputs = lambda x: x  # noqa: E731
    ipc: collections.Counter = collections.Counter()
    core_step = core.step

    def step_and_ship():
        outputs = core_step()
        t = time.perf_counter()
        # (a fresh SchedulerStats: make_stats would take the engine's counters)
        msg = pickle.dumps(("step", pack_outputs(outputs), SchedulerStats(), core.last_step_tokens, core.snapshot()))
        t1 = time.perf_counter()
        unpack_outputs(pickle.loads(msg)[1])
        ipc["core: pack and pickle"] += t1 - t
        ipc["front: unpickle and unpack"] += time.perf_counter() - t1
        ipc["bytes"] += len(msg)
        return outputs
    if a.ipc:
        core.step = step_and_ship
    rng = np.random.default_rng(0)
    for i in range(a.requests):
        eng.add_request(str(i), rng.integers(0, vocab, a.prompt).tolist(),
                        SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0))
    while len(core.scheduler.running) < a.requests or core.scheduler.waiting:
        eng.step()  # prefills
    eng.step()
    states = list(eng.output_processor.states.values())
    for st in states:
        st.detokenizer.output_text  # noqa: B018  (text decoded when read: nothing left before the window)
    spent.clear()
    ipc.clear()
    # A full collection walks every token list of every request (~80 ms here); where one lands
    # is luck, so start the window with none pending (the time of any that runs is printed).
    gc.collect()
    gc_start = [0.0]

    def gc_timer(phase: str, info: dict) -> None:  # garbage collection, inside whichever phase triggered it
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            spent[f"  (garbage collection, gen {info['generation']})"] += time.perf_counter() - gc_start[0]
    gc.callbacks.append(gc_timer)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    per = (time.perf_counter() - t0) / a.steps
    gc.callbacks.remove(gc_timer)
    per -= (ipc["core: pack and pickle"] + ipc["front: unpickle and unpack"]) / a.steps
    # Text without stop strings is decoded when a caller reads it (at the finish of a FINAL_ONLY
    # request): that work belongs to these steps too, so it is timed here and counted in.
    t0 = time.perf_counter()
    for st in states:
        st.detokenizer.output_text  # noqa: B018
    spent["output text decoded when read"] = read = time.perf_counter() - t0
    per += read / a.steps
    print(f"{a.requests} requests decoding at ~{a.prompt} tokens of context: {per * 1e3:.2f} ms of host time per step")
    for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {k:40s} {v / a.steps * 1e3:6.2f} ms")
    if a.ipc:
        print(f"engine core process message (not in the figures above): {ipc['bytes'] / a.steps:.0f} bytes per step")
        for k in ("core: pack and pickle", "front: unpickle and unpack"):
            print(f"  {k:40s} {ipc[k] / a.steps * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
