"""Time the GPU sampler's sample kernel (codegen/triton/sampling.py) on one GPU, at a vocabulary
of V tokens, for 1, 8 and 512 rows: greedy, temperature alone, top-k 50, top-p 0.9, both.

    python bench/sampler_sweep.py [--vocab 128256] [--baseline MODULE:BLOCKxWARPS ...] [--json OUT]
    python bench/sampler_sweep.py --cpu [--vocab 49152] [--json OUT]

"this": the step's phases (runtime/sample/phases.py) as GpuSampler launches them.
--baseline: a one-launch, one-program-per-row sample_kernel of an earlier kiln (its
sampling.py copied next to this one under another module name), at that launch config, for an
A/B in one process. Every candidate's tokens must equal the first one's (`same`). Times: the
launches captured 20 times in one CUDA graph (codegen/autotune.py Bench.time_us), per step.

--cpu: the host Sampler (runtime/sample/sampler.py) for 1 and 8 rows of random logits, per step
(one Sampler.sample call, the noise draws included; median of --reps): "numpy" (the numpy steps)
and, where this kiln has it, "compiled" (the compiled CPU target's kernels,
runtime/cpu/sample_kernels.py, on KILN_CPU_THREADS threads or the count its ThreadChooser picks,
as the compiled executor runs them), whose tokens must equal
numpy's (`same`). Half the rows are seeded. Run it with PYTHONPATH at an older kiln for a
before/after on the same machine (that kiln's numpy sampler only).

--cpu --engine: the same inside the engine: kiln.LLM on the default model (compiled target), --streams
prompts of 128 random tokens sampled at temperature 0.8, top-p 0.95 for 64 tokens, offline, the runner's
sampler alternated between the compiled kernels and the numpy steps --reps times in one process (so a
change of load on a shared machine hits both alike); output tok/s of each run, the tokens checked equal.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

MODES = {"greedy": (0.0, None, 1.0), "k50p0.9": (0.8, 50, 0.9), "k50": (0.8, 50, 1.0), "p0.9": (0.8, None, 0.9),
         "temp": (0.8, None, 1.0)}  # temperature, top_k (None: off), top_p


def cpu_main(a) -> dict:
    """The host Sampler per step at rows 1 and 8, numpy and (where present) compiled."""
    import os
    import time

    from kiln.runtime.sample.metadata import SamplingMetadata
    from kiln.runtime.sample.sampler import Sampler
    from kiln.runtime.sample.sampling_params import SamplingParams

    try:
        from kiln.runtime.cpu.sample_kernels import CompiledSampler
    except ImportError:  # a kiln from before the compiled sampler
        CompiledSampler = None
    v = a.vocab or 49152
    compiled = None
    if CompiledSampler is not None:  # as the compiled executor makes it
        import numba

        from kiln.runtime.worker.compiled_cpu_executor import ThreadChooser, cpu_threads

        fixed = cpu_threads()
        compiled = (CompiledSampler(threads=lambda: fixed) if fixed
                    else CompiledSampler(chooser=ThreadChooser(numba.config.NUMBA_NUM_THREADS)))
        compiled.warm_up()
    res = {}
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}", flush=True)
    for rows in (1, 8):
        logits = (np.random.default_rng(rows).standard_normal((rows, v)) * 3).astype(np.float32)
        for mode, (tv, kv, pv) in MODES.items():
            params = [SamplingParams(temperature=tv, top_k=kv or 0, top_p=pv, seed=i if i % 2 else None)
                      for i in range(rows)]
            cands = [("numpy", None)] + ([("compiled", compiled)] if compiled is not None else [])
            ref = None
            for tag, comp in cands:
                md = SamplingMetadata.from_requests(params, [[1]] * rows, [[]] * rows, v,
                                                    generators=[p.new_generator() for p in params])
                sampler = Sampler(0, compiled=comp) if comp is not None else Sampler(0)
                got = [sampler.sample(logits, md).sampled_token_ids.tolist() for _ in range(3)]
                ref = ref or got
                times = []
                for _ in range(a.reps or 30):
                    t0 = time.perf_counter()
                    sampler.sample(logits, md)
                    times.append(time.perf_counter() - t0)
                ms = float(np.median(times)) * 1e3
                res[f"{rows}/{mode}/{tag}"] = ms
                print(f"rows {rows:4d} {mode:8s} {tag:9s} {ms:8.3f} ms a step  same={got == ref}", flush=True)
    la = os.getloadavg()
    print(f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}", flush=True)
    return res


def engine_main(a) -> dict:
    """Offline streams through kiln.LLM, the compiled and the numpy sampler alternated."""
    import os
    import time

    from kiln import LLM, SamplingParams

    llm = LLM(None, kv_cache_tokens=8192, enable_prefix_caching=False)
    sampler = llm.engine.core.runner.sampler
    compiled = sampler.compiled
    if compiled is None:
        raise SystemExit("this engine has no compiled sampler (KILN_CPU_BACKEND=numpy, or an older kiln)")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, llm.engine.vocab_size, 128).tolist() for _ in range(a.streams)]
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, ignore_eos=True)
    res: dict = {"compiled": [], "numpy": [], "load": []}
    ref = None
    for rep in range(a.reps or 3):
        for tag, comp in (("compiled", compiled), ("numpy", None)):
            sampler.compiled = comp
            sampler._rng = np.random.default_rng(0)  # the unseeded rows draw the same noise each run
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            dt = time.perf_counter() - t0
            toks = [o.outputs[0].token_ids for o in outs]
            ref = ref or toks
            rate = sum(len(t) for t in toks) / dt
            res[tag].append(rate)
            res["load"].append(os.getloadavg()[0])
            print(f"{a.streams} streams, {tag:8s} sampler: {rate:6.1f} output tok/s  same={toks == ref}  "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    sampler.compiled = compiled
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--baseline", action="append", default=[])
    ap.add_argument("--cpu", action="store_true", help="time the host Sampler instead of the GPU kernel")
    ap.add_argument("--reps", type=int, help="--cpu: timed steps per case (default 30; --engine: runs, default 3)")
    ap.add_argument("--engine", action="store_true", help="--cpu: 8 sampled streams through kiln.LLM instead")
    ap.add_argument("--streams", type=int, default=8, help="--engine: concurrent requests")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.cpu:
        res = engine_main(a) if a.engine else cpu_main(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    from kiln.codegen.autotune import Bench, Timed
    from kiln.codegen.triton.sampling import sampling_spec
    from kiln.runtime.worker.cuda_driver import CudaContext
    from kiln.runtime.sample.phases import PHASE_TOKEN, sample_phases, sample_scratch

    v = a.vocab or 128256
    b = Bench(CudaContext(), "sm_90", progress=lambda s: None)
    res = {}
    for rows in (1, 8, 512):
        logits = b.buffer((rows, v), np.float32,
                          (np.random.default_rng(rows).standard_normal((rows, v)) * 3).astype(np.float32))
        ridx = b.buffer((rows,), np.int32, np.arange(rows))
        for mode, (tv, kv, pv) in MODES.items():
            if rows == 512 and mode in ("k50", "temp"):
                continue
            temp, top_k, top_p = np.full(rows, tv), np.full(rows, kv or v), np.full(rows, pv)
            col = lambda x, dt: b.buffer((rows,), dt, np.asarray(x, dt))
            args = [logits, ridx, col(temp, np.float32), col(top_k, np.int32), col(top_p, np.float32),
                    col(np.zeros(rows), np.float32), b.buffer((rows,), np.int64, np.arange(rows) + 7)]
            out = b.buffer((rows,), np.int32, np.zeros(rows))
            cands = []
            for base in a.baseline:
                mod, cfg = base.split(":")
                blk, w = (int(x) for x in cfg.split("x"))
                new = sampling_spec("sample", v, rows)
                sig = {n: t for n, t in new.signature.items() if n not in ("val_ptr", "idx_ptr", "hist_ptr", "phase")}
                spec = dataclasses.replace(new, module=mod, grid=(rows,), num_warps=w, signature=sig,
                                           divisible=tuple(d for d in new.divisible if d in sig),
                                           constexprs=dict(V=v, BLOCK_V=blk, WRITE_MASKED=False))
                cands.append((f"{mod.rsplit('.', 1)[-1]}/{blk}x{w}", [(spec, args + [out, out, v])]))
            spec = sampling_spec("sample", v, rows)
            o_idx, o_hist, nbytes = sample_scratch(rows, spec.constexprs["NP_PAD"])
            scratch = b.buffer((nbytes,), np.uint8, np.zeros(nbytes, np.uint8)).data_ptr()
            full = args + [out, out, scratch, scratch + o_idx, scratch + o_hist, v]
            launches = [(dataclasses.replace(spec, grid=(rows, 1)) if p == PHASE_TOKEN else spec, full + [p])
                        for p in sample_phases(temp, top_k, top_p, v)]
            cands.append((f"this/{spec.constexprs['BLOCK_V']}x{spec.num_warps}", launches))
            ref = None
            for tag, launches in cands:
                b.compile([s for s, _ in launches])
                us = b.time_us(Timed(reps=[launches] * 20))
                got = b.read(out.data_ptr(), 4 * rows)
                ref = ref or got
                res[f"{rows}/{mode}/{tag}"] = us
                print(f"rows {rows:4d} {mode:8s} {tag:28s} {len(launches):2d} launches: {us:8.1f} us  "
                      f"same={got == ref}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
