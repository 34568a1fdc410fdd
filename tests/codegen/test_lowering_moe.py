"""A tiny Qwen3.5-MoE hybrid's GPU launch plans replayed on the CPU under the Triton
interpreter (as test_lowering_hybrid.py does for the dense hybrid): every layer's router and
experts (the shared expert beside them), in a mixed bucket of 256 tokens (512 assignments: the
grouped path, align + grouped GEMMs + rank-order sum) and a decode bucket (the decode path),
each against the numpy executor on the same bf16 graph."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kiln.codegen.triton.moe import moe_path
from kiln.graph import DType, to_numpy
from kiln.graph.layout import stack_parts
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.worker.input_batch import SeqChunk
from tests.codegen.helpers import require_interpreter
from tests.codegen.test_lowering_hybrid import BS, DECODE, MAX_LEN, MIXED, _HybridPlan, _model
from tests.tiny_models import HYBRID_BASE

pytestmark = pytest.mark.usefixtures("interpreter")
TOP_K = 2


@pytest.fixture
def interpreter():
    require_interpreter()


def _moe_model():
    text = {k: v for k, v in HYBRID_BASE.items() if k != "intermediate_size"}
    return _model({**text, "architectures": ["Qwen3_5MoeForCausalLM"], "num_hidden_layers": 4,
                   "max_position_embeddings": MAX_LEN, "num_experts": 8, "num_experts_per_tok": TOP_K,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48})


def _prefill_then_decode(run):
    """Three prompts (one of 140 tokens) prefilled in the mixed bucket, then a decode step of each's next
    token: -> [(the plan's logits, the numpy executor's)] of both steps."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 140, 70)]
    blocks = [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17]]
    chunks = [SeqChunk(p, 0, b, state_slot=i + 1) for i, (p, b) in enumerate(zip(prompts, blocks))]
    steps = [run.step(MIXED, chunks)]
    nxt = steps[0][1].argmax(-1)
    chunks = [SeqChunk([int(t)], len(p), b, state_slot=i + 1)
              for i, (t, p, b) in enumerate(zip(nxt, prompts, blocks))]
    steps.append(run.step(DECODE, chunks))
    return steps


def test_moe_plan_matches_numpy():
    cfg, graph, weights = _moe_model()
    assert moe_path(MIXED.tokens, TOP_K) == "grouped" and moe_path(DECODE.tokens, TOP_K) == "decode"
    run = _HybridPlan(cfg, graph, weights)
    layers = cfg.num_hidden_layers
    mixed = Counter(spec.kernel for spec, _ in run.lowered[MIXED])
    decode = Counter(spec.kernel for spec, _ in run.lowered[DECODE])
    assert mixed["moe_router_kernel"] == decode["moe_router_kernel"] == layers
    assert mixed["moe_align_kernel"] == layers and decode["moe_align_kernel"] == 0
    # the decode path: GEMMs over (column block, assignment), then the rank-order sum; in both
    # buckets that sum also runs the shared expert's sigmoid_mul and the add (lower.py
    # _defer_moe_sum), so no sigmoid_mul of a [T, 1] gate is left; and but for the last layer's
    # (its output goes through the logits' gather_rows) the next layer's add_rms_norm runs it
    # (lower.py _norm_takes_moe_sum): one moe_sum launch a model, not one a layer
    assert decode["moe_gate_up_kernel"] == decode["moe_down_kernel"] == layers
    for bucket in (MIXED, DECODE):
        sums = [spec for spec, _ in run.lowered[bucket] if spec.kernel == "moe_sum_kernel"]
        assert len(sums) == 1 and all(spec.constexprs.get("SHARED") for spec in sums), bucket
        norms = [spec for spec, _ in run.lowered[bucket] if spec.kernel == "rms_norm_kernel"
                 and spec.constexprs.get("MOE_TOPK")]
        assert len(norms) == layers - 1 and all(spec.constexprs["MOE_TOPK"] == TOP_K and spec.constexprs["MOE_SHARED"]
                                                for spec in norms), bucket
        assert not any(spec.constexprs.get("GATE_PER_HEAD") for spec, _ in run.lowered[bucket]
                       if spec.kernel == "sigmoid_mul_kernel"), bucket
    assert all(spec.constexprs.get("SPLIT") for spec, _ in run.lowered[DECODE] if spec.kernel == "moe_down_kernel")
    steps = _prefill_then_decode(run)
    for got, want in steps:
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


def _quantised_moe_model(fmt: str):
    """_moe_model's hybrid with its linears and experts block-wise FP8 ([16, 16]) or ModelOpt NVFP4,
    as Qwen's and ModelOpt's files leave things bf16 (routers and shared-expert gates, GDN conv1d and
    in_proj_a/b, lm_head), with random weights and scales of the sizes a real model has."""
    from tests.codegen.helpers import FP8
    from tests.codegen.test_lowering_moe_fp8 import NVFP4_CONFIG
    from tests.fp8_checkpoints import BLOCK_CONFIG

    text = {k: v for k, v in HYBRID_BASE.items() if k != "intermediate_size"}
    layers = 4
    skip = ["lm_head", *(f"model.layers.{i}.{m}" for i in range(layers)
                         for m in ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.conv1d",
                                   "linear_attn.in_proj_a", "linear_attn.in_proj_b"))]
    qc = ({**BLOCK_CONFIG, "modules_to_not_convert": skip} if fmt == "fp8" else {**NVFP4_CONFIG, "exclude_modules": skip})
    cfg = ModelConfig.from_hf_dict({**text, "architectures": ["Qwen3_5MoeForCausalLM"], "num_hidden_layers": layers,
                                    "max_position_embeddings": MAX_LEN, "num_experts": 8, "num_experts_per_tok": TOP_K,
                                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                                    "quantization_config": qc})
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16, block_size=BS))
    rng = np.random.default_rng(0)
    weights, ckpt = {}, graph.checkpoint_weights()
    for n, shape in ckpt.items():
        t = graph.tensors.get(n)  # None: a part of a merged weight (router + shared gate, in_proj_b + a), bf16
        dtype = t.dtype if t is not None else DType.bf16
        base = n[: -len(".weight")] if n.endswith(".weight") else n
        if dtype == DType.u8:  # NVFP4: any byte is two e2m1 values
            weights[n] = rng.integers(0, 256, shape).astype(np.uint8)
        elif n.endswith(".weight_scale") and dtype == DType.fp8e4m3:  # NVFP4 block scales
            weights[n] = rng.uniform(0.5, 1.5, shape).astype(FP8)
        elif n.endswith(".weight_scale_2"):  # W = e2m1 (|.| ~2) * block scale * this ~ 1.5 / sqrt(K)
            w = n[: -len(".weight_scale_2")]
            k = 2 * ckpt[w if w in ckpt else w + ".weight"][-1]
            weights[n] = (rng.uniform(0.5, 1.5, shape) * 0.75 / k ** 0.5).astype(np.float32)
        elif dtype == DType.fp8e4m3:
            weights[n] = np.clip(rng.standard_normal(shape) * 100, -448, 448).astype(FP8)
        elif n.endswith(".weight_scale_inv"):  # W = q * s about 1.5 / sqrt(K)
            w = n[: -len(".weight_scale_inv")]
            k = ckpt[w if w in ckpt else w + ".weight"][-1]
            weights[n] = (rng.uniform(0.5, 1.5, shape) * 1.5 / k ** 0.5 / 100).astype(np.float32)
        else:
            x = rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 1.0 / shape[-1] ** 0.5)
            weights[n] = x.astype(np.float32 if base.endswith(("A_log", "dt_bias")) else to_numpy(DType.bf16))
    for t in graph.weights:
        if t.parts:
            weights[t.name] = stack_parts([weights[p] for p, _ in t.parts], t.interleave)
    return cfg, graph, weights


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantised_moe_hybrid_plan_matches_numpy(fmt):
    """The quantised Qwen3.5-MoE hybrid (FP8 W8A8 block-wise, NVFP4 W4A16): the quantised expert GEMMs
    beside a quantised shared expert whose output moe_sum adds, in a mixed and a decode bucket, against
    the numpy executor on the same graph. Whole plan within 0.1 of the largest logit for FP8 (an e4m3
    boundary flip moves an activation a whole step: test_lowering_hybrid.py's FP8 test says why),
    2e-2 for NVFP4 (weights only). The GPU found the quantised MoE hybrids wrong where this model
    had no replay."""
    cfg, graph, weights = _quantised_moe_model(fmt)
    assert [n.op for n in graph.nodes.values()].count(f"moe_experts_{fmt}") == cfg.num_hidden_layers
    run = _HybridPlan(cfg, graph, weights)
    steps = _prefill_then_decode(run)
    tol = 0.1 if fmt == "fp8" else 2e-2
    for got, want in steps:
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= tol * np.abs(want).max()
