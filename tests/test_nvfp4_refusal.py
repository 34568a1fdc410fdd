"""NVFP4 checkpoints kiln cannot run, or whose tensors disagree with their config, are refused in
one sentence naming what: never run approximately, never read as plain weights."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from kiln.errors import InvalidModelError, KilnError, UnsupportedQuantizationError
from kiln.loader import load, read_config
from kiln.models.safetensors_weights import SafetensorsWeights
from tests.nvfp4_checkpoints import CONFIG_JSON_QC, HF_QUANT_CONFIG, make_nvfp4_checkpoint
from tests.test_fp8_refusal import _one_sentence
from tests.tiny_models import make_tiny_hybrid


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("nvfp4")
    make_nvfp4_checkpoint(d, "llama_gqa_untied")
    return d


@pytest.fixture()
def edit(nvfp4_dir, tmp_path):
    """A copy of the NVFP4 checkpoint; edit(hf_quant=fn or None to drop it, config=fn, tensors=fn)."""
    def make(hf_quant=lambda q: None, config=None, tensors=None):
        cfg = json.loads((nvfp4_dir / "config.json").read_text())
        hq = json.loads((nvfp4_dir / "hf_quant_config.json").read_text())
        src = SafetensorsWeights([nvfp4_dir / "model.safetensors"])
        t = {n: np.array(src.get(n, keep_dtype=True)) for n in src.names()}
        if config:
            config(cfg)
        if tensors:
            tensors(t)
        if hf_quant is not None:
            hf_quant(hq)
            (tmp_path / "hf_quant_config.json").write_text(json.dumps(hq))
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        save_file(t, str(tmp_path / "model.safetensors"))
        return tmp_path
    return make


def _set(key, value):
    return lambda hq: hq["quantization"].__setitem__(key, value)


def _flat(**group):
    g = json.loads(json.dumps(CONFIG_JSON_QC))
    g["config_groups"]["group_0"].update(group)
    return lambda c: c.__setitem__("quantization_config", g)


_FP8_ACT = {"dynamic": False, "num_bits": 8, "type": "float"}


@pytest.mark.parametrize("hf_quant, config, says", [
    (_set("quant_algo", "W4A8_NVFP4_FP8"), None, "ModelOpt quant_algo 'W4A8_NVFP4_FP8' is not supported by kiln"),
    (_set("quant_algo", "NVFP4_AWQ"), None, "ModelOpt quant_algo 'NVFP4_AWQ'"),
    (_set("quant_algo", "MIXED_PRECISION"), None, "ModelOpt quant_algo 'MIXED_PRECISION'"),
    (_set("group_size", 32), None, "ModelOpt NVFP4 with group_size 32 (NVFP4 scales every 16 values) is not supported"),
    (_set("kv_cache_quant_algo", "FP8"), None, "ModelOpt NVFP4 with KV-cache quantisation 'FP8'"),
    (None, _flat(input_activations=_FP8_ACT), "NVFP4 weights with 8-bit float input activations"),
    (None, _flat(weights={"dynamic": False, "num_bits": 4, "type": "float", "group_size": 32}),
     "weights.group_size 32"),
    (None, _flat(weights={"dynamic": False, "num_bits": 4, "type": "int", "group_size": 16}),
     "weights type='int' num_bits=4"),
])
def test_nvfp4_kiln_cannot_run_is_refused_by_name(edit, hf_quant, config, says):
    path = edit(hf_quant=hf_quant, config=config)
    for call in (lambda: load(path, tokenizer=False), lambda: read_config(path)):
        with pytest.raises(UnsupportedQuantizationError) as e:
            call()
        assert says in _one_sentence(e.value)


def test_nvfp4_config_over_bf16_moe_experts_is_refused_by_name(tmp_path):
    """NVFP4 MoE runs W4A16 (tests/test_nvfp4_moe.py); bf16 experts under an NVFP4 config are refused
    naming the first expert scale they lack."""
    from tests.tiny_moe import make_tiny_moe

    make_tiny_moe(tmp_path, "qwen3_moe")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG))
    with pytest.raises(InvalidModelError) as e:
        load(tmp_path, tokenizer=False)
    assert "experts.0.gate_proj.weight_scale is missing" in _one_sentence(e.value)


def test_nvfp4_qwen3_next_is_refused_by_name(tmp_path):
    """Qwen3-Next's GDN projections are interleaved in the file and rearranged at load: not for
    packed weights (the Qwen3.5 hybrids run, tests/test_nvfp4_hybrid.py)."""
    make_tiny_hybrid(tmp_path, "qwen3_next")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG))
    with pytest.raises(UnsupportedQuantizationError) as e:
        read_config(tmp_path)
    assert "NVFP4 checkpoints of Qwen3NextForCausalLM" in _one_sentence(e.value)


@pytest.mark.parametrize("scale", ["weight_scale", "weight_scale_2"])
def test_missing_scale_is_named(edit, scale):
    name = f"model.layers.1.mlp.up_proj.{scale}"
    path = edit(tensors=lambda t: t.pop(name))
    with pytest.raises(KilnError) as e:
        load(path, tokenizer=False)
    assert name in _one_sentence(e.value)


@pytest.mark.parametrize("name, value", [
    ("model.layers.0.mlp.down_proj.weight_scale", np.ones((64, 4), ml_dtypes.float8_e4m3fn)),  # a 32-column group
    ("model.layers.0.mlp.down_proj.weight_scale_2", np.ones((2,), np.float32)),
    ("model.layers.0.mlp.down_proj.weight", np.ones((64, 128), np.uint8)),  # unpacked-width uint8
])
def test_tensor_of_the_wrong_shape_is_named(edit, name, value):
    path = edit(tensors=lambda t: t.__setitem__(name, value))
    with pytest.raises(InvalidModelError) as e:
        load(path, tokenizer=False)
    assert name in _one_sentence(e.value)


def test_block_scale_not_e4m3_is_named(edit):
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    path = edit(tensors=lambda t: t.__setitem__(name, t[name].astype(np.float32)))
    with pytest.raises(InvalidModelError) as e:
        load(path, tokenizer=False)
    assert name in _one_sentence(e.value) and "float8_e4m3fn" in str(e.value)


def test_nvfp4_config_over_bf16_weights_is_refused(edit):
    def to_bf16(t):
        t["model.layers.0.self_attn.q_proj.weight"] = np.ones((64, 32), ml_dtypes.bfloat16)
    with pytest.raises(InvalidModelError) as e:
        load(edit(tensors=to_bf16), tokenizer=False)
    assert "model.layers.0.self_attn.q_proj.weight" in _one_sentence(e.value) and "NVFP4" in str(e.value)


def test_packed_tensors_without_quantization_config_are_refused(edit):
    """Without hf_quant_config.json the uint8 weights must not be read as numbers."""
    with pytest.raises(InvalidModelError) as e:
        load(edit(hf_quant=None), tokenizer=False)
    assert "packed uint8" in _one_sentence(e.value) and "no quantization_config" in str(e.value)


def test_module_excluded_but_stored_packed_is_refused(edit):
    path = edit(hf_quant=lambda hq: hq["quantization"]["exclude_modules"].append("model.layers.0.mlp.down_proj"))
    with pytest.raises(InvalidModelError) as e:
        load(path, tokenizer=False)
    assert "model.layers.0.mlp.down_proj.weight" in _one_sentence(e.value) and "unquantized" in str(e.value)


def test_hf_quant_config_and_config_json_forms_agree(nvfp4_dir, tmp_path):
    """Both of ModelOpt's config forms parse to the same thing and key the config hash."""
    from kiln.models.config import ModelConfig

    hf = json.loads((nvfp4_dir / "config.json").read_text())
    a = read_config(nvfp4_dir)
    b = ModelConfig.from_hf_dict({**hf, "quantization_config": CONFIG_JSON_QC})
    plain = ModelConfig.from_hf_dict(hf)
    assert a.quantization == b.quantization and a.quantization.weight == "nvfp4"
    assert not a.quantization.quantizes("lm_head") and a.quantization.quantizes("model.layers.0.mlp.up_proj")
    assert a.compute_hash() == b.compute_hash() != plain.compute_hash()
