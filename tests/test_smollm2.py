"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers on the same file."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.loader import load
from kiln.runtime.worker.generate import greedy_generate

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hf_model(hf_smollm2_tokenizer, hf_smollm2_model):
    return hf_smollm2_tokenizer, hf_smollm2_model


@pytest.fixture(scope="module")
def kiln_model(smollm2_gguf):
    return load(smollm2_gguf, kv_cache_tokens=2048)


def test_greedy_continuation_matches_transformers(hf_model, kiln_model):
    tok, model = hf_model
    ids = kiln_model.tokenizer.encode(PROMPT)
    assert ids == tok(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids):].tolist()
    got = greedy_generate(kiln_model.executor, kiln_model.block_size, [ids], 20,
                          kiln_model.tokenizer.eos_token_ids)[0]
    assert got == ref
    assert kiln_model.tokenizer.decode(got).startswith(" Paris")


def test_prefill_logits_match_transformers(hf_model, kiln_model):
    tok, model = hf_model
    ids = kiln_model.tokenizer.encode("Hello! How are you doing today? I hope the weather is nice.")
    steps: list = []
    greedy_generate(kiln_model.executor, kiln_model.block_size, [ids], 1, logits_out=steps)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].numpy()
    rel = np.abs(steps[0][0] - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel


def test_generate_cli_default_model():
    """`build.py generate` with no --model uses the packaged SmolLM2 and says Paris."""
    proc = subprocess.run([sys.executable, str(REPO / "build.py"), "generate", "--prompt", PROMPT,
                           "--max-tokens", "4"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(PROMPT + " Paris")
