"""The sampler: logits of one engine step -> the next token of every request.

Ported from vLLM's `vllm/v1/sample/sampler.py` (`Sampler.forward`, `sample`,
`compute_logprobs`, `gather_logprobs`), on numpy. The steps, in vLLM's order:

1. If any row wants logprobs: log_softmax of the raw logits (float32), before
   anything below touches them ("raw_logprobs", vLLM's default mode).
2. allowed_token_ids mask, then bad words.
3. Processors that can change the argmax: min_tokens (stop tokens forbidden
   while the output is short), then logit_bias.
4. Penalties: repetition, frequency, presence.
5. Greedy rows (temperature < 1e-5) take the argmax here. The other rows are
   divided by their temperature, then
6. min_p (argmax-invariant), then
7. top-k and top-p, softmax, and the exponential race draws a token.
8. Logprobs of the top max_num_logprobs tokens and of the sampled token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from kiln.runtime.sample import ops
from kiln.runtime.sample.metadata import SamplingMetadata, pad_token_ids
from kiln.runtime.sample.sampling_params import SAMPLING_EPS


@dataclass(frozen=True, eq=False)
class LogprobsTensors:
    """Per row: column 0 is the sampled (or prompt) token, columns 1..K the top K by logprob.

    Rows may ask for fewer than K; LogprobsProcessor keeps each row's own count.
    """
    token_ids: np.ndarray  # i32[B, K+1]
    logprobs: np.ndarray  # f32[B, K+1]
    ranks: np.ndarray  # i32[B, K+1]: 1 + number of vocabulary entries with a strictly greater logprob

    def slice(self, start: int, stop: int) -> "LogprobsTensors":
        """Rows start..stop-1: one request's share of a batch."""
        return LogprobsTensors(self.token_ids[start:stop], self.logprobs[start:stop], self.ranks[start:stop])


@dataclass(frozen=True, eq=False)
class SamplerOutput:
    sampled_token_ids: np.ndarray  # i32[B]
    logprobs: Optional[LogprobsTensors]  # None when no row asked for logprobs

    @property
    def sampled_logprobs(self) -> Optional[np.ndarray]:
        return None if self.logprobs is None else self.logprobs.logprobs[:, 0]

    @property
    def sampled_ranks(self) -> Optional[np.ndarray]:
        return None if self.logprobs is None else self.logprobs.ranks[:, 0]


def compute_logprobs(logits: np.ndarray) -> np.ndarray:
    return ops.log_softmax(np.asarray(logits, dtype=np.float32))


def gather_logprobs(logprobs: np.ndarray, num_logprobs: int, token_ids: np.ndarray) -> LogprobsTensors:
    """The given tokens' logprobs and ranks, then the top num_logprobs (vLLM `gather_logprobs`).

    logprobs: f32[B, V]; token_ids: int[B] (sampled tokens, or prompt tokens for
    prompt logprobs). Top entries are sorted by logprob, ties by token id.
    """
    B, V = logprobs.shape
    k = min(int(num_logprobs), V)
    rows = np.arange(B)
    token_ids = np.asarray(token_ids, dtype=np.int64)
    token_lp = logprobs[rows, token_ids]
    token_rank = (logprobs > token_lp[:, None]).sum(axis=1) + 1
    if k > 0:
        cand = np.argpartition(-logprobs, k - 1, axis=1)[:, :k] if k < V else np.broadcast_to(np.arange(V), (B, V))
        cand = np.sort(cand, axis=1)  # ascending ids, so the stable sort below breaks ties by id
        vals = np.take_along_axis(logprobs, cand, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        top_ids = np.take_along_axis(cand, order, axis=1)
        top_lp = np.take_along_axis(vals, order, axis=1)
        # Every token strictly above a top-k entry is itself in the top k, so its
        # rank is 1 + the position of the first entry equal to it.
        first = np.ones((B, k), dtype=bool)
        first[:, 1:] = top_lp[:, 1:] != top_lp[:, :-1]
        top_rank = np.maximum.accumulate(np.where(first, np.arange(k), 0), axis=1) + 1
    else:
        top_ids = np.zeros((B, 0), dtype=np.int64)
        top_lp = np.zeros((B, 0), dtype=np.float32)
        top_rank = np.zeros((B, 0), dtype=np.int64)
    return LogprobsTensors(
        token_ids=np.concatenate([token_ids[:, None], top_ids], axis=1).astype(np.int32),
        logprobs=np.concatenate([token_lp[:, None], top_lp], axis=1).astype(np.float32),
        ranks=np.concatenate([token_rank[:, None], top_rank], axis=1).astype(np.int32),
    )


def _has_logits_processors(md: SamplingMetadata) -> bool:
    """Whether _apply_logits_processors would touch the logits."""
    return (md.allowed_token_ids_mask is not None or bool(md.bad_words_token_ids) or md.min_tokens_rows is not None
            or md.logit_bias_rows is not None or not md.no_penalties)


class Sampler:
    """Samples one token per row. Holds the generator for unseeded requests (its only state).

    compiled: the compiled CPU target's sampling kernels (runtime/cpu/sample_kernels.py
    CompiledSampler) or None; with them, steps 5-7 of the random rows run compiled and give the
    same tokens as the numpy steps below (which stay the reference and the fallback)."""

    def __init__(self, seed: Optional[int] = None, compiled=None):
        self._rng = np.random.default_rng(seed)
        self.compiled = compiled

    def sample(self, logits: np.ndarray, metadata: SamplingMetadata, grammar_bitmask=None) -> SamplerOutput:
        """logits: [B, V] (any float dtype; not modified) -> SamplerOutput. grammar_bitmask: the
        constrained rows' allowed tokens (structured_output_manager.GrammarBitmask) or None."""
        md = metadata
        logits = np.asarray(logits)
        if logits.shape != (md.batch_size, md.vocab_size):
            raise ValueError(f"logits {logits.shape} do not match {md.batch_size} requests "
                             f"over a vocabulary of {md.vocab_size}")
        if (md.all_greedy and md.max_num_logprobs is None and logits.dtype == np.float32
                and not _has_logits_processors(md) and grammar_bitmask is None):
            # Nothing below would change the logits: the argmax of the copy is the argmax of these.
            return SamplerOutput(sampled_token_ids=logits.argmax(axis=1).astype(np.int32), logprobs=None)
        logits = np.array(logits, dtype=np.float32)  # a copy: every step below works in place
        if grammar_bitmask is not None:
            # Before everything, logprobs included, as vLLM applies the grammar to the logits
            # before its sampler (vllm/v1/structured_output/utils.py apply_grammar_bitmask).
            ops.apply_token_bitmask(logits, grammar_bitmask.rows, grammar_bitmask.bits)
        raw_logprobs = compute_logprobs(logits) if md.max_num_logprobs is not None else None

        self._apply_logits_processors(logits, md)

        if md.all_greedy:
            sampled = logits.argmax(axis=1)
        else:
            sampled = self._sample_random(logits, md)

        lp = None
        if raw_logprobs is not None:
            lp = gather_logprobs(raw_logprobs, md.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled.astype(np.int32), logprobs=lp)

    @staticmethod
    def apply_logits_processors(logits: np.ndarray, metadata: SamplingMetadata) -> np.ndarray:
        """Steps 2-4 on a float32 copy of logits: the logits greedy rows take the argmax of."""
        out = np.array(logits, dtype=np.float32)
        Sampler._apply_logits_processors(out, metadata)
        return out

    @staticmethod
    def _apply_logits_processors(logits: np.ndarray, md: SamplingMetadata) -> None:
        """Steps 2-4, in place: everything that may change the greedy choice."""
        if md.allowed_token_ids_mask is not None:
            logits[md.allowed_token_ids_mask] = ops.NEG_INF
        if md.bad_words_token_ids:
            ops.apply_bad_words(logits, md.bad_words_token_ids, md.output_token_ids)
        if md.min_tokens_rows is not None:
            logits[md.min_tokens_rows, md.min_tokens_cols] = ops.NEG_INF
        if md.logit_bias_rows is not None:
            # (row, token) pairs are unique: logit_bias is a dict per request.
            logits[md.logit_bias_rows, md.logit_bias_cols] += md.logit_bias_values
        if not md.no_penalties:
            ops.apply_penalties(logits, md.prompt_token_ids, pad_token_ids(md.output_token_ids, md.vocab_size),
                                md.presence_penalties, md.frequency_penalties, md.repetition_penalties)

    def _sample_random(self, logits: np.ndarray, md: SamplingMetadata) -> np.ndarray:
        """Steps 5-7. Greedy rows keep their argmax; the random rows are worked on as a sub-batch."""
        if md.all_random:
            sampled, rows = np.empty(md.batch_size, dtype=np.int64), np.arange(md.batch_size)
        else:
            sampled, rows = logits.argmax(axis=1), np.flatnonzero(md.temperature >= SAMPLING_EPS)
        position = {int(r): j for j, r in enumerate(rows)}
        generators = {position[r]: g for r, g in md.generators.items() if r in position}
        draw = ops.draw_noise if self.compiled is None else self.compiled.draw_noise
        q = draw(len(rows), md.vocab_size, generators, self._rng)
        min_p = None if md.min_p is None else md.min_p[rows]
        k = None if md.top_k is None else md.top_k[rows]
        p = None if md.top_p is None else md.top_p[rows]
        tokens = None
        if self.compiled is not None:
            tokens = self.compiled.sample(logits, rows, md.temperature, min_p, k, p, q)
        if tokens is None:
            tokens = ops.sample_rows(logits[rows] / md.temperature[rows, None], min_p, k, p, q)
        sampled[rows] = tokens
        return sampled
