"""kiln's CPU logits and greedy tokens against transformers on tiny random checkpoints."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.loader import load
from kiln.runtime.worker.generate import greedy_generate
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.tiny_models import VARIANTS, make_tiny_model

PROMPT_LENS = (1, 7, 16, 33, 50)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    model = make_tiny_model(d, request.param)
    return request.param, d, model


def _prompts(vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENS]


def test_logits_match_transformers(tiny):
    name, path, model = tiny
    lm = load(path, kv_cache_tokens=1024, tokenizer=False)
    prompts = _prompts(lm.source.config.vocab_size, seed=1)
    # every prompt in one batch, each reading its own (non-contiguous) blocks
    free = list(range(lm.executor.num_blocks))[::-1]
    chunks = [SeqChunk(p, 0, [free.pop() for _ in range(-(-len(p) // 16))]) for p in prompts]
    inputs = prepare_step(chunks, 16)
    inputs["logits_indices"] = np.arange(len(inputs["input_ids"]), dtype=np.int32)  # every position
    ours = lm.executor.execute(inputs)[lm.graph.outputs[0]]
    qsl = inputs["query_start_loc"]
    for s, p in enumerate(prompts):
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0].numpy()
        got = ours[qsl[s]:qsl[s + 1]]
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < 1e-4, f"{name} prompt {s}: max relative error {rel:.2e}"


def test_greedy_tokens_match_transformers(tiny):
    name, path, model = tiny
    lm = load(path, kv_cache_tokens=1024, tokenizer=False)
    prompts = _prompts(lm.source.config.vocab_size, seed=2)
    ours = greedy_generate(lm.executor, lm.block_size, prompts, max_tokens=32)
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert got == ref, f"{name}: greedy tokens differ for a {len(p)}-token prompt"
