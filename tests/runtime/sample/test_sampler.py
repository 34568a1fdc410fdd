"""Sampler: each step of vLLM's pipeline against an independent float64 formula."""
import numpy as np
import pytest

from kiln.runtime.sample.sampler import Sampler
from kiln.runtime.sample.metadata import SamplingMetadata
from kiln.runtime.sample.sampling_params import SamplingParams

V = 40


def metadata(params, prompts=None, outputs=None, generators=None, **kw):
    B = len(params)
    return SamplingMetadata.from_requests(
        params, prompts or [[0]] * B, outputs or [[]] * B, vocab_size=kw.pop("vocab_size", V),
        generators=generators if generators is not None else [p.new_generator() for p in params], **kw)


def random_logits(seed, rows=1, vocab=V, scale=2.0):
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def draw(logits_row, params, n=20000, seed=0):
    """n samples of one request's token (n identical rows, shared noise generator)."""
    out = Sampler(seed).sample(np.repeat(logits_row[None], n, axis=0), metadata([params] * n))
    return out.sampled_token_ids


def check_distribution(samples, expected, tv_bound=0.02):
    support = np.flatnonzero(expected > 0)
    assert set(np.unique(samples)) <= set(support.tolist()), "a sample fell outside the allowed set"
    empirical = np.bincount(samples, minlength=len(expected)) / len(samples)
    tv = 0.5 * np.abs(empirical - expected).sum()
    assert tv < tv_bound, f"total variation {tv:.4f} from the renormalised distribution"


def renormalised(logits_row, allowed, temperature=1.0):
    p = softmax64(np.asarray(logits_row, np.float64) / temperature)
    p[~allowed] = 0
    return p / p.sum()


# --- greedy and seeds ---------------------------------------------------------------

def test_greedy_is_argmax_in_a_mixed_batch():
    logits = random_logits(1, rows=4)
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(temperature=0, seed=3),
              SamplingParams(seed=9, top_k=3)]
    out = Sampler(0).sample(logits, metadata(params)).sampled_token_ids
    assert out.dtype == np.int32 and out.shape == (4,)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    all_greedy = [SamplingParams(temperature=0)] * 4
    assert (Sampler().sample(logits, metadata(all_greedy)).sampled_token_ids == logits.argmax(1)).all()


def run_steps(batch_params, target, steps=8, sampler_seed=0):
    """Tokens of batch row `target` over several steps; each row's logits depend only on (row params, step)."""
    gens = [p.new_generator() for p in batch_params]
    sampler = Sampler(sampler_seed)
    tokens = []
    for step in range(steps):
        rows = [random_logits(1000 * step + (p.seed or 0) + 7 * i, scale=1.0)[0] if i != target
                else random_logits(step, scale=1.0)[0] for i, p in enumerate(batch_params)]
        out = sampler.sample(np.stack(rows), metadata(batch_params, generators=gens))
        tokens.append(int(out.sampled_token_ids[target]))
    return tokens


def test_seeded_request_reproduces_alone_and_in_any_batch():
    a = SamplingParams(seed=1234, temperature=0.9, top_k=20)
    alone = run_steps([a], 0)
    assert alone == run_steps([a], 0, sampler_seed=99)  # the sampler's own generator plays no part
    batch = [SamplingParams(), SamplingParams(temperature=0), a, SamplingParams(seed=7, top_p=0.8)]
    assert alone == run_steps(batch, 2)
    assert alone == run_steps([batch[3], a, batch[0]], 1, sampler_seed=5)
    other = run_steps([SamplingParams(seed=4321, temperature=0.9, top_k=20)], 0)
    assert other != alone


def test_seeded_request_needs_its_generator():
    with pytest.raises(ValueError, match="generator"):
        SamplingMetadata.from_requests([SamplingParams(seed=1)], [[0]], [[]], V)


# --- truncation: support and distribution -------------------------------------------------

def test_temperature_distribution():
    row = random_logits(2)[0]
    check_distribution(draw(row, SamplingParams(temperature=0.7)), renormalised(row, np.ones(V, bool), 0.7))


def test_top_k_support_and_distribution():
    row = random_logits(3)[0]
    k = 7
    allowed = row >= np.sort(row)[-k]
    assert allowed.sum() == k
    check_distribution(draw(row, SamplingParams(top_k=k, temperature=1.3)), renormalised(row, allowed, 1.3))


def top_p_cut(probs_desc_cum, j):
    """A p strictly between the cumulative mass of the top j and top j+1 tokens."""
    return float((probs_desc_cum[j - 1] + probs_desc_cum[j]) / 2) if j > 0 else float(probs_desc_cum[0] / 2)


@pytest.mark.parametrize("j", [0, 3, 11])
def test_top_p_support_and_distribution(j):
    row = random_logits(4)[0]
    order = np.argsort(-row.astype(np.float64))
    cum = np.cumsum(softmax64(row)[order])
    p = top_p_cut(cum, j)
    allowed = np.zeros(V, bool)
    allowed[order[: j + 1]] = True  # the smallest set of top tokens with mass >= p
    check_distribution(draw(row, SamplingParams(top_p=p)), renormalised(row, allowed))


def test_top_k_then_top_p_renormalises_after_top_k():
    row = random_logits(5)[0]
    k, j = 10, 4
    order = np.argsort(-row.astype(np.float64))
    p_topk = softmax64(row[order[:k]])  # top-p sees the distribution left by top-k
    p = top_p_cut(np.cumsum(p_topk), j)
    allowed = np.zeros(V, bool)
    allowed[order[: j + 1]] = True
    check_distribution(draw(row, SamplingParams(top_k=k, top_p=p)), renormalised(row, allowed))


def test_min_p_support_and_distribution():
    row = random_logits(6)[0]
    t = 0.8
    probs = softmax64(row / t)
    ratios = np.sort(probs / probs.max())[::-1]
    min_p = float((ratios[5] + ratios[6]) / 2)  # keeps exactly 6 tokens after temperature
    allowed = probs >= min_p * probs.max()
    assert allowed.sum() == 6
    check_distribution(draw(row, SamplingParams(min_p=min_p, temperature=t)), renormalised(row, allowed, t))


def test_all_truncations_together_never_leave_support():
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((64, V)) * 3).astype(np.float32)
    params = [SamplingParams(top_k=int(rng.integers(1, V)), top_p=float(rng.uniform(0.05, 1)),
                             min_p=float(rng.uniform(0, 0.5)), temperature=float(rng.uniform(0.3, 1.5)),
                             seed=i) for i in range(64)]
    for _ in range(20):
        out = Sampler(1).sample(logits, metadata(params)).sampled_token_ids
        for i, p in enumerate(params):
            x = logits[i].astype(np.float64) / np.float32(p.temperature)
            keep = x >= np.sort(x)[-p.top_k]
            probs = softmax64(np.where(keep, x, -np.inf))
            order = np.argsort(-probs)
            mass_before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
            keep_p = np.zeros(V, bool)
            keep_p[order[mass_before < p.top_p + 1e-5]] = True  # tolerance: float32 cumsum
            pm = softmax64(x)
            keep_m = pm >= p.min_p * pm.max() * (1 - 1e-5)
            assert keep[out[i]] and keep_p[out[i]] and keep_m[out[i]], (i, p)


# --- logits processors and penalties ------------------------------------------------------

def test_penalties_match_vllm_formula():
    raw = random_logits(8, rows=2, scale=3.0)
    prompt, output = [1, 2, 2, 5, 30], [2, 3, 3, 3, 7, 30]
    rep, freq, pres = 1.3, 0.4, 0.6
    params = [SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
              SamplingParams()]
    md = metadata(params, prompts=[prompt, prompt], outputs=[output, output])
    got = Sampler.apply_logits_processors(raw, md)

    expected = raw[0].astype(np.float64).copy()
    for t in range(V):
        if t in prompt or t in output:
            expected[t] = expected[t] / rep if expected[t] > 0 else expected[t] * rep
        n = output.count(t)
        expected[t] -= freq * n + pres * (n > 0)
    np.testing.assert_allclose(got[0], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[1], raw[1])  # a request without penalties is untouched
    # greedy follows the penalised logits
    greedy = [SamplingParams(temperature=0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)]
    tok = Sampler().sample(raw[:1], metadata(greedy, prompts=[prompt], outputs=[output])).sampled_token_ids[0]
    assert tok == expected.argmax()


def test_logit_bias_adds_exactly():
    raw = random_logits(9, rows=2)
    bias = {3: 5.0, 17: -100.0, 39: 0.25}
    got = Sampler.apply_logits_processors(raw, metadata([SamplingParams(logit_bias=bias), SamplingParams()]))
    expected = raw[0].copy()
    for t, b in bias.items():
        expected[t] += np.float32(b)
    np.testing.assert_array_equal(got[0], expected)
    np.testing.assert_array_equal(got[1], raw[1])
    tok = Sampler().sample(raw[:1], metadata([SamplingParams(temperature=0, logit_bias={11: 50.0})]))
    assert tok.sampled_token_ids[0] == 11


def test_allowed_token_ids():
    raw = random_logits(10, rows=2)
    allowed = [4, 9, 25]
    p = SamplingParams(allowed_token_ids=allowed)
    got = Sampler.apply_logits_processors(raw, metadata([p, SamplingParams()]))
    assert np.isneginf(np.delete(got[0], allowed)).all()
    np.testing.assert_array_equal(got[0, allowed], raw[0, allowed])
    np.testing.assert_array_equal(got[1], raw[1])
    samples = draw(raw[0], p, n=2000)
    assert set(samples.tolist()) <= set(allowed)
    greedy = Sampler().sample(raw[:1], metadata([SamplingParams(temperature=0, allowed_token_ids=allowed)]))
    assert greedy.sampled_token_ids[0] == allowed[int(np.argmax(raw[0, allowed]))]


def test_bad_words_mask_the_completing_token():
    raw = random_logits(11, rows=3)
    words = ((5,), (7, 8), (1, 2, 3))  # one-token words are always banned
    params = [SamplingParams(bad_words=["x"])] * 3
    outputs = [[9, 7], [1, 2], [4, 2]]
    md = metadata(params, outputs=outputs, bad_words_token_ids=[words] * 3)
    got = Sampler.apply_logits_processors(raw, md)
    banned = [{5, 8}, {5, 3}, {5}]
    for i in range(3):
        for t in range(V):
            assert np.isneginf(got[i, t]) == (t in banned[i]), (i, t)
    with pytest.raises(ValueError, match="bad_words"):
        metadata(params[:1])  # tokenized bad words are required


def test_min_tokens_masks_eos_and_stop_tokens():
    raw = random_logits(12, rows=3)
    eos = 2
    params = [SamplingParams(min_tokens=3, stop_token_ids=[6]),
              SamplingParams(min_tokens=3, stop_token_ids=[6]),
              SamplingParams(min_tokens=3, ignore_eos=True)]
    outputs = [[1, 1], [1, 1, 1], []]  # row 1 already has min_tokens
    got = Sampler.apply_logits_processors(raw, metadata(params, outputs=outputs, eos_token_ids=[eos]))
    assert np.isneginf(got[0, [eos, 6]]).all()
    np.testing.assert_array_equal(got[1], raw[1])
    assert np.isneginf(got[2, eos])  # vLLM masks EOS for min_tokens even with ignore_eos
    raw[0, eos] = 100.0
    out = Sampler().sample(raw[:1], metadata([SamplingParams(temperature=0, min_tokens=1)], eos_token_ids=[eos]))
    assert out.sampled_token_ids[0] != eos


# --- logprobs ------------------------------------------------------------------------------

def log_softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_logprobs_are_raw_log_softmax_with_ranks():
    raw = random_logits(13, rows=3)
    raw[1, [3, 8, 20]] = raw[1].max() + 1.0  # a three-way tie at the top
    params = [SamplingParams(logprobs=5, repetition_penalty=1.5, temperature=0.5),
              SamplingParams(logprobs=2, seed=1, logit_bias={0: 30.0}),
              SamplingParams(temperature=0)]
    out = Sampler(0).sample(raw, metadata(params, prompts=[[1, 2]] * 3, outputs=[[4]] * 3))
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == lp.ranks.shape == (3, 6)  # sampled + max(5, 2)
    ref = log_softmax64(raw)  # from the raw logits: no penalty, bias or temperature
    for i in range(3):
        tok = out.sampled_token_ids[i]
        assert lp.token_ids[i, 0] == tok
        np.testing.assert_allclose(lp.logprobs[i, 0], ref[i, tok], atol=1e-5)
        assert lp.ranks[i, 0] == 1 + (ref[i] > ref[i, tok] + 1e-9).sum()
        np.testing.assert_allclose(lp.logprobs[i, 1:], ref[i, lp.token_ids[i, 1:]], atol=1e-5)
        assert (np.diff(lp.logprobs[i, 1:]) <= 0).all()
        np.testing.assert_allclose(lp.logprobs[i, 1:], np.sort(ref[i])[::-1][:5], atol=1e-5)
        for j in range(1, 6):
            assert lp.ranks[i, j] == 1 + (ref[i] > ref[i, lp.token_ids[i, j]] + 1e-9).sum()
    assert list(lp.token_ids[1, 1:4]) == [3, 8, 20] and list(lp.ranks[1, 1:5]) == [1, 1, 1, 4]
    assert out.sampled_logprobs is not None and out.sampled_ranks[2] == 1


def test_logprobs_zero_and_all():
    raw = random_logits(14, rows=2)
    out = Sampler().sample(raw, metadata([SamplingParams(logprobs=0, temperature=0), SamplingParams()]))
    assert out.logprobs.token_ids.shape == (2, 1)
    out = Sampler().sample(raw, metadata([SamplingParams(logprobs=-1), SamplingParams()]))
    assert out.logprobs.token_ids.shape == (2, V + 1)
    assert sorted(out.logprobs.token_ids[0, 1:].tolist()) == list(range(V))
    assert Sampler().sample(raw, metadata([SamplingParams()] * 2)).logprobs is None


def test_input_logits_are_not_modified():
    raw = random_logits(15, rows=2)
    keep = raw.copy()
    Sampler().sample(raw, metadata([SamplingParams(top_k=3, logit_bias={1: 2.0}, repetition_penalty=2.0),
                                    SamplingParams(top_p=0.5, min_p=0.1)]))
    np.testing.assert_array_equal(raw, keep)


def test_top_k_only_with_a_different_k_per_row():
    logits = random_logits(16, rows=5)
    ks = [1, 3, 8, 0, 39]
    params = [SamplingParams(top_k=k, seed=i) for i, k in enumerate(ks)]
    gens = [p.new_generator() for p in params]
    seen = [set() for _ in ks]
    for _ in range(300):
        out = Sampler().sample(logits, metadata(params, generators=gens)).sampled_token_ids
        for i, tok in enumerate(out):
            seen[i].add(int(tok))
    for i, k in enumerate(ks):
        allowed = set(np.argsort(-logits[i])[: k or V].tolist())
        assert seen[i] <= allowed
        if k and k <= 8:
            assert seen[i] == allowed  # 300 draws reach every one of a few allowed tokens


def test_rank_of_a_tied_sampled_token_counts_only_strictly_greater():
    raw = random_logits(17, rows=1)
    raw[0, [5, 9]] = raw[0].max() + 2.0
    out = Sampler().sample(raw, metadata([SamplingParams(temperature=0, logprobs=1)]))
    assert out.sampled_token_ids[0] in (5, 9)
    assert out.logprobs.ranks[0, 0] == 1
