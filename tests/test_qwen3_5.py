"""Qwen3.5 / Qwen3.6 (Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM) and Qwen3-Next
hybrids on the CPU target against transformers on tiny random checkpoints: logits of every
step within 1e-4 relative (of transformers' float64 run) and 32 greedy tokens identical, for a batch of prompts some longer
than 130 tokens (three Gated DeltaNet chunks); and the bad inputs, one clear sentence each."""
from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.bench.make_random_model import write_tokenizer
from kiln.errors import ConfigError, InvalidModelError, KilnError
from kiln.loader import load
from kiln.runtime.worker.generate import greedy_generate
from tests.tiny_models import HYBRID_VARIANTS, make_tiny_hybrid

REPO = Path(__file__).resolve().parents[1]
LENGTHS = (5, 140, 70, 1, 131)


@pytest.fixture(scope="module", params=HYBRID_VARIANTS)
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, make_tiny_hybrid(d, request.param)


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in LENGTHS]


def f64_truth(model):
    """The checkpoint's float64 twin: the truth kiln's f32 logits are measured against. Against
    transformers' own f32 run the two engines' f32 errors add (on the MoE hybrids kiln 8.9e-5 and
    transformers 5.7e-5 of the largest logit, 1.4e-4 together, and the split moves with the CPU's
    BLAS), so f32 against f32 at 1e-4 measures the machine as much as kiln."""
    return copy.deepcopy(model).double().eval()


def assert_greedy_steps_match_transformers(name: str, lm, model, prompts) -> None:
    """kiln's 32 greedy tokens equal transformers' for each prompt, and every step's logits are
    within 1e-4 relative of transformers' float64 run (the plain greedy loop,
    runtime/worker/generate.py)."""
    steps: list[np.ndarray] = []
    ours = greedy_generate(lm.executor, lm.block_size, prompts, max_tokens=32, logits_out=steps)
    truth = f64_truth(model)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = truth.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        assert ours[i] == ref.sequences[0, len(p):].tolist(), f"{name}: greedy tokens differ ({len(p)}-token prompt)"
        for t, want in enumerate(ref.logits):
            got, want = steps[t][i].astype(np.float64), want[0].numpy()
            rel = np.abs(got - want).max() / np.abs(want).max()
            assert rel < 1e-4, f"{name} prompt {i} step {t}: max relative error {rel:.2e}"


def test_logits_and_greedy_tokens_match_transformers(tiny):
    name, path, model = tiny
    lm = load(path, tokenizer=False)
    prompts = _prompts(1)
    assert_greedy_steps_match_transformers(name, lm, model, prompts)


def test_prefill_logits_of_every_token(tiny):
    """All of a 140-token prompt's positions in one step (three chunks of the chunked form)."""
    name, path, model = tiny
    lm = load(path, tokenizer=False)
    from kiln.runtime.worker.input_batch import SeqChunk, prepare_step

    p = _prompts(3)[1]
    inputs = prepare_step([SeqChunk(p, 0, list(range(10)), all_logits=True, state_slot=0)], lm.block_size)
    got = next(iter(lm.executor.execute(inputs).values()))
    with torch.no_grad():
        want = f64_truth(model)(torch.tensor([p])).logits[0].numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_the_vision_tower_and_mtp_are_skipped_with_one_line(tmp_path, caplog):
    make_tiny_hybrid(tmp_path, "qwen3_5_conditional")
    with caplog.at_level(logging.INFO, logger="kiln.models"):
        lm = load(tmp_path, tokenizer=False)
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == 1 and "vision-tower" in lines[0]
    assert not any(n.startswith("model.visual") for n in lm.source.weights.names())
    assert lm.source.config.is_hybrid and lm.source.config.layer_types[3] == "full_attention"


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg.get("text_config", cfg))
    (path / "config.json").write_text(json.dumps(cfg))


def _generate(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "build.py"), "generate", "--model", str(path), "--prompt", "hi",
                           "--max-tokens", "2", *extra], capture_output=True, text=True, timeout=300)


def _one_sentence(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_a_config_missing_a_linear_field_is_one_sentence(tmp_path):
    make_tiny_hybrid(tmp_path, "qwen3_5_causal")
    _edit_config(tmp_path, lambda c: c.pop("linear_num_value_heads"))
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        load(tmp_path, tokenizer=False)
    _one_sentence(_generate(tmp_path), "linear_num_value_heads", "missing")


def test_an_unknown_layer_type_is_one_sentence(tmp_path):
    make_tiny_hybrid(tmp_path, "qwen3_5_conditional")
    _edit_config(tmp_path, lambda c: c["layer_types"].__setitem__(2, "sliding_attention"))
    with pytest.raises(ConfigError, match="'sliding_attention' is not one kiln knows"):
        load(tmp_path, tokenizer=False)
    _one_sentence(_generate(tmp_path), "sliding_attention")


def test_a_checkpoint_missing_a_gdn_weight_is_one_sentence(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_tiny_hybrid(tmp_path, "qwen3_next")
    f = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(f)
    del tensors["model.layers.1.linear_attn.A_log"]
    save_file(tensors, f, metadata={"format": "pt"})
    write_tokenizer(tmp_path, 256)  # build.py generate reads the tokenizer first
    with pytest.raises(InvalidModelError, match="model.layers.1.linear_attn.A_log"):
        load(tmp_path, tokenizer=False)
    _one_sentence(_generate(tmp_path), "A_log")


def test_a_moe_config_over_dense_weights_is_one_sentence(tmp_path):
    """Experts in the config but none in the files (MoE layers themselves: tests/test_moe_models.py)."""
    make_tiny_hybrid(tmp_path, "qwen3_next")
    _edit_config(tmp_path, lambda c: c.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=32))
    with pytest.raises(InvalidModelError, match="hold no experts for model.layers.0.mlp"):
        load(tmp_path, tokenizer=False)
    write_tokenizer(tmp_path, 256)
    _one_sentence(_generate(tmp_path), "no experts")


def test_a_hybrid_checkpoint_compiles_for_the_gpu(tmp_path):
    """`build.py compile --target sm_90` on a hybrid checkpoint: a bundle whose plans launch the
    Gated DeltaNet kernels (no GPU needed to compile)."""
    pytest.importorskip("triton")
    from kiln.loader import build_graph, compile_model, open_source

    make_tiny_hybrid(tmp_path / "m", "qwen3_5_conditional")
    source = open_source(tmp_path / "m")
    graph = build_graph(source.config, target="sm_90")
    bundle = compile_model(source, graph, target="sm_90", block_size=16, max_model_len=256, max_num_seqs=4,
                           max_num_batched_tokens=64, bundle_dir=tmp_path / "b")
    names = {m["name"] for m in bundle.manifest["kernels"].values()}
    assert {"causal_conv1d_kernel", "gdn_chunked_kernel", "gdn_recurrent_kernel", "gated_rms_norm_kernel",
            "sigmoid_mul_kernel"} <= names
    assert (tmp_path / "b" / "manifest.yaml").is_file()
