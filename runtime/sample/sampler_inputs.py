"""The GPU sampler's per-step inputs: SamplingMetadata turned into compact arrays.

The numpy sampler (runtime/sample/sampler.py) works on dense [B, V] rows; the GPU kernels
(codegen/triton/sampling.py, launched from the bundle) read a CSR list per row
instead, so a step uploads a few KiB rather than a [B, V] mask:

- entries start[b]..start[b+1]-1: (token, additive bias, output count). The bias holds
  logit_bias and -inf for bad words and min_tokens; count >= 0 marks a token seen in
  the prompt or the output (repetition penalty) and counts it in the output (frequency,
  presence); -1 means bias only. A (row, token) pair appears once: the reference's steps
  on one token commute into "add the bias, then penalise" (-inf absorbs everything).
- mode[b] = 1: whitelist (allowed_token_ids): the entries list exactly the allowed
  tokens and every other token becomes -inf.
- per row: temperature (0 for greedy rows), top_k (V = off), top_p (1 = off), min_p,
  and the penalties.

Row seeds (Philox keys) are derived here too: a seeded request's from (seed, tokens it
has generated), so its draws do not depend on the batch; the others from the engine's
generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kiln.runtime.sample.metadata import SamplingMetadata
from kiln.runtime.sample.sampling_params import SAMPLING_EPS

_M64 = (1 << 64) - 1


@dataclass(frozen=True, eq=False)
class SamplerInputs:
    start: np.ndarray  # i32[B+1]
    tok: np.ndarray  # i32[N]
    bias: np.ndarray  # f32[N]
    count: np.ndarray  # i32[N]
    mode: np.ndarray  # i32[B]
    repetition: np.ndarray  # f32[B]
    frequency: np.ndarray  # f32[B]
    presence: np.ndarray  # f32[B]
    temperature: np.ndarray  # f32[B], 0 = greedy
    top_k: np.ndarray  # i32[B], V = off
    top_p: np.ndarray  # f32[B], 1 = off
    min_p: np.ndarray  # f32[B], 0 = off

    @property
    def has_processors(self) -> bool:
        return len(self.tok) > 0 or bool(self.mode.any())

    @classmethod
    def from_metadata(cls, md: SamplingMetadata) -> "SamplerInputs":
        B, V = md.batch_size, md.vocab_size
        keys: list[np.ndarray] = []  # row * V + token, one array per source
        biases: list[np.ndarray] = []
        for k, b in _bias_entries(md):
            keys.append(k)
            biases.append(b)
        n_bias = sum(len(k) for k in keys)
        seen_keys, seen_counts = _penalty_entries(md)
        all_keys = np.concatenate(keys + [seen_keys]) if keys or len(seen_keys) else np.zeros(0, np.int64)
        uniq, inv = np.unique(all_keys, return_inverse=True)
        bias = np.zeros(len(uniq), np.float32)
        np.add.at(bias, inv[:n_bias], np.concatenate(biases) if biases else np.zeros(0, np.float32))
        count = np.full(len(uniq), -1, np.int32)
        count[inv[n_bias:]] = seen_counts
        rows, tok = np.divmod(uniq, V)
        mode = np.zeros(B, np.int32)
        if md.allowed_token_ids_mask is not None:
            allowed = ~md.allowed_token_ids_mask
            wl = ~allowed.all(axis=1)  # rows with allowed_token_ids (a full mask row is "no list")
            mode[wl] = 1
            # A whitelist row keeps only allowed tokens: the kernel sets the rest to -inf.
            keep = ~wl[rows] | allowed[rows, tok]
            rows, tok, bias, count = rows[keep], tok[keep], bias[keep], count[keep]
        start = np.searchsorted(rows, np.arange(B + 1)).astype(np.int32)

        greedy = md.temperature < SAMPLING_EPS
        return cls(
            start=start, tok=tok.astype(np.int32), bias=bias, count=count, mode=mode,
            repetition=md.repetition_penalties.astype(np.float32),
            frequency=md.frequency_penalties.astype(np.float32),
            presence=md.presence_penalties.astype(np.float32),
            temperature=np.where(greedy, 0.0, md.temperature).astype(np.float32),
            top_k=(md.top_k if md.top_k is not None else np.full(B, V)).astype(np.int32),
            top_p=(md.top_p if md.top_p is not None else np.ones(B)).astype(np.float32),
            min_p=(md.min_p if md.min_p is not None else np.zeros(B)).astype(np.float32),
        )


def _bias_entries(md: SamplingMetadata):
    """(keys, additive biases): whitelist tokens (0), bad words and min_tokens (-inf), logit_bias."""
    V = md.vocab_size
    if md.allowed_token_ids_mask is not None:
        allowed = ~md.allowed_token_ids_mask
        wl = np.flatnonzero(~allowed.all(axis=1))
        r, t = np.nonzero(allowed[wl])
        yield wl[r] * V + t, np.zeros(len(r), np.float32)
    banned = []
    for row, words in md.bad_words_token_ids.items():  # as sample/ops.py apply_bad_words
        past = list(md.output_token_ids[row])
        for word in words:
            n = len(word) - 1
            if n <= len(past) and (n == 0 or past[len(past) - n:] == list(word[:n])):
                banned.append(row * V + word[-1])
    if banned:
        yield np.array(banned, np.int64), np.full(len(banned), -np.inf, np.float32)
    if md.min_tokens_rows is not None:
        yield md.min_tokens_rows * V + md.min_tokens_cols, np.full(len(md.min_tokens_rows), -np.inf, np.float32)
    if md.logit_bias_rows is not None:
        yield md.logit_bias_rows * V + md.logit_bias_cols, md.logit_bias_values.astype(np.float32)


def _penalty_entries(md: SamplingMetadata) -> tuple[np.ndarray, np.ndarray]:
    """(keys, output counts) of every token seen in a penalised row's prompt or output.
    Rows whose penalties are all neutral are left out (the reference's ops are identities there)."""
    V = md.vocab_size
    if md.no_penalties:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    active = ((md.repetition_penalties != 1) | (md.frequency_penalties != 0) | (md.presence_penalties != 0))
    rows_p, cols_p = np.nonzero(md.prompt_token_ids < V)
    ok = active[rows_p]
    prompt_keys = rows_p[ok] * V + md.prompt_token_ids[rows_p[ok], cols_p[ok]]
    out = [np.asarray(t, np.int64) + r * V for r, t in enumerate(md.output_token_ids) if active[r] and len(t)]
    out_keys, out_counts = np.unique(np.concatenate(out) if out else np.zeros(0, np.int64), return_counts=True)
    keys, inv = np.unique(np.concatenate([prompt_keys, out_keys]), return_inverse=True)
    counts = np.zeros(len(keys), np.int32)
    counts[inv[len(prompt_keys):]] = out_counts
    return keys, counts


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_seeds(seeds: Sequence[Optional[int]], steps: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """i64[B] Philox keys: for a request with a seed, a hash of (seed, tokens generated so
    far), the same alone or batched, after preemption too; for the others, one draw each
    from the engine's generator."""
    out = np.empty(len(seeds), np.int64)
    free = [i for i, s in enumerate(seeds) if s is None]
    out[free] = rng.integers(0, np.iinfo(np.int64).max, size=len(free), dtype=np.int64)
    for i, (s, n) in enumerate(zip(seeds, steps)):
        if s is not None:
            h = _splitmix64(_splitmix64(int(s) & _M64) ^ int(n))
            out[i] = h - (1 << 64) if h >= 1 << 63 else h
    return out
