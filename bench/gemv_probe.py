"""How close can a batch-1 decode GEMM stream its weight to the HBM's read ceiling? A probe.

    python bench/gemv_probe.py [--shapes qkv o_proj gate_up down] [--json OUT]

The batch-1 decode step is the weights streamed once (docs/BENCHMARKS.md: gate/up 4.14 TB/s by
its exposed time in the graph, o_proj 2.8, lm_head ~4.4), so this times, under CUDA graphs
(Triton JIT, torch tensors, enough weight copies rotated that nothing is served from L2):
  read      a pure read of the same bytes (each program sums a contiguous chunk): the ceiling
  tile-read the decode GEMM's access pattern without the dot: [BN, BK] tiles of BN weight rows
  kiln      kiln's gemm at M = 1 with the committed schedule's tile (pointer loads, cp.async)
  kiln-tma  the same tiles loaded through TMA descriptors (GemmTile.tma=True), plus a sweep of
            BLOCK_N / warps / stages / BLOCK_K with TMA on
and checks that every TMA variant gives the pointer tile's bits (the same tiles, the same K
order). Timing only: random weights.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch
import triton
import triton.language as tl

from kiln.bench.device import torch_graph_us
from kiln.codegen.triton.configs import Configs, GemmTile
from kiln.codegen.triton.gemm import gemm
from kiln.schedules import Schedules

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
L2_BYTES = 50 << 20


@triton.jit
def read_sum(p, out, CHUNK: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    base = p + tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, CHUNK, BLOCK, num_stages=STAGES):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc))


@triton.jit
def tile_read(w, out, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = w + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros([BN, BK], tl.float32)
    for k in range(0, K, BK):
        acc += tl.load(rows + k + tl.arange(0, BK)[None, :]).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc))


def graph_us(calls, reps: int = 40) -> float:
    """calls: functions issued in turn (each on its own weight copy), timed by bench/device.py's
    torch_graph_us (best of 5 replays of a graph of `reps` calls) -> us per call."""
    turn = itertools.count()
    return torch_graph_us(lambda: calls[next(turn) % len(calls)](), reps)


def probe(name: str, sched, out: list) -> None:
    n, k = SHAPES[name]
    nbytes = 2 * n * k
    copies = max(2, -(-2 * L2_BYTES // nbytes))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    red = Configs(lookup=sched.lookup).gemm_reduction(n, k)
    base = Configs(lookup=sched.lookup).gemm_tile(1, n, k, "sm_90")
    nr = torch.tensor([1], dtype=torch.int32, device="cuda")
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    wsp = torch.empty(red.split_k, 1, n, device="cuda", dtype=torch.float32)
    sink = torch.empty(1 << 16, device="cuda", dtype=torch.float32)

    def row(kind, us, **kw):
        r = {"shape": name, "n": n, "k": k, "kind": kind, "us": round(us, 2), "TBps": round(nbytes / us / 1e6, 3), **kw}
        out.append(r)
        print(f"  {name:8s} {kind:10s} {us:8.2f} us {r['TBps']:6.3f} TB/s  {kw}", flush=True)

    numel = n * k
    for chunk in (32768, 131072):
        if numel % chunk:
            continue
        for block, warps, stages in ((4096, 4, 1), (4096, 8, 1), (4096, 4, 3)):
            grid = (numel // chunk,)
            if grid[0] > sink.numel():
                continue
            calls = [lambda w=w: read_sum[grid](w, sink, chunk, block, stages, num_warps=warps) for w in ws]
            row("read", graph_us(calls), chunk=chunk, block=block, warps=warps, stages=stages, programs=grid[0])
    for bn, bk in ((16, 128), (32, 64), (32, 128), (64, 64)):
        grid = (n // bn,)
        calls = [lambda w=w: tile_read[grid](w, sink, k, bn, bk, num_warps=4) for w in ws]
        row("tile-read", graph_us(calls), bn=bn, bk=bk, programs=grid[0])

    def run_tile(tile):
        return [lambda w=w: gemm(x, w, None, y, n_rows=nr, workspace=wsp, tile=tile, red=red) for w in ws]

    ptr = dataclasses.replace(base, tma=False)
    gemm(x, ws[0], None, y, n_rows=nr, workspace=wsp, tile=ptr, red=red)
    want = y.clone()
    row("kiln", graph_us(run_tile(ptr)), tile=dataclasses.asdict(ptr), split_k=red.split_k, block_k=red.block_k)
    cands = [dataclasses.replace(base, tma=True)]
    cands += [GemmTile(16, bn, w, s, tma=True, block_k=bk) for bn in (16, 32, 64) for w in (2, 4)
              for s in (4, 6) for bk in (128, 256) if bk <= red.k_per_split(k)]
    for t in cands:
        try:
            gemm(x, ws[0], None, y, n_rows=nr, workspace=wsp, tile=t, red=red)
            same = bool(torch.equal(y, want))
            row("kiln-tma", graph_us(run_tile(t)), tile=dataclasses.asdict(t), bits_equal=same)
        except Exception as e:  # noqa: BLE001 - a candidate the compiler refuses (shared memory) is skipped
            print(f"  {name} {t}: {type(e).__name__}: {str(e)[:120]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--json")
    a = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))  # TMA scratch
    sched = Schedules.read("sm_90")
    out: list = []
    for s in a.shapes:
        probe(s, sched, out)
    best = {}
    for r in out:
        key = (r["shape"], r["kind"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("best per shape and kind:")
    for (s, kind), r in sorted(best.items()):
        print(f"  {s:8s} {kind:10s} {r['us']:8.2f} us {r['TBps']:6.3f} TB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": out, "best": [best[k] for k in sorted(best)]}, f, indent=1)


if __name__ == "__main__":
    main()
