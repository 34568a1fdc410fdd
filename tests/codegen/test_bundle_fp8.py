"""Every bucket of a tiny FP8 Llama and Qwen3 compiles to sm_90 and sm_121a cubins on this CPU
machine (as test_bundle.py does for bf16): the FP8 GEMM and the quantising kernels in every plan,
e4m3 weights with their f32 scales in the manifest. And on sm_90 the FP8 GEMM of every default
tile is e4m3 wgmma, the one instruction for every bucket (codegen/triton/fp8_gemm.py)."""
from __future__ import annotations

from collections import Counter

import pytest

from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from tests.codegen.helpers import compile_small_bundle, mma_instructions
from tests.fp8_checkpoints import BLOCK_CONFIG, MODELOPT_CONFIG
from tests.tiny_models import BASE

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("target", ["sm_90", "sm_121"])
@pytest.mark.parametrize("arch,qc", [("LlamaForCausalLM", BLOCK_CONFIG), ("Qwen3ForCausalLM", BLOCK_CONFIG),
                                     ("LlamaForCausalLM", MODELOPT_CONFIG)], ids=["llama-block", "qwen3-block",
                                                                                  "llama-modelopt"])
def test_every_bucket_of_an_fp8_model_compiles(arch, qc, target):
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], "quantization_config": qc})
    graph = run_pipeline(get_graph_builder(arch)(cfg, dtype=DType.bf16))
    b, meta, plans = compile_small_bundle(graph, cfg, target)
    assert set(plans) == {"d1x1", "d2x2", "d4x4", "d8x8", "m16x8", "m32x8", "m64x8"}
    layers = cfg.num_hidden_layers
    for p in plans.values():
        names = Counter(meta[key]["name"] for key, _, _ in p["launches"])
        assert names["fp8_gemm_kernel"] == 7 * layers, p["bucket"]
        # per layer: the input norm, o_proj's input, the post-attention norm, SwiGLU
        assert names["fp8_quant_kernel"] == 4 * layers, p["bucket"]
    weights = b.manifest["weights"]
    assert weights["model.layers.0.self_attn.q_proj.weight"][0] == "fp8e4m3"
    scale = "weight_scale_inv" if qc is BLOCK_CONFIG else "weight_scale"
    assert weights[f"model.layers.0.mlp.down_proj.{scale}"][0] == "f32"


_PTX_SPECS = """
from kiln.codegen.triton.fp8_gemm import fp8_gemm_spec, fp8_tile
def specs():
    for m in (1, 16, 64, 2048):
        for groups, block in ((32, (128, 128)), (1, (1, 4096))):
            yield f"{m}/{groups}", 90, fp8_gemm_spec(m, 4096, 4096, groups, block, tile=fp8_tile(m, "sm_90"),
                                                     arch="sm_90")
"""


def test_sm_90_fp8_gemm_is_e4m3_wgmma_in_every_bucket():
    pytest.importorskip("triton")
    found = mma_instructions(_PTX_SPECS)
    for key, instrs in found.items():
        assert instrs and all(i.startswith("wgmma.mma_async") and ".e4m3.e4m3" in i for i in instrs), (key, instrs)


def test_the_quantising_kernels_compile_where_the_group_count_is_no_power_of_two(tmp_path):
    """The 27B shape's rows are 40 groups of 128 (hidden 5,120) and 136 (intermediate 17,408), a
    tiny model's 5 of 32: every producer's quantising kernel compiles to sm_90 (the interpreter
    accepts a reshape the compiler refuses, so the kernel tests alone did not catch it)."""
    from kiln.codegen.triton.aot import compile_spec
    from kiln.codegen.triton.configs import DEFAULT
    from kiln.codegen.triton.fp8_quant import MODES, fp8_quant_spec

    for n, group in ((5120, 128), (17408, 128), (160, 32)):
        for mode in MODES:
            spec = fp8_quant_spec(4, n, group, mode=mode, n_static=0, config=DEFAULT.row(f"{mode}_quant", n))
            assert compile_spec(spec, "sm_90", cache_dir=tmp_path).cubin[:4] == b"\x7fELF", (n, group, mode)


@pytest.mark.parametrize("target", ["sm_90", "sm_121"])
def test_every_bucket_of_an_fp8_hybrid_compiles(target):
    """A block-wise FP8 Qwen3.5 hybrid (3 Gated DeltaNet layers and a gated-attention one) as Qwen's
    Qwen3.5-*-FP8 checkpoints quantise it, [128, 128] blocks on dimensions that are multiples of
    128 (tests/test_fp8_hybrid.py WIDE), in_proj_a/in_proj_b left bf16 by modules_to_not_convert:
    every quantised linear is one fp8_gemm_kernel launch in every plan, the bf16 in_proj_b/a one
    GEMM, and the e4m3 weights and their scales are in the manifest."""
    from tests.test_fp8_hybrid import WIDE
    from tests.tiny_models import HYBRID_BASE

    skip = [f"model.layers.{i}.linear_attn.in_proj_{c}" for i in range(3) for c in "ab"]
    qc = {**BLOCK_CONFIG, "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", *skip]}
    cfg = ModelConfig.from_hf_dict({**HYBRID_BASE, **WIDE, "num_hidden_layers": 4, "max_position_embeddings": 256,
                                    "architectures": ["Qwen3_5ForCausalLM"], "quantization_config": qc})
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))
    n_fp8 = [n.op for n in graph.nodes.values()].count("linear_fp8")
    assert n_fp8 == 3 * 3 + 4 + 4 * 3  # GDN in_proj_qkv, in_proj_z, out_proj; q/k/v/o; the MLPs
    b, meta, plans = compile_small_bundle(graph, cfg, target)
    for p in plans.values():
        names = Counter(meta[key]["name"] for key, _, _ in p["launches"])
        assert names["fp8_gemm_kernel"] == n_fp8, p["bucket"]
    weights = b.manifest["weights"]
    assert weights["model.layers.0.linear_attn.in_proj_qkv.weight"][0] == "fp8e4m3"
    assert weights["model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"][:2] == ["f32", [2, 2]]
    assert weights["model.layers.3.self_attn.q_proj.weight"][0] == "fp8e4m3"
    assert not any(w[0] == "fp8e4m3" for name, w in weights.items() if "in_proj_a" in name or "in_proj_b" in name)
    print(f"Qwen3_5ForCausalLM FP8 {target}: {len(b.kernels)} cubins, "
          f"{sum(1 for k in meta.values() if k['name'] == 'fp8_gemm_kernel')} of them fp8_gemm_kernel")


def test_build_compile_online_fp8(tmp_path, capsys, monkeypatch):
    """`build.py compile --quantization fp8` on a bf16 checkpoint (online FP8: per-tensor e4m3 weights,
    per-token activations) compiles the FP8 path: every decoder linear an fp8_gemm_kernel launch."""
    import torch

    from kiln.build import main as build_main
    from tests.tiny_models import make_tiny_model

    make_tiny_model(tmp_path / "model", "qwen3_qknorm", dtype=torch.bfloat16)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    rc = build_main(["compile", "--model", str(tmp_path / "model"), "--target", "sm_90", "--out",
                     str(tmp_path / "out"), "--max-model-len", "128", "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "64", "--no-progress", "--quantization", "fp8"])
    assert rc == 0, capsys.readouterr().err
    from kiln.runtime.worker.bundle import Bundle

    m = Bundle.read(tmp_path / "out").manifest
    assert m["weights"]["model.layers.0.self_attn.q_proj.weight"][0] == "fp8e4m3"
    assert m["weights"]["model.layers.0.self_attn.q_proj.weight_scale"][:2] == ["f32", [1]]
    for p in m["plans"].values():
        names = [m["kernels"][key]["name"] for key, _, _ in p["launches"]]
        assert names.count("fp8_gemm_kernel") == 7 * 2, p["bucket"]
