"""ModelOpt NVFP4 MoE checkpoints on the GPU (W4A16 experts, codegen/triton/moe_gemm.py NV): the tiny
NVFP4 Qwen3-MoE and Qwen3.5-MoE of tests/test_nvfp4_moe.py through the GPU engine. Not yet run on a GPU.

Logits oracle as tests/gpu/test_gpu_nvfp4.py's: the same graph with bf16 activations run by the numpy
executor (W4A16 rounds no activation to FP4 and the dequantised weights are exact in bf16, so the GPU
differs from it only by its f32 summation order and bf16 roundings of intermediates), within 2e-2 of the
largest logit over the median prompt: a bf16 router can flip a top-k choice where two experts' logits
round alike, and one flipped token moves that prompt's logits by far more (tests/gpu/test_gpu_moe.py);
a wrong nibble order, scale or per-tensor scale moves every prompt's logits by their own size.
Invariance: greedy tokens alone = batched = chunked under a small token budget."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.core.kv_cache_spec import GDN_CHUNK_ALIGN

from tests.gpu.test_gpu_fp8 import _last_logits, _prompts, _rel, check_greedy_alone_batched_chunked, load_cpu_gpu_bf16
from tests.test_nvfp4_moe import make_nvfp4_moe_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def nvfp4_moe(request, tmp_path_factory, gpu_target):
    d = tmp_path_factory.mktemp(f"{request.param}_nvfp4")
    make_nvfp4_moe_checkpoint(d, request.param)
    cpu, gpu, bf16 = load_cpu_gpu_bf16(d, gpu_target, d / "bundle", num_state_slots=64)
    assert "moe_experts_nvfp4" in [n.op for n in gpu.graph.nodes.values()]
    return request.param, d, gpu, bf16


def test_nvfp4_moe_logits_match_the_bf16_numpy_executor(nvfp4_moe):
    name, _, gpu, bf16 = nvfp4_moe
    prompts = [p[:30] for p in _prompts(8, seed=1)]
    got = _last_logits(gpu.executor, prompts)
    want = _last_logits(bf16, prompts)
    assert np.isfinite(got).all(), name
    errs = [_rel(g, w) for g, w in zip(got, want)]
    print(f"\n[{name}] GPU vs numpy bf16 per prompt: " + ", ".join(f"{e:.2e}" for e in errs))
    assert np.median(errs) <= 2e-2, name


def test_nvfp4_moe_greedy_alone_batched_chunked(nvfp4_moe, gpu_target):
    name, d, _, _ = nvfp4_moe
    # the hybrid at the GDN window (test_gpu_fp8.py docstring: a chunk cut inside one is not bit-exact)
    budget = GDN_CHUNK_ALIGN if name.startswith("qwen3_5") else 32
    check_greedy_alone_batched_chunked(name, d, gpu_target, budget=budget, small_bundle="bundle32",
                                       enable_prefix_caching=False)
