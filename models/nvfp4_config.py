"""ModelOpt NVFP4 checkpoints (`quant_algo: NVFP4`), read from their own config, and what kiln
runs of them: W4A16, the FP4 weights dequantised where they are multiplied, the activations
left in the model's dtype (graph/nvfp4_ops.py).

The layout (ModelOpt's export, modelopt/torch/quantization/qtensor/nvfp4_tensor.py
NVFP4QTensor.quantize; vLLM's reader, vllm/model_executor/layers/quantization/modelopt.py
ModelOptNvFp4LinearMethod), for each quantised linear [N, K]:

  weight          uint8 [N, K/2]   two e2m1 values a byte, the lower-indexed one in the low nibble
  weight_scale    e4m3  [N, K/16]  one scale per 16 consecutive input columns
  weight_scale_2  f32   scalar     the per-tensor scale (weight amax / (6 * 448))
  input_scale     f32   scalar     the static activation scale; read only by W4A4 (not run here)

  W[n, k] = e2m1(weight nibble) * weight_scale[n, k // 16] * weight_scale_2

The config comes in two forms, both read: hf_quant_config.json's {"producer", "quantization":
{"quant_algo": "NVFP4", "kv_cache_quant_algo", "group_size": 16, "exclude_modules"}}, and
config.json's quantization_config after ModelOpt's convert_hf_quant_config_format
({"quant_method": "modelopt", "quant_algo": "NVFP4", "config_groups": {"group_0": {"weights":
{"num_bits": 4, "type": "float", "group_size": 16, ...}, "input_activations": {...}, "targets":
["Linear"]}}, "ignore": [...]}). Anything else NVFP4-like (another group size, KV-cache
quantisation, NVFP4 weights with 8-bit activations: W4A8_NVFP4_FP8, NVFP4_AWQ's pre-quant
scales, MIXED_PRECISION) is refused in one sentence naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from kiln.errors import UnsupportedQuantizationError

NVFP4_GROUP = 16  # e2m1 values per e4m3 block scale: the only group size NVFP4 has


@dataclass(frozen=True)
class Nvfp4Config:
    """A ModelOpt NVFP4 checkpoint, run W4A16. ignore: modules left unquantised
    (exclude_modules / ignore, ModelOpt's shell wildcards)."""
    method: str = "modelopt"
    weight: str = "nvfp4"
    activation: str = "none"  # W4A16: activations stay in the model's dtype, input_scale unread
    group_size: int = NVFP4_GROUP
    ignore: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (e.g. model.layers.0.mlp.up_proj, a graph name) is stored in
        NVFP4. exclude_modules names the file's modules, and a Qwen3.5 ...ForConditionalGeneration
        file holds the text tower as model.language_model.* (models/qwen3_5.py adapt_weights), so
        that name is tried too."""
        from kiln.models.quant_config import _matches

        names = [module]
        if module.startswith("model."):
            names.append("model.language_model." + module[len("model."):])
        return not any(_matches(n, p) for n in names for p in self.ignore)


def parse_modelopt_nvfp4(q: Mapping, source: str) -> Nvfp4Config:
    """q: hf_quant_config.json's "quantization" object or config.json's flat quantization_config,
    whose quant_algo is "NVFP4"."""
    def refuse(what: str) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(f"{source}: {what} is not supported by kiln")

    kv = q.get("kv_cache_quant_algo") or q.get("kv_cache_scheme")
    if kv:
        raise refuse(f"ModelOpt NVFP4 with KV-cache quantisation {kv!r}")
    if q.get("pre_quant_scale") or q.get("has_zero_point"):
        raise refuse("ModelOpt NVFP4 with pre-quant scales or zero points (AWQ)")
    sizes = [("group_size", q["group_size"])] if "group_size" in q else []
    groups = q.get("config_groups")
    if groups is not None:
        if not isinstance(groups, Mapping) or len(groups) != 1:
            raise refuse(f"a ModelOpt NVFP4 config with {len(groups) if isinstance(groups, Mapping) else groups!r} "
                         f"config groups (kiln runs one, every Linear)")
        (name, group), = groups.items()
        w, a = (group or {}).get("weights") or {}, (group or {}).get("input_activations")
        if w.get("type") != "float" or w.get("num_bits") != 4:
            raise refuse(f"ModelOpt NVFP4 config group {name!r} with weights type={w.get('type')!r} "
                         f"num_bits={w.get('num_bits')!r}")
        if a and (a.get("type") != "float" or a.get("num_bits") != 4):  # W4A8_NVFP4_FP8 and the like
            raise refuse(f"NVFP4 weights with {a.get('num_bits')}-bit {a.get('type')} input activations")
        sizes.append(("weights.group_size", w.get("group_size", NVFP4_GROUP)))
        if a:
            sizes.append(("input_activations.group_size", a.get("group_size", NVFP4_GROUP)))
    for key, size in sizes:
        if isinstance(size, bool) or size != NVFP4_GROUP:
            raise refuse(f"ModelOpt NVFP4 with {key} {size!r} (NVFP4 scales every {NVFP4_GROUP} values)")
    ignore = q.get("exclude_modules") or q.get("ignore") or ()
    if not isinstance(ignore, (list, tuple)):
        raise UnsupportedQuantizationError(f"{source}: ModelOpt exclude_modules must be a list of names, got {ignore!r}")
    return Nvfp4Config(ignore=tuple(str(x) for x in ignore))
