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
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    sampler.sample(logits, md)
                    times.append(time.perf_counter() - t0)
                ms = float(np.median(times)) * 1e3
                res[f"{rows}/{mode}/{tag}"] = ms
                print(f"rows {rows:4d} {mode:8s} {tag:9s} {ms:8.3f} ms a step  same={got == ref}", flush=True)
    la = os.getloadavg()
    print(f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--baseline", action="append", default=[])
    ap.add_argument("--cpu", action="store_true", help="time the host Sampler instead of the GPU kernel")
    ap.add_argument("--reps", type=int, default=30, help="--cpu: timed steps per case")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.cpu:
        res = cpu_main(a)
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
