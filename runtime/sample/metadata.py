"""The batch's sampling parameters as arrays: what the Sampler reads each step.

Ported from vLLM's `vllm/v1/sample/metadata.py` (`SamplingMetadata`) plus the
per-request state vLLM keeps in `InputBatch` and the built-in logits
processors (`vllm/v1/sample/logits_processor/builtin.py`: min_tokens,
logit_bias, min_p). `from_requests` builds the arrays from per-request state;
while a batch keeps the same requests in the same order, `next_step` reuses
them and rebuilds only what depends on the generated tokens (as vLLM updates
its persistent tensors only when the batch changes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from kiln.runtime.sample.sampling_params import SAMPLING_EPS, SamplingParams, SamplingType


def _min_tokens_entries(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                        eos_token_ids: Sequence[int], vocab_size: int):
    """min_tokens: forbid every stop token while the output is still too short.
    -> (rows, cols) as i64 arrays, or (None, None)."""
    mt_rows: list[int] = []
    mt_cols: list[int] = []
    for i, p in enumerate(params):
        if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
            stops = sorted(t for t in p.all_stop_token_ids(eos_token_ids) if 0 <= t < vocab_size)
            mt_rows += [i] * len(stops)
            mt_cols += stops
    if not mt_rows:
        return None, None
    return np.array(mt_rows, dtype=np.int64), np.array(mt_cols, dtype=np.int64)


def pad_token_ids(token_ids: Sequence[Sequence[int]], pad: int) -> np.ndarray:
    """-> i64[B, max_len] padded with `pad` (vLLM pads with vocab_size: no token has it)."""
    width = max((len(t) for t in token_ids), default=0)
    out = np.full((len(token_ids), max(width, 1)), pad, dtype=np.int64)
    for i, ids in enumerate(token_ids):
        out[i, : len(ids)] = ids
    return out


@dataclass(frozen=True, eq=False)
class SamplingMetadata:
    vocab_size: int
    temperature: np.ndarray  # f32[B]; rows below SAMPLING_EPS are greedy
    all_greedy: bool
    all_random: bool
    top_p: Optional[np.ndarray]  # f32[B], None when no row uses top-p
    top_k: Optional[np.ndarray]  # i32[B] with vocab_size meaning off; None when no row uses top-k
    min_p: Optional[np.ndarray]  # f32[B], None when no row uses min-p
    generators: Mapping[int, np.random.Generator]  # batch row -> the seeded request's own generator
    max_num_logprobs: Optional[int]  # most logprobs any row asked for (-1 -> vocab_size); None = none
    no_penalties: bool
    presence_penalties: np.ndarray  # f32[B]
    frequency_penalties: np.ndarray  # f32[B]
    repetition_penalties: np.ndarray  # f32[B]
    prompt_token_ids: Optional[np.ndarray]  # i64[B, Lp] padded with vocab_size; only with penalties
    output_token_ids: Sequence[Sequence[int]]  # per row, the tokens generated so far
    allowed_token_ids_mask: Optional[np.ndarray]  # bool[B, V], True = not allowed
    bad_words_token_ids: Mapping[int, Sequence[Sequence[int]]]  # row -> banned token sequences
    min_tokens_rows: Optional[np.ndarray]  # i64[N] with min_tokens_cols: logits set to -inf
    min_tokens_cols: Optional[np.ndarray]
    logit_bias_rows: Optional[np.ndarray]  # i64[M] with cols and values: logits += values
    logit_bias_cols: Optional[np.ndarray]
    logit_bias_values: Optional[np.ndarray]  # f32[M]

    @property
    def batch_size(self) -> int:
        return len(self.temperature)

    def next_step(self, output_token_ids: Sequence[Sequence[int]], params: Optional[Sequence[SamplingParams]],
                  eos_token_ids: Sequence[int] = ()) -> "SamplingMetadata":
        """The metadata of the same requests, in the same order, one step on: only what
        depends on the tokens generated so far is rebuilt (the model runner's steady decode
        batch). params: the requests' params, needed only when one has min_tokens (None: none
        has). Equals from_requests on the same inputs (tests/test_persistent_batch.py)."""
        if len(output_token_ids) != self.batch_size:
            raise ValueError("next_step needs one output list per row")
        rows = cols = None
        if params is not None:
            rows, cols = _min_tokens_entries(params, output_token_ids, eos_token_ids, self.vocab_size)
        return dataclasses.replace(self, output_token_ids=output_token_ids, min_tokens_rows=rows,
                                   min_tokens_cols=cols)

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        generators: Optional[Sequence[Optional[np.random.Generator]]] = None,
        bad_words_token_ids: Optional[Sequence[Optional[Sequence[Sequence[int]]]]] = None,
        eos_token_ids: Sequence[int] = (),
    ) -> "SamplingMetadata":
        """One row per request, in batch order.

        generators[i]: request i's own generator (`SamplingParams.new_generator()`,
        kept with the request across steps); required for seeded requests.
        bad_words_token_ids[i]: `SamplingParams.tokenize_bad_words(...)`, required
        when request i has bad_words. eos_token_ids: the model's EOS ids, which
        min_tokens forbids along with stop_token_ids.
        """
        B = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == B):
            raise ValueError("params, prompt_token_ids and output_token_ids need one entry per request")
        gens = list(generators) if generators is not None else [None] * B
        bad = list(bad_words_token_ids) if bad_words_token_ids is not None else [None] * B
        if len(gens) != B or len(bad) != B:
            raise ValueError("generators and bad_words_token_ids need one entry per request")

        f32 = lambda name: np.array([getattr(p, name) for p in params], dtype=np.float32)  # noqa: E731
        temperature = f32("temperature")
        greedy = temperature < SAMPLING_EPS
        top_p = f32("top_p")
        # top_k 0 / -1 / >= vocab all mean "keep everything" (vLLM InputBatch).
        top_k = np.array([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], dtype=np.int32)
        min_p = f32("min_p")

        row_generators: dict[int, np.random.Generator] = {}
        for i, p in enumerate(params):
            if p.sampling_type == SamplingType.RANDOM_SEED:
                if gens[i] is None:
                    raise ValueError(f"request {i} has seed={p.seed} but no generator; "
                                     "keep SamplingParams.new_generator() with the request")
                row_generators[i] = gens[i]

        requested = [vocab_size if p.logprobs == -1 else p.logprobs for p in params if p.logprobs is not None]
        presence, frequency, repetition = f32("presence_penalty"), f32("frequency_penalty"), f32("repetition_penalty")
        no_penalties = bool(np.all(presence == 0) and np.all(frequency == 0) and np.all(repetition == 1))

        allowed_mask = None
        if any(p.allowed_token_ids is not None for p in params):
            allowed_mask = np.zeros((B, vocab_size), dtype=bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids is not None:
                    allowed_mask[i] = True
                    allowed_mask[i, list(p.allowed_token_ids)] = False

        bad_words: dict[int, Sequence[Sequence[int]]] = {}
        for i, p in enumerate(params):
            if p.bad_words:
                if bad[i] is None:
                    raise ValueError(f"request {i} has bad_words but no bad_words_token_ids; "
                                     "use SamplingParams.tokenize_bad_words")
                bad_words[i] = bad[i]

        mt_rows, mt_cols = _min_tokens_entries(params, output_token_ids, eos_token_ids, vocab_size)
        lb_rows, lb_cols, lb_vals = [], [], []
        for i, p in enumerate(params):
            for tok, bias in (p.logit_bias or {}).items():
                lb_rows.append(i)
                lb_cols.append(tok)
                lb_vals.append(bias)

        def idx(values):
            return np.array(values, dtype=np.int64) if values else None

        return cls(
            vocab_size=vocab_size,
            temperature=temperature,
            all_greedy=bool(greedy.all()),
            all_random=bool(not greedy.any()),
            top_p=top_p if np.any(top_p[~greedy] < 1.0) else None,
            top_k=top_k if np.any(top_k[~greedy] < vocab_size) else None,
            min_p=min_p if np.any(min_p[~greedy] > 0.0) else None,
            generators=row_generators,
            max_num_logprobs=max(requested) if requested else None,
            no_penalties=no_penalties,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            prompt_token_ids=None if no_penalties else pad_token_ids(prompt_token_ids, vocab_size),
            output_token_ids=output_token_ids,
            allowed_token_ids_mask=allowed_mask,
            bad_words_token_ids=bad_words,
            min_tokens_rows=mt_rows,
            min_tokens_cols=mt_cols,
            logit_bias_rows=idx(lb_rows),
            logit_bias_cols=idx(lb_cols),
            logit_bias_values=np.array(lb_vals, dtype=np.float32) if lb_vals else None,
        )
