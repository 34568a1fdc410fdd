"""Mixture-of-experts models on the CPU target against transformers (eager experts) on tiny random
checkpoints (tests/tiny_moe.py): Qwen3MoeForCausalLM (decoder_sparse_step 2, one mlp_only_layers
entry), Qwen3_5MoeForConditionalGeneration (shared expert, vision tower skipped) and
Qwen3NextForCausalLM. Logits of every step within 1e-4 relative (of transformers' float64 run) and 32 greedy tokens identical
for a batch of prompts of different lengths (some past two Gated DeltaNet chunks); the per-expert
and the stacked layouts of one checkpoint give identical logits; the router and the shared
expert's GEMMs merge into one linear in --dump-ir."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.loader import build_graph, load
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.test_qwen3_5 import assert_greedy_steps_match_transformers, f64_truth
from tests.tiny_moe import MOE_VARIANTS, make_tiny_moe

REPO = Path(__file__).resolve().parents[1]
LENGTHS = (7, 140, 1, 131)


@pytest.fixture(scope="module", params=MOE_VARIANTS)
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, make_tiny_moe(d / "per_expert", request.param), d


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in LENGTHS]


def _all_logits(lm, prompt: list[int]) -> np.ndarray:
    """Every position's logits of one prompt in one step."""
    chunk = SeqChunk(prompt, 0, list(range(-(-len(prompt) // lm.block_size))), all_logits=True,
                     state_slot=1 if lm.source.config.is_hybrid else -1)
    return next(iter(lm.executor.execute(prepare_step([chunk], lm.block_size)).values()))


def test_logits_and_greedy_tokens_match_transformers(tiny):
    name, _, model, root = tiny
    lm = load(root / "per_expert", tokenizer=False)
    cfg = lm.source.config
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.layer_is_moe(i)]
    assert moe_layers == {"qwen3_moe": [1, 5], "qwen3_5_moe": list(range(8)),
                          "qwen3_next": [0, 1, 3, 4, 5, 6, 7]}[name]
    prompts = _prompts(1)
    assert_greedy_steps_match_transformers(name, lm, model, prompts)


def test_per_expert_and_stacked_layouts_give_identical_logits(tiny):
    """The same weights saved both ways: transformers' default per-expert tensors, and its stacked
    experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] (save_original_format=False)."""
    name, _, model, root = tiny
    stacked = root / "stacked"
    if not stacked.exists():
        model.save_pretrained(stacked, safe_serialization=True, save_original_format=False)
    names = set(load(stacked, tokenizer=False).source.weights.inner.names())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert not any(".experts.0." in n for n in names)
    p = _prompts(2)[1]
    a = _all_logits(load(root / "per_expert", tokenizer=False), p)
    b = _all_logits(load(stacked, tokenizer=False), p)
    np.testing.assert_array_equal(a, b)
    with torch.no_grad():
        want = f64_truth(model)(torch.tensor([p])).logits[0].numpy()
    assert np.abs(a - want).max() / np.abs(want).max() < 1e-4


def test_router_and_shared_expert_share_one_gemm(tiny, tmp_path):
    """passes/merge_parallel_linears.py stacks the router [E, H] with the shared expert's gate,
    up and gate-scalar weights (one read of x), and --dump-ir shows it."""
    name, _, _, root = tiny
    lm = load(root / "per_expert", tokenizer=False)
    cfg = lm.source.config
    graph = build_graph(cfg, target="cpu", dump_dir=tmp_path)
    i = next(i for i in range(cfg.num_hidden_layers) if cfg.layer_is_moe(i))
    p = f"model.layers.{i}.mlp."
    router = graph.producer(graph.nodes[f"layers.{i}.topk"].inputs[0])
    if name == "qwen3_moe":  # no shared expert: the router GEMM stands alone
        assert router.op == "linear" and router.inputs[1] == p + "gate.weight"
        return
    assert router.op == "slice_cols"  # the router's columns of the merged GEMM
    merged = graph.tensors[graph.producer(router.inputs[0]).inputs[1]]
    parts = [n for n, _ in merged.parts]
    assert parts == [p + "gate.weight", p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight",
                     p + "shared_expert_gate.weight"]
    dumped = sorted(tmp_path.glob("*merge_parallel_linears.txt"))[0].read_text()
    assert merged.name in dumped and "moe_router" in dumped and "moe_experts" in dumped
    # fuse_router_silu: the shared expert's silu_mul rides in the router's launch, in every MoE layer
    topk = graph.nodes[f"layers.{i}.topk"]
    assert topk.op == "moe_router_silu_mul" and topk.outputs[2] == graph.nodes[f"layers.{i}.shared_expert.down_proj"].inputs[0]
    moe_layers = sum(cfg.layer_is_moe(j) for j in range(cfg.num_hidden_layers))
    fused = sorted(tmp_path.glob("*fuse_router_silu.txt"))[0].read_text()
    assert fused.count("moe_router_silu_mul(") == moe_layers and " moe_router(" not in fused


def _compile(model, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "build.py"), "compile", "--model", str(model), *extra],
                          capture_output=True, text=True, timeout=300)


def test_build_compile_for_the_cpu_and_sm_90(tmp_path):
    """`build.py compile` takes the MoE graph for the cpu target (the IR dump shows the moe ops)
    and compiles its bundle for sm_90 (router, align, grouped and decode expert kernels)."""
    make_tiny_moe(tmp_path / "m", "qwen3_5_moe")
    ok = _compile(tmp_path / "m", "--target", "cpu", "--dump-ir", str(tmp_path / "ir"))
    assert ok.returncode == 0, ok.stderr
    assert "Qwen3_5MoeForConditionalGeneration" in ok.stderr + ok.stdout
    assert "moe_experts" in sorted((tmp_path / "ir").glob("*.txt"))[-1].read_text()
    pytest.importorskip("triton")
    gpu = _compile(tmp_path / "m", "--target", "sm_90", "--out", str(tmp_path / "b"))
    assert gpu.returncode == 0, gpu.stderr
    assert "moe_router_kernel" in (tmp_path / "b" / "manifest.yaml").read_text()


def test_config_fields_as_transformers_reads_them():
    """transformers writes qwen3_moe's expert count as num_local_experts and defaults its
    norm_topk_prob to False (Qwen3-Next: True); qwen3_5_moe has no such field and always renormalises."""
    from kiln.errors import ConfigError
    from kiln.models.config import ModelConfig

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_experts_per_tok=2, moe_intermediate_size=32)
    cfg = ModelConfig.from_hf_dict(dict(base, architectures=["Qwen3MoeForCausalLM"], num_local_experts=8,
                                        decoder_sparse_step=2, mlp_only_layers=[3]))
    assert (cfg.num_experts, cfg.norm_topk_prob) == (8, False)
    assert [cfg.layer_is_moe(i) for i in range(4)] == [False, True, False, False]
    cfg = ModelConfig.from_hf_dict(dict(base, architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                                        norm_topk_prob=True))
    assert cfg.norm_topk_prob and all(cfg.layer_is_moe(i) for i in range(4))
    with pytest.raises(ConfigError, match="num_experts_per_tok \\(9\\) is more than the 8 experts"):
        ModelConfig.from_hf_dict(dict(base, architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                                      num_experts_per_tok=9))


def test_a_missing_expert_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    from kiln.errors import InvalidModelError

    make_tiny_moe(tmp_path, "qwen3_moe")
    f = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(f)
    del tensors["model.layers.5.mlp.experts.6.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(InvalidModelError, match=r"model.layers.5.mlp.experts.6.up_proj.weight is missing"):
        load(tmp_path, tokenizer=False)
