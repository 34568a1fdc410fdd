"""An HF config.json-like dict from GGUF metadata.

A GGUF carries no config.json: the shape of the model lives in "{arch}.*" metadata keys
under llama.cpp's names. We rebuild the dict transformers derives from the same file
(AutoConfig.from_pretrained(dir, gguf_file=...)), so config parsing downstream has one
input format, and the values agree with the oracle we test against.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kiln.errors import ConfigError, UnsupportedArchitectureError

# The key under which GGUFWeights.metadata carries the file's tensor names, next to the
# reader's own "GGUF.*" pseudo keys: llama.cpp says "tied embeddings" only by omitting
# output.weight, so the config needs the names, and callers pass the metadata dict around.
TENSOR_NAMES_KEY = "GGUF.tensor_names"

# llama.cpp architecture -> (HF model_type, HF architectures entry, HF default rms_norm_eps).
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", 1e-6),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", 1e-6),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", 1e-6),
}

# "{arch}.rope.scaling.<key>" -> HF rope_scaling key; the type goes to "rope_type".
ROPE_SCALING_KEYS = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def gguf_to_hf_config(metadata: dict[str, Any], tensor_names: Iterable[str] | None = None) -> dict[str, Any]:
    """The HF-style config of a llama, qwen3 or qwen3moe GGUF.

    tensor_names are the file's llama.cpp tensor names (they decide tie_word_embeddings);
    GGUFWeights.metadata carries them under "GGUF.tensor_names", so
    `gguf_to_hf_config(weights.metadata)` is enough.
    """
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported by kiln (supported: {', '.join(ARCHITECTURES)})")
    model_type, hf_arch, default_eps = ARCHITECTURES[arch]
    if tensor_names is None:
        if TENSOR_NAMES_KEY not in metadata:
            # A programming error, not a user's: without the names we would guess tying.
            raise ValueError(f"gguf_to_hf_config needs tensor_names or metadata[{TENSOR_NAMES_KEY!r}]")
        tensor_names = metadata[TENSOR_NAMES_KEY]
    names = set(tensor_names)

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in metadata:
            raise ConfigError(f"GGUF metadata lacks {full!r}, which kiln needs to build the model")
        return metadata[full]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = metadata.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ConfigError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    # key_length is the per-head width when it differs from hidden / heads (qwen3); llama.cpp
    # writes rope.dimension_count for llama, which transformers reads as head_dim there.
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = metadata.get("llama.rope.dimension_count")
    if head_dim is None:
        head_dim = hidden // heads

    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", default_eps)),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(metadata, arch),
        "max_position_embeddings": int(need("context_length")),
        # llama.cpp omits output.weight exactly when lm_head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    if metadata.get(f"{arch}.expert_count"):
        config.update(_experts(metadata, arch, need))
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
        value = metadata.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    return config


def _experts(metadata: dict[str, Any], arch: str, need) -> dict[str, Any]:
    """A MoE GGUF's expert fields. llama.cpp's qwen3moe graph always renormalises the top-k
    weights (transformers sets norm_topk_prob for these files too) and puts experts in every layer."""
    out = {"num_experts": int(need("expert_count")), "num_experts_per_tok": int(need("expert_used_count")),
           "moe_intermediate_size": int(need("expert_feed_forward_length")), "norm_topk_prob": True,
           "decoder_sparse_step": 1, "mlp_only_layers": []}
    shared = metadata.get(f"{arch}.expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    prefix = f"{arch}.rope.scaling."
    kind = metadata.get(prefix + "type")
    if kind is None and prefix + "factor" in metadata:
        kind = "linear"  # old files wrote only the factor, which llama.cpp read as linear
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "type": kind}
    for gguf_key, hf_key in ROPE_SCALING_KEYS.items():
        if prefix + gguf_key in metadata:
            value = metadata[prefix + gguf_key]
            scaling[hf_key] = int(value) if hf_key == "original_max_position_embeddings" else float(value)
    return scaling
