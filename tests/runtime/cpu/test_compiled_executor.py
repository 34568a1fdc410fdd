"""The compiled CPU executor end to end: `load` picks it by default, keeps a GGUF's weights in
their blocks, and gives the numpy executor's logits (the oracle) on prefill (BLAS path) and
decode (GEMV path) steps of real and tiny models; KILN_CPU_BACKEND and fallbacks say what they do.
The parity and engine tests elsewhere (tests/test_models.py, tests/test_smollm2.py,
tests/runtime/engine/test_engine.py) run on this executor because it is the default."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from kiln.errors import ConfigError
from kiln.loader import build_graph, load
from kiln.runtime.cpu.linear import GEMM_MIN_TOKENS
from kiln.runtime.cpu.plan import ATTENTION_BLAS_ROWS
from kiln.runtime.worker.compiled_cpu_executor import CompiledCpuExecutor
from kiln.runtime.worker.cpu_executor import CpuExecutor
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.tiny_models import make_tiny_model


def steps(vocab: int, seed: int):
    """A mixed first step (three prompts, one long enough for the BLAS linears and the BLAS
    attention of plan.ATTENTION_BLAS_ROWS, the others through the attention kernel), then decodes."""
    rng = np.random.default_rng(seed)
    n0 = max(GEMM_MIN_TOKENS, ATTENTION_BLAS_ROWS) + 9
    prompts = [rng.integers(0, vocab, n).tolist() for n in (n0, 3, 1)]
    nb = -(-(n0 + 3) // 16)
    blocks = [list(range(nb)), [nb], [nb + 1]]
    yield prepare_step([SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)], 16)
    for i in range(2):
        toks = rng.integers(0, vocab, 3).tolist()
        yield prepare_step([SeqChunk([t], len(p) + i, b) for t, p, b in zip(toks, prompts, blocks)], 16)
    for i in range(1):  # one sequence alone
        yield prepare_step([SeqChunk([int(rng.integers(vocab))], len(prompts[1]) + 3 + i, blocks[1])], 16)


def agree(lm, tol, exact_argmax=True):
    """Logits within tol (relative to the range) of the numpy executor's on every step. The argmax
    agrees on every row (exact_argmax), or, for an executor that rounds differently by design, on
    every row whose reference margin between its first and second logit exceeds twice that row's
    largest difference (a flip there would be a real error, not a near tie moved by the rounding).
    -> the largest relative difference seen."""
    ref = CpuExecutor(lm.graph, lm.source.weights.get, num_blocks=lm.executor.num_blocks)
    worst = 0.0
    for st in steps(lm.source.config.vocab_size, 5):
        got = next(iter(lm.executor.execute(st).values()))
        want = next(iter(ref.execute(st).values()))
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < tol, err
        worst = max(worst, float(err))
        if exact_argmax:
            assert (got.argmax(-1) == want.argmax(-1)).all()
        else:
            top2 = np.sort(want, axis=-1)[:, -2:]
            clear = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(got - want).max(-1)
            assert (got.argmax(-1) == want.argmax(-1))[clear].all()
    return worst


@pytest.mark.parametrize("variant", ["llama_llama3_rope", "qwen3_qknorm"])
def test_tiny_models_match_numpy(tmp_path, variant):
    """attention bias + llama3 rope; Qwen3's q/k norms through attention_preamble"""
    make_tiny_model(tmp_path, variant)
    lm = load(tmp_path, kv_cache_tokens=256, tokenizer=False)
    assert isinstance(lm.executor, CompiledCpuExecutor)
    agree(lm, 1e-5)


def test_bf16_checkpoint_keeps_its_bf16_weights(tmp_path):
    """A bf16 safetensors checkpoint's linears stay bf16 in memory (half the bytes of f32 tiles),
    widened exactly in the kernels: the numpy executor's logits on the same weights."""
    import torch

    make_tiny_model(tmp_path, "qwen3_qknorm", dtype=torch.bfloat16)
    lm = load(tmp_path, kv_cache_tokens=256, tokenizer=False)
    assert isinstance(lm.executor, CompiledCpuExecutor)
    kinds = {getattr(w, "kind", None) for w in lm.executor.weights.values()}
    assert "bf16" in kinds and "f32" not in kinds, kinds
    agree(lm, 1e-5)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load(smollm2_gguf, kv_cache_tokens=256, tokenizer=False)


def test_smollm2_runs_in_its_q4_1_blocks(smollm2):
    ex = smollm2.executor
    assert isinstance(ex, CompiledCpuExecutor)
    kinds = {w.source for w in ex.weights.values() if hasattr(w, "source")}
    assert kinds == {"Q4_1", "Q8_0"}  # the file's own types: nothing dequantised at load
    assert ex.weight_bytes < 130e6  # ~540 MB as f32


def test_smollm2_matches_numpy(smollm2):
    agree(smollm2, 1e-4)


def test_smollm2_with_q8_1_activations(monkeypatch, smollm2_gguf):
    """KILN_CPU_ACT_QUANT=q8_1 (llama.cpp's rounding of Q4 linears' activations; its kernels
    against their reference: test_packed_weights.py) moves SmolLM2's logits by a few percent of
    their range from the f32 reference (3.3e-2 on the prefill in tests/test_smollm2.py), so near
    ties among these random-token steps may flip (CI saw one: 277 for 282); clear winners keep
    their argmax, and the rounding is really applied; an unknown value is refused."""
    monkeypatch.setenv("KILN_CPU_ACT_QUANT", "q8_1")
    lm = load(smollm2_gguf, kv_cache_tokens=256, tokenizer=False)
    assert lm.executor.act_quant == "q8_1"
    assert agree(lm, 0.1, exact_argmax=False) > 1e-4
    monkeypatch.setenv("KILN_CPU_ACT_QUANT", "q4")
    with pytest.raises(ConfigError, match="KILN_CPU_ACT_QUANT"):
        load(smollm2_gguf, kv_cache_tokens=256, tokenizer=False)


def test_backend_switch_and_fallback(monkeypatch, tmp_path, caplog):
    make_tiny_model(tmp_path, "llama_gqa_untied")
    monkeypatch.setenv("KILN_CPU_BACKEND", "numpy")
    assert type(load(tmp_path, kv_cache_tokens=64, tokenizer=False).executor) is CpuExecutor
    monkeypatch.setenv("KILN_CPU_BACKEND", "fast")
    with pytest.raises(ConfigError, match="KILN_CPU_BACKEND"):
        load(tmp_path, kv_cache_tokens=64, tokenizer=False)
    monkeypatch.setenv("KILN_CPU_BACKEND", "compiled")
    monkeypatch.setenv("KILN_CPU_THREADS", "0")
    with pytest.raises(ConfigError, match="KILN_CPU_THREADS"):
        load(tmp_path, kv_cache_tokens=64, tokenizer=False)
    monkeypatch.delenv("KILN_CPU_THREADS")
    # an fp8 KV cache has no compiled kernel: numpy runs it, and says so once
    with caplog.at_level(logging.WARNING, logger="kiln.loader"):
        for _ in range(2):
            lm = load(tmp_path, kv_cache_tokens=64, tokenizer=False, kv_cache_dtype="fp8")
            assert type(lm.executor) is CpuExecutor
    said = [r.getMessage() for r in caplog.records if "numpy CPU target" in r.getMessage()]
    assert len(said) <= 1 and all("fp8" in m or "f32" in m for m in said)


def test_refused_graph_names_why():
    from kiln.models.config import ModelConfig
    from kiln.runtime.cpu.plan import NotCompilable, check_graph
    from tests.tiny_models import BASE

    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    check_graph(build_graph(cfg, target="cpu"))
    with pytest.raises(NotCompilable, match="f32"):
        check_graph(build_graph(cfg, target="cpu", kv_cache_dtype="fp8"))


def test_thread_chooser_keeps_the_faster_count_and_keeps_probing():
    from kiln.runtime.worker.compiled_cpu_executor import ThreadChooser

    for fast in (1, 2):
        ch = ThreadChooser(2, probe_every=8, load=lambda: 0.0)
        picks = []
        for _ in range(64):
            k = ch.pick()
            picks.append(k)
            ch.record(k, 1.0 if k == fast else 3.0)
        assert picks[:2] == [2, 1]  # both measured first
        slow = [i for i, k in enumerate(picks[2:], start=3) if k != fast]
        assert slow == [8, 24, 56]  # only the probes, each one that loses doubling the gap
    assert ThreadChooser(1).pick() == 1


def test_thread_chooser_follows_a_change_of_load():
    """Two threads fast, then 20x slower (other processes took the cores), then fast again: the
    chooser moves to one thread after one slow step, probes two rarely (gap bounded by max_gap),
    and is back on two threads within one probe of the load going away."""
    from kiln.runtime.worker.compiled_cpu_executor import ThreadChooser

    ch = ThreadChooser(2, probe_every=8, max_gap=64, load=lambda: 0.0)
    cost = {1: 2.0, 2: 1.0}
    picks = []
    for step in range(600):
        if step == 100:
            cost[2] = 40.0
        if step == 400:
            cost[2] = 1.0
        k = ch.pick()
        picks.append(k)
        ch.record(k, cost[k])
    loaded = picks[101:400]
    assert loaded.count(2) <= 2 + 300 // 64 + 1 and loaded[-50:].count(1) >= 49
    back = picks.index(2, 400)
    assert back - 400 <= 64 and picks[back + 1:].count(1) <= (600 - back) // 8 + 1


def test_thread_chooser_keeps_one_thread_while_the_cores_are_busy():
    """Load average above the core count: start on one thread and probe all cores only once
    the load has gone (then, two threads being faster, run them)."""
    from kiln.runtime.worker.compiled_cpu_executor import ThreadChooser

    load = [6.0]
    ch = ThreadChooser(2, probe_every=8, load=lambda: load[0])
    picks = []
    for step in range(200):
        if step == 100:
            load[0] = 0.5
        k = ch.pick()
        picks.append(k)
        ch.record(k, 1.0 if k == 2 else 2.0)
    assert set(picks[:100]) == {1}
    assert picks[100:].index(2) <= 8 and picks[-50:].count(2) >= 45
