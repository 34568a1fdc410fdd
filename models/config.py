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
from kiln.graph.rope import SUPPORTED_ROPE_TYPES

REQUIRED_KEYS = ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads")


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

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    def compute_hash(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        d = dict(d.get("text_config") or {}, **{k: v for k, v in d.items() if k != "text_config"}) \
            if "text_config" in d else dict(d)
        missing = [k for k in REQUIRED_KEYS if d.get(k) is None]
        if missing:
            raise ConfigError(f"{source} is missing required key {missing[0]!r}")
        archs = d["architectures"]
        if not isinstance(archs, list) or not archs:
            raise ConfigError(f"{source}: 'architectures' must be a non-empty list, got {archs!r}")
        heads = _pos_int(d, "num_attention_heads", source)
        hidden = _pos_int(d, "hidden_size", source)
        kv_heads = _pos_int(d, "num_key_value_heads", source) if d.get("num_key_value_heads") else heads
        if heads % kv_heads:
            raise ConfigError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                              f"num_key_value_heads ({kv_heads})")
        head_dim = d.get("head_dim") or hidden // heads
        act = d.get("hidden_act", d.get("hidden_activation", "silu"))
        if act not in ("silu", "swish"):
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        theta, scaling, partial = _rope(d, source)
        arch = archs[0]
        return cls(
            architecture=arch,
            vocab_size=_pos_int(d, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_pos_int(d, "intermediate_size", source),
            num_hidden_layers=_pos_int(d, "num_hidden_layers", source),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
        )


def _pos_int(d: Mapping[str, Any], key: str, source: str) -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {v!r}")
    return v


def _rope(d: Mapping[str, Any], source: str) -> tuple[float, tuple, float]:
    """HF v4 keeps rope_theta and rope_scaling at top level; v5 nests both in rope_parameters."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
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
