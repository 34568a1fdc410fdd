"""Block-wise FP8 MoE checkpoints on the GPU (codegen/triton/moe_gemm.py FP8 experts): the tiny FP8
Qwen3-MoE ([128, 128] blocks on widened dimensions) and Qwen3.5-MoE ([16, 16] blocks, shared expert,
GDN layers) of tests/test_fp8_moe.py through the GPU engine, against the cpu target's executor, and
the engine's invariance (greedy alone = batched = chunked; the FP8 expert GEMMs run e4m3 wgmma in
the decode and grouped forms alike on sm_90, so a token's row has one set of bits in every bucket).

Logits oracle as tests/gpu/test_gpu_fp8.py's (its module docstring says why): the same FP8 graph in
bf16 run by the numpy executor is the yardstick of what the storage dtype alone does; the GPU must be
as close to the f32 cpu executor as that, within a factor of 2 plus 1e-2 of the largest logit. A
wrong expert scale, a missing group or an expert GEMM on e4m3 bytes without scales moves the logits
by their own size. Not yet run on a GPU."""
from __future__ import annotations

import pytest

from kiln.runtime.core.kv_cache_spec import GDN_CHUNK_ALIGN

from tests.gpu.test_gpu_fp8 import _last_logits, _prompts, _rel, check_greedy_alone_batched_chunked, load_cpu_gpu_bf16
from tests.test_fp8_moe import CASES, make_fp8_moe_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0])
def fp8_moe(request, tmp_path_factory, gpu_target):
    variant, block, overrides = request.param
    d = tmp_path_factory.mktemp(f"{variant}_fp8")
    make_fp8_moe_checkpoint(d, variant, block, **overrides)
    cpu, gpu, bf16 = load_cpu_gpu_bf16(d, gpu_target, d / "bundle", num_state_slots=64)
    assert "moe_experts_fp8" in [n.op for n in gpu.graph.nodes.values()]
    return variant, d, cpu, gpu, bf16


def test_fp8_moe_logits_match_the_cpu_executor(fp8_moe):
    name, _, cpu, gpu, bf16 = fp8_moe
    prompts = [p[:30] for p in _prompts(8, seed=1)]
    want = _last_logits(cpu.executor, prompts)
    got = _last_logits(gpu.executor, prompts)
    ref16 = _last_logits(bf16, prompts)
    assert got.shape == want.shape and bool((got == got).all()), name
    errs = [(_rel(g, w), _rel(r, w)) for g, w, r in zip(got, want, ref16)]
    print(f"\n[{name}] per prompt (GPU vs cpu f32, numpy bf16 vs cpu f32): "
          + ", ".join(f"{e:.2e}/{r:.2e}" for e, r in errs))
    for i, (err, storage) in enumerate(errs):
        assert err <= 2 * storage + 1e-2, f"{name} prompt {i}: {err:.2e} from the cpu target, bf16 storage alone " \
                                          f"{storage:.2e}"


def test_fp8_moe_greedy_alone_batched_chunked(fp8_moe, gpu_target):
    name, d, _, _, _ = fp8_moe
    # the hybrid at the GDN window (test_gpu_fp8.py docstring: a chunk cut inside one is not bit-exact)
    budget = GDN_CHUNK_ALIGN if name.startswith("qwen3_5") else 32
    check_greedy_alone_batched_chunked(name, d, gpu_target, budget=budget, small_bundle="bundle32",
                                       enable_prefix_caching=False)
