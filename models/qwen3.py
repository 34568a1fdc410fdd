"""Qwen3 (dense): the Llama decoder with per-head RMSNorm on q and k before RoPE."""
from __future__ import annotations

from kiln.graph import DType, Graph
from kiln.models.config import ModelConfig
from kiln.models.llama import build_decoder


def build_graph(cfg: ModelConfig, *, dtype: DType = DType.f32, block_size: int = 16,
                kv_cache_dtype: DType | None = None) -> Graph:
    return build_decoder(cfg, dtype=dtype, block_size=block_size, qk_norm=True, kv_cache_dtype=kv_cache_dtype)
