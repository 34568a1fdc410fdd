"""The GPU sampling kernels under the Triton interpreter against the numpy sampler
(runtime/sample/sampler.py, ops.py), on fresh random inputs. V is small and the
blocks smaller still, so every loop over the vocabulary runs several chunks."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton import sampling as K
from kiln.codegen.triton.configs import ElementwiseConfig
from kiln.runtime.sample import ops
from kiln.runtime.sample.sampler import Sampler, compute_logprobs, gather_logprobs
from kiln.runtime.sample.sampler_inputs import SamplerInputs, row_seeds
from kiln.runtime.sample.metadata import SamplingMetadata
from kiln.runtime.sample.sampling_params import SamplingParams
from tests.codegen.helpers import require_interpreter

pytestmark = pytest.mark.usefixtures("interpreter")

V = 97
CFG = ElementwiseConfig(block=32, num_warps=4)  # 4 chunks of a 97-token row


@pytest.fixture
def interpreter():
    require_interpreter()


def _metadata(params, prompts, outputs, bad=None, eos=(1,)):
    return SamplingMetadata.from_requests(params, prompts, outputs, V, generators=[p.new_generator() for p in params],
                                          bad_words_token_ids=bad, eos_token_ids=eos)


def _process(logits, rows, inp: SamplerInputs):
    K.apply_logits_processors(logits, rows, inp.start, inp.tok, inp.bias.copy(), inp.count, inp.mode,
                              inp.repetition, inp.frequency, inp.presence, config=CFG)


def _logits(rng, rows, scale=3.0):
    x = (rng.standard_normal((rows, V)) * scale).astype(np.float32)
    x[x == 0] = 0.5
    return x


def test_processors_and_greedy_equal_reference():
    rng = np.random.default_rng(11)
    params = [
        SamplingParams(temperature=0, logit_bias={5: 3.5, 40: -2.0, 96: 100.0}),
        SamplingParams(temperature=0, bad_words=["x"], min_tokens=4, stop_token_ids=[7, 90]),
        SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=0.8),
        SamplingParams(temperature=0, allowed_token_ids=[3, 17, 33, 64, 95], logit_bias={17: 2.0, 18: 9.0},
                       repetition_penalty=0.6),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, frequency_penalty=-0.5, logit_bias={0: -1.0}, min_tokens=1),
    ]
    prompts = [rng.integers(0, V, int(n)).tolist() for n in rng.integers(1, 60, len(params))]
    outputs = [rng.integers(0, V, int(n)).tolist() for n in (0, 3, 40, 12, 5, 0)]
    outputs[1][-1] = 21  # the bad word [21, 22] is banned after 21; [50] always
    bad = [None, [[21, 22], [50], [60, 61, 62]], None, None, None, None]
    md = _metadata(params, prompts, outputs, bad)
    logits = _logits(rng, 9)
    logits[5, [17, 64]] = 40.0  # two allowed tokens tied before the bias
    rows = np.array([0, 2, 4, 5, 7, 8])
    want = Sampler.apply_logits_processors(logits[rows], md)
    got = logits.copy()
    inp = SamplerInputs.from_metadata(md)
    assert inp.has_processors and inp.mode.tolist() == [0, 0, 0, 1, 0, 0]
    _process(got, rows, inp)
    assert np.array_equal(got[rows], want)
    untouched = np.setdiff1d(np.arange(9), rows)
    assert np.array_equal(got[untouched], logits[untouched])
    # greedy: the argmax of the processed rows, ties to the lowest id
    got[rows[4], [10, 70]] = 99.0
    tok = K.sample(got, rows, inp.temperature, inp.top_k, inp.top_p, inp.min_p, np.zeros(6), config=CFG)
    assert tok.tolist() == got[rows].argmax(axis=1).tolist() and tok[4] == 10


def test_no_processors_gives_an_empty_list():
    md = _metadata([SamplingParams(), SamplingParams(temperature=0)], [[1, 2], [3]], [[4], []])
    inp = SamplerInputs.from_metadata(md)
    assert not inp.has_processors and inp.start.tolist() == [0, 0, 0]
    assert inp.temperature.tolist() == [1.0, 0.0] and inp.top_k.tolist() == [V, V]


@pytest.mark.parametrize("k", [0, 5])
def test_logprobs_ranks_and_top_k_equal_gather_logprobs(k):
    rng = np.random.default_rng(12 + k)
    logits = _logits(rng, 5)
    logits[1, [3, 40, 90]] = logits[1].max() + 1.0  # a three-way tie at the top, across chunks
    top = logits[2].max()
    logits[2, [31, 32]] = top + 2.0  # a tie across a chunk boundary
    logits[2, [33, 64]] = top + 1.0
    rows = np.array([4, 1, 2, 0])
    tokens = np.array([5, 40, 64, 96], np.int32)
    ids, lp, rank = K.logprobs(logits, rows, tokens, k, config=CFG)
    want = gather_logprobs(compute_logprobs(logits[rows]), k, tokens)
    assert ids.tolist() == want.token_ids.tolist()
    assert rank.tolist() == want.ranks.tolist()
    np.testing.assert_allclose(lp, want.logprobs, rtol=0, atol=2e-6)
    if k:
        assert ids[1, 1:4].tolist() == [3, 40, 90] and rank[1, 1:4].tolist() == [1, 1, 1] and rank[1, 0] == 1
        assert ids[2, 1:5].tolist() == [31, 32, 33, 64] and rank[2, 1:5].tolist() == [1, 1, 3, 3]


def test_copy_rows():
    logits = _logits(np.random.default_rng(3), 4)
    assert np.array_equal(K.copy_rows(logits, np.array([3, 0]), config=CFG), logits[[3, 0]])


@pytest.mark.parametrize("n_words", [5, 1024, 2500])
def test_stage_inputs_copies_the_block_and_feeds_sampled_ids(n_words):
    """The step-input stage: every staged word lands in place, except the fed input ids, which
    take the sampled id their map names (-1: the staged word); words past the block move not."""
    rng = np.random.default_rng()
    src = rng.integers(-2**31, 2**31 - 1, size=n_words, dtype=np.int64).astype(np.int32)
    dst = rng.integers(0, 50_000, size=n_words + 40).astype(np.int32)
    ids = rng.integers(0, 50_000, size=12).astype(np.int32)
    n_ids = int(rng.integers(1, min(n_words, 600) + 1))
    ids_off = int(rng.integers(0, n_words - n_ids + 1))
    fmap = np.full(n_ids, -1, np.int32)
    fed = rng.permutation(n_ids)[:min(n_ids, 7)]
    fmap[fed] = rng.integers(0, 12, size=len(fed))
    want = dst.copy()
    want[:n_words] = src
    want[ids_off + fed] = ids[fmap[fed]]
    K.stage_inputs(src, dst, ids_off, fmap, ids)
    assert np.array_equal(dst, want)
    src2 = rng.integers(0, 50_000, size=n_words).astype(np.int32)
    K.stage_inputs(src2, dst, ids_off)  # nothing fed: the placeholders stay as staged
    assert np.array_equal(dst[:n_words], src2) and np.array_equal(dst[n_words:], want[n_words:])


def _reference_mask(row, temperature, k, p, min_p):
    """The numpy sampler's steps 5-7 on one row: z after min_p, top-k, top-p (-inf where cut)."""
    sub = row[None] / np.float32(temperature)
    ops.apply_min_p(sub, np.array([min_p], np.float32))
    ops.apply_top_k_top_p(sub, None if k >= V else np.array([k]), None if p >= 1 else np.array([p], np.float32))
    return sub[0]


def test_top_k_top_p_min_p_masks_equal_reference_and_samples_stay_inside():
    rng = np.random.default_rng(21)
    cases = [  # temperature, top_k, top_p, min_p
        (1.0, 5, 1.0, 0.0), (0.7, V, 0.8, 0.0), (1.3, 12, 0.6, 0.0), (1.0, V, 1.0, 0.05),
        (0.5, 30, 0.95, 0.01), (2.0, 1, 1.0, 0.0), (1.0, 4, 1.0, 0.0),
    ]
    logits = _logits(rng, len(cases), scale=2.0)
    logits[6, [8, 50, 51, 77, 80]] = 9.0  # five tied at the top: top_k 4 keeps all five (a value cut)
    t, k, p, mp = (np.array(c) for c in zip(*cases))
    masked = np.empty_like(logits)
    seeds = row_seeds([None] * len(cases), [0] * len(cases), rng)
    two = ElementwiseConfig(block=64, num_warps=4)  # 2 chunks a pass: 4 passes for top-k, 8 for top-p
    tok = K.sample(logits, np.arange(len(cases)), t, k, p, mp, seeds, masked=masked, config=two)
    for i, c in enumerate(cases):
        want = _reference_mask(logits[i], *c)
        assert np.array_equal(masked[i], want), f"case {c}: kept {np.isfinite(masked[i]).sum()}, " \
                                                f"reference {np.isfinite(want).sum()}"
        assert np.isfinite(want[tok[i]]), f"case {c}: sampled token {tok[i]} was cut"
    assert np.isfinite(masked[6]).sum() == 5 and tok[5] == logits[5].argmax()


def test_radix_cuts_equal_reference_on_random_rows():
    """The radix searches (4 count passes for top-k, 8 mass passes for top-p) over fresh random
    rows and settings, ties and negative-only rows included: the kept set equals numpy's."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    n = 16
    logits = _logits(rng, n, scale=rng.uniform(0.3, 6.0))
    logits[3] = -np.abs(logits[3]) - 50.0  # every key negative: the radix digits of the sign flip
    logits[4, rng.choice(V, 9, replace=False)] = logits[4].max() + 1.0  # nine tied at the top
    logits[5] = np.round(logits[5])  # many ties everywhere
    t = rng.uniform(0.3, 2.0, n)
    k = rng.integers(1, V + 1, n)
    p = np.where(rng.random(n) < 0.7, rng.uniform(0.05, 1.0, n), 1.0)
    mp = np.where(rng.random(n) < 0.3, rng.uniform(0.0, 0.2, n), 0.0)
    masked = np.empty_like(logits)
    seeds = row_seeds([None] * n, [0] * n, rng)
    two = ElementwiseConfig(block=64, num_warps=4)  # each row split over 2 programs
    tok = K.sample(logits, np.arange(n), t, k, p, mp, seeds, masked=masked, config=two)
    for i in range(n):
        want = _reference_mask(logits[i], t[i], k[i], p[i], mp[i])
        assert np.array_equal(masked[i], want), (seed, i, t[i], k[i], p[i], mp[i])
        assert np.isfinite(want[tok[i]])


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of chi-square (Wilson-Hilferty)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * np.sqrt(a)) ** 3


def test_random_draws_follow_the_renormalised_distribution():
    v = 12
    rng = np.random.default_rng(8)
    row = (rng.standard_normal(v) * 1.5).astype(np.float32)
    n, temperature, min_p = 240, 0.8, 0.05
    one = ElementwiseConfig(block=16, num_warps=4)  # one chunk: the interpreter pays per op
    seeds = row_seeds([None] * n, [0] * n, rng)
    tok = K.sample(row[None], np.zeros(n), np.full(n, temperature), np.full(n, v), np.ones(n),
                   np.full(n, min_p), seeds, config=one)
    z = row.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p[p < min_p] = 0
    p /= p.sum()
    assert set(np.unique(tok)) <= set(np.flatnonzero(p).tolist()), "a draw outside the min_p set"
    kept = p > 0
    counts = np.bincount(tok, minlength=v)[kept]
    chi2 = float(((counts - n * p[kept]) ** 2 / (n * p[kept])).sum())
    assert chi2 < _chi2_critical(int(kept.sum()) - 1), f"chi-square {chi2:.1f} over {kept.sum()} tokens"


def test_seeded_rows_equal_alone_and_batched():
    rng = np.random.default_rng(31)
    logits = _logits(rng, 4, scale=0.5)  # flat: the draw depends on the noise, not the logits
    t, k, p, mp = np.ones(4), np.full(4, V), np.ones(4), np.zeros(4)
    seeds = row_seeds([7, None, 123, None], [3, 0, 0, 0], rng)
    # a seeded row's key depends on (seed, step) only, not on the batch or the generator
    assert seeds[0] == row_seeds([None, 7], [9, 3], np.random.default_rng(0))[1]
    assert seeds[0] != row_seeds([7], [4], rng)[0]
    batched = K.sample(logits, np.arange(4), t, k, p, mp, seeds, config=CFG)
    for i in (0, 2):
        alone = K.sample(logits[i:i + 1], [0], t[:1], k[:1], p[:1], mp[:1], seeds[i:i + 1], config=CFG)
        assert alone[0] == batched[i]
    draws = K.sample(logits[[0] * 8], np.zeros(8), np.ones(8), np.full(8, V), np.ones(8), np.zeros(8),
                     row_seeds([7] * 8, range(8), rng), config=CFG)
    assert len(set(draws.tolist())) > 1  # the step changes the key


@pytest.mark.parametrize("vocab,words,block", [(97, 4, 32), (1000, 32, 128), (256, 8, 64), (61, 3, 128)],
                         ids=["V97", "V1000", "V256", "V61-one-block"])
def test_token_bitmask_equals_the_numpy_reference(vocab, words, block):
    """The grammar mask (llguidance's packed bits) on fresh random logits and masks, rows picked
    out of order and not all of them, vocabularies that 32 does and does not divide: the masked
    rows equal runtime/sample/ops.py's apply_token_bitmask, the others are untouched."""
    rng = np.random.default_rng()
    logits = (rng.standard_normal((6, vocab)) * 4).astype(np.float32)
    rows = np.array([4, 0, 5], np.int32)
    bits = rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    bits[2] = 0
    bits[2, 1] = np.int32(1 << 7)  # one token allowed: 39
    want = logits.copy()
    ops.apply_token_bitmask(want, rows, bits)
    got = logits.copy()
    K.apply_token_bitmask(got, rows, bits, config=ElementwiseConfig(block=block, num_warps=4))
    assert np.array_equal(got, want)
    assert np.isneginf(got[5]).sum() == vocab - 1 and got[5, 39] == logits[5, 39]
    assert np.array_equal(got[[1, 2, 3]], logits[[1, 2, 3]])
