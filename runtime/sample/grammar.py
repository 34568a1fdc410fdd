"""Constrained decoding with llguidance: the tokenizer adapter (one per model) and each
constrained request's matcher (vLLM: vllm/v1/structured_output/backend_guidance.py
GuidanceBackend, GuidanceGrammar).

The adapter gives llguidance the model's tokenizer.json text (kiln's Tokenizer wraps a
`tokenizers.Tokenizer`, which serialises to exactly that), the model's vocabulary size
(ids past the tokenizer's are never allowed) and its EOS ids (allowed once the grammar is
complete, so a finished answer ends the request as "stop"). It is built on the first
constrained request, so a server that never sees one never pays for it (about a second at
a 150k vocabulary).
"""
from __future__ import annotations

import json
import logging
from typing import Optional, Sequence

import numpy as np

from kiln.runtime.sample.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("kiln.runtime")

DEAD_END = "structured_output_dead_end"  # the stop_reason of a request whose grammar has no way on


class GrammarTokenizer:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._ll = None

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> "GrammarTokenizer":
        """From kiln's Tokenizer (runtime/text/tokenizer.py) and the model's vocabulary size."""
        return cls(tokenizer.backend.to_str(), max(vocab_size, tokenizer.vocab_size), tokenizer.eos_token_ids)

    @property
    def ll(self):
        if self._ll is None:
            import llguidance

            ll = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                        eos_token=self.eos_token_ids or None)
            plain = self._plain_added_tokens()
            self._ll = self._with_plain_tokens(ll, plain) if plain else ll
        return self._ll

    def _plain_added_tokens(self) -> set[int]:
        """Ids of the tokenizer's added tokens that are not special (Qwen3's <think>, </think>,
        <tool_call>, ...): text the model writes, which a grammar must be able to match."""
        added = json.loads(self.tokenizer_json).get("added_tokens") or []
        return {int(t["id"]) for t in added if not t.get("special", False)}

    def _with_plain_tokens(self, ll, plain: set[int]):
        """llguidance 1.9 reads every added token of a tokenizer.json as special, though its mask
        lets a plain one through where its text fits, and then its matcher refuses the token:
        a grammar spanning `</think>` reached a dead end. vLLM builds its LLTokenizer the same way
        (vllm/v1/structured_output/backend_guidance.py: llguidance.hf.from_tokenizer over the
        serialised tokenizer), so it has this too. Rebuilt here through llguidance's
        TokenizerWrapper, where the caller names the special ids: every token keeps the bytes
        llguidance gave it, and only the tokenizer's special=true tokens (and ids past its
        vocabulary) stay special."""
        import llguidance
        from tokenizers import Tokenizer

        n = ll.vocab_size
        backend = Tokenizer.from_str(self.tokenizer_json)
        # (the tokenizer.json's own decoder cannot give a byte-level token's bytes alone: it
        # replaces a partial UTF-8 sequence; llguidance's table has them)

        class _Tokens:
            eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else n - 1
            bos_token_id = None
            tokens = [ll.decode_bytes([i]) for i in range(n)]
            special_token_ids = [i for i in range(n) if i not in plain and ll.is_special_token(i)]

            def __call__(self, text):
                if isinstance(text, bytes):
                    text = text.decode("utf-8", errors="replace")
                return backend.encode(text, add_special_tokens=False).ids

        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens()), n_vocab=self.vocab_size,
                                      eos_token=self.eos_token_ids or None)

    def __getstate__(self):  # the engine process builds its own
        return {**self.__dict__, "_ll": None}


class RequestGrammar:
    """One request's matcher, and the reasoning gate in front of it: while the model thinks
    (structured_outputs.py: reasoning_end / reasoning_start) its tokens pass unconstrained."""

    def __init__(self, tokenizer: GrammarTokenizer, params: StructuredOutputsParams) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(tokenizer.ll, params.grammar_text, log_level=0)
        self.end = params.reasoning_end
        self.start = params.reasoning_start
        # "open": waiting for the end of reasoning; "first": the first token decides; "on": constrained
        self.phase = "on" if not self.end else ("first" if self.start is not None else "open")
        self.recent: list[int] = []  # the last len(end) tokens, while reasoning
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.dead = False  # no way on: only EOS is allowed from here

    @property
    def constrains(self) -> bool:
        return self.phase != "open"

    def fill(self, bits: np.ndarray) -> bool:
        """Write the allowed tokens into bits (i32[W], one bit per token); -> False at a dead
        end (the matcher failed, or it allows nothing)."""
        from llguidance.numpy import fill_next_token_bitmask

        if self.dead or self.matcher.is_error():
            return False
        fill_next_token_bitmask(self.matcher, bits[None, :], 0)
        if self.phase == "first":  # the token that opens reasoning is allowed too
            bits[self.start >> 5] |= np.int32(np.uint32(1 << (self.start & 31)).view(np.int32))
        return bool(bits.any())

    def accept(self, token: int) -> None:
        if self.phase == "first":
            self.phase = "open" if token == self.start else "on"
            if self.phase == "open":
                return
        if self.phase == "open":
            self.recent = (self.recent + [token])[-len(self.end):]
            if tuple(self.recent) == self.end:
                self.phase = "on"
            return
        if token in self.eos or self.dead:
            return  # the request ends with this token
        if not self.matcher.consume_token(token):  # the mask should have barred it
            logger.warning("grammar rejected token %d: %s", token, self.matcher.get_error())
            self.dead = True
