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
from kiln.runtime.worker.input_batch import SeqChunk
from tests.codegen.helpers import require_interpreter
from tests.codegen.test_lowering_hybrid import DECODE, MAX_LEN, MIXED, _HybridPlan, _model
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


def test_moe_plan_matches_numpy():
    cfg, graph, weights = _moe_model()
    assert moe_path(MIXED.tokens, TOP_K) == "grouped" and moe_path(DECODE.tokens, TOP_K) == "decode"
    run = _HybridPlan(cfg, graph, weights)
    layers = cfg.num_hidden_layers
    mixed = Counter(spec.kernel for spec, _ in run.lowered[MIXED])
    decode = Counter(spec.kernel for spec, _ in run.lowered[DECODE])
    assert mixed["moe_router_kernel"] == decode["moe_router_kernel"] == layers
    assert mixed["moe_align_kernel"] == mixed["moe_sum_kernel"] == layers and decode["moe_align_kernel"] == 0
    # the decode path: GEMMs over (column block, assignment), then the rank-order sum; in both
    # buckets that sum also runs the shared expert's sigmoid_mul and the add (lower.py
    # _defer_moe_sum), so no sigmoid_mul of a [T, 1] gate is left
    assert decode["moe_sum_kernel"] == decode["moe_gate_up_kernel"] == decode["moe_down_kernel"] == layers
    for bucket in (MIXED, DECODE):
        sums = [spec for spec, _ in run.lowered[bucket] if spec.kernel == "moe_sum_kernel"]
        assert all(spec.constexprs.get("SHARED") for spec in sums), bucket
        assert not any(spec.constexprs.get("GATE_PER_HEAD") for spec, _ in run.lowered[bucket]
                       if spec.kernel == "sigmoid_mul_kernel"), bucket
    assert all(spec.constexprs.get("SPLIT") for spec, _ in run.lowered[DECODE] if spec.kernel == "moe_down_kernel")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 140, 70)]
    blocks = [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17]]
    chunks = [SeqChunk(p, 0, b, state_slot=i + 1) for i, (p, b) in enumerate(zip(prompts, blocks))]
    steps = [run.step(MIXED, chunks)]
    nxt = steps[0][1].argmax(-1)
    chunks = [SeqChunk([int(t)], len(p), b, state_slot=i + 1)
              for i, (t, p, b) in enumerate(zip(nxt, prompts, blocks))]
    steps.append(run.step(DECODE, chunks))
    for got, want in steps:
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
