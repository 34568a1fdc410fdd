"""Paged attention alone on the GPU, across schedules: a decode batch and a prefill.

    python bench/attn_sweep.py [--case decode256@1500|prefill2048|decode1@512|mixed512@1500+1536|
                                       decode512@1000-2000v ...] [--split auto|on|off] [--route]
                               [--cache-dtype bf16|fp8] [--module MOD ...] [--max-model-len N] [--heads H,HKV,D]
                               --configs SPEC ...
                               [--json OUT]

Times kiln's paged_attention kernel the way `build.py tune` does, with the same code
(codegen/autotune_attention.py): the AOT cubins a bundle carries, loaded with cuda.bindings,
a CUDA graph of back-to-back launches, K/V rotated over copies so that it comes from HBM.
Shape: Llama-3.1-8B's heads (32 query heads, 8 KV heads, 128 dims, 16-token blocks), or --heads
(Qwen3.6-27B: 24,4,256; Qwen3.6-35B-A3B: 16,2,256).
Reports microseconds per call and the K/V bytes read per second (decode) or attention
TFLOP/s (prefill, causal: 4 N^2 D H / 2). Every config's output is compared with the first
one's of the same tile and seg: they must give the same bits (rows per program, warps and
stages only group rows). Unlike the tuner, this sweeps tile and seg too (they change the
sums: a model's choice, never a bucket's).

A config is `tile,seg,block_q,warps,stages[,maxnreg[,key_halves[,dv_parts]]]` (maxnreg 0: no cap;
key_halves: decode cases, every size class; dv_parts: the split and one-sequence classes' V column
parts, paged_attention.py DV_PARTS); for prefill cases block_q/warps/stages are the prefill ones. --split: decode split-KV as a bundle's plan has it (auto), or forced.
--cache-dtype fp8: the KV cache of --kv-cache-dtype fp8. --module points the launch at another
copy of the kernel; given several, every config runs in each, in one process, and each output is
compared with the first module's (an A/B: `git show HEAD:codegen/triton/paged_attention.py >
codegen/triton/pa_old.py`, then `--module kiln.codegen.triton.pa_old kiln.codegen.triton.paged_attention`).
--route: a mixed case's decode rows in a launch of the decode variant (AttentionConfig.route_mixed),
against the default of every row in the prefill variant.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from kiln.codegen.autotune import Bench
from kiln.codegen.autotune_attention import AttentionRig, AttentionShape, parse_case
from kiln.codegen.triton import paged_attention_launch as L
from kiln.codegen.triton.configs import AttentionConfig

H, HKV, D, BS = 32, 8, 128, 16


def parse(spec: str, decode: bool) -> AttentionConfig:
    tile, seg, bq, warps, stages = (int(x) for x in spec.split(",")[:5])
    if decode:
        fields = spec.split(",")
        halves = int(fields[6]) if len(fields) > 6 and fields[6] != "0" else None  # every decode class's
        parts = int(fields[7]) if len(fields) > 7 else None  # the split classes'
        return AttentionConfig(block_q=bq, tile=tile, seg=seg, num_warps=warps, num_stages=stages,
                               key_halves=halves, split_key_halves=halves, one_key_halves=halves,
                               split_dv_parts=parts, one_dv_parts=parts)
    return AttentionConfig(tile=tile, seg=seg, prefill_block_q=bq, prefill_num_warps=warps,
                           prefill_num_stages=stages)


def main() -> None:
    from kiln.runtime.worker.cuda_driver import CudaContext

    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", help="decode256[@1500], prefill2048, decode1@512, "
                    "mixed512@1500[+1536] (decode rows and a prompt chunk in the prefill kernel), "
                    "decode512@1000-2000[v] (lengths spread over a range, random or longest first); repeatable")
    ap.add_argument("--module", nargs="+", default=[L.MODULE],
                    help="kernel modules to launch instead of kiln's, each in turn (A/B; default: kiln's)")
    ap.add_argument("--split", choices=("auto", "on", "off"), default="auto", help="split-KV (decode)")
    ap.add_argument("--cache-dtype", choices=("bf16", "fp8"), default="bf16", help="fp8: --kv-cache-dtype fp8")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--heads", default=f"{H},{HKV},{D}", help="query heads, KV heads, head dim (default Llama-8B's)")
    ap.add_argument("--configs", nargs="+", required=True, help="tile,seg,block_q,warps,stages ...")
    ap.add_argument("--route", action="store_true",
                    help="mixed cases: the decode rows in a launch of the decode variant (AttentionConfig.route_mixed; "
                         "its knobs the defaults')")
    ap.add_argument("--json")
    ap.add_argument("--hnd", action="store_true", help="timing only: read the cache as [NB, 2, Hkv, BS, D] "
                    "(each KV head's block rows contiguous) through its strides; the outputs are not checked")
    a = ap.parse_args()
    if a.hnd:
        plain = L.strides_of

        def hnd(x):
            st = plain(x)
            if len(st) != 5:
                return st
            _, _, bs, hkv, d = L.shape_of(x)
            return (st[0], st[1], d, bs * d)  # block, K/V, position, head
        L.strides_of = hnd
    ctx = CudaContext()
    bench = Bench(ctx, f"sm_{ctx.arch}", progress=lambda s: None)
    h, hkv, d = (int(x) for x in a.heads.split(","))
    shape = AttentionShape(h, hkv, d, BS, a.max_model_len,
                           cache_dtype={"bf16": "bfloat16", "fp8": "float8_e4m3fn"}[a.cache_dtype])
    rows = []
    for name in a.case or ["decode256"]:
        case = parse_case(name, {"auto": None, "on": True, "off": False}[a.split])
        rig = AttentionRig(bench, shape, case)
        ref = {}  # (tile, seg) -> the first output: the first module's first config of them
        for module in a.module:
            L.MODULE = module
            tag = module.rsplit(".", 1)[-1] if len(a.module) > 1 else ""
            for spec in a.configs:
                cfg = dataclasses.replace(parse(spec, case.decode), route_mixed=a.route)
                timed = rig.timed(cfg)
                cap = [c for c in spec.split(",")[5:6] if c != "0"]  # a sixth field: the kernel's register cap
                if cap:
                    for rep in timed.reps:
                        rep[:] = [(dataclasses.replace(s, maxnreg=int(cap[0]))
                                   if s.kernel == "paged_attention_kernel" else s, a) for s, a in rep]
                bench.compile([s for s, _ in timed.reps[0]])
                if not all(bench.fits(s) for s, _ in timed.reps[0]):
                    print(f"{name:14s} {tag} {spec:18s} needs more shared memory than a block has", flush=True)
                    continue
                us, out = bench.time_us(timed), rig.output()
                key = (cfg.tile, cfg.seg)
                same = "first" if key not in ref else ("same bits" if out == ref[key] else "BITS DIFFER")
                ref.setdefault(key, out)
                if case.decode or name.startswith("mixed"):
                    rate = f"{rig.kv_bytes / us / 1e6:6.2f} TB/s K/V"
                else:
                    n = case.lens[0]
                    rate = f"{4 * n * n * d * h / 2 / us / 1e6:6.1f} TFLOP/s"
                print(f"{name:14s} {tag} {spec:18s} split={case.split:d} {us:9.1f} us  {rate}  {same}", flush=True)
                rows.append(dict(case=name, heads=[h, hkv, d], config=dataclasses.asdict(cfg), split=case.split, us=us,
                                 module=L.MODULE,
                                 cache_dtype=a.cache_dtype, maxnreg=int(cap[0]) if cap else None))
        bench.free_all()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
