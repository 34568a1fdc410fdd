"""Which MoE expert tiles give a token the same bits, bf16 experts against NVFP4 (W4A16) ones, on one GPU.

    TRITON_INTERPRET=0 python3 bench/moe_tile_bits_probe.py

The H100 run at ddae4ff found NVFP4 experts' 64-row grouped tiles (wgmma) giving other bits than the
16-row default (mma.sync; tests/codegen/test_moe_nvfp4_gpu.py), where bf16 experts give one set of
bits at 16, 32 and 64 rows (tests/codegen/test_moe_gpu.py); the PTX of both uses the same two
instruction forms (mma.sync m16n8k16 bf16 below 64 rows, wgmma m64nNk16 bf16 at 64). This prints, for
each tile (rows x columns x K step, warps) and the two decode paths, whether the 300-token layer's output
is the 16-row tile's bits, and how many elements differ: which knob moves the NVFP4 sums."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.codegen.triton.moe_gemm import MoeTile  # noqa: E402
from tests.codegen import test_moe_gpu as bf16_test  # noqa: E402
from tests.codegen.gpu_torch import dev  # noqa: E402
from tests.codegen.helpers import rand, same_bits  # noqa: E402
from tests.codegen.test_moe_nvfp4_gpu import E, H, I, K, _run  # noqa: E402
from tests.codegen.test_moe_nvfp4_kernels import _experts  # noqa: E402

TILES = [(16, 64, 64, 4), (32, 64, 64, 4), (64, 64, 64, 4), (64, 64, 128, 4), (16, 64, 128, 4), (128, 64, 64, 4),
         (64, 64, 64, 8), (16, 32, 64, 2)]


def _diff(out, ref) -> str:
    """'=' for the same bits, else how many elements differ and by how much at most (relative to the
    row's largest magnitude): a last-bit change or a wrong tile."""
    if same_bits(out, ref):
        return "="
    o, r = out.astype(np.float32), ref.astype(np.float32)
    rel = np.abs(o - r).max() / max(float(np.abs(r).max()), 1e-30)
    return f"{int((out != ref).sum())} differ (max {rel:.1e})"


def main() -> None:
    rng = np.random.default_rng(2)
    t = 300
    x = rand(rng, (t, H), scale=2.0)
    nv = tuple(dev(a) for a in (*_experts(rng, E, 2 * I, H, 2), *_experts(rng, E, H, I, 1)))
    ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)
    ww = rng.uniform(0.1, 1.0, (t, K)).astype(np.float32)
    ww /= ww.sum(-1, keepdims=True)
    w13, w2 = dev(rand(rng, (E, 2 * I, H), scale=0.1)), dev(rand(rng, (E, H, I), scale=0.1))
    runs = {"nvfp4": lambda **kw: _run(x, ids, ww, nv, **kw),
            "bf16": lambda **kw: bf16_test.run_experts(x, ids, ww, w13, w2, **kw)}
    for name, fn in runs.items():
        ref = None
        res = []
        for bm, bn, bk, nw in TILES:
            tile = MoeTile(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=3)
            out = fn(path="grouped", tiles=(tile, tile))
            ref = out if ref is None else ref
            res.append(f"{bm}x{bn}x{bk}w{nw}:" + _diff(out, ref))
        for path in ("decode", "decode_token"):
            res.append(f"{path}:" + _diff(fn(path=path), ref))
        print(name, "  ".join(res), flush=True)


if __name__ == "__main__":
    main()
