"""One typed model config, parsed from an HF config.json dict or GGUF metadata.

Frozen: it shapes compiled output, so `compute_hash()` keys bundles and schedules.
Values found at run time (EOS ids, the KV block count) do not live here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from kiln.errors import ConfigError
from kiln.models.config_values import flag, opt_int, pos_int, real
from kiln.graph.rope import SUPPORTED_ROPE_TYPES
from kiln.models.quant_config import Fp8Config, parse_quantization

REQUIRED_KEYS = ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads")

# Qwen3-Next / Qwen3.5 / Qwen3.6 hybrids (../shared/specs/qwen3_5.md section 1): Gated DeltaNet
# ("linear_attention") layers between gated full-attention layers.
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                        "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
LAYER_TYPES = ("full_attention", "linear_attention")
LINEAR_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # sorted items of HF rope_scaling, () for none
    partial_rotary_factor: float = 1.0
    rope_is_neox: bool = True
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: str = "float32"  # the checkpoint's dtype, as HF names it
    # -- hybrid models (Qwen3-Next / Qwen3.5 / Qwen3.6); the defaults are the plain decoder's.
    # Fields at their default are left out of compute_hash, so older models keep their hashes.
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "linear_attention"; () = all full
    linear_num_key_heads: int = 0  # GDN key heads Hk (q and k)
    linear_num_value_heads: int = 0  # GDN value heads Hv (v, z, a, b); Hv % Hk == 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0  # the depthwise causal conv's width
    norm_offset: float = 0.0  # 1.0: every RMSNorm but the GDN's gated one applies (1 + w)
    attn_output_gate: bool = False  # q_proj also gives a per-head sigmoid gate on the attention output
    # -- MoE (models/moe.py; layer_is_moe says which layers have experts)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # -- quantization (models/quant_config.py): the checkpoint's FP8 layout, None for none
    quantization: Fp8Config | None = None

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def layer_is_moe(self, i: int) -> bool:
        """Qwen3-Next's rule (spec 1.1); qwen3_5_moe configs have decoder_sparse_step 1 and no
        mlp_only_layers, so every layer is MoE there."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def linear_key_dim(self) -> int:  # Hk * dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # Hv * dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:  # the conv's channels: q | k | v
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    def compute_hash(self) -> str:
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.name in _HASH_IF_SET and d[f.name] == f.default:
                del d[f.name]
        blob = json.dumps(d, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        if d.get("text_config") is not None and not isinstance(d["text_config"], dict):
            raise ConfigError(f"{source}: text_config must be an object, got {d['text_config']!r}")
        d = dict(d.get("text_config") or {}, **{k: v for k, v in d.items() if k != "text_config"}) \
            if "text_config" in d else dict(d)
        archs = d.get("architectures")
        if archs is not None and (not isinstance(archs, list) or not archs or not isinstance(archs[0], str)):
            raise ConfigError(f"{source}: 'architectures' must be a non-empty list of names, got {archs!r}")
        # a hybrid's text config may have no dense width (qwen3_5_moe: every layer MoE)
        optional = ("intermediate_size",) if (archs or [None])[0] in HYBRID_ARCHITECTURES else ()
        missing = [k for k in REQUIRED_KEYS if d.get(k) is None and k not in optional]
        if missing:
            raise ConfigError(f"{source} is missing required key {missing[0]!r}")
        heads = pos_int(d, "num_attention_heads", source)
        hidden = pos_int(d, "hidden_size", source)
        kv_heads = pos_int(d, "num_key_value_heads", source) if d.get("num_key_value_heads") else heads
        if heads % kv_heads:
            raise ConfigError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                              f"num_key_value_heads ({kv_heads})")
        head_dim = pos_int(d, "head_dim", source) if d.get("head_dim") is not None else hidden // heads
        if head_dim <= 0:
            raise ConfigError(f"{source}: hidden_size ({hidden}) is smaller than num_attention_heads ({heads}); "
                              "give head_dim")
        act = d.get("hidden_act", d.get("hidden_activation", "silu"))
        if act not in ("silu", "swish"):
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        arch = archs[0]
        hybrid = _hybrid_fields(d, arch, source) if arch in HYBRID_ARCHITECTURES else {}
        moe = _moe_fields(d, arch, source)
        # Qwen3-Next and Qwen3.5 default partial_rotary_factor to 0.25 "for BC" (spec 1.1)
        theta, scaling, partial = _rope(d, source, default_partial=0.25 if hybrid else 1.0)
        if hybrid and "intermediate_size" not in d:
            d["intermediate_size"] = 0  # an all-MoE config has no dense width
        return cls(
            architecture=arch,
            vocab_size=pos_int(d, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=opt_int(d, "intermediate_size", source, 0) if hybrid else pos_int(d, "intermediate_size", source),
            num_hidden_layers=pos_int(d, "num_hidden_layers", source),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=real(d, "rms_norm_eps", source, 1e-6, upper=1.0),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            max_position_embeddings=pos_int(d, "max_position_embeddings", source) if d.get(
                "max_position_embeddings") is not None else 2048,
            tie_word_embeddings=flag(d, "tie_word_embeddings", source),
            attention_bias=flag(d, "attention_bias", source),
            mlp_bias=flag(d, "mlp_bias", source),
            dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            quantization=parse_quantization(d.get("quantization_config"), arch, source),
            **hybrid,
            **moe,
        )


_HASH_IF_SET = frozenset(("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                          "linear_value_head_dim", "linear_conv_kernel_dim", "norm_offset", "attn_output_gate",
                          "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                          "mlp_only_layers", "quantization"))


def _hybrid_fields(d: Mapping[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The Gated DeltaNet and MoE fields of a Qwen3-Next / Qwen3.5 config (spec section 1)."""
    missing = [k for k in LINEAR_KEYS if d.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: {arch} needs {missing[0]!r} (a Gated DeltaNet field) and it is missing")
    lin = {k: pos_int(d, k, source) for k in LINEAR_KEYS}
    if lin["linear_num_value_heads"] % lin["linear_num_key_heads"]:
        raise ConfigError(f"{source}: linear_num_value_heads ({lin['linear_num_value_heads']}) is not a multiple "
                          f"of linear_num_key_heads ({lin['linear_num_key_heads']})")
    n_layers = pos_int(d, "num_hidden_layers", source)
    types = d.get("layer_types")
    if types is None:  # built from full_attention_interval, as Qwen3NextConfig.__post_init__ does
        interval = d.get("full_attention_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise ConfigError(f"{source}: full_attention_interval must be a positive integer, got {interval!r}")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"{source}: layer_types must list one type per layer ({n_layers}), got {types!r}")
    unknown = [t for t in types if t not in LAYER_TYPES]
    if unknown:
        raise ConfigError(f"{source}: layer type {unknown[0]!r} is not one kiln knows "
                          f"(known: {', '.join(LAYER_TYPES)})")
    # HF ignores attn_output_gate: the gate is always on (spec 1.1, pitfall 19)
    return dict(layer_types=tuple(types), norm_offset=1.0, attn_output_gate=True, **lin)


def _moe_fields(d: Mapping[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields (spec 1.1, 7.2); {} for a dense model. transformers writes
    qwen3_moe's expert count as num_local_experts (its attribute_map), the official configs as
    num_experts."""
    key = "num_experts" if d.get("num_experts") else "num_local_experts"
    if not d.get(key):
        return {}
    if arch.startswith("Qwen3_5Moe"):
        norm = True  # qwen3_5_moe removed the field: its router always renormalises
    else:  # transformers' defaults: Qwen3MoeConfig False, Qwen3NextConfig True
        norm = bool(d.get("norm_topk_prob", arch != "Qwen3MoeForCausalLM"))
    only = d.get("mlp_only_layers") or ()
    if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}")
    experts, k = pos_int(d, key, source), pos_int(d, "num_experts_per_tok", source)
    if k > experts:
        raise ConfigError(f"{source}: num_experts_per_tok ({k}) is more than the {experts} experts")
    return dict(num_experts=experts,
                num_experts_per_tok=k,
                moe_intermediate_size=pos_int(d, "moe_intermediate_size", source),
                shared_expert_intermediate_size=opt_int(d, "shared_expert_intermediate_size", source, 0),
                norm_topk_prob=norm,
                decoder_sparse_step=pos_int(d, "decoder_sparse_step", source) if d.get("decoder_sparse_step")
                is not None else 1,
                mlp_only_layers=tuple(only))


def _rope(d: Mapping[str, Any], source: str, default_partial: float = 1.0) -> tuple[float, tuple, float]:
    """HF v4 keeps rope_theta and rope_scaling at top level; v5 nests both in rope_parameters.
    Qwen3.5's text-only MRoPE (mrope_section, mrope_interleaved) is the plain 1-D rope: its
    three position rows are equal for text (spec 5.2), so those keys change nothing here."""
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ConfigError(f"{source}: {key} must be an object, got {d[key]!r}")
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    theta = real(d, "rope_theta", source, 10000.0)  # checked even where rope_parameters' wins: a lie is a lie
    theta = real({"rope_theta": params.pop("rope_theta", theta)}, "rope_theta", source, theta)
    partial = real({"partial_rotary_factor": params.pop("partial_rotary_factor", d.get("partial_rotary_factor"))},
                    "partial_rotary_factor", source, default_partial, upper=1.0, inclusive=True)
    for k in ("mrope_section", "mrope_interleaved"):
        params.pop(k, None)
        scaling.pop(k, None)
    scaling.update(params)
    rope_type = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    scaling["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = d.get("original_max_position_embeddings",
                                                            d.get("max_position_embeddings", 2048))
    if rope_type == "default":
        return theta, (), partial
    return theta, tuple(sorted(scaling.items())), partial
