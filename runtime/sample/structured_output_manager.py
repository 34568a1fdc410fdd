"""The batch's grammars: a bitmask before each sampling step, the sampled tokens after it
(vLLM: vllm/v1/structured_output/__init__.py StructuredOutputManager, grammar_bitmask,
and the scheduler's accept_tokens).

Only constrained requests cost anything: with none in the batch `bitmask` returns None and
the sampler runs as before. Masks are filled one request after another (llguidance's
parallel executor is the next step once batches hold many constrained rows). A request whose grammar reaches a dead end (no token
allowed, or the matcher failed) may produce only EOS, so it ends at once, and `stop_reasons`
names it (the runner reports it as the request's stop_reason).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kiln.runtime.sample.grammar import DEAD_END, GrammarTokenizer, RequestGrammar


@dataclass(frozen=True, eq=False)
class GrammarBitmask:
    rows: np.ndarray  # i64[K]: the batch rows constrained this step
    bits: np.ndarray  # i32[K, ceil(V / 32)]: bit t of row k set = token t allowed


class StructuredOutputManager:
    def __init__(self, tokenizer: Optional[GrammarTokenizer]) -> None:
        self.tokenizer = tokenizer
        self.num_requests = 0  # held constrained requests
        self._executor = None

    def new_request(self, params) -> Optional[RequestGrammar]:
        so = getattr(params, "structured_outputs", None)
        if so is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        self.num_requests += 1
        return RequestGrammar(self.tokenizer, so)

    def drop(self, grammar: Optional[RequestGrammar]) -> None:
        if grammar is not None:
            self.num_requests -= 1

    def bitmask(self, grammars: Sequence[Optional[RequestGrammar]]) -> Optional[GrammarBitmask]:
        """The masks of this step's constrained rows (grammars: one per sampled row, None when
        unconstrained), or None when no row is constrained."""
        rows = [i for i, g in enumerate(grammars) if g is not None and g.constrains]
        if not rows:
            return None
        width = (self.tokenizer.vocab_size + 31) // 32
        bits = np.zeros((len(rows), width), dtype=np.int32)
        for k, i in enumerate(rows):
            g = grammars[i]
            if not g.fill(bits[k]):
                g.dead = True
                bits[k] = 0  # EOS alone
                for t in self.tokenizer.eos_token_ids[:1]:  # the way out: end the request now
                    bits[k, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
        return GrammarBitmask(np.asarray(rows, dtype=np.int64), bits)

    @staticmethod
    def accept(grammars: Sequence[Optional[RequestGrammar]], tokens: Sequence[int]) -> None:
        for g, t in zip(grammars, tokens):
            if g is not None:
                g.accept(t)

    @staticmethod
    def stop_reasons(ids: Sequence[str], grammars: Sequence[Optional[RequestGrammar]]) -> dict[str, str]:
        return {rid: DEAD_END for rid, g in zip(ids, grammars) if g is not None and g.dead}
