"""Quantized checkpoints kiln cannot run are refused in one sentence naming what, never run as if
unquantized (issue 39: a block-wise FP8 checkpoint used to load silently and give garbage)."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from kiln.errors import InvalidModelError, KilnError, UnsupportedQuantizationError
from kiln.loader import load, read_config
from kiln.models.safetensors_weights import SafetensorsWeights
from tests.fp8_checkpoints import CHANNEL_CONFIG, MODELOPT_CONFIG, make_fp8_checkpoint
from tests.tiny_models import make_tiny_hybrid, make_tiny_model


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8_block")
    make_fp8_checkpoint(d, "llama_gqa_untied", "block")
    return d


@pytest.fixture()
def edit(block_dir, tmp_path):
    """A copy of the block-wise checkpoint; edit(config_fn, tensors_fn) changes it and returns its path."""
    def make(config=None, tensors=None):
        cfg = json.loads((block_dir / "config.json").read_text())
        src = SafetensorsWeights([block_dir / "model.safetensors"])  # safetensors.numpy cannot read fp8
        t = {n: np.array(src.get(n, keep_dtype=True)) for n in src.names()}
        if config:
            config(cfg)
        if tensors:
            tensors(t)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        save_file(t, str(tmp_path / "model.safetensors"))
        return tmp_path
    return make


def _one_sentence(e: Exception) -> str:
    msg = str(e)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def _qc(**kw):
    return lambda c: c.__setitem__("quantization_config", kw)


@pytest.mark.parametrize("qc, says", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quantization method 'awq' is not supported by kiln"),
    ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [16, 16], "activation_scheme": "static"},
     "activation_scheme 'static'"),
    ({"quant_method": "fp8", "weight_block_size": [16, 16], "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ({**CHANNEL_CONFIG, "kv_cache_scheme": {"type": "float", "num_bits": 8}}, "kv_cache_scheme"),
    ({**CHANNEL_CONFIG, "config_groups": {"group_0": {**CHANNEL_CONFIG["config_groups"]["group_0"], "weights": {
        **CHANNEL_CONFIG["config_groups"]["group_0"]["weights"], "strategy": "block"}}}}, "weight strategy 'block'"),
    ({**CHANNEL_CONFIG, "config_groups": {"group_0": {**CHANNEL_CONFIG["config_groups"]["group_0"],
                                                      "input_activations": None}}}, "input activations None"),
    ({**MODELOPT_CONFIG["quantization"], "quant_method": "modelopt", "quant_algo": "W4A8_NVFP4_FP8"},
     "ModelOpt quant_algo 'W4A8_NVFP4_FP8'"),
    ({**MODELOPT_CONFIG, "quantization": {**MODELOPT_CONFIG["quantization"], "kv_cache_quant_algo": "FP8"}},
     "KV-cache"),
])
def test_unsupported_quantization_is_refused_by_name(edit, qc, says):
    path = edit(config=lambda c: c.__setitem__("quantization_config", qc))
    for call in (lambda: load(path, tokenizer=False), lambda: read_config(path)):
        with pytest.raises(UnsupportedQuantizationError) as e:
            call()
        assert says in _one_sentence(e.value)


def test_missing_scale_is_named(edit):
    path = edit(tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale_inv"))
    with pytest.raises(KilnError) as e:
        load(path, tokenizer=False)
    assert "model.layers.1.mlp.up_proj.weight_scale_inv" in _one_sentence(e.value)


def test_scale_of_the_wrong_shape_is_named(edit):
    path = edit(tensors=lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight_scale_inv",
                                                np.ones((2, 2), np.float32)))
    with pytest.raises(InvalidModelError) as e:
        load(path, tokenizer=False)
    assert "model.layers.0.mlp.down_proj.weight_scale_inv" in _one_sentence(e.value)


def test_fp8_tensors_without_quantization_config_are_refused(edit):
    """The issue's bug: e4m3 weights and no quantization_config must not run as plain weights."""
    path = edit(config=lambda c: c.pop("quantization_config"))
    with pytest.raises(InvalidModelError) as e:
        load(path, tokenizer=False)
    assert "float8_e4m3fn" in _one_sentence(e.value) and "no quantization_config" in str(e.value)


def test_module_left_unquantized_by_config_but_stored_fp8_is_refused(edit):
    path = edit(config=lambda c: c["quantization_config"].__setitem__("modules_to_not_convert",
                                                                      ["model.layers.0.mlp.down_proj"]))
    with pytest.raises(InvalidModelError) as e:
        load(path, tokenizer=False)
    assert "model.layers.0.mlp.down_proj.weight" in _one_sentence(e.value) and "unquantized" in str(e.value)


def test_fp8_config_over_bf16_weights_is_refused(edit):
    """A quantization_config is never silently ignored: a bf16 weight where it says e4m3 is named."""
    def to_bf16(t):
        t["model.layers.0.self_attn.q_proj.weight"] = np.ones((64, 64), ml_dtypes.bfloat16)
    with pytest.raises(InvalidModelError) as e:
        load(edit(tensors=to_bf16), tokenizer=False)
    assert "model.layers.0.self_attn.q_proj.weight" in _one_sentence(e.value) and "bfloat16" in str(e.value)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_moe", "qwen3_5_moe"])
def test_quantization_config_on_an_architecture_kiln_runs_unquantized_is_refused(tmp_path, kind):
    """Qwen3-Next (its GDN projections are rearranged at load) is refused in FP8 by name; the dense
    Qwen3.5 hybrids run (test_fp8_hybrid.py), and so do block-wise FP8 MoE models (test_fp8_moe.py),
    whose bf16 experts under an FP8 config are refused naming the first expert scale they lack."""
    if kind == "qwen3_next":
        make_tiny_hybrid(tmp_path, "qwen3_next")
    else:
        from tests.tiny_moe import make_tiny_moe
        make_tiny_moe(tmp_path, kind)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if kind != "qwen3_next":
        with pytest.raises(InvalidModelError) as e:
            load(tmp_path, tokenizer=False)
        assert "experts.0.gate_proj.weight_scale_inv is missing" in _one_sentence(e.value)
        return
    with pytest.raises(UnsupportedQuantizationError) as e:
        load(tmp_path, tokenizer=False)
    assert "FP8 checkpoints of" in _one_sentence(e.value) and cfg["architectures"][0] in str(e.value)


def test_modelopt_hf_quant_config_is_read_beside_config_json(tmp_path):
    """hf_quant_config.json alone marks a ModelOpt checkpoint; compile (config only) sees it too."""
    make_fp8_checkpoint(tmp_path, "llama_gqa_untied", "modelopt", calib_prompts=[[1, 2, 3, 4]])
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    q = read_config(tmp_path).quantization
    assert (q.method, q.weight, q.activation) == ("modelopt", "tensor", "static")
    assert not q.quantizes("lm_head") and q.quantizes("model.layers.0.mlp.up_proj")


def test_quantization_keys_the_config_hash(block_dir):
    """A bundle compiled for the bf16 model is never taken for the FP8 one (and back)."""
    from kiln.models.config import ModelConfig

    hf = json.loads((block_dir / "config.json").read_text())
    fp8 = ModelConfig.from_hf_dict(hf)
    plain = ModelConfig.from_hf_dict({k: v for k, v in hf.items() if k != "quantization_config"})
    assert fp8.quantization.block == (16, 16) and plain.quantization is None
    assert fp8.compute_hash() != plain.compute_hash()


def test_gpu_target_compiles_fp8(block_dir, tmp_path, capsys, monkeypatch):
    """FP8 Llama/Qwen3 compile for sm_90 (codegen/triton/fp8_gemm.py, fp8_quant.py); what kiln
    cannot run in FP8 (Qwen3-Next, MoE) is refused when the config is read, by name, on any target."""
    pytest.importorskip("triton")
    from kiln.build import main as build_main

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    rc = build_main(["compile", "--model", str(block_dir), "--target", "sm_90", "--out", str(tmp_path / "out"),
                     "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                     "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "manifest.yaml").is_file()
