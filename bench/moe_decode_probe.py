"""The fused MoE decode path's kernels alone on one GPU, at the Qwen3.6-35B-A3B layer shape
(E 256, top-8, H 2048, I 512, bf16; issue 37): us and GB/s of expert weights per kernel and per
layer, for T = 1, 2, 4, 8, 16 tokens.

    python bench/moe_decode_probe.py [--ts 1 2 4 8 16] [--sweep] [--json OUT]

Variants (codegen/triton/moe.py): "new" the decode path (gate_up and down over (column block,
assignment), then moe_sum's rank-order sum) at its default tiles; "old" the decode_token form at
its default tiles (kiln's decode path before issue 37: down over (column block, token) walking
the k experts); "grouped" for reference. Every variant's output must equal the first's bit for
bit (`bits`). --sweep also times every decode tile the tuner sweeps (autotune_moe.tiles) for
each GEMM of the new form alone and prints the best few.

Timing is the MoE tuner's (codegen/autotune_moe.py _MoeRig, codegen/autotune.py Bench): the
layer recorded through moe.moe_experts (the plan's specs and integer hints), compiled AOT,
launched with cuda.bindings and timed as one CUDA graph of 24 layers that each route their
tokens another way (uniform top-8), so each layer reads its experts' weights from HBM. A
kernel "alone" is the same graph holding only that kernel's 24 launches. GB/s: the distinct
experts' weight bytes the kernel reads (w13 for gate_up, w2 for down; the layer: both), averaged
over the 24 routings, per us. The H200 copies at ~4.27 TB/s (docs/GPU_NOTES.md: pure reads cap
at ~4.36).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from kiln.codegen.autotune import REPS, Bench, Timed
from kiln.codegen.autotune_moe import MoeProblem, _MoeRig, tiles
from kiln.codegen.triton.moe import moe_tiles
from kiln.codegen.triton.moe_config import MoeConfig
from kiln.runtime.worker.cuda_driver import CudaContext

E, K, H, I = 256, 8, 2048, 512
GEMMS = {"moe_gate_up_kernel": 2 * I * H * 2, "moe_down_kernel": H * I * 2}  # weight bytes an expert


def variants(t: int) -> dict[str, MoeConfig]:
    return {"new": MoeConfig.of("decode", *moe_tiles(t, K, E, H, I, path="decode")),
            "old": MoeConfig.of("decode_token", *moe_tiles(t, K, E, H, I, path="decode_token")),
            "grouped": MoeConfig.of("grouped", *moe_tiles(t, K, E, H, I, path="grouped"))}


def only(timed: Timed, kernel: str) -> Timed:
    return Timed([[ln for ln in rep if ln[0].kernel == kernel] for rep in timed.reps])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ts", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--sweep", action="store_true", help="also time every decode tile of each GEMM alone")
    ap.add_argument("--json")
    a = ap.parse_args()
    b = Bench(CudaContext(), "sm_90", progress=lambda s: None)
    p = MoeProblem(E, H, I, K, "bfloat16", ts=sorted(a.ts))
    rig = _MoeRig(b, p, [16, 32])
    t_max = max(p.ts)
    ids = [np.frombuffer(b.read(r.ptr, t_max * K * 4), np.int32).reshape(t_max, K) for r in rig.ids]
    rows = []

    def report(t, name, kernel, us, experts):
        nbytes = experts * (sum(GEMMS.values()) if kernel == "layer" else GEMMS.get(kernel, 0))
        r = {"t": t, "variant": name, "kernel": kernel, "us": round(us, 2), "GBps": round(nbytes / us / 1e3)}
        rows.append(r)
        print(f"  T={t:2d} {name:8s} {kernel:20s} {us:7.2f} us {r['GBps']:6d} GB/s", flush=True)

    for t in p.ts:
        experts = float(np.mean([len(np.unique(x[:t])) for x in ids]))  # distinct experts a layer reads
        print(f"T={t}: {experts:.1f} distinct experts a layer, {experts * sum(GEMMS.values()) / 1e6:.1f} MB of weights")
        want = None
        for name, cfg in variants(t).items():
            timed = rig.timed(t, cfg)
            b.compile([s for s, _ in timed.reps[0]])
            us = b.time_us(timed)
            out = timed.output()
            want = want if want is not None else out
            report(t, name, "layer", us, experts)
            rows[-1]["bits"] = "same" if out == want else "DIFFER"
            if out != want:
                print(f"  T={t} {name}: BITS DIFFER from {next(iter(variants(t)))}")
            for kernel in dict.fromkeys(s.kernel for s, _ in timed.reps[0]):
                report(t, name, kernel, b.time_us(only(timed, kernel)), experts)
        if not a.sweep:
            continue
        base = variants(t)["new"]
        for gemm, kernel in (("gate_up", "moe_gate_up_kernel"), ("down", "moe_down_kernel")):
            cands = [base.with_tile(gemm, tile) for tile in tiles("decode", 16)]
            timeds = [rig.timed(t, c) for c in cands]
            b.compile([s for x in timeds for s, _ in x.reps[0]])
            res = []
            for c, x in zip(cands, timeds):
                if not all(b.fits(s) for s, _ in x.reps[0]):
                    continue  # more shared memory than a block has
                b.time_us(x)  # the whole layer, so that y is this candidate's
                if x.output() != want:
                    print(f"  T={t} {gemm} {c.tiles}: BITS DIFFER")
                    continue
                res.append((b.time_us(only(x, kernel)), c.tiles[0 if gemm == "gate_up" else 1]))
            res.sort(key=lambda r: r[0])
            for us, tile in res[:5]:
                nbytes = experts * GEMMS[kernel]
                print(f"    sweep T={t} {gemm}: {us:7.2f} us {nbytes / us / 1e3:6.0f} GB/s  bn {tile.block_n} "
                      f"bk {tile.block_k} w{tile.num_warps} s{tile.num_stages}")
                rows.append({"t": t, "variant": "sweep", "kernel": kernel, "us": round(us, 2),
                             "GBps": round(nbytes / us / 1e3), "tile": dataclasses.asdict(tile)})
    print(f"({REPS} layers a graph, each its own routing; GB/s of distinct expert weights)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    b.free_all()


if __name__ == "__main__":
    main()
