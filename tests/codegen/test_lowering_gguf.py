"""A tiny GGUF model's GPU launch plans replayed on the CPU under the Triton interpreter (as
test_lowering.py does for bf16): the linears in GGUF blocks (Q8_0, Q4_0, Q4_1 mixed within a layer,
as llama.cpp's mixes do, and an untied LM head in Q8_0; the k-quants need K a multiple of 256,
too wide for this test's interpreter budget: test_gguf_kernels.py and test_bundle_gguf.py) lowered to gguf_gemm_kernel,
against

- the numpy executor on the same graph (linear_gguf's reference), within test_lowering.py's bound;
- the plan of the same model with its weights dequantised at load and stored in bf16, through the
  same passes and split-K off (the GGUF kernel has none): the same logits, bit for bit, in a padded
  mixed step and the decode step after it. The in-kernel dequantisation then rounds every weight
  as the load-time cast does and the K order is the bf16 GEMM's.
And a Qwen3-MoE whose experts stay in blocks (op_moe_experts_gguf), the same way.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kiln.codegen.triton.configs import Configs
from kiln.graph import DType
from kiln.graph.layout import stack_parts
from kiln.models.config import ModelConfig
from kiln.models.gguf_quant import SUFFIX, GgufConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import default_passes, run_pipeline
from tests.codegen.helpers import BF16, require_interpreter, same_bits
from tests.codegen.test_lowering import BS, BUCKETS, MAX_LEN, _Plan
from tests.gguf_blocks import random_matrix
from tests.tiny_models import BASE

pytestmark = pytest.mark.usefixtures("interpreter")
TYPES = {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q4_1", "o_proj": "Q4_0", "gate_proj": "Q4_1",
         "up_proj": "Q4_1", "down_proj": "Q8_0"}


@pytest.fixture
def interpreter():
    require_interpreter()


def _no_split(op, key):
    return {"split_k": 1} if op == "gemm_reduction" else None


def _graph(cfg):
    passes = default_passes(fuse_silu=False, fuse_residual=False, fuse_rope=False)
    return run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16, block_size=BS), passes)


def _models(arch):
    base = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], "num_hidden_layers": 2,
                                     "max_position_embeddings": MAX_LEN, "tie_word_embeddings": False})
    types = [(f"model.layers.{i}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}.weight", q)
             for i in range(2) for m, q in TYPES.items()] + [("lm_head.weight", "Q8_0")]
    cfg = dataclasses.replace(base, quantization=GgufConfig(tuple(types)))
    gg, plain = _graph(cfg), _graph(base)
    rng = np.random.default_rng(0)
    qtype = dict(types)
    w_gguf, w_plain = {}, {}
    for name, shape in plain.checkpoint_weights().items():
        if name in qtype:
            n, k = shape
            raw = random_matrix(qtype[name], n, k, rng, scale=0.3 / k ** 0.5)
            w_gguf[name.removesuffix(".weight") + SUFFIX] = raw
            w_plain[name] = gguf_dequantize(raw, GGMLQuantizationType[qtype[name]]).astype(BF16)
        else:
            w_plain[name] = w_gguf[name] = (rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 0.5)
                                            + (1.0 if name.endswith("norm.weight") else 0.0)).astype(BF16)
    for graph, weights in ((gg, w_gguf), (plain, w_plain)):
        for t in graph.weights:  # stacked weights as the executor uploads them
            if t.parts:
                weights[t.name] = stack_parts([weights[p] for p, _ in t.parts], t.interleave)
    return cfg, (gg, w_gguf), (plain, w_plain)


def test_gguf_plan_is_the_dequantised_plan_bit_for_bit():
    cfg, (gg, w_gguf), (plain, w_plain) = _models("LlamaForCausalLM")
    ops = [n.op for n in gg.nodes.values()]
    # q/k (both Q8_0) and gate/up (both Q4_1) merge into one GEMM each; v, o, down and the head alone
    assert ops.count("linear_gguf") == 5 * cfg.num_hidden_layers + 1 and "linear" not in ops
    assert set(t.dtype for t in gg.weights if t.name.endswith(SUFFIX)) == {DType.u8}
    configs = Configs(lookup=_no_split)
    run, ref = _Plan(cfg, gg, w_gguf, configs), _Plan(cfg, plain, w_plain, configs)
    for b in BUCKETS:
        kernels = [spec.kernel for spec, _ in run.lowered[b]]
        assert kernels.count("gguf_gemm_kernel") == 5 * cfg.num_hidden_layers + 1 and "gemm_kernel" not in kernels
    for (got, _), (want, _), what in zip(run.prefill_then_decode(), ref.prefill_then_decode(), ("mixed", "decode")):
        assert same_bits(got, want), f"{what} step: the GGUF plan's logits differ from the dequantised plan's"



def test_gguf_moe_plan_is_the_dequantised_plan_bit_for_bit():
    """Qwen3-MoE with its experts in blocks (gate/up Q4_1 stacked per layer, down Q8_0; attention
    bf16): the decode bucket (8 assignments: the decode path) and the mixed one (128: align +
    grouped GEMMs + sum) give the plan's logits with the experts dequantised at load, bit for bit."""
    from collections import Counter

    from kiln.graph.gguf_blocks import row_bytes

    base = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 1,
                                     "max_position_embeddings": MAX_LEN, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True})
    types = tuple((f"model.layers.{i}.mlp.experts.{w}_proj.weight", q) for i in range(1)
                  for w, q in (("gate", "Q4_1"), ("up", "Q4_1"), ("down", "Q8_0")))
    cfg = dataclasses.replace(base, quantization=GgufConfig(types))
    gg, plain = _graph(cfg), _graph(base)
    rng = np.random.default_rng(1)
    w_plain = {n: (rng.standard_normal(s) * (0.3 if len(s) == 1 else 0.5 / s[-1] ** 0.5)
                   + (1.0 if n.endswith("norm.weight") else 0.0)).astype(BF16)
               for n, s in plain.checkpoint_weights().items() if "experts" not in n}
    w_gguf = dict(w_plain)
    e, h, i = 4, BASE["hidden_size"], 32
    for layer in range(1):
        x = f"model.layers.{layer}.mlp.experts"
        w13 = random_matrix("Q4_1", e * 2 * i, h, rng, scale=0.3 / h ** 0.5).reshape(e, 2 * i, row_bytes("Q4_1", h))
        w2 = random_matrix("Q8_0", e * h, i, rng, scale=0.3 / i ** 0.5).reshape(e, h, row_bytes("Q8_0", i))
        w_gguf[f"{x}.gate_up_proj{SUFFIX}"], w_gguf[f"{x}.down_proj{SUFFIX}"] = w13, w2
        w_plain[f"{x}.gate_up_proj"] = gguf_dequantize(w13, GGMLQuantizationType.Q4_1).astype(BF16)
        w_plain[f"{x}.down_proj"] = gguf_dequantize(w2, GGMLQuantizationType.Q8_0).astype(BF16)
    for graph, weights in ((gg, w_gguf), (plain, w_plain)):
        for t in graph.weights:
            if t.parts:
                weights[t.name] = stack_parts([weights[p] for p, _ in t.parts], t.interleave)
    run, ref = _Plan(cfg, gg, w_gguf, Configs(lookup=_no_split)), _Plan(base, plain, w_plain, Configs(lookup=_no_split))
    for b in BUCKETS:
        kernels = Counter(spec.kernel for spec, _ in run.lowered[b])
        assert kernels["moe_gate_up_kernel"] == kernels["moe_down_kernel"] == 1
        assert kernels["moe_align_kernel"] == (0 if b.decode else 1)
        assert all(spec.signature["w_ptr"] == "*u8" for spec, _ in run.lowered[b]
                   if spec.kernel in ("moe_gate_up_kernel", "moe_down_kernel"))
    for (got, _), (want, _), what in zip(run.prefill_then_decode(), ref.prefill_then_decode(), ("mixed", "decode")):
        assert same_bits(got, want), f"{what} step: the GGUF MoE plan's logits differ from the dequantised plan's"
