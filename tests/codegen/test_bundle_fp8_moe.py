"""Quantised MoE models compile on this CPU machine (as test_bundle_fp8.py does for the dense FP8
models): a tiny Qwen3-MoE and a tiny Qwen3.5-MoE (shared expert, GDN layers) whose experts stay e4m3
with their stacked block scales, every bucket's plan running the FP8 expert GEMMs (decode and grouped
forms) for sm_90 and sm_121, and the Qwen3-MoE in ModelOpt NVFP4 the same way; and on sm_90 every FP8
expert GEMM is e4m3 wgmma, decode form included (codegen/triton/moe_gemm.py: a token's row gets the
same bits in every form)."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from tests.codegen.helpers import compile_small_bundle, mma_instructions
from tests.fp8_checkpoints import BLOCK_CONFIG
from tests.tiny_models import BASE, HYBRID_BASE

pytestmark = pytest.mark.slow
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)
QC = {**BLOCK_CONFIG, "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}


def _config(kind: str) -> ModelConfig:
    if kind == "qwen3_moe":  # layer 1 dense (mlp_only_layers)
        return ModelConfig.from_hf_dict({**BASE, **EXPERTS, "hidden_size": 256, "head_dim": 64,
                                         "intermediate_size": 256, "mlp_only_layers": [1],
                                         "architectures": ["Qwen3MoeForCausalLM"], "quantization_config": QC})
    skip = [f"model.layers.{i}.linear_attn.in_proj_{c}" for i in range(3) for c in "ab"]
    return ModelConfig.from_hf_dict({**HYBRID_BASE, **EXPERTS, "hidden_size": 256, "head_dim": 64,
                                     "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                                     "shared_expert_intermediate_size": 128, "num_hidden_layers": 4,
                                     "max_position_embeddings": 256, "architectures": ["Qwen3_5MoeForCausalLM"],
                                     "quantization_config": {**QC, "modules_to_not_convert": ["lm_head", *skip]}})


@pytest.mark.parametrize("target", ["sm_90", "sm_121"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_5_moe"])
def test_every_bucket_of_an_fp8_moe_model_compiles(kind, target):
    cfg = _config(kind)
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.layer_is_moe(i)]
    assert [n.op for n in graph.nodes.values()].count("moe_experts_fp8") == len(moe)
    b, meta, plans = compile_small_bundle(graph, cfg, target)
    for p in plans.values():
        names = Counter(meta[key]["name"] for key, _, _ in p["launches"])
        assert names["moe_gate_up_kernel"] == names["moe_down_kernel"] == len(moe), p["bucket"]
    fp8 = {k: m for k, m in meta.items() if m["name"] in ("moe_gate_up_kernel", "moe_down_kernel")}
    assert fp8 and all("*fp8e4nv" in json.dumps(m["signature"]) for m in fp8.values())
    weights = b.manifest["weights"]
    x = f"model.layers.{moe[0]}.mlp.experts"
    assert weights[f"{x}.gate_up_proj"][:2] == ["fp8e4m3", [4, 256, 256]]
    assert weights[f"{x}.gate_up_proj.weight_scale_inv"][:2] == ["f32", [4, 2, 2]]
    assert weights[f"{x}.down_proj.weight_scale_inv"][:2] == ["f32", [4, 2, 1]]
    print(f"{cfg.architecture} FP8 {target}: {len(b.kernels)} cubins, {len(fp8)} of them FP8 expert GEMMs")


@pytest.mark.parametrize("target", ["sm_90", "sm_121"])
def test_every_bucket_of_an_nvfp4_moe_model_compiles(target):
    """The tiny Qwen3-MoE in ModelOpt NVFP4 (W4A16): experts packed u8 with e4m3 block and f32
    per-tensor scales, every bucket running the NVFP4 expert GEMMs."""
    cfg = ModelConfig.from_hf_dict({**BASE, **EXPERTS, "hidden_size": 256, "head_dim": 64, "intermediate_size": 256,
                                    "mlp_only_layers": [1], "architectures": ["Qwen3MoeForCausalLM"],
                                    "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                            "group_size": 16, "exclude_modules": ["lm_head"]}})
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))
    assert [n.op for n in graph.nodes.values()].count("moe_experts_nvfp4") == 1
    b, meta, plans = compile_small_bundle(graph, cfg, target)
    for p in plans.values():
        names = Counter(meta[key]["name"] for key, _, _ in p["launches"])
        assert names["moe_gate_up_kernel"] == names["moe_down_kernel"] == 1, p["bucket"]
    weights = b.manifest["weights"]
    assert weights["model.layers.0.mlp.experts.gate_up_proj"][:2] == ["u8", [4, 256, 128]]
    assert weights["model.layers.0.mlp.experts.gate_up_proj.weight_scale_2"][:2] == ["f32", [4, 2]]
    print(f"Qwen3MoeForCausalLM NVFP4 {target}: {len(b.kernels)} cubins")


_PTX_SPECS = """
from kiln.codegen.triton.moe import moe_experts_specs
from kiln.codegen.triton.moe_gemm import Fp8Experts
def specs():
    for t in (1, 8, 512):
        for spec in moe_experts_specs(t, 8, 256, 2048, 512, fp8=Fp8Experts((128, 128), 1e-10 / 448, "sm_90")):
            if spec.kernel in ("moe_gate_up_kernel", "moe_down_kernel"):
                yield f"{t}/{spec.kernel}", 90, spec
"""


def test_sm_90_fp8_expert_gemms_are_e4m3_wgmma_in_every_bucket():
    pytest.importorskip("triton")
    found = mma_instructions(_PTX_SPECS, timeout=900)
    assert len(found) == 6
    for key, instrs in found.items():
        assert instrs and all(i.startswith("wgmma.mma_async") and ".e4m3.e4m3" in i for i in instrs), (key, instrs)
