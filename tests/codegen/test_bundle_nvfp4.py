"""Every bucket of a tiny NVFP4 (ModelOpt) Llama (sm_90) and Qwen3 (sm_121a) compiles to cubins on
this CPU machine (as test_bundle_fp8.py does for FP8): the W4A16 GEMM in every plan, the packed
uint8 weights with their e4m3 block scales and f32 per-tensor scales in the manifest. And the
sm_90 W4A16 GEMM multiplies on bf16 tensor cores in every default tile (PTX: bf16 wgmma for the
64- and 128-row prefill tiles, bf16 mma.sync for the 16-row decode tile); sm_121a has no wgmma,
so every tile there is bf16 mma.sync. Native FP4 MMA (tl.dot_scaled on sm_121a) is not used."""
from __future__ import annotations

from collections import Counter

import pytest

from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from tests.codegen.helpers import compile_small_bundle, mma_instructions
from tests.nvfp4_checkpoints import HF_QUANT_CONFIG
from tests.tiny_models import BASE

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch,target", [("LlamaForCausalLM", "sm_90"), ("Qwen3ForCausalLM", "sm_121")])
def test_every_bucket_of_an_nvfp4_model_compiles(arch, target):
    """(Two of the four pairs: each compile takes ~30 s on 2 cores; both archs and targets are covered.)"""
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], "quantization_config": HF_QUANT_CONFIG})
    graph = run_pipeline(get_graph_builder(arch)(cfg, dtype=DType.bf16))
    b, meta, plans = compile_small_bundle(graph, cfg, target)
    assert set(plans) == {"d1x1", "d2x2", "d4x4", "d8x8", "m16x8", "m32x8", "m64x8"}
    for p in plans.values():
        names = Counter(meta[key]["name"] for key, _, _ in p["launches"])
        assert names["nvfp4_gemm_kernel"] == 7 * cfg.num_hidden_layers, p["bucket"]
    weights = b.manifest["weights"]
    assert weights["model.layers.0.self_attn.q_proj.weight"][:2] == ["u8", [64, 32]]
    assert weights["model.layers.0.mlp.down_proj.weight_scale"][:2] == ["fp8e4m3", [64, 8]]
    assert weights["model.layers.0.mlp.down_proj.weight_scale_2"][:2] == ["f32", [1]]
    nv = sum(1 for k in meta.values() if k["name"] == "nvfp4_gemm_kernel")
    print(f"{arch} {target}: {len(b.kernels)} cubins, {nv} of them nvfp4_gemm_kernel")


_PTX_SPECS = """
from kiln.codegen.triton.nvfp4_gemm import nvfp4_gemm_spec, nvfp4_tile
def specs():
    for arch, cc in (("sm_90", 90), ("sm_121", 121)):
        for m in (1, 64, 2048):
            yield f"{arch}/{m}", cc, nvfp4_gemm_spec(m, 4096, 4096, tile=nvfp4_tile(m, arch))
"""


def test_nvfp4_gemm_is_bf16_tensor_core_math():
    """bf16 tensor-core math in every bucket, and one instruction form: mma.sync (on sm_90 a 64-row wgmma
    tile of the dequantised operand gave other bits than mma.sync on the H100: nvfp4_gemm.nvfp4_tile)."""
    pytest.importorskip("triton")
    found = mma_instructions(_PTX_SPECS)
    for key, instrs in found.items():
        assert instrs and all(".bf16" in i for i in instrs), (key, instrs)
        assert all(i.startswith("mma.sync") for i in instrs), (key, instrs)


def test_build_compile_takes_an_nvfp4_checkpoint(tmp_path, capsys, monkeypatch):
    """`build.py compile` reads hf_quant_config.json beside config.json and compiles the W4A16 path."""
    from kiln.build import main as build_main
    from tests.nvfp4_checkpoints import make_nvfp4_checkpoint

    make_nvfp4_checkpoint(tmp_path / "model", "qwen3_qknorm")
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    rc = build_main(["compile", "--model", str(tmp_path / "model"), "--target", "sm_90", "--out",
                     str(tmp_path / "out"), "--max-model-len", "128", "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "64", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    manifest = (tmp_path / "out" / "manifest.yaml").read_text()
    assert "nvfp4_gemm_kernel" in manifest and "weight_scale_2" in manifest
