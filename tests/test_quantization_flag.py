"""--quantization (vLLM's flag) through the real entry points: `build.py generate/compile/serve/bench`
(kiln.build.main, the console script's function) and LLM(quantization=...).

vLLM's semantics (vllm/config/model.py ModelConfig._verify_quantization): the flag names the
method, as vLLM names a checkpoint's (its quant_method: fp8, compressed-tensors; ModelOpt's
override: modelopt for FP8, modelopt_fp4 for NVFP4, which also takes modelopt; gguf for a GGUF
file); a method that is not the checkpoint's is refused naming both; a name kiln does not run (awq,
gptq, bitsandbytes, ...) is refused; fp8 on an unquantised checkpoint is online dynamic FP8: each
linear's weight quantised to e4m3 with one scale per tensor at load, activations per token.

Online FP8 oracle: transformers in f32 with each linear's weight quantised by torch (scale =
amax / 448, torch's float8_e4m3fn cast) and its input rounded per token (vLLM's
ref_dynamic_per_token_quant), told kiln's rounding of boundary elements only
(tests/test_fp8_hybrid.py _told_oracle): within 1e-3 (measured ~1e-6), and LLM's greedy tokens
equal the oracle's argmax at every step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from kiln import LLM, SamplingParams
from kiln.build import main as build_main
from kiln.errors import UnsupportedQuantizationError
from kiln.loader import load
from tests.fp8_checkpoints import LINEARS, _leaf, make_fp8_checkpoint
from tests.nvfp4_checkpoints import make_nvfp4_checkpoint
from tests.test_fp8_hybrid import _oracle_logits, _Probe
from tests.test_fp8_models import _prompts, _rel
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantization_flag")
    make_fp8_checkpoint(root / "block", "llama_gqa_untied", "block")
    make_fp8_checkpoint(root / "channel", "qwen3_qknorm", "channel")  # compressed-tensors FP8_DYNAMIC
    make_fp8_checkpoint(root / "modelopt", "llama_gqa_untied", "modelopt", calib_prompts=[[1, 2, 3, 4]])
    make_nvfp4_checkpoint(root / "nvfp4", "qwen3_qknorm")
    make_tiny_model(root / "bf16", "qwen3_qknorm", dtype=torch.bfloat16)
    # the oracle reads the bf16 file back in f32 (the model make_tiny_model returns went through bf16
    # whole: its RoPE inv_freq too, which moves the attention by 1e-4 at 50 tokens)
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(root / "bf16", dtype=torch.float32).eval()
    return root, bf16


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = build_main([str(a) for a in argv])
    return rc, capsys.readouterr().err.strip()


def _one_sentence(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("name", ["awq", "gptq", "bitsandbytes", "fp4"])
def test_methods_kiln_does_not_run_are_refused(ckpts, capsys, name):
    root, _ = ckpts
    for cmd in (["generate", "--prompt", "hi"], ["compile", "--target", "cpu"]):
        rc, err = _cli(capsys, *cmd, "--model", root / "bf16", "--quantization", name)
        assert rc == 1 and f"'{name}' is not supported by kiln" in _one_sentence(err), err
    rc, err = _cli(capsys, "serve", "--model", root / "bf16", "-q", name, "--port", "0")
    assert rc == 1 and f"'{name}' is not supported by kiln" in _one_sentence(err), err
    rc, err = _cli(capsys, "bench", "--workload", "decode", "--model", root / "bf16", "--quantization", name)
    assert rc == 1 and f"'{name}' is not supported by kiln" in _one_sentence(err), err
    with pytest.raises(UnsupportedQuantizationError, match=f"'{name}' is not supported by kiln"):
        LLM(str(root / "bf16"), quantization=name, skip_tokenizer_init=True)


@pytest.mark.parametrize("ckpt,name,have", [
    ("block", "modelopt", "fp8"), ("block", "compressed-tensors", "fp8"), ("block", "gguf", "fp8"),
    ("nvfp4", "fp8", "modelopt_fp4"), ("nvfp4", "compressed-tensors", "modelopt_fp4"),
    ("channel", "fp8", "compressed-tensors"), ("modelopt", "fp8", "modelopt"), ("modelopt", "modelopt_fp4", "modelopt"),
])
def test_a_method_that_is_not_the_checkpoints_is_refused_naming_both(ckpts, capsys, ckpt, name, have):
    root, _ = ckpts
    for cmd in (["compile", "--target", "sm_90", "--out", root / "never"], ["compile", "--target", "cpu"]):
        rc, err = _cli(capsys, *cmd, "--model", root / ckpt, "--quantization", name)
        line = _one_sentence(err)
        assert rc == 1 and f"--quantization {name} does not match" in line and f"quantized with {have}" in line, err
    assert not (root / "never").exists()
    with pytest.raises(UnsupportedQuantizationError, match=f"quantized with {have}"):
        LLM(str(root / ckpt), quantization=name, skip_tokenizer_init=True)


@pytest.mark.parametrize("ckpt,name", [("block", "fp8"), ("channel", "compressed-tensors"), ("modelopt", "modelopt"),
                                       ("nvfp4", "modelopt_fp4"), ("nvfp4", "modelopt")])
def test_the_checkpoints_own_method_runs_it_as_without_the_flag(ckpts, capsys, ckpt, name):
    """The checkpoint's own name (and vLLM's modelopt for an NVFP4 one) changes nothing: the same
    greedy tokens as without the flag, through LLM; compile accepts it too."""
    root, _ = ckpts
    rc, err = _cli(capsys, "compile", "--model", root / ckpt, "--target", "cpu", "--quantization", name)
    assert rc == 0, err
    prompt = _prompts(256, seed=5, lens=(12,))[0]
    flagged = LLM(str(root / ckpt), quantization=name, skip_tokenizer_init=True, kv_cache_tokens=1024)
    plain = LLM(str(root / ckpt), skip_tokenizer_init=True, kv_cache_tokens=1024)
    assert flagged.model.source.config.quantization == plain.model.source.config.quantization
    assert flagged.generate(prompt, GREEDY)[0].outputs[0].token_ids == plain.generate(prompt, GREEDY)[0].outputs[0].token_ids


def test_gguf_names_the_default_gguf(capsys):
    """The default model is SmolLM2's Q4_1 GGUF: --quantization gguf generates as without it, and
    any other method is refused naming gguf."""
    rc, err = _cli(capsys, "generate", "--prompt", "The capital of France is", "--max-tokens", "4",
                   "--quantization", "fp8")
    assert rc == 1 and "quantized with gguf" in _one_sentence(err), err
    rc = build_main(["generate", "--prompt", "The capital of France is", "--max-tokens", "4", "-q", "gguf"])
    with_flag = capsys.readouterr().out
    assert rc == 0
    assert build_main(["generate", "--prompt", "The capital of France is", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out == with_flag


def test_other_methods_on_an_unquantized_checkpoint_are_refused(ckpts, capsys):
    root, _ = ckpts
    for name in ("modelopt", "modelopt_fp4", "compressed-tensors", "gguf"):
        rc, err = _cli(capsys, "compile", "--model", root / "bf16", "--target", "cpu", "--quantization", name)
        line = _one_sentence(err)
        assert rc == 1 and f"--quantization {name} needs a checkpoint quantized with {name}" in line, err
        assert "is not quantized" in line


def test_online_fp8_on_a_moe_model_is_refused_by_name(tmp_path):
    from tests.tiny_moe import make_tiny_moe

    make_tiny_moe(tmp_path, "qwen3_moe")
    with pytest.raises(UnsupportedQuantizationError, match="online FP8.*Qwen3MoeForCausalLM"):
        LLM(str(tmp_path), quantization="fp8", skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def online(ckpts):
    """The bf16 checkpoint loaded with --quantization fp8, and its oracle: the f32 model whose
    linears hold the weights torch quantises per tensor."""
    root, model = ckpts
    lm = load(root / "bf16", quantization="fp8", kv_cache_tokens=2048, tokenizer=False)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if "layers" in name.split(".") and _leaf(name) in LINEARS:
                w = mod.weight
                s = w.abs().max() / 448.0
                mod.weight.copy_((w / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32) * s)
    model.fp8_linears, model.fp8_skip = LINEARS, ()
    return root, lm, model


def test_online_fp8_graph(online):
    """Every decoder linear is an FP8 linear on an e4m3 weight with one f32 scale; the LM head stays bf16."""
    _, lm, _ = online
    q = lm.source.config.quantization
    assert (q.method, q.weight, q.activation, q.online) == ("fp8", "tensor", "token", True)
    assert [n.op for n in lm.graph.nodes.values()].count("linear_fp8") == 7 * lm.source.config.num_hidden_layers
    w = lm.executor.weights
    assert w["model.layers.0.mlp.down_proj.weight"].dtype.name == "float8_e4m3fn"
    assert w["model.layers.0.mlp.down_proj.weight_scale"].shape == (1,)
    assert w["lm_head.weight"].dtype == np.float32


def test_online_fp8_logits_match_the_oracle(online):
    _, lm, model = online
    probe, stats = _Probe(lm), {"elements": 0, "ties": 0}
    for p in _prompts(256, seed=1):
        got, acts = probe.run(p)
        ref = _oracle_logits(model, p, acts, stats, min_scale=1.0 / (448.0 * 512.0))
        assert _rel(got, ref) <= 1e-3, f"{len(p)}-token prompt: {_rel(got, ref):.2e} from the online FP8 oracle"
    assert stats["ties"] <= 1e-4 * stats["elements"], stats


def test_online_fp8_greedy_through_llm_matches_the_oracle(online):
    """LLM(quantization="fp8") generates 32 greedy tokens; the oracle, told the rounding kiln's
    executor makes of that sequence, takes the same argmax at every step."""
    root, lm, model = online
    prompt = _prompts(256, seed=2, lens=(16,))[0]
    llm = LLM(str(root / "bf16"), quantization="fp8", skip_tokenizer_init=True, kv_cache_tokens=1024)
    ours = list(llm.generate(prompt, GREEDY)[0].outputs[0].token_ids)
    seq = prompt + ours[:-1]
    _, acts = _Probe(lm).run(seq)
    ref = _oracle_logits(model, seq, acts, {"elements": 0, "ties": 0}, min_scale=1.0 / (448.0 * 512.0))
    assert ref[len(prompt) - 1:].argmax(axis=-1).tolist() == ours


def test_online_fp8_of_a_hybrid_matches_the_oracle(tmp_path):
    """--quantization fp8 on an unquantised Qwen3.5 hybrid (the ForConditionalGeneration layout):
    every linear of the text tower FP8 per tensor, in_proj_a/in_proj_b too (vLLM quantises every
    LinearBase online), logits within 1e-3 of the oracle told kiln's boundary roundings."""
    from tests.fp8_checkpoints import GDN_LINEARS
    from tests.tiny_models import make_tiny_hybrid

    model = make_tiny_hybrid(tmp_path, "qwen3_5_conditional")
    lm = load(tmp_path, quantization="fp8", kv_cache_tokens=2048, tokenizer=False)
    linears = LINEARS + GDN_LINEARS
    assert [n.op for n in lm.graph.nodes.values()].count("linear_fp8") == 6 * 5 + 2 * 4 + 8 * 3
    with torch.no_grad():
        for name, mod in model.named_modules():
            if "layers" in name.split(".") and _leaf(name) in linears:
                s = mod.weight.abs().max() / 448.0
                mod.weight.copy_((mod.weight / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32) * s)
    model.fp8_linears, model.fp8_skip = linears, ()
    probe, stats = _Probe(lm), {"elements": 0, "ties": 0}
    for p in _prompts(256, seed=1, lens=(7, 33)):
        got, acts = probe.run(p)
        ref = _oracle_logits(model, p, acts, stats, min_scale=1.0 / (448.0 * 512.0))
        assert _rel(got, ref) <= 1e-3, f"{len(p)}-token prompt: {_rel(got, ref):.2e} from the online FP8 oracle"
    assert stats["ties"] <= 1e-4 * stats["elements"], stats
