"""Tiny NVFP4 (ModelOpt) models' GPU launch plans replayed on the CPU under the Triton
interpreter, whole plan, against the numpy executor on the same bf16 graph (as test_lowering.py
does for bf16): a padded mixed step and the decode step after it, Llama and Qwen3, some linears
left bf16 by exclude_modules. W4A16 quantises no activation, so no e4m3 step amplifies the bf16
kernels' roundings (the reason test_lowering_fp8.py goes node by node): the whole plan is held to
test_lowering.py's bf16 tolerance. Every quantised linear is one nvfp4_gemm_kernel launch
reading the packed weight, its e4m3 block scales and its f32 scale from their own regions."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton.configs import DEFAULT
from kiln.graph import DType, to_numpy
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from tests.codegen.helpers import FP8, require_interpreter
from tests.codegen.test_lowering import BS, BUCKETS, MAX_LEN, _Plan
from tests.nvfp4_checkpoints import HF_QUANT_CONFIG
from tests.tiny_models import BASE

pytestmark = pytest.mark.usefixtures("interpreter")

SKIP = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"]


@pytest.fixture
def interpreter():
    require_interpreter()


def nvfp4_model(arch: str, seed: int = 0):
    """A tiny NVFP4 model's graph for a GPU target and random weights in its checkpoint layout:
    random packed bytes, e4m3 block scales around 1 (never all ones), per-tensor scales that make
    W = e2m1 * s * s2 about 1.5 / sqrt(K)."""
    hq = {**HF_QUANT_CONFIG, "quantization": {**HF_QUANT_CONFIG["quantization"], "exclude_modules": ["lm_head", *SKIP]}}
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], "num_hidden_layers": 2,
                                    "max_position_embeddings": MAX_LEN, "quantization_config": hq})
    graph = run_pipeline(get_graph_builder(arch)(cfg, dtype=DType.bf16, block_size=BS))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in graph.checkpoint_weights().items():
        dtype = graph.tensors[name].dtype
        if dtype == DType.u8:
            weights[name] = rng.integers(0, 256, shape).astype(np.uint8)
        elif dtype == DType.fp8e4m3:
            weights[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32).astype(FP8)
        elif name.endswith("weight_scale_2"):
            k = graph.tensors[name.rsplit(".", 1)[0] + ".weight"].shape[1] * 2
            weights[name] = np.array([1.5 / k ** 0.5 / 2.5 * rng.uniform(0.8, 1.2)], np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 1.5 / shape[-1] ** 0.5)
                             + (1.0 if name.endswith("norm.weight") else 0.0)).astype(to_numpy(dtype))
    return cfg, graph, weights


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM"])  # (Llama: the bundle test compiles it; ~40 s a model here)
def test_nvfp4_plan_matches_numpy(arch):
    cfg, graph, weights = nvfp4_model(arch)
    run = _Plan(cfg, graph, weights, DEFAULT)
    for b in BUCKETS:
        launches = run.launches(b)
        kernels = [spec.kernel for spec, _ in launches]
        assert kernels.count("nvfp4_gemm_kernel") == 7 * cfg.num_hidden_layers - len(SKIP)
        for spec, args in launches:
            if spec.kernel == "nvfp4_gemm_kernel":
                assert spec.signature["w_ptr"] == "*u8" and spec.signature["ws_ptr"] == "*fp8e4nv"
                assert args["ws2_ptr"].shape == (1,) and args["ws2_ptr"].np_dtype == np.float32
    run.prefill_then_decode()  # logits within 2e-2 of the largest, both steps (test_lowering.py's bound)
