"""The compiled sampler (runtime/cpu/sample_kernels.py) against the numpy sampler, its oracle:
on fresh random logits (ties, top-p near 0 and 1, top-k 1 and beyond the vocabulary, min-p,
mixed per-row settings, seeded and unseeded rows, greedy rows between them) the tokens and the
logprobs are the numpy sampler's, and SmolLM2 through kiln.LLM samples the same text with either.
The seed of each random case is printed on failure (a fresh one every run)."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.cpu.sample_kernels import CompiledSampler, pairwise_sum
from kiln.runtime.sample import ops
from kiln.runtime.sample.metadata import SamplingMetadata
from kiln.runtime.sample.sampler import Sampler
from kiln.runtime.sample.sampling_params import SamplingParams
from kiln.runtime.worker.compiled_cpu_executor import ThreadChooser


@pytest.fixture(scope="module")
def compiled():
    cs = CompiledSampler()
    cs.warm_up()
    return cs


def random_logits(rng, B, V):
    """Rows of several kinds: plain normal, rounded (ties everywhere), a tie at the top, a wide
    spread (probabilities that underflow), a narrow one (a flat distribution)."""
    x = (rng.standard_normal((B, V)) * rng.uniform(0.3, 6.0, (B, 1))).astype(np.float32)
    for b in range(B):
        kind = rng.integers(5)
        if kind == 1:
            x[b] = np.round(x[b])
        elif kind == 2:
            x[b, rng.choice(V, min(V, 4), replace=False)] = x[b].max() + 1.0
        elif kind == 3:
            x[b] *= 40.0
        elif kind == 4:
            x[b] *= 0.01
    return x


def random_params(rng, V, n):
    """Per-row settings, each of temperature / top-k / top-p / min-p on or off at random, with
    the edges: top-k 1 and above V, top-p near 0 and near 1; about half the rows seeded."""
    out = []
    for _ in range(n):
        kw = {"temperature": float(rng.choice([0.0, rng.uniform(0.1, 2.0)], p=[0.15, 0.85]))}
        if rng.random() < 0.5:
            kw["top_k"] = int(rng.choice([1, 2, int(rng.integers(1, V + 1)), V + 7]))
        if rng.random() < 0.6:
            kw["top_p"] = float(rng.choice([1e-6, 0.01, rng.uniform(0.05, 1.0), 0.999999, 1.0]))
        if rng.random() < 0.3:
            kw["min_p"] = float(rng.uniform(0.0, 0.5))
        if rng.random() < 0.5:
            kw["seed"] = int(rng.integers(1 << 31))
        out.append(SamplingParams(**kw))
    return out


def metadata(params, V, **kw):
    n = len(params)
    return SamplingMetadata.from_requests(params, [[1, 2]] * n, [[]] * n, V,
                                          generators=[p.new_generator() for p in params], **kw)


@pytest.mark.parametrize("V", [97, 1000, 49152])
def test_tokens_equal_the_numpy_sampler(compiled, V):
    """Whole Sampler steps, compiled and numpy, from the same seeds: the same tokens, step after
    step (the seeded rows' generators and the sampler's own generator advance alike)."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    for case in range(6 if V > 10000 else 25):
        B = int(rng.integers(1, 9))
        params = random_params(rng, V, B)
        logits = random_logits(rng, B, V)
        a, b = Sampler(case, compiled=compiled), Sampler(case)
        md_a, md_b = metadata(params, V), metadata(params, V)
        for step in range(3):
            got = a.sample(logits, md_a).sampled_token_ids
            want = b.sample(logits, md_b).sampled_token_ids
            assert np.array_equal(got, want), (seed, case, step, params)
            logits = random_logits(rng, B, V)


def test_kernels_on_every_row_equal_numpy_steps(compiled):
    """The kernels on every row, those without top-k / top-p included (the Sampler sends those to
    numpy), against ops.sample_rows with the same noise, at V below and above 128 (the pairwise
    sum's block) and the ones in between."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    for V in (5, 8, 129, 300, 1025, 8193, 49152):
        for case in range(4):
            B = int(rng.integers(1, 9))
            x = random_logits(rng, B, V)
            T = rng.uniform(0.2, 2.0, B).astype(np.float32)
            mp = np.where(rng.random(B) < 0.4, rng.uniform(0, 0.4, B), 0).astype(np.float32)
            k = np.where(rng.random(B) < 0.5, rng.integers(1, V + 1, B), V)
            p = np.where(rng.random(B) < 0.5, rng.choice([1e-6, 0.3, 0.9, 0.999999], B), 1).astype(np.float32)
            q = ops.draw_noise(B, V, {}, rng)
            args = (mp if (mp > 0).any() else None, k if (k < V).any() else None, p if (p < 1).any() else None)
            want = ops.sample_rows(x / T[:, None], *args, q)
            for threads in (1, 2):
                got = compiled.sample(x, np.arange(B), T, *args, q, threads=threads, every_row=True)
                assert np.array_equal(got, want), (seed, V, case, threads)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's NaN arithmetic on the NaN row
def test_rows_of_a_larger_batch_and_bad_rows(compiled):
    """The random rows picked out of a batch (greedy ones between them), a row with a NaN and one
    with no finite logit (both left to numpy), logprobs asked for: equal to the numpy sampler's."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    V = 2000
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(top_p=0.8, seed=3, logprobs=5),
              SamplingParams(top_k=40, temperature=0.7), SamplingParams(temperature=0.0),
              SamplingParams(top_k=1, top_p=0.5), SamplingParams(top_p=0.9, min_p=0.05, seed=11),
              SamplingParams(top_k=3)]
    logits = random_logits(rng, len(params), V)
    logits[5, 17] = np.nan
    logits[6] = -np.inf
    a = Sampler(7, compiled=compiled).sample(logits, metadata(params, V))
    b = Sampler(7).sample(logits, metadata(params, V))
    assert np.array_equal(a.sampled_token_ids, b.sampled_token_ids), seed
    # as the compiled executor makes it: a ThreadChooser of its own, probing the other count
    chosen, ref = Sampler(8, compiled=CompiledSampler(chooser=ThreadChooser(2))), Sampler(8)
    md_c, md_r = metadata(params, V), metadata(params, V)
    for step in range(20):
        assert np.array_equal(chosen.sample(logits, md_c).sampled_token_ids,
                              ref.sample(logits, md_r).sampled_token_ids), (seed, step)
    for name in ("token_ids", "logprobs", "ranks"):  # (the NaN row's logprobs are NaN in both)
        assert np.array_equal(getattr(a.logprobs, name), getattr(b.logprobs, name), equal_nan=name == "logprobs"), \
            (seed, name)


def test_noise_is_the_numpy_draws(compiled):
    """CompiledSampler.draw_noise = ops.draw_noise: the same values from the same generators (the
    shared one for unseeded rows, row order; each seeded row's own), step after step, the two
    interleaved on the same generators (a request may move between the paths)."""
    seed = np.random.SeedSequence().entropy
    for V in (1, 7, 97, 49152):
        g1, g2 = np.random.default_rng(seed), np.random.default_rng(seed)
        own1 = {1: np.random.default_rng(5), 4: np.random.default_rng(6)}
        own2 = {1: np.random.default_rng(5), 4: np.random.default_rng(6)}
        for step in range(3):
            want = ops.draw_noise(6, V, own1, g1)
            got = compiled.draw_noise(6, V, own2, g2)
            assert np.array_equal(got, want), (seed, V, step)
            g1, g2, own1, own2 = g2, g1, own2, own1  # the other path draws next


def test_pairwise_sum_is_numpys_row_sum():
    """The race's and min-p's normaliser: numpy's float32 row sum, bit for bit (what makes the
    compiled probabilities the numpy ones)."""
    rng = np.random.default_rng()
    for V in (1, 7, 8, 9, 128, 129, 1000, 8192, 8193, 49152, 151936):
        x = np.exp((rng.standard_normal((3, V)) * 4).astype(np.float32))
        x[0, rng.random(V) < 0.5] = 0.0  # masked tokens
        want = x.sum(axis=-1)
        assert [pairwise_sum(x[j], 0, V) for j in range(3)] == list(want), V


def test_top_p_cut_by_value_keeps_ties_and_the_top_token():
    """The oracle's rule (ops.apply_top_k_top_p), which the kernels reproduce: tokens tied with the
    least kept value stay, the top token stays at any p, p = 1 cuts nothing."""
    row = np.log(np.array([[0.4, 0.2, 0.2, 0.1, 0.1]], np.float32))
    kept = lambda p: np.isfinite(ops.apply_top_k_top_p(row.copy(), None, np.array([p], np.float32)))[0]  # noqa
    assert kept(0.5).tolist() == [True, True, True, False, False]  # 0.4 + both 0.2s (a tie)
    assert kept(0.3).tolist() == [True, False, False, False, False]
    assert kept(1e-6).tolist() == [True, False, False, False, False]
    assert kept(1.0).all()


def test_smollm2_seeded_sampling_same_text(smollm2_gguf):
    """SmolLM2 through kiln.LLM on the compiled target: seeded and unseeded requests with top-k,
    top-p and min-p in one batch give the same text with the compiled sampler as with the numpy
    one (same executor, so the same logits; the sampler's generator reset between the runs)."""
    from kiln import LLM

    llm = LLM(smollm2_gguf, kv_cache_tokens=2048, enable_prefix_caching=False, seed=0)
    sampler = llm.engine.core.runner.sampler
    assert sampler.compiled is not None  # the compiled target's default
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors"]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24),
              SamplingParams(temperature=1.0, top_k=40, seed=2, max_tokens=24),
              SamplingParams(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02, max_tokens=24),
              SamplingParams(temperature=1.2, top_p=0.5, seed=4, max_tokens=24)]
    compiled_sampler = sampler.compiled
    texts = []
    for comp in (compiled_sampler, None):
        sampler.compiled = comp
        sampler._rng = np.random.default_rng(0)
        texts.append([o.outputs[0].text for o in llm.generate(prompts, params)])
    sampler.compiled = compiled_sampler
    assert texts[0] == texts[1]
    assert all(len(t) > 0 for t in texts[0])


def test_smollm2_seeded_sampling_same_text_on_both_backends(monkeypatch, smollm2_gguf):
    """End to end: SmolLM2 through kiln.LLM with KILN_CPU_BACKEND=compiled (compiled executor and
    sampler) and =numpy (the numpy executor and sampler): seeded requests with top-p, top-k and
    min-p sample the same text. (The executors' logits differ by float rounding, as in the greedy
    parity tests: a token at a near-tie could differ there; these requests' do not.)"""
    from kiln import LLM

    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors"]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24),
              SamplingParams(temperature=1.0, top_k=40, seed=2, max_tokens=24),
              SamplingParams(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02, seed=3, max_tokens=24),
              SamplingParams(temperature=1.2, top_p=0.5, seed=4, max_tokens=24)]
    texts = {}
    for backend in ("compiled", "numpy"):
        monkeypatch.setenv("KILN_CPU_BACKEND", backend)
        llm = LLM(smollm2_gguf, kv_cache_tokens=2048, enable_prefix_caching=False)
        assert (llm.engine.core.runner.sampler.compiled is not None) == (backend == "compiled")
        texts[backend] = [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert texts["compiled"] == texts["numpy"]
