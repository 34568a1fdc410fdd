"""Paged attention alone on the GPU, across schedules: a decode batch and a prefill.

    python bench/attn_sweep.py [--case decode256|prefill2048|decode1] [--module MOD] [--configs SPEC ...]

Times kiln's paged_attention kernel (Triton JIT, torch tensors; the same kernel the AOT
bundles carry) at the Llama-3.1-8B head shape (32 query heads, 8 KV heads, 128 dims,
16-token blocks), replaying a CUDA graph of 20 launches. Reports microseconds per call and
the K/V bytes read per second (decode) or attention TFLOP/s (prefill, causal: 4 N^2 D H / 2).
Every config's output is compared with the first one's: same tile and seg must give
the same bits (rows per program, warps and stages only group rows).

A config is `tile,seg,block_q,warps,stages`; for prefill cases block_q/warps/stages are the
prefill ones. --module points the launch at another copy of the kernel (an A/B).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from kiln.bench.device import torch_graph_us
from kiln.codegen.triton import paged_attention_launch as L
from kiln.codegen.triton.configs import AttentionConfig

H, HKV, D, BS = 32, 8, 128, 16


def make_case(name: str, max_model_len: int = 4096, seed: int = 0, cache_dtype: str = "bf16"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if name.startswith("decode"):
        s = int(name[len("decode"):].split("@")[0])
        ctx = int(name.split("@")[1]) if "@" in name else 1500
        lens = [ctx] * s
        counts = [1] * s
    else:
        n = int(name[len("prefill"):])
        lens, counts = [n], [n]
    mb = max_model_len // BS
    nb = sum(-(-x // BS) for x in lens) + 1
    cache = (torch.randn((nb, 2, BS, HKV, D), generator=g, device="cuda") * 0.5).to(
        {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[cache_dtype])
    perm = torch.randperm(nb - 1, generator=g, device="cuda").to(torch.int32)
    bt = torch.zeros((len(lens), mb), dtype=torch.int32, device="cuda")
    at = 0
    for i, x in enumerate(lens):
        k = -(-x // BS)
        bt[i, :k] = perm[at:at + k]
        at += k
    t = sum(counts)
    q = torch.randn((t, H, D), generator=g, device="cuda").to(torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32, device="cuda")
    pos = torch.cat([torch.arange(x - c, x, dtype=torch.int32) for x, c in zip(lens, counts)]).cuda()
    return dict(q=q, cache=cache, bt=bt, sl=sl, qsl=qsl, pos=pos, lens=lens, counts=counts,
                decode=name.startswith("decode"), max_model_len=max_model_len)


def parse(spec: str, decode: bool) -> AttentionConfig:
    tile, seg, bq, warps, stages = (int(x) for x in spec.split(","))
    if decode:
        return AttentionConfig(block_q=bq, tile=tile, seg=seg, num_warps=warps, num_stages=stages)
    return AttentionConfig(tile=tile, seg=seg, prefill_block_q=bq, prefill_num_warps=warps,
                           prefill_num_stages=stages)


def run(case, cfg: AttentionConfig, split: bool, reps: int = 20):
    t = case["q"].shape[0]
    segs = -(-case["max_model_len"] // cfg.seg)
    out = torch.empty((t, H, D), dtype=torch.bfloat16, device="cuda")
    ws = (torch.empty((t, segs, H, D), dtype=torch.float32, device="cuda"),
          torch.empty((t, segs, H, 2), dtype=torch.float32, device="cuda"))

    def call():
        L.paged_attention(case["q"], case["cache"], case["bt"], case["sl"], case["qsl"], out, scale=D ** -0.5,
                          split=split, max_model_len=case["max_model_len"], positions=case["pos"], workspace=ws,
                          config=cfg, decode=case["decode"])
    return torch_graph_us(call, reps), out.clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", help="decode256[@1500], prefill2048, decode1@512 (repeatable)")
    ap.add_argument("--module", help="kernel module to launch instead of kiln's (A/B)")
    ap.add_argument("--split", action="store_true", help="split-KV (decode)")
    ap.add_argument("--cache-dtype", choices=("bf16", "fp8"), default="bf16", help="fp8: --kv-cache-dtype fp8")
    ap.add_argument("--configs", nargs="+", required=True, help="tile,seg,block_q,warps,stages ...")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.module:
        L.MODULE = a.module
    rows = []
    for name in a.case or ["decode256"]:
        case = make_case(name, cache_dtype=a.cache_dtype)
        ref = {}
        for spec in a.configs:
            cfg = parse(spec, case["decode"])
            us, out = run(case, cfg, a.split)
            key = (cfg.tile, cfg.seg)
            same = "first" if key not in ref else ("same bits" if torch.equal(out, ref[key]) else
                                                   f"DIFFERS max {(out.float() - ref[key].float()).abs().max():.3g}")
            ref.setdefault(key, out)
            if case["decode"]:
                kv = sum(case["lens"]) * HKV * D * 2 * case["cache"].element_size()
                rate = f"{kv / us / 1e6:6.2f} TB/s K/V"
            else:
                n = case["lens"][0]
                rate = f"{4 * n * n * D * H / 2 / us / 1e6:6.1f} TFLOP/s"
            print(f"{name:14s} {spec:18s} split={a.split:d} {us:9.1f} us  {rate}  {same}", flush=True)
            rows.append(dict(case=name, config=dataclasses.asdict(cfg), split=a.split, us=us, module=L.MODULE,
                             cache_dtype=a.cache_dtype))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
