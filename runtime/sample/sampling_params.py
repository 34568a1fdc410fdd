"""Per-request sampling parameters, ported from vLLM's `vllm/sampling_params.py`.

Field names, defaults and validation rules follow vLLM's `SamplingParams`
(`__post_init__`, `_verify_args`, `_verify_greedy_sampling`,
`update_from_tokenizer`). The dataclass is frozen: `__post_init__` normalises
once (a lone stop string becomes a tuple, `seed=-1` becomes None, ...) and
nothing changes afterwards. Run-time facts (the EOS id, the tokenizer, the
vocabulary size) are passed to the methods that need them instead of being
written into the params, as vLLM does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.runtime.sample.structured_outputs import StructuredOutputsParams

# Below this temperature a request samples greedily (vLLM `_SAMPLING_EPS`).
SAMPLING_EPS = 1e-5
# Temperatures in [SAMPLING_EPS, MIN_TEMPERATURE) are raised to it, as vLLM
# does (`_MAX_TEMP`) to keep logits / temperature finite in float32. vLLM also
# raises (0, SAMPLING_EPS) and so samples them; here they stay greedy.
MIN_TEMPERATURE = 1e-2
# Seeds a client may send: a signed 64-bit integer, as vLLM's protocol bounds them.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
SEED_MASK = (1 << 64) - 1


class InvalidSamplingParamsError(KilnError, ValueError):
    """A sampling parameter is out of range; `field` names it (OpenAI's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 1e-6, 1e6  # past these every seen token's fate is fixed anyway


def _fail(field: str, message: str) -> None:
    raise InvalidSamplingParamsError(field, message)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (>0) / multiplies (<0) logits of prompt or output tokens
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # in [0, 1], relative to the most likely token; 0 = off
    seed: Optional[int] = None
    stop: Union[str, Sequence[str], None] = None  # normalised to tuple[str, ...]
    stop_token_ids: Optional[Sequence[int]] = None  # normalised to tuple[int, ...]
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16  # None = up to max_model_len
    min_tokens: int = 0
    logprobs: Optional[int] = None  # top-k logprobs per output token; -1 = whole vocabulary
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: Optional[Mapping[int, float]] = None  # keys normalised to int
    allowed_token_ids: Optional[Sequence[int]] = None  # normalised to tuple[int, ...]
    bad_words: Optional[Sequence[str]] = None  # normalised to tuple[str, ...]; see tokenize_bad_words
    # the grammar the output must match (runtime/sample/structured_outputs.py), or None
    structured_outputs: Optional["StructuredOutputsParams"] = None

    def __post_init__(self) -> None:
        # Normalise in place once; the instance is frozen from here on.
        def put(name, value):
            object.__setattr__(self, name, value)

        if self.seed == -1:
            put("seed", None)
        if SAMPLING_EPS <= self.temperature < MIN_TEMPERATURE:
            put("temperature", MIN_TEMPERATURE)
        stop = self.stop
        put("stop", () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop))
        # Duplicates are dropped keeping the first occurrence, as vLLM does.
        put("stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids or ())))
        put("bad_words", tuple(dict.fromkeys(self.bad_words or ())))
        if self.allowed_token_ids is not None:
            put("allowed_token_ids", tuple(self.allowed_token_ids))
        if self.logit_bias is not None:
            try:
                put("logit_bias", {int(t): float(b) for t, b in self.logit_bias.items()})
            except (TypeError, ValueError):
                _fail("logit_bias", "logit_bias keys must be integer token ids and values numbers.")
            if not all(math.isfinite(b) for b in self.logit_bias.values()):
                # a NaN or infinite bias made every logit NaN and sampled token 0, silently
                _fail("logit_bias", "logit_bias values must be finite numbers.")
        if self.logprobs is True:
            put("logprobs", 1)
        if self.prompt_logprobs is True:
            put("prompt_logprobs", 1)
        self._verify_args()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change an argmax, so turn them off.
            put("top_p", 1.0)
            put("top_k", 0)
            put("min_p", 0.0)
            if self.n > 1:
                _fail("n", f"n must be 1 when using greedy sampling, got {self.n}.")

    def _verify_args(self) -> None:  # vLLM SamplingParams._verify_args
        if not _is_int(self.n) or self.n < 1:
            _fail("n", f"n must be an integer of at least 1, got {self.n!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                _fail(name, f"{name} must be in [-2, 2], got {value}.")
        # Bounded both ways, not only > 0: the penalty divides or multiplies f32 logits, and one that
        # rounds to 0 or past 1e38 in f32 made them inf, then NaN (found by tests/server/test_openapi.py).
        if not REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX:
            _fail("repetition_penalty", f"repetition_penalty must be in [{REPETITION_PENALTY_MIN:g}, "
                  f"{REPETITION_PENALTY_MAX:g}], got {self.repetition_penalty}.")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            _fail("temperature", f"temperature must be a finite non-negative number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens",
                  f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or (value < 0 and value != -1)):
                _fail(name, f"{name} must be a non-negative integer or -1, got {value!r}.")
        if not all(_is_int(t) for t in self.stop_token_ids):
            _fail("stop_token_ids", f"stop_token_ids must contain only integers, got {list(self.stop_token_ids)}.")
        if not all(isinstance(s, str) for s in self.stop) or any(not s for s in self.stop):
            _fail("stop", "stop must be non-empty strings.")
        if self.stop and not self.detokenize:
            _fail("stop", "stop strings are only supported when detokenize is True.")
        if not all(isinstance(w, str) and w for w in self.bad_words):
            _fail("bad_words", "bad_words must be non-empty strings.")
        if self.allowed_token_ids is not None and not all(_is_int(t) for t in self.allowed_token_ids):
            _fail("allowed_token_ids", "allowed_token_ids must contain only integers.")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            # vLLM's bound (a torch long); negative seeds are fine: new_generator maps them
            _fail("seed", f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}.")

    def verify(self, vocab_size: int) -> None:
        """Checks that need the model's vocabulary (vLLM `SamplingParams.verify`)."""
        def check_ids(name, ids):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                _fail(name, f"{name} contains out-of-vocabulary token ids {bad} (vocabulary size {vocab_size}).")

        check_ids("stop_token_ids", self.stop_token_ids)
        check_ids("logit_bias", self.logit_bias or ())
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                _fail("allowed_token_ids", "allowed_token_ids must not be empty.")
            check_ids("allowed_token_ids", self.allowed_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                _fail(name, f"{name}={value} is more than the vocabulary size {vocab_size}.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back while streaming so a stop string is never shown."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def all_stop_token_ids(self, eos_token_ids: Sequence[int] = ()) -> frozenset[int]:
        """Tokens min_tokens forbids: stop_token_ids plus EOS (even with ignore_eos, as vLLM)."""
        return frozenset(self.stop_token_ids) | frozenset(eos_token_ids)

    def new_generator(self) -> Optional[np.random.Generator]:
        """The request's own noise source: seeded requests replay whatever their batch."""
        if self.sampling_type != SamplingType.RANDOM_SEED:
            return None
        # default_rng refuses negative seeds (issue 42 #8: seed=-5 raised inside the step and
        # killed the engine); a seed's 64-bit two's complement is its key, as row_seeds takes it
        # on the GPU. Non-negative seeds are unchanged.
        return np.random.default_rng(int(self.seed) & SEED_MASK)

    def child_seed(self, index: int) -> Optional[int]:
        """The seed of completion `index` of an n > 1 request: seed + index, wrapped into the
        valid range (seed = SEED_MAX must not make its second child invalid mid-add)."""
        if self.seed is None:
            return None
        return (int(self.seed) + index - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN

    def tokenize_bad_words(self, encode: Callable[[str], Sequence[int]],
                           vocab_size: Optional[int] = None) -> tuple[tuple[int, ...], ...]:
        """Token sequences to forbid (vLLM `update_from_tokenizer`).

        `encode(text)` returns token ids without special tokens. Each word is
        encoded bare and with a leading space, so it is banned both at the start
        of the text and mid-text; the spaced form is kept only when it is a
        different token sequence of the same length.
        """
        out: list[tuple[int, ...]] = []
        for word in self.bad_words:
            bare = tuple(int(t) for t in encode(word.lstrip()))
            if not bare:
                _fail("bad_words", f"bad_words entry {word!r} tokenizes to no tokens.")
            out.append(bare)
            spaced = tuple(int(t) for t in encode(" " + word.lstrip()))
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        if vocab_size is not None:
            bad = sorted({t for seq in out for t in seq if not 0 <= t < vocab_size})
            if bad:
                _fail("bad_words", f"bad_words tokenize to out-of-vocabulary ids {bad}.")
        return tuple(out)
