"""Where the compiled CPU target's linear should leave its GEMV for dequantise + BLAS.

    python bench/cpu_linear_switch.py [--tokens 1,2,4,8,12,16,32,128] [--repeats 20]
    OPENBLAS_NUM_THREADS=1 python bench/cpu_linear_switch.py --cpu-time   (one core's CPU time)

Times both paths of runtime/cpu/linear.py on SmolLM2-135M's real Q4_1 weights (layer 0's merged
gate/up [3072, 576] and down [576, 1536]) and its Q8_0 embedding used as the LM head, at each
token count: the GEMV (codes streamed once for all T tokens) and the dequantisation into the
K-major scratch plus numpy's sgemm. Minimum over repeats (other load on the cores only adds).
As in a step, the BLAS path runs numba with one thread (compiled_cpu_executor.py says why).
--cpu-time runs everything on one numba thread and times the calling thread's CPU time, which
other processes on the cores disturb far less than wall time (give OpenBLAS one thread too).
"""
from __future__ import annotations

import argparse
import os
import time

import numba
import numpy as np

from kiln.graph.layout import stack_parts
from kiln.loader import open_source
from kiln.runtime.cpu import linear as L
from kiln.runtime.cpu.packed import pack_gguf


def tmin(f, repeats: int, clock=time.perf_counter) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        f()
        best = min(best, clock() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,12,16,32,128")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cpu-time", action="store_true")
    a = ap.parse_args()
    clock = time.thread_time if a.cpu_time else time.perf_counter
    w = open_source().weights
    raw = lambda n: (w.ggml_type(n).name, w.get(n.removesuffix(".weight") + ".gguf_weight"))  # noqa: E731
    p = "model.layers.0.mlp."
    (tg, g), (_, u) = raw(p + "gate_proj.weight"), raw(p + "up_proj.weight")
    weights = {"gate_up Q4_1 [3072, 576]": pack_gguf(tg, stack_parts([g, u], 16), 576),
               "down Q4_1 [576, 1536]": pack_gguf(*raw(p + "down_proj.weight"), 1536),
               "lm_head Q8_0 [49152, 576]": pack_gguf(*raw("model.embed_tokens.weight"), 576)}
    threads = 1 if a.cpu_time else numba.config.NUMBA_NUM_THREADS
    print(f"load average {os.getloadavg()[0]:.2f}; numba threads {threads}")
    scratch = L.Scratch()
    for name, pw in weights.items():
        print(name)
        for T in (int(t) for t in a.tokens.split(",")):
            x = np.random.default_rng(0).standard_normal((T, pw.k)).astype(np.float32)
            y = np.empty((T, pw.n), np.float32)
            numba.set_num_threads(threads)
            L.gemv(pw, x, y, T)
            g_s = tmin(lambda: L.gemv(pw, x, y, T), a.repeats, clock)

            def blas():
                wt = scratch.get(pw.k, pw.q.shape[0] * pw.q.shape[-1])
                L.dequant_t(pw, wt)
                np.matmul(x, wt[:, :pw.n], out=y)
            numba.set_num_threads(1)
            blas()
            b_s = tmin(blas, a.repeats, clock)
            numba.set_num_threads(threads)
            print(f"  T={T:4d}  gemv {g_s * 1e3:8.3f} ms   dequant+sgemm {b_s * 1e3:8.3f} ms   "
                  f"{'gemv' if g_s < b_s else 'blas'}")


if __name__ == "__main__":
    main()
