"""Tiny ModelOpt NVFP4 checkpoints, quantised in numpy from a tiny HF model (tests/tiny_models.py)
the way ModelOpt's export does it (modelopt/torch/quantization/qtensor/nvfp4_tensor.py
NVFP4QTensor, read for its recipe):

  weight_scale_2 = amax(W) / (6 * 448)                         f32 scalar
  weight_scale   = e4m3(max(amax(16-column block) / (6 * weight_scale_2), 2^-9))   [N, K/16]
  e2m1 values    = e2m1(W / (weight_scale * weight_scale_2))   round to nearest even, saturating at 6
  weight         = (value[2j+1] << 4) | value[2j]              uint8 [N, K/2]
  input_scale    = amax(calibration input) / (6 * 448)         f32 scalar (kiln's W4A16 ignores it)

The rounding to e2m1 and e4m3 is ml_dtypes' (the format's own types); the packing and the config
are written here from ModelOpt's layout. Unquantised tensors (embeddings, norms, lm_head, modules
in exclude_modules) stay bf16 as in the real checkpoints. `make_nvfp4_checkpoint` returns the f32
transformers model whose linears hold W = value * weight_scale * weight_scale_2, computed from
the unpacked values, before any packing: the W4A16 oracle, independent of kiln's unpacking.
"""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.numpy import save_file

from tests.fp8_checkpoints import LINEARS, _calibrate
from tests.tiny_models import HYBRID_VARIANTS, make_tiny_hybrid, make_tiny_model

# the Gated DeltaNet projections of a Qwen3.5 hybrid: Linear modules too, so ModelOpt quantises them
GDN_LINEARS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
               "linear_attn.in_proj_a", "linear_attn.out_proj")

E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn

# hf_quant_config.json as ModelOpt writes it for NVFP4 (vLLM's ModelOptNvFp4Config requires
# group_size, kv_cache_quant_algo and exclude_modules in it)
HF_QUANT_CONFIG = {"producer": {"name": "modelopt", "version": "0.37.0"},
                   "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                    "exclude_modules": ["lm_head"]}}
# the same in config.json, as ModelOpt's convert_hf_quant_config_format turns it
_FP4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
CONFIG_JSON_QC = {"config_groups": {"group_0": {"input_activations": dict(_FP4), "weights": dict(_FP4),
                                                "targets": ["Linear"]}},
                  "ignore": ["lm_head"], "quant_algo": "NVFP4",
                  "producer": {"name": "modelopt", "version": "0.37.0"}, "quant_method": "modelopt"}


def quantize_nvfp4(w: np.ndarray, group: int = 16):
    """w: f32 [N, K] -> (uint8 [N, K/2], e4m3 [N, K/group], f32 scalar, the dequantised f32 [N, K])."""
    n, k = w.shape
    s2 = np.float32(np.abs(w).max() / (6.0 * 448.0))
    blocks = w.reshape(n, k // group, group)
    s = np.abs(blocks).max(axis=-1) / (6.0 * s2)
    s = np.maximum(np.where(s == 0, 1.0, s), 2.0 ** -9).astype(np.float32).astype(E4M3)  # ModelOpt's zero rule
    full = s.astype(np.float32)[..., None] * s2
    q = (blocks / full).astype(E2M1)  # [N, K/group, group]
    deq = (q.astype(np.float32) * full).reshape(n, k)
    codes = q.reshape(n, k).view(np.uint8) & 0x0F  # one e2m1 a byte, in its low nibble
    packed = (codes[:, 1::2] << 4) | codes[:, 0::2]
    return packed.astype(np.uint8), s, s2, deq


def make_nvfp4_checkpoint(out_dir: Path, variant: str, *, exclude=(), config_json: bool = False, seed: int = 0,
                          calib_prompts=((1, 2, 3, 4, 5, 6, 7, 8),)):
    """Write variant's tiny model as a ModelOpt NVFP4 checkpoint under out_dir (hf_quant_config.json
    beside config.json, or with config_json the flat quantization_config inside config.json);
    exclude: modules left bf16 and listed in exclude_modules. Returns the f32 W4A16 oracle."""
    if variant in HYBRID_VARIANTS:
        model = make_tiny_hybrid(out_dir, variant, seed=seed)
    else:
        model = make_tiny_model(out_dir, variant, seed=seed, dtype=torch.float32)
    cfg = json.loads((out_dir / "config.json").read_text())
    amax = _calibrate(model, calib_prompts, LINEARS + GDN_LINEARS)
    out: dict[str, np.ndarray] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, w in ((k, v.detach().numpy()) for k, v in model.state_dict().items()):
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and _leaf(module) in LINEARS + GDN_LINEARS) or _excluded(module, exclude):
            out[name] = w.astype(ml_dtypes.bfloat16)
            deq[name] = torch.from_numpy(out[name].astype(np.float32))
            continue
        packed, s, s2, d = quantize_nvfp4(w)
        out[name], out[f"{module}.weight_scale"] = packed, s
        out[f"{module}.weight_scale_2"] = np.array(s2, np.float32)  # scalars, as ModelOpt saves them
        out[f"{module}.input_scale"] = np.array(amax[module] / (6.0 * 448.0), np.float32)
        deq[name] = torch.from_numpy(d)
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg["dtype"] = "bfloat16"
    if config_json:
        cfg["quantization_config"] = {**json.loads(json.dumps(CONFIG_JSON_QC)), "ignore": ["lm_head", *exclude]}
    else:
        hq = json.loads(json.dumps(HF_QUANT_CONFIG))
        hq["quantization"]["exclude_modules"] += list(exclude)
        (out_dir / "hf_quant_config.json").write_text(json.dumps(hq, indent=2))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    model.load_state_dict(deq, strict=False)
    return model


def _leaf(module: str) -> str:
    """model.layers.3.mlp.up_proj (or model.language_model.layers.3...) -> mlp.up_proj"""
    parts = module.split(".")
    return ".".join(parts[parts.index("layers") + 2:]) if "layers" in parts else module


def _excluded(module: str, exclude) -> bool:
    """ModelOpt's exclude_modules: names or shell wildcards."""
    import fnmatch

    return any(module == p or fnmatch.fnmatchcase(module, p) for p in exclude)
