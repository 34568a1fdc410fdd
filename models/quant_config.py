"""A checkpoint's quantization, read from its own config: config.json's `quantization_config`
or ModelOpt's `hf_quant_config.json` beside it. Never guessed from tensor dtypes.

kiln runs three FP8 layouts (W8A8 on the numpy target, graph/fp8_ops.py):

  block-wise   quant_method "fp8" + weight_block_size [bn, bk], activation_scheme "dynamic"
               (Qwen3-*-FP8, DeepSeek): `weight` e4m3 [N, K], `weight_scale_inv` f32
               [ceil(N/bn), ceil(K/bk)], a multiplier despite its name (vLLM fp8.py Fp8Config,
               transformers FineGrainedFP8Config); activations per token per bk columns.
  FP8_DYNAMIC  quant_method "compressed-tensors", one config group of float 8-bit weights with
               strategy "channel" or "tensor" (`weight_scale` [N, 1] or [1]) and dynamic per-token
               float 8-bit input activations (llm-compressor; vLLM CompressedTensorsW8A8Fp8).
  ModelOpt     quant_algo "FP8" (vLLM modelopt.py ModelOptFp8Config): per-tensor `weight_scale`
               and a static per-tensor `input_scale`, both f32 scalars.

Anything else (another method, static block activations, an unknown strategy, KV-cache scales)
is refused in one sentence that names it: running it as if unquantized gives garbage.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Mapping

from kiln.errors import UnsupportedQuantizationError
from kiln.models.nvfp4_config import Nvfp4Config, parse_modelopt_nvfp4

# The decoder architectures whose graph builders emit FP8 linears (models/fp8_linear.py): the dense
# decoders and the dense Qwen3.5/3.6 hybrids (models/qwen3_5.py: gated attention, Gated DeltaNet
# projections, MLP); any other architecture with a quantization_config is refused, not run in bf16.
# Not Qwen3-Next, whose interleaved GDN projections are rearranged at load (a block scale of the
# interleaved rows is no scale of the rearranged ones). The MoE decoders run block-wise FP8 and NVFP4
# (models/moe.py: experts kept in their format with their scales); their MoE layers refuse the other
# FP8 layouts by name.
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
FP8_ARCHITECTURES = (*DENSE_ARCHITECTURES, "Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM",
                     "Qwen3_5MoeForConditionalGeneration")
# NVFP4 (W4A16, models/nvfp4_linear.py; MoE experts: models/moe.py) runs the same architectures
NVFP4_ARCHITECTURES = FP8_ARCHITECTURES

FP8_MAX = 448.0  # e4m3fn's largest finite value
# The smallest activation scale, as vLLM's references clamp it (tests/kernels/quant_utils.py):
# per-token-group quant clamps the group's amax at 1e-10 (native_per_token_group_quant_fp8);
# dynamic per-token quant clamps the scale at 1 / (448 * 512) (ref_dynamic_per_token_quant).
MIN_SCALE_GROUP = 1e-10 / FP8_MAX
MIN_SCALE_TOKEN = 1.0 / (FP8_MAX * 512.0)


@dataclass(frozen=True)
class Fp8Config:
    """How a checkpoint's linears are quantised. weight: "block" | "channel" | "tensor";
    block: (bn, bk) for "block", () otherwise; activation: "group" (dynamic, per token per bk
    columns) | "token" (dynamic per token) | "static" (the checkpoint's per-tensor input_scale)."""
    method: str  # the checkpoint's name for it ("fp8", "compressed-tensors", "modelopt"), for messages
    weight: str
    activation: str
    block: tuple[int, ...] = ()
    scale_name: str = "weight_scale"  # the weight scale's tensor suffix ("weight_scale_inv" for block-wise)
    targets: tuple[str, ...] = ()  # modules quantised (compressed-tensors); () = every decoder linear
    ignore: tuple[str, ...] = ()  # modules left unquantised (modules_to_not_convert, ignore, exclude_modules)
    online: bool = False  # a bf16 checkpoint quantised at load (--quantization fp8, models/fp8_online.py)

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (e.g. model.layers.0.self_attn.q_proj, a graph name) is stored
        in FP8. The skip and target lists name the file's modules, and a Qwen3.5/3.6
        ...ForConditionalGeneration file holds the text tower as model.language_model.* (its FP8
        checkpoints list e.g. model.language_model.layers.0.linear_attn.in_proj_a in
        modules_to_not_convert; models/qwen3_5.py adapt_weights), so that name is tried too."""
        names = file_module_names(module)
        if any(_matches(n, p) for n in names for p in self.ignore):
            return False
        return not self.targets or any(p == "Linear" or _matches(n, p) for n in names for p in self.targets)


def file_module_names(module: str) -> tuple[str, ...]:
    """A graph module name and the name a Qwen3.5/3.6 ...ForConditionalGeneration file gives it."""
    if module.startswith("model."):
        return module, "model.language_model." + module[len("model."):]
    return (module,)


def _matches(module: str, pattern: str) -> bool:
    """The name patterns the producers write: "re:<regex>" (compressed-tensors), shell wildcards
    (ModelOpt's exclude_modules), or a module name or a dotted suffix/prefix of one (HF, vLLM)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(module, pattern)
    return module == pattern or module.endswith("." + pattern) or module.startswith(pattern + ".")


def parse_quantization(qc: Any, arch: str, source: str) -> Fp8Config | Nvfp4Config | None:
    """config.json's quantization_config (or hf_quant_config.json's content) -> Fp8Config,
    None for no quantization; UnsupportedQuantizationError naming what kiln cannot run."""
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise UnsupportedQuantizationError(f"{source}: quantization_config must be a JSON object, got {qc!r}")
    if "quantization" in qc and "quant_method" not in qc:  # hf_quant_config.json's nested form
        method = "modelopt"
    else:
        method = str(qc.get("quant_method", "")).lower() or "(none given)"
    if method == "fp8":
        cfg = _fp8(qc, source)
    elif method == "compressed-tensors":
        cfg = _compressed_tensors(qc, source)
    elif method == "modelopt":
        cfg = _modelopt(qc, source)
    else:
        raise UnsupportedQuantizationError(f"{source}: quantization method {method!r} is not supported by kiln")
    fmt, archs = ("NVFP4", NVFP4_ARCHITECTURES) if cfg.weight == "nvfp4" else ("FP8", FP8_ARCHITECTURES)
    if arch not in archs:
        raise UnsupportedQuantizationError(
            f"{source}: {method} {fmt} checkpoints of {arch} are not supported by kiln yet "
            f"({fmt} runs for {', '.join(archs)})")
    return cfg


def _refuse(source: str, what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"{source}: {what} is not supported by kiln")


def _names(qc: Mapping, *keys: str) -> tuple[str, ...]:
    for k in keys:
        v = qc.get(k)
        if v:
            return tuple(str(x) for x in v)
    return ()


def _fp8(qc: Mapping, source: str) -> Fp8Config:
    """HF / vLLM block-wise FP8 (Fp8Config, FineGrainedFP8Config)."""
    block = qc.get("weight_block_size")
    if block is None:
        raise _refuse(source, "quant_method 'fp8' without weight_block_size (per-tensor FP8)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UnsupportedQuantizationError(f"{source}: weight_block_size must be two positive integers, got {block!r}")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise _refuse(source, f"block-wise FP8 with activation_scheme {scheme!r}")
    for key, ok in (("fmt", "e4m3"), ("scale_fmt", "float")):
        if qc.get(key, ok) != ok:
            raise _refuse(source, f"block-wise FP8 with {key} {qc[key]!r}")
    if qc.get("modules_to_convert"):
        raise _refuse(source, "block-wise FP8 with modules_to_convert (quantised embeddings)")
    return Fp8Config("fp8", "block", "group", tuple(block), "weight_scale_inv",
                     ignore=_names(qc, "modules_to_not_convert", "ignored_layers"))


def _compressed_tensors(qc: Mapping, source: str) -> Fp8Config:
    """compressed-tensors FP8 W8A8 with dynamic per-token activations (FP8_DYNAMIC)."""
    if qc.get("kv_cache_scheme"):
        raise _refuse(source, "a compressed-tensors kv_cache_scheme (FP8 KV-cache scales)")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise _refuse(source, f"a compressed-tensors config with {len(groups)} config groups (kiln runs one)")
    (name, group), = groups.items()
    fmt = group.get("format") or qc.get("format")
    if fmt != "float-quantized":
        raise _refuse(source, f"compressed-tensors format {fmt!r}")
    w, a = group.get("weights") or {}, group.get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("dynamic"):
        raise _refuse(source, f"compressed-tensors weights {_scheme(w)}")
    if w.get("strategy") not in ("channel", "tensor"):
        raise _refuse(source, f"compressed-tensors weight strategy {w.get('strategy')!r}")
    if not a or a.get("type") != "float" or a.get("num_bits") != 8 or a.get("dynamic") is not True \
            or a.get("strategy") != "token":
        raise _refuse(source, f"compressed-tensors input activations {_scheme(a)} (kiln runs dynamic per-token FP8)")
    if group.get("output_activations"):
        raise _refuse(source, "compressed-tensors output activation quantisation")
    targets = tuple(str(t) for t in group.get("targets") or ())
    if not targets:
        raise UnsupportedQuantizationError(f"{source}: compressed-tensors config group {name!r} has no targets")
    return Fp8Config("compressed-tensors", w["strategy"], "token", targets=targets, ignore=_names(qc, "ignore"))


def _scheme(d: Mapping | None) -> str:
    if not d:
        return "None"
    return ", ".join(f"{k}={d.get(k)!r}" for k in ("type", "num_bits", "strategy", "dynamic"))


def _modelopt(qc: Mapping, source: str) -> Fp8Config | Nvfp4Config:
    """ModelOpt FP8: hf_quant_config.json's {"quantization": {...}} or the flat config.json form."""
    q = qc["quantization"] if "quantization" in qc and "quant_algo" not in qc else qc
    algo = q.get("quant_algo")
    if algo == "NVFP4":  # W4A16 (models/nvfp4_config.py)
        return parse_modelopt_nvfp4(q, source)
    if algo != "FP8":
        raise UnsupportedQuantizationError(f"{source}: ModelOpt quant_algo {algo!r} is not supported by kiln "
                                           f"(kiln runs ModelOpt 'FP8' and 'NVFP4')")
    if q.get("kv_cache_quant_algo") or q.get("kv_cache_scheme"):
        kv = q.get("kv_cache_quant_algo") or q.get("kv_cache_scheme")
        raise _refuse(source, f"ModelOpt KV-cache quantisation {kv!r} (FP8 KV-cache scales)")
    return Fp8Config("modelopt", "tensor", "static", ignore=_names(q, "exclude_modules", "ignore"))


# -- --quantization (vLLM's flag): the method's name, checked against the checkpoint -------------------

# vLLM's names (vllm/model_executor/layers/quantization/__init__.py QuantizationMethods) of the
# formats kiln runs, each as vLLM names a checkpoint of it (vllm/config/model.py
# _verify_quantization: the config's quant_method, with ModelOpt's overrides giving "modelopt" for
# quant_algo FP8 and "modelopt_fp4" for NVFP4; a .gguf file is "gguf").
QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "modelopt", "modelopt_fp4", "gguf")


def check_quantization_name(name: str | None) -> None:
    """An unknown --quantization, or one of vLLM's methods kiln does not run (awq, gptq,
    bitsandbytes, ...), is one sentence before anything is opened."""
    if name is not None and name not in QUANTIZATION_METHODS:
        raise UnsupportedQuantizationError(
            f"--quantization {name!r} is not supported by kiln (it runs {', '.join(QUANTIZATION_METHODS)})")


def checkpoint_method(config, fmt: str) -> str | None:
    """vLLM's name for the quantization of a checkpoint (its ModelConfig, its format), None for none."""
    q = config.quantization
    if fmt == "gguf":
        return "gguf"
    if q is None:
        return None
    if isinstance(q, Nvfp4Config):
        return "modelopt_fp4"
    return q.method


# what --quantization fp8 makes of an unquantised checkpoint: vLLM's online dynamic FP8 (fp8.py
# Fp8Config with is_checkpoint_fp8_serialized False: each weight quantised to e4m3 with one scale per
# tensor at load, activations quantised per token as they are made); the LM head stays as it is
ONLINE_FP8 = Fp8Config("fp8", "tensor", "token", ignore=("lm_head",), online=True)


def resolve_quantization(config, name: str | None, fmt: str, source: str):
    """The model's config under --quantization `name` (vLLM's semantics): None or the checkpoint's
    own method leaves it as it is; another method than the checkpoint's is refused naming both; fp8 on
    an unquantised checkpoint quantises it online (ONLINE_FP8); any other method there is refused."""
    check_quantization_name(name)
    if name is None:
        return config
    have = checkpoint_method(config, fmt)
    if have is not None:
        # vLLM's ModelOpt override takes --quantization modelopt for an NVFP4 checkpoint too
        if name == have or (name == "modelopt" and have == "modelopt_fp4"):
            return config
        raise UnsupportedQuantizationError(
            f"--quantization {name} does not match {source}, which is quantized with {have}")
    if name != "fp8":
        raise UnsupportedQuantizationError(
            f"--quantization {name} needs a checkpoint quantized with {name}, and {source} is not quantized "
            f"(kiln quantizes online to fp8 only)")
    if config.architecture not in DENSE_ARCHITECTURES:
        raise UnsupportedQuantizationError(
            f"{source}: --quantization fp8 (online FP8) of {config.architecture} is not supported by kiln "
            f"(FP8 runs for {', '.join(DENSE_ARCHITECTURES)})")
    import dataclasses

    return dataclasses.replace(config, quantization=ONLINE_FP8)
