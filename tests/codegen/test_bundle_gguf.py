"""Every bucket of a tiny GGUF Llama whose linears are in all six block formats kiln computes in
(q/k Q4_K, v Q6_K, o Q5_K, gate Q4_0, up Q4_1, down Q8_0, the untied head Q6_K) compiles to sm_90
and sm_121a cubins on this CPU machine (as test_bundle.py does for bf16): gguf_gemm_kernel for
every linear of every plan, the weights in the manifest as their u8 blocks.

Measured here (2 cores, empty kernel cache, 7 buckets): 33 cubins, 19 of them gguf_gemm_kernel;
sm_90 18 s, sm_121 32 s."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from kiln.codegen.compile import compile_bundle
from kiln.graph import DType
from kiln.graph.gguf_blocks import BLOCKS, row_bytes
from kiln.models.config import ModelConfig
from kiln.models.gguf_quant import SUFFIX, GgufConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from tests.codegen.helpers import compile_small_bundle, mma_instructions

pytestmark = pytest.mark.slow

DIMS = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6,
            tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
MIX = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_K", "gate_proj": "Q4_0",
       "up_proj": "Q4_1", "down_proj": "Q8_0"}


@pytest.mark.parametrize("target", ["sm_90", "sm_121"])
def test_every_bucket_of_a_gguf_model_compiles(target):
    base = ModelConfig.from_hf_dict(DIMS)
    types = tuple((f"model.layers.{i}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}.weight", q)
                  for i in range(base.num_hidden_layers) for m, q in MIX.items()) + (("lm_head.weight", "Q6_K"),)
    assert set(q for _, q in types) == set(BLOCKS)
    cfg = dataclasses.replace(base, quantization=GgufConfig(types))
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))
    b, meta, plans = compile_small_bundle(graph, cfg, target)
    assert set(plans) == {"d1x1", "d2x2", "d4x4", "d8x8", "m16x8", "m32x8", "m64x8"}
    for p in plans.values():
        names = Counter(meta[key]["name"] for key, _, _ in p["launches"])
        # per layer q+k (merged: one type), v, o, gate, up (two types: apart), down; and the head
        assert names["gguf_gemm_kernel"] == 6 * cfg.num_hidden_layers + 1, p["bucket"]
        assert names["gemm_kernel"] == 0, p["bucket"]
    weights = b.manifest["weights"]
    assert weights["model.layers.0.mlp.down_proj" + SUFFIX][:2] == ["u8", [256, row_bytes("Q8_0", 512)]]
    assert weights["lm_head" + SUFFIX][:2] == ["u8", [256, row_bytes("Q6_K", 256)]]
    assert weights["model.layers.1.self_attn.q_proj+k_proj" + SUFFIX][2] == [
        ["model.layers.1.self_attn.q_proj" + SUFFIX, 256], ["model.layers.1.self_attn.k_proj" + SUFFIX, 128]]


def test_a_gguf_moe_model_compiles_for_sm_90():
    """Qwen3-MoE with its experts in blocks (gate/up Q4_K stacked, down Q6_K) and Q8_0 attention:
    every bucket's plan runs the MoE kernels over the u8 expert blocks (both paths: decode buckets
    and the grouped one)."""
    base = ModelConfig.from_hf_dict({**DIMS, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 256, "decoder_sparse_step": 1,
                                     "norm_topk_prob": True})
    types = []
    for i in range(base.num_hidden_layers):
        x = f"model.layers.{i}.mlp.experts"
        types += [(f"{x}.gate_proj.weight", "Q4_K"), (f"{x}.up_proj.weight", "Q4_K"), (f"{x}.down_proj.weight", "Q6_K")]
        types += [(f"model.layers.{i}.self_attn.{m}.weight", "Q8_0") for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
    cfg = dataclasses.replace(base, quantization=GgufConfig(tuple(types)))
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))
    assert sum(n.op == "moe_experts_gguf" for n in graph.nodes.values()) == cfg.num_hidden_layers
    b = compile_bundle(graph, target="sm_90", model_config=dataclasses.asdict(cfg), config_hash=cfg.compute_hash(),
                       max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16)
    meta = b.manifest["kernels"]
    for p in b.manifest["plans"].values():
        names = Counter(meta[key]["name"] for key, _, _ in p["launches"])
        assert names["moe_gate_up_kernel"] == names["moe_down_kernel"] == cfg.num_hidden_layers, p["bucket"]
        assert names["gguf_gemm_kernel"] == 2 * cfg.num_hidden_layers, p["bucket"]  # q/k/v merged, o
    gguf = [k for k, m in meta.items() if m["name"].startswith("moe_") and "*u8" in m["signature"]]
    assert len(gguf) >= 4  # gate_up and down, decode and grouped forms, over u8 blocks
    assert b.manifest["weights"]["model.layers.0.mlp.experts.gate_up_proj" + SUFFIX][:2] == \
        ["u8", [4, 512, row_bytes("Q4_K", 256)]]


_PTX_SPECS = """
from kiln.codegen.triton.gguf_gemm import gguf_gemm_spec, gguf_tile
def specs():
    for m in (1, 64, 2048):
        yield str(m), 90, gguf_gemm_spec(m, 4096, 4096, "Q4_K", tile=gguf_tile(m, "sm_90"))
"""


def test_sm_90_gguf_gemm_runs_the_bf16_gemms_instructions():
    """The dequantised tile goes through the bf16 GEMM's instructions: mma.sync for the decode tiles,
    wgmma for 64+ rows, bf16 operands, f32 accumulators (the pair gemm.py measured to give
    identical rows on the H200, which the GGUF kernel's invariance rests on)."""
    found = mma_instructions(_PTX_SPECS)
    assert found["1"] == ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"]
    assert all(i.startswith("wgmma.mma_async") and i.endswith(".f32.bf16.bf16") for m in ("64", "2048")
               for i in found[m]) and found["64"] and found["2048"]
