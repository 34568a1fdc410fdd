"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (plain
attention with per-head q/k RMSNorm) whose MLP is the sparse MoE block (models/moe.py) in every
layer that `layer_is_moe` picks (decoder_sparse_step, mlp_only_layers), a dense SwiGLU MLP of
intermediate_size elsewhere. No shared expert; the router renormalises when norm_topk_prob."""
from __future__ import annotations

from kiln.graph import DType, Graph
from kiln.models import moe
from kiln.models.config import ModelConfig
from kiln.models.llama import build_decoder


def build_graph(cfg: ModelConfig, *, dtype: DType = DType.f32, block_size: int = 16,
                kv_cache_dtype: DType | None = None) -> Graph:
    return build_decoder(cfg, dtype=dtype, block_size=block_size, qk_norm=True, kv_cache_dtype=kv_cache_dtype,
                         mlp=moe.mlp)
