"""Passes change the graph's structure, never its numbers."""
from __future__ import annotations

from collections import Counter

import numpy as np

from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.cpu_executor import CpuExecutor
from kiln.runtime.input_batch import SeqChunk, prepare_step
from tests.tiny_models import BASE


def test_pipeline_fuses_and_preserves_logits(tmp_path):
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 3})
    build = get_graph_builder(cfg.architecture)
    rng = np.random.default_rng(0)
    ref_graph = build(cfg)
    weights = {t.name: rng.standard_normal(t.shape).astype(np.float32) * 0.2 for t in ref_graph.weights}
    fused = run_pipeline(build(cfg), dump_dir=tmp_path)
    ops = Counter(n.op for n in fused.nodes.values())
    # every norm after a residual add, the final norm too once the logits gather moved above it
    assert ops["add_rms_norm"] == 2 * 3 and ops["add"] == 0
    assert ops["silu_mul"] == 3 and ops["silu"] == 0 and ops["mul"] == 0
    assert ops["attention_preamble"] == 3 and ops["rope"] == ops["cache_write"] == 0
    assert ops["rms_norm"] == 1  # the first layer's input norm reads the embedding, no add before it
    # q/k/v and gate/up each became one GEMM over a stacked weight, sliced back into views
    assert ops["linear"] == 4 * 3 + 1 and ops["slice_cols"] == 5 * 3
    assert {t.name for t in fused.weights if t.parts} >= {"model.layers.0.self_attn.q_proj+k_proj+v_proj.weight",
                                                          "model.layers.2.mlp.gate_proj+up_proj.weight"}
    assert (tmp_path / "04_fuse_add_rmsnorm.txt").read_text().count("add_rms_norm(") == 6
    chunks = [SeqChunk(rng.integers(0, 256, n).tolist(), 0, [2 * i, 2 * i + 1]) for i, n in enumerate((3, 20, 9))]
    inputs = prepare_step(chunks, 16)
    a = CpuExecutor(ref_graph, weights.__getitem__, 8).execute(inputs)
    b = CpuExecutor(fused, weights.__getitem__, 8).execute(inputs)
    # not bit-equal: OpenBLAS blocks an f32 GEMM by its N, so the stacked q/k/v GEMM rounds
    # differently from three narrow ones (the GPU GEMM's per-element K order does not move)
    np.testing.assert_allclose(a["lm_head"], b["lm_head"], rtol=1e-5, atol=1e-6)
