"""`build.py tune`: sweep GEMM schedules on the GPU, timed the way production runs them.

For every weight of the fused graph ([N, K]) and every GEMM row count M its
buckets use, candidates are compiled (in parallel child processes, through the
same AOT path as a bundle), loaded with cuda.bindings and timed as one CUDA graph
of `reps` back-to-back launches, with the weight rotating over enough copies that
it streams from HBM as in a real step (a layer's weight is never in L2 when its
GEMM starts). The winners become schedules/<arch>/gemm.yaml entries.

Invariance (DESIGN.md): the reduction knobs (BLOCK_K, SPLIT_K) are chosen once per
weight, at the smallest M (the batch-1 decode step, where the GEMM is a pure
weight stream and they matter most), and every other M only varies the tile
(BLOCK_M/BLOCK_N, warps, stages), which never changes an element's sums.
"""
from __future__ import annotations

import ctypes
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kiln.codegen.buckets import Bucket
from kiln.codegen.triton import gemm as k_gemm
from kiln.codegen.triton.aot import cache_key, compile_specs
from kiln.codegen.triton.configs import DEFAULT, GemmReduction, GemmTile
from kiln.graph import Graph
from kiln.schedules import Schedules

MAX_SHARED = {"sm_90": 232448, "sm_121": 101376}  # opt-in dynamic shared memory per block
TUNED_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_CT = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "fp32": ctypes.c_float}


@dataclass
class GemmProblem:
    n: int
    k: int
    out_dtype: str
    has_bias: bool
    ms: list[int] = field(default_factory=list)  # the row counts to tune at


def gemm_problems(graph: Graph, buckets: list[Bucket]) -> list[GemmProblem]:
    """One problem per distinct weight shape; M = tokens (or logits rows for the LM head)
    of each bucket, reduced to the TUNED_MS that cover them."""
    found: dict[tuple, set[int]] = {}
    for node in graph.topo_order():
        if node.op != "linear":
            continue
        n, k = graph.tensors[node.inputs[1]].shape
        lead = graph.tensors[node.inputs[0]].shape[0]
        out = str(graph.tensors[node.outputs[0]].dtype)
        has_bias = len(node.inputs) > 2 and bool(node.inputs[2])
        ms = found.setdefault((n, k, out, has_bias), set())
        for b in buckets:
            ms.add(b.logits if lead == "L" else b.tokens)
    probs = []
    for (n, k, out, bias), ms in sorted(found.items()):
        top = max(ms)
        cover = sorted({next((t for t in TUNED_MS if t >= m), top) for m in ms} | {top})
        probs.append(GemmProblem(n, k, out, bias, [m for m in cover if m <= top]))
    return probs


# -- candidates ---------------------------------------------------------------------------
def reductions(k: int) -> list[GemmReduction]:
    splits = [1, 2] + ([4] if k >= 8192 else [])
    return [GemmReduction(bk, s) for bk in (64, 128) if k % bk == 0 for s in splits]


def tiles(m: int, *, wide: bool) -> list[GemmTile]:
    if m <= 16:  # a weight stream: narrow N, deep pipelines
        ns, warps, stages = (16, 32, 64), ((4,) if not wide else (2, 4, 8)), ((4,) if not wide else (3, 4, 5, 6))
        return [GemmTile(16, bn, w, s) for bn in ns for w in warps for s in stages]
    if m <= 64:
        return [GemmTile(bm, bn, 4, s) for bm in (32, 64) for bn in (32, 64, 128) for s in (3, 4)]
    return [GemmTile(bm, bn, w, s) for bm in (64, 128) for bn in (64, 128, 256) for w in (4, 8) for s in (2, 3, 4)
            if not (bm == 64 and w == 8)]


# -- timing -------------------------------------------------------------------------------
class _Rig:
    """Device buffers for one weight shape, and timed CUDA graphs of candidate launches."""

    def __init__(self, ctx, prob: GemmProblem, max_split: int) -> None:
        self.ctx, self.p = ctx, prob
        m_max = max(prob.ms)
        wbytes = prob.n * prob.k * 2
        self.copies = min(8, max(1, math.ceil(150e6 / wbytes)))
        rng = np.random.default_rng(0)
        pool = (rng.standard_normal(1 << 20) * 0.02).astype(np.float32).view(np.uint32) >> 16
        pool = pool.astype(np.uint16)

        def filled(nbytes: int) -> int:
            ptr = ctx.malloc(nbytes)
            host = np.resize(pool, nbytes // 2)
            ctx.upload(ptr, host)
            return ptr
        self.x = filled(m_max * prob.k * 2)
        self.w = [filled(wbytes) for _ in range(self.copies)]
        self.bias = filled(prob.n * 2)
        out_item = 4 if prob.out_dtype == "f32" else 2
        self.y = ctx.malloc(m_max * prob.n * out_item)
        self.ws = ctx.malloc(max_split * m_max * prob.n * 4)
        self.n_rows = ctx.malloc(4)
        self.allocs = [self.x, *self.w, self.bias, self.y, self.ws, self.n_rows]

    def launches(self, m: int, specs, kernels, rep: int) -> list:
        self.ctx.upload(self.n_rows, np.array([m], np.int32))
        p = self.p
        w = self.w[rep % self.copies]
        args = [[self.x, w, self.bias, self.y, self.ws, self.n_rows, m, p.k, p.n],
                [self.ws, self.bias, self.y, self.n_rows, m, p.n]]
        out = []
        for spec, kern, a in zip(specs, kernels, args):
            vals, types = [], []
            for ty, v in zip(spec.signature.values(), a):
                vals.append(v)
                types.append(ctypes.c_void_p if ty.startswith("*") else _CT[ty])
            vals += [0] * kern.num_scratch
            types += [ctypes.c_void_p] * kern.num_scratch
            g = tuple(spec.grid) + (1,) * (3 - len(spec.grid))
            out.append((kern, g, (tuple(vals), tuple(types))))
        return out

    def time_us(self, m: int, specs, kernels, reps: int = 24) -> float:
        ctx, drv = self.ctx, self.ctx.drv
        seq = [self.launches(m, specs, kernels, r) for r in range(reps)]
        ctx.begin_capture()
        for launches in seq:
            for kern, g, params in launches:
                drv.cuLaunchKernel(kern.function, *g, 32 * kern.num_warps, 1, 1, kern.shared, ctx.stream, params, 0)
        graph = ctx.end_capture()
        ctx.replay(graph)  # warm-up
        start, end = ctx.event(), ctx.event()
        ctx.record(start)
        for _ in range(3):
            ctx.replay(graph)
        ctx.record(end)
        us = ctx.elapsed_ms(start, end) * 1000 / (3 * reps)
        drv.cuGraphExecDestroy(graph)
        return us

    def close(self) -> None:
        for ptr in self.allocs:
            self.ctx.free(ptr)


# -- the sweep ----------------------------------------------------------------------------
class GemmTuner:
    def __init__(self, ctx, arch: str = "sm_90", progress: Callable[[str], None] = print,
                 workers: int | None = None) -> None:
        self.ctx, self.arch, self.progress, self.workers = ctx, arch, progress, workers
        self._kernels: dict[str, object] = {}  # cache key -> loaded kernel

    def _specs(self, prob: GemmProblem, m: int, tile: GemmTile, red: GemmReduction):
        return k_gemm.gemm_specs(m, prob.n, prob.k, out_dtype={"f32": "float32"}.get(prob.out_dtype, "bfloat16"),
                                 has_bias=prob.has_bias, tile=tile, red=red)

    def _compile(self, jobs: list) -> list:
        """jobs: [(prob, m, tile, red)] -> [(specs, kernels) or None when it does not fit]."""
        per_job = [self._specs(*j) for j in jobs]
        unique = {cache_key(s, self.arch): s for specs in per_job for s in specs}
        t0 = time.perf_counter()
        compiled = dict(zip(unique, compile_specs([(s, self.arch) for s in unique.values()], workers=self.workers)))
        self.progress(f"  {len(unique)} kernels compiled (or cached) in {time.perf_counter() - t0:.0f} s")
        out = []
        for specs in per_job:
            keys = [cache_key(s, self.arch) for s in specs]
            if any(compiled[k].shared > MAX_SHARED[self.arch] for k in keys):
                out.append(None)  # does not fit in shared memory
                continue
            for k in keys:
                if k not in self._kernels:
                    c = compiled[k]
                    self._kernels[k] = self.ctx.load_kernel(c.cubin, c.name, c.num_warps, c.shared, c.n_hidden)
            out.append((specs, [self._kernels[k] for k in keys]))
        return out

    def tune(self, problems: list[GemmProblem]) -> Schedules:
        sched = Schedules(self.arch)
        reds: dict[tuple, GemmReduction] = {}
        rigs = {}
        # 1. per weight, at its smallest M: reduction knobs and tile together
        jobs = [(p, p.ms[0], t, r) for p in problems for r in reductions(p.k) for t in tiles(p.ms[0], wide=False)]
        self.progress(f"stage 1: {len(jobs)} reduction x tile candidates at the smallest M of {len(problems)} weights")
        built = self._compile(jobs)
        best: dict[tuple, tuple] = {}
        for (p, m, t, r), b in zip(jobs, built):
            if b is None:
                continue
            key = (p.n, p.k)
            if key not in rigs:
                rigs[key] = _Rig(self.ctx, p, max_split=4)
            us = rigs[key].time_us(m, *b)
            if key not in best or us < best[key][0]:
                best[key] = (us, t, r)
        for p in problems:
            us, t, r = best[(p.n, p.k)]
            reds[(p.n, p.k)] = r
            sched.entries.setdefault("gemm_reduction", []).append(
                {"n": p.n, "k": p.k, "block_k": r.block_k, "split_k": r.split_k, "us": round(us, 2)})
            default = DEFAULT.gemm_tile(p.ms[0], p.n, p.k, self.arch)
            self.progress(f"  [{p.n}, {p.k}] M={p.ms[0]}: block_k {r.block_k}, split_k {r.split_k}, "
                          f"{us:.1f} us ({p.n * p.k * 2 / us / 1e6:.2f} TB/s of weight); default tile {default}")
        # 2. per weight and M: the tile, under the chosen reduction
        jobs = [(p, m, t, reds[(p.n, p.k)]) for p in problems for m in p.ms for t in tiles(m, wide=True)]
        self.progress(f"stage 2: {len(jobs)} tile candidates over {sum(len(p.ms) for p in problems)} (weight, M) pairs")
        built = self._compile(jobs)
        won: dict[tuple, tuple] = {}
        for (p, m, t, r), b in zip(jobs, built):
            if b is None:
                continue
            us = rigs[(p.n, p.k)].time_us(m, *b)
            key = (p.n, p.k, m)
            if key not in won or us < won[key][0]:
                won[key] = (us, t)
        for (n, k, m), (us, t) in sorted(won.items()):
            sched.entries.setdefault("gemm_tile", []).append(
                {"m": m, "n": n, "k": k, "block_m": t.block_m, "block_n": t.block_n, "num_warps": t.num_warps,
                 "num_stages": t.num_stages, "us": round(us, 2)})
            self.progress(f"  [{n}, {k}] M={m}: {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages} {us:.1f} us")
        for rig in rigs.values():
            rig.close()
        return sched
