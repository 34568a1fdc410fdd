"""ModelOpt NVFP4 Qwen3.5 hybrids on the cpu target (W4A16) against transformers: the tiny hybrid of
tests/tiny_models.py quantised by the test (tests/nvfp4_checkpoints.py), every Linear of the text
tower in NVFP4 (gated attention, Gated DeltaNet projections, MLP) but those exclude_modules lists
with ModelOpt's wildcards, once as Qwen3_5ForCausalLM and once in the ForConditionalGeneration
layout Qwen3.5 checkpoints ship (the file's model.language_model.* names in exclude_modules).
Oracle: transformers in f32 with the quantiser's dequantised weights. Measured up to 6e-5 of the
largest logit (the delta rule's f32 recurrences add in another order than torch's chunked
reference); bound 1e-3, the issue's. Greedy tokens equal the oracle's for 32 steps (one prompt)."""
from __future__ import annotations

import pytest
import torch

from kiln.loader import load
from kiln.runtime.worker.generate import greedy_generate
from tests.nvfp4_checkpoints import make_nvfp4_checkpoint
from tests.test_fp8_models import _kiln_logits, _prompts, _rel

CASES = [  # (variant, exclude_modules beyond lm_head, linear_nvfp4 nodes expected)
    # 6 GDN layers x 5 projections + 2 attention layers x 4 + 8 MLPs x 3 = 62, less 12 + 1 excluded
    ("qwen3_5_causal", ("model.layers.*.linear_attn.in_proj_[ab]", "model.layers.3.mlp.down_proj"), 49),
    ("qwen3_5_conditional", ("model.language_model.layers.*.linear_attn.in_proj_[ab]",), 50),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0])
def hybrid(request, tmp_path_factory):
    variant, exclude, n = request.param
    d = tmp_path_factory.mktemp(f"{variant}_nvfp4")
    oracle = make_nvfp4_checkpoint(d, variant, exclude=exclude)
    return variant, n, load(d, kv_cache_tokens=1024, tokenizer=False), oracle


def test_hybrid_graph_is_nvfp4(hybrid):
    variant, n, lm, _ = hybrid
    assert [nd.op for nd in lm.graph.nodes.values()].count("linear_nvfp4") == n, variant
    assert lm.executor.weights["model.layers.0.linear_attn.in_proj_qkv.weight"].dtype.name == "uint8"


def test_hybrid_logits_match_dequantised_transformers(hybrid):
    variant, _, lm, oracle = hybrid
    prompts = _prompts(256, seed=1)
    for p, got in zip(prompts, _kiln_logits(lm, prompts)):
        with torch.no_grad():
            ref = oracle(torch.tensor([p])).logits[0].numpy()
        assert _rel(got, ref) <= 1e-3, f"{variant}: {len(p)}-token prompt {_rel(got, ref):.2e} from the oracle"


def test_hybrid_greedy_tokens_match_oracle(hybrid):
    """One prompt, one layout: transformers' hybrid fallback takes ~10 s a prompt on 2 cores."""
    variant, _, lm, oracle = hybrid
    if variant != "qwen3_5_causal":
        pytest.skip("the same graph as qwen3_5_causal's under other file names: its logits are checked")
    prompts = _prompts(256, seed=2, lens=(16,))
    ours = greedy_generate(lm.executor, lm.block_size, prompts, max_tokens=32)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            ref = oracle.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == ref, f"{variant}: greedy tokens differ for a {len(p)}-token prompt"
