"""MoE experts layers on the GPU across schedules: schedules/<arch>/moe.yaml.

What is tuned: per MoE layer shape (E, H, I, top_k, dtype) of the graph and per bucket size T
of the bundle (reduced, as the GEMM's M, to the TUNED_MS that cover them: an entry tuned at T
serves every bucket up to it), the experts layer's MoeConfig (moe_config.py): the path (decode
or grouped) where T*k lies within a factor NEAR of the default threshold, and otherwise the
default's, the grouped path's block_m (the align step's block, shared by both GEMMs), and the
gate_up and down tiles. The router is not tuned (one small launch, no knob).

How it is timed: the layer is recorded through the wrapper the lowering calls
(moe.moe_experts, with the same workspace layout and integer hints as the plan, so the same
cubins) and timed as one CUDA graph of REPS back-to-back layers (autotune.Bench). Each of the
REPS layers routes its tokens another way (uniform, top_k distinct experts a token: a model's
router is less even, but the path threshold is about how many rows land on an expert, and a
uniform routing is the case that spreads them most), so a decode step reads other experts'
weights in each, from HBM as in a real step, where a fixed routing would serve the same few
experts from L2.

The search, per (shape, T): round 1 sweeps the gate_up tile for each (path, block_m) under the
default down tile; round 2 sweeps the down tile under round 1's winner; round 3 times kiln's
default config against each (path, block_m)'s winner and keeps the fastest (the decode path's
two forms, "decode" and "decode_token", are two groups: moe.py). Every round reads
the layer's output back: rounds 1 and 2 refuse a candidate whose bits differ from its
(path, block_m)'s first one, round 3 one whose bits differ from the default config's. So a
written schedule gives every token the default's bits, whatever its path and tiles: none of
them is a reduction knob (moe_gemm.py), and a candidate that says otherwise is a kernel bug
that Bench.mismatches reports, never a faster choice.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace

import numpy as np

from kiln.codegen.autotune import REPS, TUNED_MS, Bench, Timed, Trial, record
from kiln.codegen.buckets import Bucket
from kiln.codegen.triton import moe as k_moe
from kiln.codegen.triton.launch import Buf, next_pow2
from kiln.codegen.triton.moe_config import MoeConfig, default_moe_config
from kiln.codegen.triton.moe_gemm import MoeTile
from kiln.graph import Graph, to_numpy
from kiln.schedules import Schedules

NEAR = 4  # both paths are timed where T*k is within this factor of moe.DECODE_MAX_ASSIGNMENTS
BLOCK_MS = (16, 32, 64, 128)


@dataclass
class MoeProblem:
    e: int
    h: int
    i: int
    top_k: int
    dtype: str  # the activations' and experts' numpy name
    ts: list[int] = field(default_factory=list)  # the bucket sizes to tune at

    @property
    def key(self) -> tuple:
        return self.e, self.h, self.i, self.top_k, self.dtype


def moe_problems(graph: Graph, buckets: list[Bucket]) -> list[MoeProblem]:
    """One problem per distinct MoE experts layer shape; T = each bucket's tokens (a decode and a
    mixed bucket of as many tokens run the same launches), reduced to the TUNED_MS that cover them."""
    found: dict[tuple, MoeProblem] = {}
    for node in graph.topo_order():
        if node.op != "moe_experts":
            continue
        x, ids, _, w13, _ = (graph.tensors[t] for t in node.inputs)
        e, two_i, h = w13.shape
        key = (e, h, two_i // 2, ids.shape[1], to_numpy(x.dtype).name)
        found.setdefault(key, MoeProblem(*key))
    ts = {b.tokens for b in buckets}
    top = max(ts)
    cover = sorted({next((m for m in TUNED_MS if m >= t), top) for t in ts} | {top})
    for p in found.values():
        p.ts = [t for t in cover if t <= top]
    return [found[k] for k in sorted(found)]


def paths(t: int, top_k: int) -> list[str]:
    """The default path, and the others worth timing: both decode forms wherever the default is a
    decode one (moe.py: "decode", a program per assignment and column block, then the rank sum;
    "decode_token", a program per token and column block summing its k experts itself), and the
    grouped or decode forms where T*k is near the threshold between them."""
    n, cut = t * top_k, k_moe.DECODE_MAX_ASSIGNMENTS
    near = cut // NEAR <= n <= cut * NEAR
    default = k_moe.moe_path(t, top_k)
    decode = list(k_moe.DECODE_PATHS)
    if default in decode:
        return decode + (["grouped"] if near else [])
    return [default] + (decode if near else [])


def block_ms(t: int, top_k: int, e: int) -> list[int]:
    """The grouped path's row blocks: up to twice the mean rows of an expert that gets any (a
    block past that is mostly the sentinel's padding rows)."""
    n = t * top_k
    rows = -(-n // min(e, n))
    return [bm for bm in BLOCK_MS if bm <= max(16, 2 * next_pow2(rows))]


def tiles(path: str, block_m: int) -> list[MoeTile]:
    """One GEMM's tile candidates (gate_up's and down's grids are the same). Decode: one live row
    in a 16-row tile streaming an expert's rows, so narrow N and deep K in flight, as the GEMM's
    decode tiles (up to a whole K = 512 step: the down weight of Qwen3.6-35B-A3B's experts in
    one load); grouped: the GEMM's tiles of up to 128 rows. A tile whose stages need more shared
    memory than a block has is compiled and left out (Bench.compile)."""
    if path in k_moe.DECODE_PATHS:
        return [MoeTile(16, bn, bk, w, s) for bn in (16, 32, 64) for bk in (64, 128, 256, 512) for w in (2, 4)
                for s in (2, 3, 4, 5, 6) if s * bk * bn <= 32 * 1024]
    return [MoeTile(block_m, bn, bk, w, s) for bn in (32, 64, 128) for bk in (64, 128) for w in (4, 8)
            for s in (2, 3, 4)]


def _unique(cands: list[MoeConfig]) -> list[MoeConfig]:
    return [c for n, c in enumerate(cands) if c not in cands[:n]]


class _MoeRig:
    """Device buffers for one layer shape at its largest T: x, the experts' weights, REPS
    routings, the routing weights, y, n_rows per T, and each workspace buffer at the largest size
    any candidate asks for (the plan's: moe.moe_workspace)."""

    def __init__(self, bench: Bench, p: MoeProblem, block_ms_: list[int]) -> None:
        self.bench, self.p = bench, p
        self.dt = np.dtype(p.dtype)  # (numpy knows bfloat16 by name once ml_dtypes is imported: autotune does)
        t_max, k = max(p.ts), p.top_k
        self.x = bench.buffer((t_max, p.h), self.dt)
        self.w13 = bench.buffer((p.e, 2 * p.i, p.h), self.dt)
        self.w2 = bench.buffer((p.e, p.h, p.i), self.dt)
        rng = np.random.default_rng(0)
        # ids: each token's k distinct experts, uniform; a fresh routing for each of the REPS layers
        self.ids = [bench.buffer((t_max, k), np.int32, np.argsort(rng.random((t_max, p.e)), axis=1)[:, :k])
                    for _ in range(REPS)]
        tw = rng.random((t_max, k)).astype(np.float32) + 0.5
        self.tw = bench.buffer((t_max, k), np.float32, tw / tw.sum(1, keepdims=True))
        self.y = bench.buffer((t_max, p.h), self.dt)
        self.n_rows = {t: bench.buffer((1,), np.int32, [t]) for t in p.ts}
        need: dict[str, int] = {}
        for t in p.ts:
            for path, bm in [(d, 16) for d in k_moe.DECODE_PATHS] + [("grouped", bm) for bm in block_ms_]:
                for name, (shape, d) in k_moe.moe_workspace(t, k, p.e, p.h, p.i, p.dtype, path=path,
                                                            block_m=bm).items():
                    need[name] = max(need.get(name, 0), int(np.prod(shape)) * np.dtype(d).itemsize)
        self.ws = {name: bench.malloc(nbytes) for name, nbytes in need.items()}

    def timed(self, t: int, cfg: MoeConfig) -> Timed:
        p, k = self.p, self.p.top_k
        view = lambda b, shape: Buf(ptr=b.ptr, shape=shape, dtype=b.np_dtype)  # noqa: E731 (a prefix of rows)
        ws = {name: Buf(ptr=self.ws[name], shape=shape, dtype=np.dtype(d))
              for name, (shape, d) in k_moe.moe_workspace(t, k, p.e, p.h, p.i, p.dtype, path=cfg.path,
                                                          block_m=cfg.block_m).items()}
        x, tw, y = view(self.x, (t, p.h)), view(self.tw, (t, k)), view(self.y, (t, p.h))
        reps = [record(k_moe.moe_experts, x, view(self.ids[r], (t, k)), tw, self.w13, self.w2, y, path=cfg.path,
                       tiles=cfg.tiles, n_rows=self.n_rows[t], workspace=ws, arch=self.bench.arch)
                for r in range(REPS)]
        # the last layer's output (the same routing for every candidate): the bits check's
        return Timed(reps, output=lambda: self.bench.read(self.y.ptr, t * p.h * self.dt.itemsize))


class MoeTuner:
    def __init__(self, bench: Bench) -> None:
        self.bench, self.arch, self.progress = bench, bench.arch, bench.progress

    def _round(self, cands: dict[Hashable, list[MoeConfig]], rig, t_of) -> dict:
        """Bench.best over each group's candidates, its first one the baseline whose bits the rest must give."""
        trials = [Trial(g, c, lambda g=g, c=c: [rig(g).timed(t_of(g), c)], baseline=n == 0)
                  for g, cs in cands.items() for n, c in enumerate(_unique(cs))]
        return self.bench.best(trials)

    def tune(self, problems: list[MoeProblem]) -> Schedules:
        sched = Schedules(self.arch)
        if not problems:
            return sched
        rigs: dict[tuple, _MoeRig] = {}
        by_key = {p.key: p for p in problems}

        def rig(g: tuple) -> _MoeRig:
            p = by_key[g[0]]
            if p.key not in rigs:
                rigs[p.key] = _MoeRig(self.bench, p, sorted({bm for t in p.ts for bm in block_ms(t, p.top_k, p.e)}))
            return rigs[p.key]

        def default(p: MoeProblem, t: int, path: str | None = None) -> MoeConfig:
            return default_moe_config(t, p.top_k, p.e, p.h, p.i, self.arch, path)

        # groups: (shape, T, path, block_m), each starting from the default's tiles at that path and block_m
        start = {(p.key, t, path, bm): replace(default(p, t, path), block_m=bm) for p in problems for t in p.ts
                 for path in paths(t, p.top_k)
                 for bm in ([16] if path in k_moe.DECODE_PATHS else block_ms(t, p.top_k, p.e))}
        t_of = lambda g: g[1]  # noqa: E731
        self.progress(f"moe: {len(start)} (shape, T, path, block_m) groups over T = "
                      f"{', '.join(str(t) for t in sorted({g[1] for g in start}))}")
        won: dict = {g: c for g, c in start.items()}
        for gemm in ("gate_up", "down"):  # round 1, then round 2 under round 1's gate_up
            cands = {g: [c] + [c.with_tile(gemm, tile) for tile in tiles(g[2], g[3])] for g, c in won.items()}
            best = self._round(cands, rig, t_of)
            won = {g: w.cand for g, w in best.items()}
            self.progress(f"  {gemm}: {sum(len(_unique(c)) for c in cands.values())} candidates timed")
        # round 3: per (shape, T), kiln's default (the bits every winner must give) against each group's winner
        finals: dict[tuple, list[MoeConfig]] = {}
        for p in problems:
            for t in p.ts:
                finals[(p.key, t)] = [default(p, t)] + [c for g, c in won.items() if g[:2] == (p.key, t)]
        for (key, t), w in sorted(self._round(finals, rig, t_of).items()):
            e, h, i, top_k, dtype = key
            sched.entries.setdefault("moe_experts", []).append(
                {"t": t, "e": e, "h": h, "i": i, "top_k": top_k, "dtype": dtype, **w.cand.fields(),
                 "us": round(w.us, 2)})
            was = f" (default {w.baseline_us:.1f} us)" if w.baseline_us is not None else ""
            gu, dn = w.cand.tiles
            self.progress(f"  E={e} H={h} I={i} k={top_k} T={t}: {w.cand.path}, block_m {w.cand.block_m}, gate_up "
                          f"{gu.block_n}x{gu.block_k} w{gu.num_warps} s{gu.num_stages}, down {dn.block_n}x{dn.block_k} "
                          f"w{dn.num_warps} s{dn.num_stages}: {w.us:.1f} us a layer{was}")
        self.bench.free_all()
        return sched
