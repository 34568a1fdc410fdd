"""ModelOpt NVFP4 MoE experts in the fused MoE kernels (codegen/triton/moe_gemm.py NV: packed e2m1 experts
dequantised with their e4m3 block scales in the K loop, the per-tensor scales on the f32 sums, W4A16)
under the interpreter against the numpy op graph/nvfp4_ops.py moe_experts_nvfp4, on fresh random
inputs (gate and up of an expert with other per-tensor scales; some experts idle; one expert taking
every token) on every path; a token's bits alone and in a batch; the cubins of a Qwen3.6-35B-A3B shape
for sm_90 and sm_121."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton.aot import compile_specs
from kiln.codegen.triton.moe import moe_experts, moe_experts_specs, quantised_tiles
from kiln.codegen.triton.moe_gemm import MoeTile
from kiln.graph.nvfp4_ops import moe_experts_nvfp4
from tests.codegen.helpers import BF16, assert_close, f32, rand, require_interpreter, same_bits
from tests.codegen.test_moe_fp8_kernels import PATHS, _routing
from tests.nvfp4_checkpoints import quantize_nvfp4

pytestmark = pytest.mark.usefixtures("interpreter")

E, K, H, I = 8, 2, 64, 32


@pytest.fixture
def interpreter():
    require_interpreter()


def _experts(rng, e, n, k, halves):
    """u8 [e, n, k/2], e4m3 [e, n, k/16], f32 [e, halves]: each expert's `halves` row blocks quantised
    as linears of their own (ModelOpt: a per-tensor scale each), of random magnitudes."""
    ws, ss, gs = [], [], []
    for _ in range(e):
        parts = [quantize_nvfp4((rng.standard_normal((n // halves, k)) * rng.uniform(0.05, 2.0) / k ** 0.5)
                                .astype(np.float32)) for _ in range(halves)]
        ws.append(np.concatenate([p[0] for p in parts]))
        ss.append(np.concatenate([p[1] for p in parts]))
        gs.append(np.array([p[2] for p in parts], np.float32))
    return np.stack(ws), np.stack(ss), np.stack(gs)


def _layer(rng, t):
    x = rand(rng, (t, H), BF16, 2.0)
    w13, s13, g13 = _experts(rng, E, 2 * I, H, 2)
    w2, s2, g2 = _experts(rng, E, H, I, 1)
    assert not np.isclose(g13[:, 0], g13[:, 1]).any()
    return x, (w13, s13, g13, w2, s2, g2)


def _run(x, ids, w, ex, **kw):
    w13, s13, g13, w2, s2, g2 = ex
    return moe_experts(x, ids, w, w13, w2, nvfp4=(s13, g13, s2, g2), **kw)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["random", "some_experts_idle", "one_expert_takes_all"])
def test_nvfp4_experts_match_the_graph_op(path, case):
    rng = np.random.default_rng()
    t = 24 if path == "grouped" else 5
    x, ex = _layer(rng, t)
    ids, w = _routing(rng, t, case)
    assert_close(f32(_run(x, ids, w, ex, path=path)), f32(moe_experts_nvfp4(x, ids, w, *ex)), rtol=2e-2,
                 what=f"{path} {case}")


def test_a_tokens_bits_do_not_depend_on_its_batch_or_path():
    rng = np.random.default_rng()
    t = 40
    x, ex = _layer(rng, t)
    ids, w = _routing(rng, t, "random")
    full = _run(x, ids, w, ex, path="grouped")
    for j in (0, 27):
        for path in PATHS:
            assert same_bits(_run(x[j:j + 1], ids[j:j + 1], w[j:j + 1], ex, path=path)[0], full[j]), (j, path)


def test_sm90_nvfp4_expert_tiles_are_mma_sync_tiles():
    """On sm_90 every NVFP4 expert GEMM has at most 32 rows in every path and bucket, whatever the
    schedule asks (a bf16 experts' schedule may take 64- or 128-row tiles), so that every bucket runs
    mma.sync: a 64-row wgmma tile moved a few outputs by a bf16 ulp on the H100 (moe.nvfp4_tiles);
    the align step's block is the tiles' rows. sm_121 keeps the schedule's tiles."""
    big = MoeTile(block_m=128, block_n=64, block_k=64, num_warps=8)
    for arch in ("sm_90", "sm_121"):
        for t, path in ((1, "decode"), (1, "decode_token"), (512, "grouped"), (4096, "grouped")):
            for tiles in (None, (big, big)):
                specs = moe_experts_specs(t, 8, 256, 2048, 512, path=path, arch=arch, nvfp4=True, tiles=tiles)
                gemms = [s for s in specs if s.kernel in ("moe_gate_up_kernel", "moe_down_kernel")]
                assert all(s.constexprs["NV"] for s in gemms)
                rows = {s.constexprs["BLOCK_M"] for s in gemms}
                if arch == "sm_90":
                    assert max(rows) <= 32, (path, t, rows)
                elif tiles and path == "grouped":
                    assert rows == {128}
                if path == "grouped":
                    assert specs[0].constexprs["BLOCK_M"] == gemms[0].constexprs["BLOCK_M"]  # the align step's
    assert quantised_tiles((big, big), "sm_90", nvfp4=True)[0].block_m == 32


@pytest.mark.slow
def test_every_nvfp4_moe_kernel_compiles_for_both_archs(tmp_path):
    specs = []
    for arch in ("sm_90", "sm_121"):
        for t in (1, 64, 4096):
            specs += [(s, arch) for s in moe_experts_specs(t, 8, 256, 2048, 512, arch=arch, nvfp4=True)
                      if s.kernel in ("moe_gate_up_kernel", "moe_down_kernel")]
    for (spec, arch), c in zip(specs, compile_specs(specs, cache_dir=tmp_path), strict=True):
        assert c.cubin[:4] == b"\x7fELF" and c.name == spec.kernel, (spec.kernel, arch)
        assert spec.constexprs["NV"] and spec.signature["w_ptr"] == "*u8"
