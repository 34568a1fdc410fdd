"""Would TMA loads make kiln's prefill GEMMs faster? A probe before the runtime work.

    python bench/gemm_tma_probe.py [--m 2048] [--stages 3 4] [--json OUT]

kiln's gemm_kernel loads its tiles with pointer arithmetic (cp.async on sm_90) and reaches
400-590 TFLOP/s in a 2,048-token prefill where cuBLAS reaches ~790 (docs/BENCHMARKS.md). This
times, at the Llama-3.1-8B prefill shapes and under CUDA graphs (Triton JIT, torch tensors):
  kiln      kiln's gemm_kernel (split_k 1, the prefill tile 128 x 256, 8 warps)
  tma       the same program with both operands loaded through host-built TMA descriptors
  tma-pers  the same, persistent: one program per SM walking the tiles in kiln's grouped order
  cublas    torch.matmul, the ceiling
and checks that tma and tma-pers give kiln's bits: same tiles, the same K order, the same dot
chain, so only where the operands come from changes. If TMA wins, the runtime must build the
descriptors (cuTensorMapEncodeTiled) at plan load: a plan's pointers are fixed, so once per plan.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@triton.jit
def _tile_of(t, M, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % size_m, (t % per_group) // size_m


@triton.jit
def _tma_tile(x_desc, w_desc, y_ptr, M, stride_ym, pid_m, pid_n, N: tl.constexpr, K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K, BLOCK_K):  # the same increasing K order as gemm_kernel
        a = x_desc.load([pid_m * BLOCK_M, kk])  # [BM, BK]
        b = w_desc.load([pid_n * BLOCK_N, kk])  # [BN, BK] of w: [N, K]
        acc = tl.dot(a, b.T, acc)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def gemm_tma(x_desc, w_desc, y_ptr, M, stride_ym, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    _tma_tile(x_desc, w_desc, y_ptr, M, stride_ym, pid_m, pid_n, N, K, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def gemm_tma_persistent(x_desc, w_desc, y_ptr, M, stride_ym, N: tl.constexpr, K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), tiles, NUM_SMS):
        pid_m, pid_n = _tile_of(t, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _tma_tile(x_desc, w_desc, y_ptr, M, stride_ym, pid_m, pid_n, N, K, BLOCK_M, BLOCK_N, BLOCK_K)


def main() -> None:
    from kiln.bench.device import torch_graph_us
    from kiln.codegen.triton.configs import GemmReduction, GemmTile
    from kiln.codegen.triton.gemm import gemm

    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # TMA descriptors that the JIT builds host side need an allocator for any device-side scratch
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    for name, (n, k) in SHAPES.items():
        m = a.m
        x = torch.randn((m, k), device="cuda").to(torch.bfloat16)
        # enough weight copies that each launch streams its weight from HBM, as in a model step
        copies = max(1, math.ceil(200e6 / (n * k * 2)))
        ws = [torch.randn((n, k), device="cuda").to(torch.bfloat16) * 0.02 for _ in range(copies)]
        flop = 2 * m * n * k
        nr = torch.tensor([m], dtype=torch.int32, device="cuda")
        for stages in a.stages:
            tile = GemmTile(block_m=128, block_n=256, num_warps=8, num_stages=stages)
            red = GemmReduction(block_k=64, split_k=1)
            outs, it = {}, {"i": 0}

            def nxt():
                it["i"] = (it["i"] + 1) % copies
                return ws[it["i"]]

            y = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
            ptr_tile = dataclasses.replace(tile, tma=False)
            us = torch_graph_us(lambda: gemm(x, nxt(), None, y, n_rows=nr, tile=ptr_tile, red=red))
            gemm(x, ws[0], None, y, n_rows=nr, tile=ptr_tile, red=red)
            outs["kiln"] = y.clone()
            rows.append(dict(shape=name, m=m, n=n, k=k, kernel="kiln", stages=stages, us=us))
            # kiln's own TMA path: descriptors built on the device (tl.make_tensor_descriptor)
            dev_tile = dataclasses.replace(tile, tma=True)
            us = torch_graph_us(lambda: gemm(x, nxt(), None, y, n_rows=nr, tile=dev_tile, red=red))
            gemm(x, ws[0], None, y, n_rows=nr, tile=dev_tile, red=red)
            rows.append(dict(shape=name, m=m, n=n, k=k, kernel="kiln-tma", stages=stages, us=us,
                             same_bits=torch.equal(y, outs["kiln"])))
            xd = TensorDescriptor.from_tensor(x, [tile.block_m, red.block_k])
            wds = [TensorDescriptor.from_tensor(w, [tile.block_n, red.block_k]) for w in ws]
            tiles = triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n)
            kw = dict(N=n, K=k, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=red.block_k, GROUP_M=8,
                      num_warps=8, num_stages=stages)
            for kind, fn, grid, extra in (("tma", gemm_tma, (tiles,), {}),
                                          ("tma-pers", gemm_tma_persistent, (min(sms, tiles),), {"NUM_SMS": sms})):
                def call(fn=fn, grid=grid, extra=extra):
                    it["i"] = (it["i"] + 1) % copies
                    fn[grid](xd, wds[it["i"]], y, m, y.stride(0), **kw, **extra)
                us = torch_graph_us(call)
                fn[grid](xd, wds[0], y, m, y.stride(0), **kw, **extra)
                same = torch.equal(y, outs["kiln"])
                rows.append(dict(shape=name, m=m, n=n, k=k, kernel=kind, stages=stages, us=us, same_bits=same))
        us = torch_graph_us(lambda: torch.matmul(x, nxt().T))
        rows.append(dict(shape=name, m=m, n=n, k=k, kernel="cublas", stages=None, us=us))
        for r in rows:
            if r["shape"] == name and "tflops" not in r:
                r["tflops"] = flop / r["us"] / 1e6
                print(f"{name:8s} M={m} N={n:6d} K={k:6d} {r['kernel']:9s} stages={r['stages']!s:4s} "
                      f"{r['us']:8.1f} us {r['tflops']:6.1f} TFLOP/s"
                      + ("" if "same_bits" not in r else f"  {'same bits' if r['same_bits'] else 'BITS DIFFER'}"),
                      flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
