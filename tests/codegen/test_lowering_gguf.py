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

