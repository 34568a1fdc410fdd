"""`build.py tune`: sweep kernel schedules on the GPU, timed the way production runs them.

`Bench` is what every sweep shares. A candidate's launches are recorded through the
kernel wrappers (launch.recording(), so each carries the spec, integer hints and
arguments a bundle's plan would), compiled through the same AOT path as a bundle (in
parallel child processes, cached), loaded with cuda.bindings and timed as one CUDA graph
of back-to-back launches. `Bench.best` keeps the fastest candidate of each group; where a
sweep reads back what its launches wrote, a candidate whose bits differ from the default
config's is never chosen and is listed in `Bench.mismatches` (a schedule knob that changes
results is a bug to report, not a faster candidate). The sweeps: GEMMs here, paged
attention in autotune_attention.py, row kernels in autotune_rows.py, MoE
experts layers in autotune_moe.py.

GEMMs: for every weight of the fused graph ([N, K]) and every GEMM row count M its
buckets use, the weight rotates over enough copies that it streams from HBM as in a
real step (a layer's weight is never in L2 when its GEMM starts). The winners become
schedules/<arch>/gemm.yaml entries.

Invariance (DESIGN.md): the reduction knobs (BLOCK_K, SPLIT_K) are chosen once per
weight (stage 1: each reduction's best tile at the weight's smallest M, the batch-1 decode
step's pure weight stream, and at its largest, a prefill; the objective weighs the two), and
every M then only varies the tile (BLOCK_M/BLOCK_N, warps, stages, and above 16 rows the K
block each program loads, GemmTile.block_k; stage 2), which never changes an element's sums:
stage 2 reads every candidate's output back and refuses one whose bits differ from the
weight's own K block's (`stage2_tiles`).
"""
from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any

import ml_dtypes
import numpy as np

from kiln.codegen.buckets import Bucket
from kiln.codegen.triton import gemm as k_gemm
from kiln.codegen.triton.aot import Compiled, cache_key, compile_specs
from kiln.codegen.triton.configs import DEFAULT, SMS, GemmReduction, GemmTile
from kiln.codegen.triton.launch import Buf, KernelSpec, recording
from kiln.graph import Graph
from kiln.schedules import Schedules

MAX_SHARED = {"sm_90": 232448, "sm_121": 101376}  # opt-in dynamic shared memory per block
TUNED_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
REPS = 24  # launch lists per captured graph
_CT = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "fp32": ctypes.c_float}
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)

Launch = tuple  # (KernelSpec, args): one launch as a kernel wrapper records it


def record(fn: Callable, *args: Any, **kw: Any) -> list[Launch]:
    """The launches a kernel wrapper makes, recorded instead of run."""
    with recording() as launches:
        fn(*args, **kw)
    return launches


@dataclass
class Timed:
    """`reps` launch lists captured back to back as one CUDA graph; its time is per list.
    The lists launch the same kernels (they may rotate buffers). `setup` runs before the
    timing (it restores device memory the launches read), `output` after it: it reads
    back what the launches wrote, for the bits check."""
    reps: list[list[Launch]]
    weight: float = 1.0
    setup: Callable[[], None] | None = None
    output: Callable[[], bytes] | None = None


@dataclass
class Trial:
    """One candidate of a group (the candidates competing for one schedules entry). Its
    time is the weighted sum over `timed()`, built on demand (device buffers exist only
    on the GPU). The baseline's outputs are the bits its group's other trials must give."""
    group: Hashable
    cand: Any
    timed: Callable[[], list[Timed]]
    baseline: bool = False


@dataclass
class Won:
    us: float
    cand: Any
    baseline_us: float | None = None


class Bench:
    """Device memory, compiled candidates and their timing on one GPU (`ctx`: a CudaContext).
    The methods that touch the device are small and few, so a test can stand in for them."""

    def __init__(self, ctx, arch: str = "sm_90", progress: Callable[[str], None] = print,
                 workers: int | None = None) -> None:
        self.ctx, self.arch, self.progress, self.workers = ctx, arch, progress, workers
        self._kernels: dict[str, Any] = {}  # cache key -> loaded kernel (None: does not fit)
        self._allocs: list[int] = []
        self._scratch = (0, 0)  # (pointer, bytes): the launches' global scratch (_scratch_for)
        self._pools: dict[np.dtype, np.ndarray] = {}  # dtype -> random values as bytes
        self.mismatches: list[tuple[Hashable, Any]] = []  # (group, candidate) whose bits differ

    # -- device memory ----------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        ptr = self.ctx.malloc(nbytes)
        self._allocs.append(ptr)
        return ptr

    def upload(self, ptr: int, host: np.ndarray) -> None:
        self.ctx.upload(ptr, host)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.ctx.copy(dst, src, nbytes)

    def read(self, ptr: int, nbytes: int) -> bytes:
        return self.ctx.download(ptr, np.empty(nbytes, np.uint8)).tobytes()

    def free_all(self) -> None:
        for ptr in self._allocs:
            self.ctx.free(ptr)
        self._allocs.clear()
        self._scratch = (0, 0)

    def buffer(self, shape, dtype, data=None) -> Buf:
        """Device memory for an array: `data`, or random values (bf16 bit patterns of a
        normal, std 0.5: finite, also where a kernel reads them as f32)."""
        dt = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape)) * dt.itemsize
        ptr = self.malloc(nbytes)
        if data is not None:
            self.upload(ptr, np.ascontiguousarray(np.asarray(data, dtype=dt).reshape(shape)))
        else:
            pool = self._random(FP8 if dt == FP8 else BF16)
            for off in range(0, nbytes, pool.nbytes):
                self.upload(ptr + off, pool[:min(pool.nbytes, nbytes - off)])
        return Buf(ptr=ptr, shape=shape, dtype=dt)

    def _random(self, dt: np.dtype) -> np.ndarray:
        if dt not in self._pools:
            rng = np.random.default_rng(0)
            self._pools[dt] = (rng.standard_normal(1 << 22) * 0.5).astype(dt).view(np.uint8)
        return self._pools[dt]

    # -- kernels --------------------------------------------------------------------------
    def compile(self, specs: list[KernelSpec]) -> None:
        """Compile (or read from the cache) and load every kernel not loaded yet; one that
        needs more shared memory than a block may have is kept as not fitting."""
        todo: dict[str, KernelSpec] = {}
        for s in specs:
            k = cache_key(s, self.arch)
            if k not in self._kernels:
                todo.setdefault(k, s)
        if not todo:
            return
        t0 = time.perf_counter()
        compiled = compile_specs([(s, self.arch) for s in todo.values()], workers=self.workers)
        for k, c in zip(todo, compiled):
            self._kernels[k] = self._load(c) if c.shared <= MAX_SHARED[self.arch] else None
        self.progress(f"  {len(todo)} kernels compiled (or cached) in {time.perf_counter() - t0:.0f} s")

    def _load(self, c: Compiled) -> Any:
        return self.ctx.load_kernel(c.cubin, c.name, c.num_warps, c.shared, c.n_hidden, c.global_scratch_size)

    def fits(self, spec: KernelSpec) -> bool:
        return self._kernels[cache_key(spec, self.arch)] is not None

    def _resolve(self, spec: KernelSpec, args) -> tuple:
        kern = self._kernels[cache_key(spec, self.arch)]
        vals, types = [], []
        for ty, a in zip(spec.signature.values(), args):
            ptr = ty.startswith("*")
            vals.append((a if isinstance(a, int) else a.data_ptr()) if ptr else a)
            types.append(ctypes.c_void_p if ptr else _CT[ty])
        grid = tuple(spec.grid) + (1,) * (3 - len(spec.grid))
        hidden, hidden_types = kern.hidden_args(self._scratch_for(kern.scratch_bytes(grid)))
        return kern, grid, (tuple(vals + hidden), tuple(types + hidden_types))

    def _scratch_for(self, nbytes: int) -> int:
        """A global scratch buffer of at least nbytes, shared by every launch (they run in order
        on one stream); grown, never shrunk, and only between captures."""
        if nbytes > self._scratch[1]:
            self._scratch = (self.malloc(nbytes), nbytes)
        return self._scratch[0]

    def time_us(self, timed: Timed, replays: int = 3) -> float:
        """Microseconds per launch list: one warm-up replay of the graph, then `replays` timed."""
        ctx, drv = self.ctx, self.ctx.drv
        launches = [self._resolve(spec, args) for rep in timed.reps for spec, args in rep]
        ctx.begin_capture()
        for kern, g, params in launches:
            err = drv.cuLaunchKernel(kern.function, *g, 32 * kern.num_warps, 1, 1, kern.shared, ctx.stream,
                                     params, 0)
            if err[0] != drv.CUresult.CUDA_SUCCESS:
                drv.cuStreamEndCapture(ctx.stream)
                raise RuntimeError(f"launching {kern.name} failed while capturing: {err[0]}")
        graph = ctx.end_capture()
        ctx.replay(graph)
        start, end = ctx.event(), ctx.event()
        ctx.record(start)
        for _ in range(replays):
            ctx.replay(graph)
        ctx.record(end)
        us = ctx.elapsed_ms(start, end) * 1000 / (replays * len(timed.reps))
        drv.cuGraphExecDestroy(graph)
        return us

    # -- the sweep ----------------------------------------------------------------------
    def best(self, trials: list[Trial]) -> dict[Hashable, Won]:
        """Time every trial whose kernels fit and keep the fastest of each group. Baselines
        run first; a trial whose outputs differ from its group's baseline's never wins."""
        built = [(t, t.timed()) for t in sorted(trials, key=lambda t: not t.baseline)]
        self.compile([s for _, ts in built for x in ts for s, _ in x.reps[0]])
        won: dict[Hashable, Won] = {}
        ref: dict[Hashable, tuple[list, float]] = {}
        for trial, ts in built:
            if not all(self.fits(s) for x in ts for s, _ in x.reps[0]):
                continue
            us, outs = 0.0, []
            for x in ts:
                if x.setup:
                    x.setup()
                us += x.weight * self.time_us(x)
                outs.append(x.output() if x.output else None)
            if trial.baseline:
                ref[trial.group] = (outs, us)
            elif trial.group in ref and outs != ref[trial.group][0]:
                self.mismatches.append((trial.group, trial.cand))
                self.progress(f"  BITS DIFFER from the default config: {trial.group} {trial.cand}")
                continue
            if trial.group not in won or us < won[trial.group].us:
                won[trial.group] = Won(us, trial.cand)
        for group, w in won.items():
            w.baseline_us = ref[group][1] if group in ref else None
        return won


class DryBench(Bench):
    """No GPU: the sweeps run as on one, and every candidate they would time is compiled into
    the cubin cache (`build.py tune --compile-only`), so that a GPU run later spends its time
    timing. Nothing is timed: best() keeps each group's first trial, so the GEMM tiles of
    stage 2 are compiled for that trial's reduction only, not for the one a GPU would choose."""

    def __init__(self, arch: str = "sm_90", progress: Callable[[str], None] = print,
                 workers: int | None = None) -> None:
        super().__init__(None, arch, progress, workers)
        self._next = 1 << 36  # fake device addresses: launches are recorded, never run

    def malloc(self, nbytes: int) -> int:
        ptr, self._next = self._next, self._next + -(-nbytes // 256) * 256 + 256
        return ptr

    def upload(self, ptr: int, host: np.ndarray) -> None:
        pass

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        pass

    def read(self, ptr: int, nbytes: int) -> bytes:
        return b""

    def free_all(self) -> None:
        pass

    def _load(self, c: Compiled) -> Any:
        return c.name

    def time_us(self, timed: Timed, replays: int = 3) -> float:
        return math.nan  # not timed: never less than another time, so the first trial stays


# -- GEMMs ------------------------------------------------------------------------------
@dataclass
class GemmProblem:
    n: int
    k: int
    out_dtype: str
    has_bias: bool
    ms: list[int] = field(default_factory=list)  # the row counts to tune at
    silu_group: int = 0  # > 0: the gate/up GEMM with the SwiGLU epilogue (linear_silu_mul), as the bundle runs it
    # a linear_add of this weight shape (o_proj, down): timed with the residual epilogue where the bundle
    # adds it there (gemm.residual_in_epilogue; a last layer's plain linear of the shape takes the same tile)
    residual: bool = False


def gemm_problems(graph: Graph, buckets: list[Bucket]) -> list[GemmProblem]:
    """One problem per distinct weight shape; M = tokens (or logits rows for the LM head)
    of each bucket, reduced to the TUNED_MS that cover them."""
    found: dict[tuple, set[int]] = {}
    residual: set[tuple] = set()
    for node in graph.topo_order():
        if node.op not in ("linear", "linear_silu_mul", "linear_add", "linear_rope"):
            continue
        n, k = graph.tensors[node.inputs[1]].shape
        lead = graph.tensors[node.inputs[0]].shape[0]
        out = str(graph.tensors[node.outputs[0]].dtype)  # (linear_rope's q: the model's dtype, as its GEMM's)
        # linear_add's 3rd input is the residual; linear_rope's bias is its 6th (timed as the plain GEMM)
        bias_at = {"linear": 2, "linear_rope": 5}.get(node.op)
        has_bias = bias_at is not None and len(node.inputs) > bias_at and bool(node.inputs[bias_at])
        silu = node.attrs["group"] if node.op == "linear_silu_mul" else 0
        ms = found.setdefault((n, k, out, has_bias, silu), set())
        if node.op == "linear_add":
            residual.add((n, k, out, has_bias, silu))
        for b in buckets:
            ms.add(b.logits if lead == "L" else b.tokens)
    probs = []
    for (n, k, out, bias, silu), ms in sorted(found.items()):
        top = max(ms)
        cover = sorted({next((t for t in TUNED_MS if t >= m), top) for m in ms} | {top})
        probs.append(GemmProblem(n, k, out, bias, [m for m in cover if m <= top], silu,
                                 (n, k, out, bias, silu) in residual))
    return probs


def reductions(k: int) -> list[GemmReduction]:
    """BLOCK_K x SPLIT_K where K divides evenly and every split has some of it."""
    splits = [1, 2] + ([4] if k >= 8192 else [])
    return [GemmReduction(bk, s) for bk in (64, 128) if k % bk == 0 for s in splits
            if (-(-k // bk) + s - 1) // s * bk * (s - 1) < k]


# The tiles that rank the reductions at a weight's largest M (stage 1, objectives other
# than decode): the wgmma tiles a 2,048-row prefill runs on the H200.
PREFILL_TILES = [GemmTile(128, bn, 8, s) for bn in (128, 256) for s in (3, 4)]
OBJECTIVES = ("balanced", "decode", "prefill", "keep")


def tiles(m: int) -> list[GemmTile]:
    """The tile candidates at M rows (stage 1 ranks the reductions on them at a weight's smallest M,
    stage 2 picks per M). M <= 16, a weight stream: narrow N, deep pipelines; BLOCK_K 64 keeps half
    of BLOCK_K 128's bytes in flight per stage, so it needs the deeper ones to stream as fast."""
    if m <= 16:
        return [GemmTile(16, bn, w, s) for bn in (16, 32, 64) for w in (2, 4, 8) for s in (3, 4, 5, 6, 8)]
    if m <= 64:
        return [GemmTile(bm, bn, 4, s) for bm in (32, 64) for bn in (32, 64, 128) for s in (3, 4)]
    return [GemmTile(bm, bn, w, s) for bm in (64, 128) for bn in (64, 128, 256) for w in (4, 8) for s in (2, 3, 4)
            if not (bm == 64 and w == 8)]


def stage2_tiles(m: int, n: int, k: int, red: GemmReduction, arch: str = "sm_90") -> list[GemmTile]:
    """Stage 2's candidates at M rows under the weight's reduction: tiles(m), and above 16 rows
    the same tiles with the other K block (64 or 128) where it cuts every split into whole
    blocks. The weight's own K block serves decode, where it sets the bytes in flight; a
    prefill tile may want the other (BLOCK_K 128 leaves a 128 x 256 tile 2 stages of shared
    memory where 64 leaves it 4). The K block moves no rounding (gemm.py), and the bits
    check holds every candidate to that.
    Under split-K, also each of those tiles folded (fold=True) where Configs.gemm_fold's rule
    would not fold it but its output tiles fill every SM once: the split-K of a weight is
    chosen for decode, and a prefill tile of 128 x 256 (which folds through memory,
    gemm.fold_through_memory) may then beat the partials' second set of programs.
    Where M has more row blocks than a tile's GROUP_M, also that tile with all of them in one
    group (a schedule knob: which programs run side by side, not what they sum): each W tile
    then comes from HBM once while x is re-read from L2, where a group of 8 reads W once per
    group (2,048 rows of 128: twice). H200, Llama-3.1-8B's four 2,048-row GEMMs: 1-2 % each, the
    prefill's GPU time -2.4 % (docs/BENCHMARKS.md, 2026-12-04 fourth session)."""
    base = tiles(m)
    if m <= 16:
        return base
    per = red.k_per_split(k)
    other = [bk for bk in (64, 128) if bk != red.block_k and k % bk == 0 and (red.split_k == 1 or per % bk == 0)]
    out = base + [replace(t, block_k=bk) for bk in other for t in base]
    if red.split_k > 1:
        sms = SMS.get(arch, SMS["sm_90"])
        out += [replace(t, fold=True) for t in out
                if per >= 2 * (t.block_k or red.block_k) and not DEFAULT.gemm_fold(m, n, k, t, red, arch)
                and -(-m // t.block_m) * -(-n // t.block_n) >= sms]
    out += [replace(t, group_m=-(-m // t.block_m)) for t in out if -(-m // t.block_m) > t.group_m]
    return out


class _GemmRig:
    """Device buffers for one weight shape: x, `copies` of the weight (so that it streams
    from HBM), bias, y, the split-K workspace, and a live-row count per M."""

    def __init__(self, bench: Bench, prob: GemmProblem) -> None:
        self.bench, self.p = bench, prob
        m_max, n, k = max(prob.ms), prob.n, prob.k
        self.copies = min(8, max(1, math.ceil(150e6 / (n * k * 2))))
        self.x = bench.buffer((m_max, k), BF16)
        self.w = [bench.buffer((n, k), BF16) for _ in range(self.copies)]
        self.bias = bench.buffer((n,), BF16) if prob.has_bias else None
        self.out_dtype = np.dtype(np.float32) if prob.out_dtype == "f32" else BF16
        self.y = bench.malloc(m_max * n * self.out_dtype.itemsize)
        self.ws = bench.malloc(max(r.split_k for r in reductions(k)) * m_max * n * 4)
        self.res = bench.buffer((m_max, n), self.out_dtype) if prob.residual else None
        self.n_rows: dict[int, Buf] = {}

    def timed(self, m: int, tile: GemmTile, red: GemmReduction) -> Timed:
        p = self.p
        if m not in self.n_rows:
            self.n_rows[m] = self.bench.buffer((1,), np.int32, [m])
        x = Buf(ptr=self.x.ptr, shape=(m, p.k), dtype=BF16)
        g = p.silu_group
        y = Buf(ptr=self.y, shape=(m, p.n // 2 if g else p.n), dtype=self.out_dtype)
        tile = k_gemm.silu_tile(tile, g)  # as the bundle's lowering widens it
        ws = Buf(ptr=self.ws, shape=(red.split_k, m, p.n), dtype=np.float32) if red.split_k > 1 else None
        nbytes = int(np.prod(y.shape)) * self.out_dtype.itemsize
        res = None
        fold = DEFAULT.gemm_fold(m, p.n, p.k, tile, red, self.bench.arch)
        if p.residual and k_gemm.residual_in_epilogue(m, red.split_k, fold):
            res = Buf(ptr=self.res.ptr, shape=(m, p.n), dtype=self.out_dtype)
        # the last list's output (the same weight copy for every candidate): the bits check's
        output = lambda: self.bench.read(self.y, nbytes)
        reduce = not by_norm(p, m, red, fold)
        if not reduce:
            # The bundle leaves these partials to add_rms_norm (codegen/lower.py op_linear_add), so
            # no reduce launch is timed; the partials are what the bits check compares.
            output = lambda: self.bench.read(self.ws, red.split_k * m * p.n * 4)
        elif p.residual and res is None:
            # Compared as h = y + residual, the value either way reaches the norm with: a tile that
            # folds adds it in its epilogue, one that does not leaves it to add_rms_norm (same
            # rounding: y rounded, the sum in f32, rounded again). Compared as y, every folding
            # candidate of a split-K linear_add would differ from a baseline that does not fold.
            output = lambda: _plus_residual(self.bench.read(self.y, nbytes), self.bench.read(self.res.ptr, nbytes),
                                            self.out_dtype)
        return Timed([record(k_gemm.gemm, x, self.w[r % self.copies], self.bias, y, n_rows=self.n_rows[m],
                             workspace=ws, tile=tile, red=red, arch=self.bench.arch, silu_group=g, residual=res,
                             reduce=reduce)
                      for r in range(REPS)], output=output)


def by_norm(p: GemmProblem, m: int, red: GemmReduction, fold: bool) -> bool:
    """Whether the tuner times this GEMM without its split-K reduce launch: a linear_add
    (o_proj, down) whose partials the next add_rms_norm sums in the bundle (split-K, not folded:
    codegen/lower.py op_linear_add), at up to 16 rows. There the partials cost the norm a read of
    S x 16 x N f32, nothing against its latency, while the reduce launch the rig would otherwise
    time is a kernel the bundle never runs (it kept o_proj at one split where two are 30 us a
    decode step faster in the graph; docs/BENCHMARKS.md). Above 16 rows the partials' round trip
    through the norm costs bytes, and the reduce launch stands in for it."""
    return p.residual and red.split_k > 1 and not fold and m <= 16


def _plus_residual(y: bytes, res: bytes, dtype: np.dtype) -> bytes:
    """Bytes of (y + res) in `dtype`, the sum in f32 (add_rms_norm's and the epilogue's add)."""
    if not y:  # DryBench reads nothing
        return y
    a, b = np.frombuffer(y, dtype), np.frombuffer(res, dtype)
    return (a.astype(np.float32) + b.astype(np.float32)).astype(dtype).tobytes()


class GemmTuner:
    def __init__(self, bench: Bench) -> None:
        self.bench, self.arch, self.progress = bench, bench.arch, bench.progress

    def tune(self, problems: list[GemmProblem], objective: str = "balanced",
             known: Callable[[int, int], GemmReduction | None] | None = None) -> Schedules:
        """objective: what a weight's reduction (BLOCK_K, split-K) is chosen for. Batch invariance
        fixes it for every M, so the choice trades decode (smallest M, where split-K buys
        programs) against prefill (largest M, where it costs f32 partials): "decode" and
        "prefill" take the fastest at that end; "balanced" the smallest sum of the two
        slowdowns against each end's fastest reduction; "keep" the reduction `known(n, k)`
        gives (the committed schedules': stage 2 alone re-tunes the tiles), "balanced" for a
        weight without one."""
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown GEMM objective {objective!r} (known: {', '.join(OBJECTIVES)})")
        sched = Schedules(self.arch)
        kept = {(p.n, p.k): r for p in problems
                if objective == "keep" and known is not None and (r := known(p.n, p.k)) is not None}
        for (n, k), r in kept.items():
            self.progress(f"  [{n}, {k}]: keeping block_k {r.block_k}, split_k {r.split_k}")
        problems, all_problems = [p for p in problems if (p.n, p.k) not in kept], problems
        objective = "balanced" if objective == "keep" else objective
        rigs: dict[tuple, _GemmRig] = {}

        def rig(p: GemmProblem) -> _GemmRig:
            if (p.n, p.k, p.silu_group) not in rigs:
                rigs[(p.n, p.k, p.silu_group)] = _GemmRig(self.bench, p)
            return rigs[(p.n, p.k, p.silu_group)]

        # 1. per weight and reduction: the best tile at its smallest M and, unless the objective
        # is decode, at its largest; then the reduction the objective prefers
        ends = {(p.n, p.k): [p.ms[0]] + ([p.ms[-1]] if objective != "decode" and p.ms[-1] > 64 else [])
                for p in problems}
        trials = [Trial((p.n, p.k, m, r), t, lambda p=p, m=m, t=t, r=r: [rig(p).timed(m, t, r)])
                  for p in problems for r in reductions(p.k) for m in ends[(p.n, p.k)]
                  for t in (tiles(m) if m == p.ms[0] else PREFILL_TILES)]
        self.progress(f"stage 1: {len(trials)} reduction x tile candidates at the smallest "
                      f"{'' if objective == 'decode' else 'and largest '}M of {len(problems)} weights "
                      f"(objective: {objective})")
        won = self.bench.best(trials)
        reds: dict[tuple, GemmReduction] = {}
        for p in problems:
            at = ends[(p.n, p.k)]
            cands = [r for r in reductions(p.k) if all((p.n, p.k, m, r) in won for m in at)]
            us = {m: {r: won[(p.n, p.k, m, r)].us for r in cands} for m in at}
            lo, hi = at[0], at[-1]
            if objective == "decode" or hi == lo:
                cost = us[lo]
            elif objective == "prefill":
                cost = us[hi]
            else:
                cost = {r: us[lo][r] / min(us[lo].values()) + us[hi][r] / min(us[hi].values()) for r in cands}
            r = reds[(p.n, p.k)] = min(cands, key=cost.__getitem__)
            entry = {"n": p.n, "k": p.k, "block_k": r.block_k, "split_k": r.split_k, "us": round(us[lo][r], 2)}
            if hi != lo:
                entry["prefill_us"] = round(us[hi][r], 2)
            sched.entries.setdefault("gemm_reduction", []).append(entry)
            default = DEFAULT.gemm_tile(p.ms[0], p.n, p.k, self.arch)
            self.progress(f"  [{p.n}, {p.k}] M={lo}: block_k {r.block_k}, split_k {r.split_k}, "
                          f"{us[lo][r]:.1f} us ({p.n * p.k * 2 / us[lo][r] / 1e6:.2f} TB/s of weight); "
                          f"default tile {default}")
            for c in cands:
                self.progress(f"    block_k {c.block_k} split_k {c.split_k}: "
                              + ", ".join(f"M={m} {us[m][c]:.1f} us" for m in at))
        # 2. per weight and M: the tile, under the chosen reduction; the first candidate (the
        # weight's own K block) gives the bits every other one must
        reds.update(kept)
        problems = all_problems
        trials = [Trial((p.n, p.k, m), t, lambda p=p, m=m, t=t: [rig(p).timed(m, t, reds[(p.n, p.k)])],
                        baseline=i == 0)
                  for p in problems for m in p.ms
                  for i, t in enumerate(stage2_tiles(m, p.n, p.k, reds[(p.n, p.k)], self.arch))]
        self.progress(f"stage 2: {len(trials)} tile candidates over {sum(len(p.ms) for p in problems)} "
                      f"(weight, M) pairs")
        for (n, k, m), w in sorted(self.bench.best(trials).items()):
            t = w.cand
            sched.entries.setdefault("gemm_tile", []).append(
                {"m": m, "n": n, "k": k, "block_m": t.block_m, "block_n": t.block_n, "num_warps": t.num_warps,
                 "num_stages": t.num_stages, **({"block_k": t.block_k} if t.block_k else {}),
                 **({"fold": True} if t.fold else {}),
                 **({"group_m": t.group_m} if t.group_m != GemmTile.group_m else {}), "us": round(w.us, 2)})
            self.progress(f"  [{n}, {k}] M={m}: {t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}"
                          f"{f' block_k {t.block_k}' if t.block_k else ''}{' fold' if t.fold else ''}"
                          f"{f' group_m {t.group_m}' if t.group_m != GemmTile.group_m else ''} {w.us:.1f} us")
        self.bench.free_all()
        return sched
