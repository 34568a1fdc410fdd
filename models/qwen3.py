"""Qwen3 (dense): the Llama decoder with per-head RMSNorm on q and k before RoPE."""
from __future__ import annotations

from kiln.graph import DType, Graph
from kiln.models.config import ModelConfig
from kiln.models.llama import build_decoder


def build_graph(cfg: ModelConfig, *, dtype: DType = DType.f32, block_size: int = 16) -> Graph:
    return build_decoder(cfg, dtype=dtype, block_size=block_size, qk_norm=True)
