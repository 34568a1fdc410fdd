"""Passes change the graph's structure, never its numbers."""
from __future__ import annotations

from collections import Counter

import numpy as np

from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.worker.cpu_executor import CpuExecutor
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.tiny_models import BASE


def test_pipeline_fuses_and_preserves_logits(tmp_path):
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 3})
    build = get_graph_builder(cfg.architecture)
    rng = np.random.default_rng(0)
    ref_graph = build(cfg)
    weights = {t.name: rng.standard_normal(t.shape).astype(np.float32) * 0.2 for t in ref_graph.weights}
    fused = run_pipeline(build(cfg), dump_dir=tmp_path)
    ops = Counter(n.op for n in fused.nodes.values())
    # every norm after a residual add, the final norm too once the logits gather moved above it;
    # then each residual add whose input a GEMM makes moved into that GEMM (fuse_residual_into_linear):
    # all but the final norm's, whose inputs are the gathered rows
    assert ops["add_rms_norm"] == 1 and ops["linear_add"] == 2 * 3 - 1 and ops["add"] == 0
    # silu(gate) * up became silu_mul, then the gate/up GEMM's epilogue (fuse_gate_up_silu.py)
    assert ops["linear_silu_mul"] == 3 and ops["silu_mul"] == ops["silu"] == ops["mul"] == 0
    assert ops["attention_preamble"] == 3 and ops["rope"] == ops["cache_write"] == 0
    # the first layer's input norm reads the embedding, no add before it; the others read linear_add's sum
    assert ops["rms_norm"] == 1 + 2 * 3 - 1
    # q/k/v and gate/up each became one GEMM over a stacked weight; q/k/v sliced back into views
    assert ops["linear"] == 3 * 3 + 1 - (2 * 3 - 1) and ops["slice_cols"] == 3 * 3
    assert {t.name for t in fused.weights if t.parts} >= {"model.layers.0.self_attn.q_proj+k_proj+v_proj.weight",
                                                          "model.layers.2.mlp.gate_proj+up_proj.weight"}
    assert {t.name: t.interleave for t in fused.weights if t.parts}["model.layers.2.mlp.gate_proj+up_proj.weight"] == 16
    assert (tmp_path / "04_fuse_add_rmsnorm.txt").read_text().count("add_rms_norm(") == 6
    assert (tmp_path / "05_fuse_residual_into_linear.txt").read_text().count("linear_add(") == 2 * 3 - 1
    assert (tmp_path / "07_fuse_gate_up_silu.txt").read_text().count("linear_silu_mul(") == 3
    chunks = [SeqChunk(rng.integers(0, 256, n).tolist(), 0, [2 * i, 2 * i + 1]) for i, n in enumerate((3, 20, 9))]
    inputs = prepare_step(chunks, 16)
    a = CpuExecutor(ref_graph, weights.__getitem__, 8).execute(inputs)
    b = CpuExecutor(fused, weights.__getitem__, 8).execute(inputs)
    # not bit-equal: OpenBLAS blocks an f32 GEMM by its N, so the stacked q/k/v GEMM rounds
    # differently from three narrow ones (the GPU GEMM's per-element K order does not move)
    np.testing.assert_allclose(a["lm_head"], b["lm_head"], rtol=1e-5, atol=1e-6)


def test_fuse_gate_up_silu_only_takes_the_plain_pattern():
    """The SwiGLU epilogue fusion leaves a gate/up stack alone where something else reads the
    stacked output or a half, and the CPU executor runs the fused graph (interleaved weight)
    to the unfused graph's numbers."""
    from kiln.graph import DType, Graph
    from kiln.graph.ops import OPS
    from kiln.graph.layout import stack_parts
    from kiln.passes.fuse_gate_up_silu import FuseGateUpSilu
    from kiln.passes.fuse_silu_mul import FuseSiluMul
    from kiln.passes.merge_parallel_linears import MergeParallelLinears

    def mlp(extra_use):
        g = Graph(OPS, "mlp")
        x = g.input("x", DType.bf16, ("T", 32))
        wg, wu = g.weight("gate.weight", DType.bf16, (48, 32)), g.weight("up.weight", DType.bf16, (48, 32))
        gate, up = g.call1("linear", x, wg, name="gate"), g.call1("linear", x, wu, name="up")
        h = g.call1("mul", g.call1("silu", gate, name="silu"), up, name="mul")
        g.mark_output(h, *([up] if extra_use else []))
        for p in (MergeParallelLinears(), FuseSiluMul(), FuseGateUpSilu()):
            p.run(g)
            g.verify()
        return g

    plain, fused = mlp(True), mlp(False)
    assert "linear_silu_mul" not in {n.op for n in plain.nodes.values()}
    assert [n.op for n in fused.topo_order()] == ["linear_silu_mul"]
    rng = np.random.default_rng(0)
    w = {n: rng.standard_normal((48, 32)).astype(np.float32) for n in ("gate.weight", "up.weight")}
    x = {"x": rng.standard_normal((5, 32)).astype(np.float32)}
    a = CpuExecutor(plain, w.__getitem__, 1).execute(x)
    b = CpuExecutor(fused, w.__getitem__, 1).execute(x)
    np.testing.assert_array_equal(b[fused.outputs[0]], a[plain.outputs[0]])
    (wt,) = [t for t in fused.weights if t.parts]
    assert wt.parts == (("gate.weight", 48), ("up.weight", 48)) and wt.interleave == 16
    stored = CpuExecutor(fused, w.__getitem__, 1).weights[wt.name]
    np.testing.assert_array_equal(stored, stack_parts([w["gate.weight"], w["up.weight"]], 16)
                                  .astype(stored.dtype))


def _hybrid_weights(graph, rng):
    w = {}
    for name, shape in graph.checkpoint_weights().items():
        x = rng.standard_normal(shape).astype(np.float32)
        w[name] = x * (0.3 if len(shape) == 1 else 1.0 / shape[-1] ** 0.5)
    return w


def test_hybrid_pipeline_fuses_the_gated_deltanet_and_preserves_logits(tmp_path):
    """The Gated DeltaNet layer after the passes, as --dump-ir shows it: q/k/v, z, b and a in one
    GEMM (merge_parallel_linears), SiLU inside the conv (fuse_conv_silu), the l2 norms and gates
    inside the delta rule (fold_gdn_gates), the gated output norm too (fold_gdn_norm: out_proj's
    input written once); the gated attention's q/k norms, partial rope and KV write in the preamble. The logits of a prefill across two GDN chunks and a decode step stay."""
    from tests.tiny_models import HYBRID_BASE

    cfg = ModelConfig.from_hf_dict({**HYBRID_BASE, "architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 4})
    build = get_graph_builder(cfg.architecture)
    ref_graph = build(cfg)
    fused = run_pipeline(build(cfg), dump_dir=tmp_path)
    ops = Counter(n.op for n in fused.nodes.values())
    gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    assert gdn == 3
    assert ops["fused_gated_delta_rule_norm"] == ops["causal_conv1d"] == gdn
    assert ops["gated_delta_rule"] == ops["l2norm"] == ops["gdn_gates"] == ops["silu"] == 0
    assert ops["fused_gated_delta_rule"] == ops["gated_rms_norm"] == 0
    assert all(n.attrs["activation"] == "silu" for n in fused.nodes.values() if n.op == "causal_conv1d")
    assert "model.layers.0.linear_attn.in_proj_qkv+in_proj_z+in_proj_b+in_proj_a.weight" in \
        {t.name for t in fused.weights if t.parts}
    assert ops["attention_preamble"] == 1 and ops["rope"] == ops["cache_write"] == 0
    dumps = {p.name: p.read_text() for p in tmp_path.iterdir()}
    conv = next(v for k, v in dumps.items() if k.endswith("_fuse_conv_silu.txt"))
    fold = next(v for k, v in dumps.items() if k.endswith("_fold_gdn_gates.txt"))
    assert conv.count("silu(") == 0 and "activation=silu" in conv.replace("'", "").replace('"', "")
    assert fold.count("fused_gated_delta_rule(") == gdn and "l2norm(" not in fold
    norm = next(v for k, v in dumps.items() if k.endswith("_fold_gdn_norm.txt"))
    assert norm.count("fused_gated_delta_rule_norm(") == gdn and "gated_rms_norm(" not in norm
    rng = np.random.default_rng(0)
    weights = _hybrid_weights(ref_graph, rng)
    run = {}
    for name, g in (("ref", ref_graph), ("fused", fused)):
        ex = CpuExecutor(g, weights.__getitem__, 16, num_state_slots=4)
        prompts = [rng.integers(0, 256, n).tolist() for n in (70, 5)] if name == "ref" else run["prompts"]
        run.setdefault("prompts", prompts)
        blocks = [[1, 2, 3, 4, 5], [6]]
        a = ex.execute(prepare_step([SeqChunk(p, 0, b, state_slot=i + 1) for i, (p, b) in
                                     enumerate(zip(prompts, blocks))], 16))[g.outputs[0]]
        nxt = a.argmax(-1)
        b = ex.execute(prepare_step([SeqChunk([int(t)], len(p), bl, state_slot=i + 1) for i, (t, p, bl) in
                                     enumerate(zip(nxt, prompts, blocks))], 16))[g.outputs[0]]
        run[name] = (a, b)
    for want, got in zip(run["ref"], run["fused"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
