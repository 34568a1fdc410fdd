"""ModelOpt NVFP4 checkpoints on the GPU (W4A16, codegen/triton/nvfp4_gemm.py): the tiny NVFP4
checkpoints of tests/nvfp4_checkpoints.py through the GPU engine. Not yet run on a GPU.

Logits oracle: the same graph with bf16 activations run by the numpy executor (the GPU's
arithmetic written independently: W4A16 rounds no activation to FP4, and the dequantised weights
are exact in bf16, so the GPU differs from it only by its f32 summation order and bf16 roundings
of intermediates). Bound: test_lowering.py's 2e-2 of the largest logit, which the interpreter
replay of the same plans meets (tests/codegen/test_lowering_nvfp4.py). A wrong nibble order, a
scale read from the wrong block or the per-tensor scale left out moves logits by their own size.

Invariance (DESIGN): greedy tokens alone = batched = chunked under a small token budget: the
W4A16 GEMM reduces K in one order per weight, whatever the bucket.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.test_gpu_fp8 import _last_logits, _prompts, _rel, check_greedy_alone_batched_chunked, load_cpu_gpu_bf16
from tests.nvfp4_checkpoints import make_nvfp4_checkpoint

torch = pytest.importorskip("torch")

SKIP = ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj")
CASES = [("llama_gqa_untied", SKIP), ("qwen3_qknorm", ())]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}{'-skip' if c[1] else ''}")
def nvfp4(request, tmp_path_factory, gpu_target):
    variant, skip = request.param
    d = tmp_path_factory.mktemp(f"{variant}_nvfp4")
    make_nvfp4_checkpoint(d, variant, exclude=skip)
    cpu, gpu, bf16 = load_cpu_gpu_bf16(d, gpu_target, d / "bundle", num_state_slots=0)
    return variant, d, gpu, bf16


def test_nvfp4_logits_match_the_bf16_numpy_executor(nvfp4):
    name, _, gpu, bf16 = nvfp4
    prompts = [p[:30] for p in _prompts(8, seed=1)]  # one step: within the bundle's 256-token budget
    got = _last_logits(gpu.executor, prompts)
    want = _last_logits(bf16, prompts)
    assert np.isfinite(got).all(), name
    errs = [_rel(g, w) for g, w in zip(got, want)]
    print(f"\n[{name}] GPU vs numpy bf16 per prompt: " + ", ".join(f"{e:.2e}" for e in errs))
    assert max(errs) <= 2e-2, name


def test_nvfp4_greedy_alone_batched_chunked(nvfp4, gpu_target):
    name, d, _, _ = nvfp4
    check_greedy_alone_batched_chunked(name, d, gpu_target)
