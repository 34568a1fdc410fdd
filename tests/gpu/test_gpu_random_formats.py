"""bench/make_random_model.py's quantised formats on the GPU (issue 40's benchmark checkpoints, tiny
shapes): each loads and compiles on the GPU target, its logits are finite and follow the cpu target's
as tests/gpu/test_gpu_fp8.py bounds them (GPU vs the f32 cpu target within twice what bf16 storage
alone moves, from the same graph run by the numpy executor in bf16, plus 1e-2), and the decode
roofline's weight bytes (bench/workloads.py decode_weight_bytes) equal the bytes the executor uploads
(the bundle manifest's weights: what a decode step reads, but the untied embedding's other rows and,
of a MoE's stacked experts (weights and scales), all but the num_experts_per_tok the router picks).
The MoE shapes (FP8 and NVFP4 experts, the fused MoE kernels) added at 2026-12-07 are not yet run on a GPU.
Not yet run on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.bench.make_random_model import make_random_model
from kiln.bench.workloads import decode_weight_bytes
from kiln.graph import DType, to_numpy
from tests.gpu.test_gpu_fp8 import _last_logits, _prompts, _rel, load_cpu_gpu_bf16

CASES = [("tiny-llama", "fp8"), ("tiny-llama", "nvfp4"), ("tiny-llama-k", "q4k"), ("tiny-qwen3.6", "fp8"),
         ("tiny-qwen3.6", "nvfp4"), ("tiny-qwen3.6-moe", "fp8"), ("tiny-qwen3.6-moe", "nvfp4"),
         ("tiny-qwen3-moe", "fp8"), ("tiny-qwen3-moe", "nvfp4")]


@pytest.fixture(scope="module", params=CASES, ids="-".join)
def model(request, tmp_path_factory, gpu_target):
    shape, fmt = request.param
    d = tmp_path_factory.mktemp(f"{shape}_{fmt}")
    path = make_random_model(shape, d / "ckpt", fmt=fmt)
    cpu, gpu, bf16 = load_cpu_gpu_bf16(path, gpu_target, d / "bundle", num_state_slots=33, max_num_seqs=32)
    return f"{shape}-{fmt}", cpu, gpu, bf16


def test_logits_follow_the_cpu_target(model):
    name, cpu, gpu, bf16 = model
    prompts = [p[:30] for p in _prompts(8, seed=1, vocab=320)]  # one step within the 256-token bucket
    want = _last_logits(cpu.executor, prompts)
    got = _last_logits(gpu.executor, prompts)
    ref16 = _last_logits(bf16, prompts)
    assert np.isfinite(got).all(), name
    errs = [(_rel(g, w), _rel(r, w)) for g, w, r in zip(got, want, ref16)]
    print(f"\n[{name}] per prompt (GPU vs cpu f32, numpy bf16 vs cpu f32): "
          + ", ".join(f"{e:.2e}/{r:.2e}" for e, r in errs))
    for i, (err, storage) in enumerate(errs):
        assert err <= 2 * storage + 1e-2, f"{name} prompt {i}: {err:.2e} from the cpu target, bf16 storage {storage:.2e}"


def test_roofline_bytes_are_the_uploaded_weights(model):
    name, _, gpu, _ = model
    cfg = gpu.source.config
    uploaded = 0
    for w, (dtype, shape, *_) in gpu.executor.manifest["weights"].items():
        n = to_numpy(DType(dtype)).itemsize * int(np.prod(shape))
        if w == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            n //= shape[0]
        if cfg.num_experts and ".experts." in w and shape[0] == cfg.num_experts:
            n = n // cfg.num_experts * cfg.num_experts_per_tok  # a stacked expert tensor: the routed experts'
        uploaded += n
    assert decode_weight_bytes(gpu.graph, cfg) == uploaded, name
