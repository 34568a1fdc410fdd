"""Numpy logits operations of the sampler, each over a whole batch.

Ported from vLLM: `vllm/v1/sample/ops/bad_words.py`, `ops/penalties.py` with
`model_executor/layers/utils.py::apply_penalties` (and the torch fallback of
`_custom_ops.apply_repetition_penalties`), `logits_processor/builtin.py::
MinPLogitsProcessor`, `ops/topk_topp_sampler.py` (`apply_top_k_top_p_pytorch`,
`apply_top_k_only`, `random_sample`). Functions named apply_* modify float32
`logits: [B, V]` in place and also return it.

These are the oracle of the compiled sampler (runtime/cpu/sample_kernels.py), which must give
the same tokens: every step here is defined so that another implementation can reproduce its
bits without sorting the vocabulary (the sums are numpy's pairwise float32 sums over vocabulary
order, or exact integer sums).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

NEG_INF = np.float32(-np.inf)
# Top-p's probability masses in fixed point: a token's exp(z - zmax) <= 1 times 2^40, truncated to
# an integer (the GPU sampler's MASS_ONE, codegen/triton/sampling.py). Integer sums are exact, so
# the cumulative mass is the same in any order: sorted here, radix buckets in the compiled sampler.
MASS_ONE = np.float32(2.0 ** 40)
TINY = np.finfo(np.float32).tiny


def softmax(logits: np.ndarray) -> np.ndarray:
    """float32 softmax over the last axis; -inf logits get probability 0."""
    x = logits - logits.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log_softmax over the last axis (vLLM `Sampler.compute_logprobs`)."""
    x = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True).astype(np.float32)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def apply_bad_words(logits: np.ndarray, bad_words_token_ids: Mapping[int, Sequence[Sequence[int]]],
                    output_token_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """Forbid the last token of each bad word whose other tokens end the output so far."""
    for row, words in bad_words_token_ids.items():
        past = output_token_ids[row]
        for word in words:
            prefix_len = len(word) - 1
            if prefix_len > len(past):
                continue
            if prefix_len == 0 or list(past[len(past) - prefix_len:]) == list(word[:prefix_len]):
                logits[row, word[-1]] = NEG_INF
    return logits


def _seen(token_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """token_ids: i64[B, L] padded with vocab_size -> flat indices row * V + token, one per token."""
    rows, cols = np.nonzero(token_ids < vocab_size)
    return rows * vocab_size + token_ids[rows, cols]


def apply_penalties(logits: np.ndarray, prompt_token_ids: np.ndarray, output_token_ids: np.ndarray,
                    presence_penalties: np.ndarray, frequency_penalties: np.ndarray,
                    repetition_penalties: np.ndarray) -> np.ndarray:
    """vLLM's penalties, in its order.

    repetition: a token seen in the prompt or the output has its logit divided
    by the penalty when positive, multiplied by it otherwise. frequency and
    presence (OpenAI's definition) look at the output only:
    logit -= frequency * count + presence * (count > 0).
    prompt_token_ids / output_token_ids: i64[B, L] padded with vocab_size.
    Only the (row, token) pairs that occur are touched: a few hundred per row
    instead of vLLM's dense [B, V] bin counts.
    """
    B, V = logits.shape
    out_idx, out_counts = np.unique(_seen(output_token_ids, V), return_counts=True)
    seen = np.union1d(_seen(prompt_token_ids, V), out_idx)
    rows, cols = np.divmod(seen, V)
    x = logits[rows, cols]
    rep = repetition_penalties.astype(np.float32)[rows]
    logits[rows, cols] = np.where(x > 0, x / rep, x * rep)
    rows, cols = np.divmod(out_idx, V)
    logits[rows, cols] -= (frequency_penalties.astype(np.float32)[rows] * out_counts.astype(np.float32)
                           + presence_penalties.astype(np.float32)[rows])
    return logits


def apply_min_p(logits: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """Forbid tokens whose probability is below min_p times the top token's."""
    probs = softmax(logits)
    threshold = probs.max(axis=-1, keepdims=True) * min_p.astype(np.float32)[:, None]
    logits[probs < threshold] = NEG_INF
    return logits


def apply_top_k_only(logits: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Keep tokens at least as likely as the k-th most likely (ties at the k-th are kept).

    Partitions instead of sorting the vocabulary (vLLM `apply_top_k_only`).
    """
    B, V = logits.shape
    active = k < V
    if not active.any():
        return logits
    rows = np.flatnonzero(active)
    kmax = int(k[rows].max())
    top = -np.partition(-logits[rows], kmax - 1, axis=1)[:, :kmax]
    top.sort(axis=1)
    kth = top[np.arange(len(rows)), kmax - k[rows]]  # ascending: the k-th largest sits at kmax - k
    sub = logits[rows]
    sub[sub < kth[:, None]] = NEG_INF
    logits[rows] = sub
    return logits


def apply_top_k_top_p(logits: np.ndarray, k: Optional[np.ndarray], p: Optional[np.ndarray]) -> np.ndarray:
    """Top-k then top-p (vLLM `apply_top_k_top_p_pytorch`).

    Top-p keeps the smallest set of most likely tokens whose probability (after
    top-k, renormalised) reaches p: over tokens sorted ascending, a token goes
    when the cumulative probability up to and including it is <= 1 - p. The
    most likely token always stays. vLLM masks by sorted position; this masks by
    value (below the least likely kept logit), which sorts values only (several
    times faster in numpy) and keeps every token tied with the last kept one,
    as top-k does. Rows with p >= 1 get no top-p cut (vLLM's cut there drops only
    tokens whose probability is 0, which no draw picks).

    The cumulative probability is an exact integer sum of fixed-point masses
    (MASS_ONE), compared in float64 with (1 - p) times the total: the cut is
    the least value v with float64(mass(z <= v)) > (1 - p) * float64(total), or
    the top value if there is none. (Until issue 43 it was a float32 cumsum of
    softmax(sorted row), whose rounding depends on the sort: the compiled
    sampler finds this cut without sorting.)
    """
    if p is None:
        return logits if k is None else apply_top_k_only(logits, k)
    B, V = logits.shape
    srt = np.sort(logits, axis=1)  # ascending
    cut = np.full(B, NEG_INF, dtype=np.float32)
    if k is not None:
        cut = srt[np.arange(B), V - np.minimum(k, V)]
        srt[srt < cut[:, None]] = NEG_INF
    on = np.flatnonzero(p < 1.0)
    if len(on):
        s = srt[on]
        mass = (np.exp(s - s[:, -1:]) * MASS_ONE).astype(np.int64)
        cum = np.cumsum(mass, axis=1)
        limit = (1.0 - p[on].astype(np.float64)) * cum[:, -1].astype(np.float64)
        # cum only grows, so the dropped tokens are a prefix of the sorted row; the
        # last one is never dropped.
        n_drop = np.minimum((cum.astype(np.float64) <= limit[:, None]).sum(axis=1), V - 1)
        cut[on] = np.maximum(cut[on], s[np.arange(len(on)), n_drop])
    logits[logits < cut[:, None]] = NEG_INF
    return logits


def draw_noise(B: int, V: int, generators: Mapping[int, np.random.Generator],
               rng: np.random.Generator) -> np.ndarray:
    """q: f32[B, V] ~ Exp(1) i.i.d. for the exponential race, at least float32's tiny.

    A row listed in `generators` draws its noise from its own generator, V
    values per step, so a seeded request's tokens depend only on its seed and
    its own logits, not on the batch around it (vLLM `random_sample`). The other
    rows draw from `rng` in one call, in row order.
    """
    q = np.empty((B, V), dtype=np.float32)
    shared = [i for i in range(B) if i not in generators]
    if shared:
        q[shared] = rng.standard_exponential((len(shared), V), dtype=np.float32)
    for i, gen in generators.items():
        q[i] = gen.standard_exponential(V, dtype=np.float32)
    # Exp(1) can round to 0 in float32; 0/0 would be NaN, which argmax picks.
    np.maximum(q, TINY, out=q)
    return q


def race(probs: np.ndarray, q: np.ndarray) -> np.ndarray:
    """argmax(probs / q), the first index among equals: with q ~ Exp(1) i.i.d. (draw_noise)
    this draws token i with probability probs[i]."""
    return (probs / q).argmax(axis=1)


def sample_rows(sub: np.ndarray, min_p: Optional[np.ndarray], k: Optional[np.ndarray],
                p: Optional[np.ndarray], q: np.ndarray) -> np.ndarray:
    """The sampler's steps 6-7 on temperature-scaled rows `sub` (modified in place): min_p,
    top-k and top-p, softmax, and the race against the noise q (draw_noise) -> token per row."""
    if min_p is not None:
        apply_min_p(sub, min_p)
    apply_top_k_top_p(sub, k, p)
    return race(softmax(sub), q)


def random_sample(probs: np.ndarray, generators: Mapping[int, np.random.Generator],
                  rng: np.random.Generator) -> np.ndarray:
    """Exponential race: argmax(probs / q), q ~ Exp(1) i.i.d., draws token i with prob probs[i]
    (draw_noise, then race)."""
    B, V = probs.shape
    return race(probs, draw_noise(B, V, generators, rng))


def apply_token_bitmask(logits: np.ndarray, rows: np.ndarray, bits: np.ndarray) -> None:
    """logits[rows[k], t] = -inf where bit t of bits[k] is clear (llguidance's layout: token t is
    bit t % 32 of word t // 32). logits: f32[B, V] in place; bits: i32[K, ceil(V / 32)]."""
    V = logits.shape[1]
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
    sub = logits[rows]
    sub[~allowed] = NEG_INF
    logits[rows] = sub
