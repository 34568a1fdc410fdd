"""ModelOpt NVFP4 checkpoints on the cpu target (W4A16: graph/nvfp4_ops.py) against transformers.

Each tiny Llama / Qwen3 is quantised by the test into NVFP4 (tests/nvfp4_checkpoints.py: packed
e2m1 uint8 weights, e4m3 block scales, f32 per-tensor scales, ModelOpt's recipe), the config in
hf_quant_config.json or in config.json's flat form, some modules left bf16 through
exclude_modules. The oracle: transformers in f32 with every quantised linear holding the weights
dequantised in numpy from the quantiser's own e2m1 values (before packing), so kiln's unpacking,
nibble order and scale layout are all checked. W4A16 rounds no activation, so the only
difference is the f32 summation order (kiln scales the per-tensor factor after the sum):
measured about 1e-6 of the largest logit; the bound is the issue's 1e-3. Greedy tokens agree
for all 32 steps.

And the reference dequantisation itself against the format's definition, bit field by bit field.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kiln.graph.nvfp4_ops import dequantize_nvfp4, unpack_e2m1
from kiln.loader import load
from kiln.runtime.worker.generate import greedy_generate
from tests.nvfp4_checkpoints import make_nvfp4_checkpoint, quantize_nvfp4
from tests.test_fp8_models import _kiln_logits, _prompts, _rel

SKIP = ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj")
CASES = [  # (variant, config in config.json (else hf_quant_config.json), modules left bf16)
    ("llama_gqa_untied", False, SKIP), ("qwen3_qknorm", True, ()), ("qwen3_yarn_tied", False, ()),
]


def _e2m1_by_definition(code: int) -> float:
    """e2m1 (OCP MX): bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa; exponent 0 subnormal."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return -mag if sign else mag


def test_unpack_is_the_format_definition_low_nibble_first():
    packed = np.arange(256, dtype=np.uint8).reshape(4, 64)
    got = unpack_e2m1(packed)
    want = np.array([[_e2m1_by_definition(b & 15), _e2m1_by_definition(b >> 4)] for b in range(256)],
                    np.float32).reshape(4, 128)
    assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))


def test_dequantize_matches_the_quantisers_values():
    """Random weights through the test's ModelOpt-recipe quantiser, back through kiln's reference:
    the quantiser's own pre-packing values (W = e2m1 * block scale * tensor scale), exactly."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((48, 96)) * rng.uniform(0.01, 3.0, (48, 1))).astype(np.float32)
    packed, s, s2, deq = quantize_nvfp4(w)
    assert packed.dtype == np.uint8 and packed.shape == (48, 48) and s.dtype == ml_dtypes.float8_e4m3fn
    assert len(np.unique(s.astype(np.float32))) > 20  # random scales, never all ones
    np.testing.assert_array_equal(dequantize_nvfp4(packed, s, s2), deq)
    assert 0 < np.abs(deq - w).max() <= 0.25 * np.abs(w).max()  # really 4-bit, and near w


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}{'-config_json' if c[1] else ''}"
                                                             f"{'-skip' if c[2] else ''}")
def nvfp4(request, tmp_path_factory):
    variant, config_json, skip = request.param
    d = tmp_path_factory.mktemp(f"{variant}_nvfp4")
    oracle = make_nvfp4_checkpoint(d, variant, exclude=skip, config_json=config_json)
    lm = load(d, kv_cache_tokens=1024, tokenizer=False)
    return request.param, d, lm, oracle


def test_graph_is_nvfp4(nvfp4):
    (_, _, skip), _, lm, _ = nvfp4
    ops = [n.op for n in lm.graph.nodes.values()]
    assert ops.count("linear_nvfp4") == 7 * lm.source.config.num_hidden_layers - len(skip)
    w = lm.executor.weights
    assert w["model.layers.1.self_attn.q_proj.weight"].dtype == np.uint8
    assert w["model.layers.1.self_attn.q_proj.weight_scale"].dtype.name == "float8_e4m3fn"
    assert not any(f"{s}.weight_scale" in w for s in skip)


def test_logits_match_dequantised_transformers(nvfp4):
    (variant, _, _), d, lm, oracle = nvfp4
    prompts = _prompts(256, seed=1)
    for p, got in zip(prompts, _kiln_logits(lm, prompts)):
        with torch.no_grad():
            ref = oracle(torch.tensor([p])).logits[0].numpy()
        assert _rel(got, ref) <= 1e-3, f"{variant}: {len(p)}-token prompt {_rel(got, ref):.2e} from the oracle"


def test_quantisation_moved_the_logits(nvfp4):
    """The oracle is not the unquantised model in disguise: 4-bit weights move the logits by far
    more than the 1e-3 the comparison allows."""
    (variant, _, _), d, lm, oracle = nvfp4
    from tests.tiny_models import make_tiny_model

    plain = make_tiny_model(d / "plain", variant)
    p = torch.tensor([_prompts(256, seed=5, lens=(24,))[0]])
    with torch.no_grad():
        assert _rel(oracle(p).logits[0].numpy(), plain(p).logits[0].numpy()) > 3e-2


def test_greedy_tokens_match_oracle(nvfp4):
    (variant, _, _), _, lm, oracle = nvfp4
    prompts = _prompts(256, seed=2, lens=(1, 16, 33))
    ours = greedy_generate(lm.executor, lm.block_size, prompts, max_tokens=32)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            ref = oracle.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == ref, f"{variant}: greedy tokens differ for a {len(p)}-token prompt"
