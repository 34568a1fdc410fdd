"""Logprobs as a request returns them: per position, token id -> (logprob, rank, text).

Ported from vLLM's `vllm/v1/engine/logprobs.py` (`LogprobsProcessor`) and
`vllm/logprobs.py` (`Logprob`, `append_logprobs_for_next_position`). The
sampler hands over numbers (`LogprobsTensors`); this turns each position into
a dict holding the sampled (or prompt) token and the request's top-k, decodes
each token on its own, and sums the sampled tokens' logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from kiln.runtime.text.detokenizer import REPLACEMENT_CHAR, unwrap_tokenizer
from kiln.runtime.sample.sampler import LogprobsTensors
from kiln.runtime.sample.sampling_params import SamplingParams

# UTF-8 characters are at most 4 bytes, so 4 preceding tokens complete any of them.
_MAX_UTF8_CONTEXT = 4


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: Optional[int] = None  # 1 = most likely
    decoded_token: Optional[str] = None  # None without a tokenizer


LogprobsOnePosition = dict[int, Logprob]


class LogprobsProcessor:
    """Accumulates one request's sample and prompt logprobs.

    logprobs: one dict per output token, or None if not requested.
    prompt_logprobs: one per prompt token, the first None (nothing predicts it).
    cumulative_logprob: sum of the sampled tokens' logprobs, or None.
    """

    def __init__(self, tokenizer, num_logprobs: Optional[int], num_prompt_logprobs: Optional[int]):
        self.tokenizer = None if tokenizer is None else unwrap_tokenizer(tokenizer)
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.logprobs: Optional[list[LogprobsOnePosition]] = None if num_logprobs is None else []
        self.prompt_logprobs: Optional[list[Optional[LogprobsOnePosition]]] = (
            None if num_prompt_logprobs is None else [None])
        self.cumulative_logprob: Optional[float] = None if num_logprobs is None else 0.0
        # The last few sampled / prompt tokens, context to decode split UTF-8 characters.
        self._sample_context: list[int] = []
        self._prompt_context: list[int] = []

    @classmethod
    def from_new_request(cls, tokenizer, params: SamplingParams) -> "LogprobsProcessor":
        return cls(tokenizer if params.detokenize else None, params.logprobs, params.prompt_logprobs)

    def update_from_output(self, sample: Optional[LogprobsTensors] = None,
                           prompt: Optional[LogprobsTensors] = None) -> None:
        """sample: this request's rows of the sampler's logprobs, one per new token.
        prompt: one row per scored prompt position (a prefill chunk)."""
        if sample is not None and self.logprobs is not None:
            for ids, lps, ranks in zip(sample.token_ids.tolist(), sample.logprobs.tolist(),
                                       sample.ranks.tolist()):
                self.logprobs.append(self._position(ids, lps, ranks, self.num_logprobs, self._sample_context))
                self.cumulative_logprob += lps[0]
                self._push(self._sample_context, ids[0])
        if prompt is not None and self.prompt_logprobs is not None:
            for ids, lps, ranks in zip(prompt.token_ids.tolist(), prompt.logprobs.tolist(),
                                       prompt.ranks.tolist()):
                self.prompt_logprobs.append(
                    self._position(ids, lps, ranks, self.num_prompt_logprobs, self._prompt_context))
                self._push(self._prompt_context, ids[0])

    def pop_prompt_logprobs(self) -> Optional[list[Optional[LogprobsOnePosition]]]:
        """All prompt logprobs gathered so far, once (vLLM returns them at the end of prefill)."""
        out = self.prompt_logprobs
        if out:
            self.prompt_logprobs = []
        return out

    @staticmethod
    def _push(context: list[int], token_id: int) -> None:
        context.append(token_id)
        del context[:-_MAX_UTF8_CONTEXT]

    def _position(self, ids: list[int], lps: list[float], ranks: list[int], num: int,
                  context: Sequence[int]) -> LogprobsOnePosition:
        # Column 0 is the chosen token, then the top-k; a chosen token also in the
        # top-k appears once (its top-k entry, written second, is the same data).
        keep = len(ids) if num == -1 else min(len(ids), num + 1)
        ids, lps, ranks = ids[:keep], lps[:keep], ranks[:keep]
        texts = self._decode_each(ids, context)
        return {t: Logprob(lp, r, s) for t, lp, r, s in zip(ids, lps, ranks, texts)}

    def _decode_each(self, ids: list[int], context: Sequence[int]) -> list[Optional[str]]:
        if self.tokenizer is None:
            return [None] * len(ids)
        texts = self.tokenizer.decode_batch([[t] for t in ids], skip_special_tokens=False)
        return [self._complete_character(t, list(context)) if s.endswith(REPLACEMENT_CHAR) else s
                for t, s in zip(ids, texts)]

    def _complete_character(self, token_id: int, context: list[int]) -> str:
        """Text a byte-fallback token adds once the preceding tokens supply the rest
        of its character; "" if the character is still incomplete
        (vLLM `LogprobsProcessor._correct_decoded_token`)."""
        decode = self.tokenizer.decode
        for n in range(1, min(len(context), _MAX_UTF8_CONTEXT) + 1):
            ctx = context[-n:]
            full = decode(ctx + [token_id], skip_special_tokens=False)
            if full.endswith(REPLACEMENT_CHAR):
                continue
            # Context tokens that are themselves partial characters showed as "", so
            # their bytes belong to this token's text; strip only the clean prefix.
            clean_end = len(ctx)
            while clean_end > 0 and decode([ctx[clean_end - 1]], skip_special_tokens=False).endswith(REPLACEMENT_CHAR):
                clean_end -= 1
            prefix = decode(ctx[:clean_end], skip_special_tokens=False) if clean_end else ""
            common = 0
            for a, b in zip(prefix, full):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""
