"""Time the GPU sampler's sample kernel (codegen/triton/sampling.py) on one GPU, at a vocabulary
of V tokens, for 1, 8 and 512 rows: greedy, temperature alone, top-k 50, top-p 0.9, both.

    python bench/sampler_sweep.py [--vocab 128256] [--configs 2048x8,8192x32]
        [--baseline-module kiln.codegen.triton.sampling_old] [--json OUT]

Each config is BLOCK_VxWARPS. --baseline-module: the same kernel from another module (e.g. the
previous commit's sampling.py copied next to this one), timed with every config as well, for
an A/B in one process. Every candidate's tokens must equal the first one's (`same`): the
sampled tokens do not depend on the launch config. Times: the kernel captured 20 times in one
CUDA graph (codegen/autotune.py Bench.time_us), per launch.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from kiln.codegen.autotune import Bench, Timed
from kiln.codegen.triton.configs import ElementwiseConfig
from kiln.codegen.triton.sampling import sampling_spec
from kiln.runtime.cuda_driver import CudaContext

MODES = {"greedy": (0.0, None, 1.0), "k50p0.9": (0.8, 50, 0.9), "k50": (0.8, 50, 1.0), "p0.9": (0.8, None, 0.9),
         "temp": (0.8, None, 1.0)}  # temperature, top_k (None: off), top_p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--configs", default="2048x8,8192x32")
    ap.add_argument("--baseline-module")
    ap.add_argument("--json")
    a = ap.parse_args()
    v = a.vocab
    configs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",")]
    modules = ([a.baseline_module] if a.baseline_module else []) + [None]
    b = Bench(CudaContext(), "sm_90", progress=lambda s: None)
    res = {}
    for rows in (1, 8, 512):
        logits = b.buffer((rows, v), np.float32,
                          (np.random.default_rng(rows).standard_normal((rows, v)) * 3).astype(np.float32))
        ridx = b.buffer((rows,), np.int32, np.arange(rows))
        for mode, (tv, kv, pv) in MODES.items():
            if rows == 512 and mode in ("k50", "temp"):
                continue
            col = lambda x, dt: b.buffer((rows,), dt, np.full(rows, x))
            args = [logits, ridx, col(tv, np.float32), col(kv or v, np.int32), col(pv, np.float32),
                    col(0.0, np.float32), b.buffer((rows,), np.int64, np.arange(rows) + 7)]
            out = b.buffer((rows,), np.int32, np.zeros(rows))
            ref = None
            for mod in modules:
                for blk, w in configs:
                    spec = sampling_spec("sample", v, rows, config=ElementwiseConfig(block=blk, num_warps=w))
                    if mod:
                        spec = dataclasses.replace(spec, module=mod)
                    b.compile([spec])
                    us = b.time_us(Timed(reps=[[(spec, args + [out, out, v])]] * 20))
                    got = b.read(out.data_ptr(), 4 * rows)
                    ref = ref or got
                    tag = "baseline" if mod else "this"
                    res[f"{rows}/{mode}/{tag}/{blk}/{w}"] = us
                    print(f"rows {rows:4d} {mode:8s} {tag:8s} block {blk:5d} warps {w:2d}: {us:8.1f} us  "
                          f"same={got == ref}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
