"""Tiny quantised Qwen3-MoE GPU launch plans replayed on the CPU under the Triton interpreter, node by
node against the numpy executor (test_lowering_fp8.py's _NodePlan and bounds): block-wise FP8 experts
kept in e4m3 with their stacked [16, 16] block scales, and ModelOpt NVFP4 experts kept packed with
their block and per-tensor scales, lower to the quantised expert GEMMs (moe_gemm.py FP8 / NV: no bf16
expert weight anywhere), in the decode bucket (the decode path) and the mixed one (align + grouped
GEMMs + the rank-order sum), and each launch's output is its node's reference's."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kiln.graph import DType
from kiln.graph.dtype import to_numpy
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from tests.codegen.helpers import require_interpreter
from tests.codegen.test_lowering import BS, BUCKETS, MAX_LEN
from tests.codegen.test_lowering_fp8 import FP8, _NodePlan
from tests.fp8_checkpoints import BLOCK_CONFIG
from tests.tiny_models import BASE

pytestmark = pytest.mark.usefixtures("interpreter")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)


@pytest.fixture
def interpreter():
    require_interpreter()


NVFP4_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                "exclude_modules": ["lm_head"]}


def fp8_moe_model(seed: int = 0, qc=None, layers: int = 1):
    qc = qc or {**BLOCK_CONFIG, "modules_to_not_convert": ["lm_head"]}
    cfg = ModelConfig.from_hf_dict({**BASE, **MOE, "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": layers,
                                    "max_position_embeddings": MAX_LEN, "quantization_config": qc})
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16, block_size=BS))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in graph.checkpoint_weights().items():
        dtype = graph.tensors[name].dtype
        if dtype == DType.u8:  # NVFP4: any byte is two e2m1 values
            weights[name] = rng.integers(0, 256, shape).astype(np.uint8)
        elif name.endswith(".weight_scale") and dtype == DType.fp8e4m3:  # NVFP4 block scales
            weights[name] = rng.uniform(0.5, 1.5, shape).astype(FP8)
        elif name.endswith("weight_scale_2"):  # W = e2m1 (|.| ~2) * block scale * this ~ 1.5 / sqrt(K)
            k = MOE["moe_intermediate_size"] if "experts.down_proj" in name else BASE["hidden_size"]  # (q/k/v/o too)
            weights[name] = (rng.uniform(0.5, 1.5, shape) * 0.75 / k ** 0.5).astype(np.float32)
        elif dtype == DType.fp8e4m3:
            weights[name] = np.clip(rng.standard_normal(shape) * 100, -448, 448).astype(FP8)
        elif name.endswith("weight_scale_inv"):  # W = q * s about 1.5 / sqrt(K); K: the scale's columns x 16
            k = shape[-1] * 16
            weights[name] = (rng.uniform(0.5, 1.5, shape) * 1.5 / k ** 0.5 / 100).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 1.5 / shape[-1] ** 0.5)
                             + (1.0 if name.endswith("norm.weight") else 0.0)).astype(to_numpy(dtype))
    return cfg, graph, weights


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantised_moe_plan_matches_numpy_node_by_node(fmt):
    cfg, graph, weights = fp8_moe_model(qc=NVFP4_CONFIG if fmt == "nvfp4" else None, layers=2)
    assert [n.op for n in graph.nodes.values()].count(f"moe_experts_{fmt}") == 2
    run = _NodePlan(cfg, graph, weights)
    # layer 0's sum runs in layer 1's input norm (lower.py _norm_takes_moe_sum: FP8's quantising
    # add_rms_norm_quant, NVFP4's (W4A16) add_rms_norm), checked node by node against the reference
    # norm of the reference layer output; layer 1's output goes through the logits' gather: moe_sum
    norm = "fp8_quant_kernel" if fmt == "fp8" else "rms_norm_kernel"
    for b in BUCKETS:
        kernels = Counter(spec.kernel for spec, _ in run.lowered[b])
        assert kernels["moe_gate_up_kernel"] == kernels["moe_down_kernel"] == 2
        assert kernels["moe_align_kernel"] == (0 if b.decode else 2) and kernels["moe_sum_kernel"] == 1
        fused = [spec for spec, _ in run.lowered[b] if spec.kernel == norm and spec.constexprs.get("MOE_TOPK")]
        assert len(fused) == 1 and not fused[0].constexprs.get("MOE_SHARED")
        gemms = [spec for spec, _ in run.lowered[b] if spec.kernel in ("moe_gate_up_kernel", "moe_down_kernel")]
        if fmt == "fp8":
            assert all(s.constexprs["FP8"] and s.signature["w_ptr"] == "*fp8e4nv" and s.constexprs["BLOCK_M"] >= 64
                       for s in gemms)
        else:
            assert all(s.constexprs["NV"] and s.signature["w_ptr"] == "*u8" for s in gemms)
    run.check_prefill_then_decode()
