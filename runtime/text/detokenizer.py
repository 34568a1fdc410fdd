"""Incremental detokenization and stop strings, one request at a time.

Ported from vLLM's `vllm/v1/engine/detokenizer.py` (`BaseIncrementalDetokenizer`,
`FastIncrementalDetokenizer`, `SlowIncrementalDetokenizer`, `check_stop_strings`)
and `detokenizer_utils.py::detokenize_incrementally`.

Text is produced token by token and never ends inside a UTF-8 character: a
token that carries only part of a multi-byte character (byte-level BPE splits
emoji and CJK that way) yields "" until the character is complete. Two decoders
do that: tokenizers' `DecodeStream` (the fast path, as vLLM), and the
prefix_offset/read_offset algorithm (decode a short window twice and emit the
difference, unless it ends in U+FFFD) for tokenizers without it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import tokenizers
import tokenizers.decoders

from kiln.runtime.sample.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# tokenizers' DecodeStream raises this when a decoder's output is not monotonic.
_INVALID_PREFIX_ERR = "Invalid prefix encountered"
# Prompt tokens kept as decoding context by the offset decoder (vLLM's default).
_INITIAL_OFFSET = 5


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> Optional[tuple[str, int]]:
    """Find a stop string that ends within the last new_char_count characters.

    -> (stop string, length to truncate output_text to, or -1 for no
    truncation), or None. The search starts len(stop) - 1 characters before the
    new text so that a stop string spanning tokens is found, and never rescans
    older text. When several match, the one that ends first wins (as if tokens
    had arrived one at a time); ties go to the earlier in `stop`.
    """
    if not new_char_count or not stop:
        return None
    best: Optional[tuple[str, int, int]] = None  # (stop, start, end)
    for s in stop:
        start = output_text.find(s, max(0, len(output_text) - new_char_count - len(s) + 1))
        if start != -1 and (best is None or start + len(s) < best[2]):
            best = (s, start, start + len(s))
    if best is None:
        return None
    s, start, end = best
    if not include_in_output:
        return s, start
    return (s, -1) if end >= len(output_text) else (s, end)


def unwrap_tokenizer(tokenizer):
    """Accept a tokenizers.Tokenizer, or a wrapper holding one as `.backend`/`.backend_tokenizer`."""
    for attr in ("backend", "backend_tokenizer", "_tokenizer"):
        inner = getattr(tokenizer, attr, None)
        if isinstance(inner, tokenizers.Tokenizer):
            return inner
    return tokenizer


class _StreamDecoder:
    """tokenizers' DecodeStream, primed on a prompt suffix (vLLM FastIncrementalDetokenizer)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool, spaces_between_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = self._new_stream(self._priming_suffix(prompt_token_ids))
        # Special tokens back to back are joined without the decoder's spacing when asked.
        self.added_tokens: dict[int, str] = {}
        if not (skip_special_tokens or spaces_between_special_tokens):
            self.added_tokens = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.last_special = False
        # Special tokens that decoding skips add no text, and are kept out of the stream: it
        # holds every id since its last text, so a run of them (EOS or padding sampled over
        # and over) made each step re-decode the whole run. Every decode the stream makes
        # drops them anyway, so its text is the same without them.
        self.skipped_ids: frozenset[int] = frozenset()
        if skip_special_tokens:
            self.skipped_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    def _priming_suffix(self, prompt: Sequence[int]) -> list[int]:
        # The shortest suffix of 4..23 tokens that decodes without a broken character,
        # so the stream starts on a character boundary; else the whole prompt.
        prompt = list(prompt)
        if len(prompt) > 4:
            for n in range(4, min(len(prompt) + 1, 24)):
                if REPLACEMENT_CHAR not in self.tokenizer.decode(prompt[-n:]):
                    return prompt[-n:]
        return prompt

    def _new_stream(self, ids: list[int]):
        try:  # tokenizers >= 0.22 primes natively
            return tokenizers.decoders.DecodeStream(ids=ids, skip_special_tokens=self.skip_special_tokens)
        except TypeError:
            stream = tokenizers.decoders.DecodeStream(skip_special_tokens=self.skip_special_tokens)
            for t in ids:
                stream.step(self.tokenizer, t)
            return stream

    def decode_next(self, token_id: int) -> str:
        if token_id in self.skipped_ids:
            return ""
        try:
            text = self.stream.step(self.tokenizer, token_id)
        except (OverflowError, TypeError):
            text = None  # an id no tokenizer knows (vLLM issue 21951): no text
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX_ERR):
                raise
            # The decoder produced non-monotonic text; restart the stream (vLLM issue 17448).
            self.stream = self._new_stream([])
            text = self.stream.step(self.tokenizer, token_id)
        if self.added_tokens:
            special = self.added_tokens.get(token_id)
            if special is not None and self.last_special:
                text = special
            self.last_special = special is not None
        return text or ""


class _OffsetDecoder:
    """prefix_offset/read_offset over token ids (vLLM detokenize_incrementally).

    Decodes ids[prefix:read] and ids[prefix:]; the difference is the new text.
    The prefix is context that defeats decoders' clean-up of the first token.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-(_INITIAL_OFFSET + 2):])
        self.read = len(self.ids)
        self.prefix = max(self.read - _INITIAL_OFFSET, 0)

    def decode_next(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(self.ids[self.prefix:self.read])
        new_text = decode(self.ids[self.prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # A character still incomplete at the end: wait for its next bytes.
            return ""
        # Advance: the read window becomes the prefix; drop what no window needs.
        del self.ids[:self.read]
        self.prefix, self.read = 0, len(self.ids)
        return new_text[len(prefix_text):]


class IncrementalDetokenizer:
    """Output text of one request, grown token by token, with stop strings applied.

    tokenizer=None or params.detokenize=False keeps token ids only (no text, no
    stop strings). use_decode_stream=False forces the offset decoder.
    """

    def __init__(self, tokenizer: Optional[tokenizers.Tokenizer], prompt_token_ids: Sequence[int],
                 params: SamplingParams, *, use_decode_stream: bool = True):
        self.stop: tuple[str, ...] = tuple(params.stop)
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.stop_buffer_length = params.output_text_buffer_length
        self.token_ids: list[int] = []  # output tokens, stop token included
        self._text = ""
        # Without stop strings nothing needs the text before a caller reads it (a FINAL_ONLY
        # request reads it once, when it finishes), so update() only records the tokens and
        # output_text decodes token_ids[_decoded:_text_end] first (_lazy): the same decoder
        # calls in the same order, so the same text, without a pass per request per step.
        self._decoded = 0
        self._text_end: int | None = None  # the stop token that ended the request, kept out of the text
        self._last_output_text_offset = 0
        self._decoder = None
        if tokenizer is not None and params.detokenize:
            backend = unwrap_tokenizer(tokenizer)
            if use_decode_stream and hasattr(tokenizers.decoders, "DecodeStream"):
                self._decoder = _StreamDecoder(backend, prompt_token_ids, params.skip_special_tokens,
                                               params.spaces_between_special_tokens)
            else:
                self._decoder = _OffsetDecoder(backend, prompt_token_ids, params.skip_special_tokens)
        self._lazy = self._decoder is not None and not self.stop  # text decoded when read

    @property
    def output_text(self) -> str:
        """The text so far (the tokens update() only recorded are decoded now)."""
        if self._lazy:
            self._decode_pending()
        return self._text

    def _decode_pending(self) -> None:
        end = len(self.token_ids) if self._text_end is None else self._text_end
        if self._decoded < end:
            decode_next = self._decoder.decode_next
            self._text += "".join([decode_next(t) for t in self.token_ids[self._decoded:end]])
            self._decoded = end

    @output_text.setter
    def output_text(self, text: str) -> None:
        self._text = text

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool) -> Optional[str]:
        """Append this step's tokens; -> the stop string that ended the text, or None.

        stop_terminated: the last token is EOS or a stop token id; its text is
        left out unless include_stop_str_in_output. A matched stop string cuts
        output_text at its start (or its end with include_stop_str_in_output).
        Stop strings are not looked for in the text of the first min_tokens tokens.
        """
        if not new_token_ids:
            return None
        if self._decoder is None:
            self.token_ids.extend(new_token_ids)
            return None
        if not self.stop:  # no stop strings: the text only grows, decoded when read (output_text)
            self.token_ids.extend(new_token_ids)
            if stop_terminated and not self.include_stop_str_in_output:
                self._text_end = len(self.token_ids) - 1
            return None
        skipped = None
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = list(new_token_ids)
            skipped = new_token_ids.pop()
        decode_next = self._decoder.decode_next
        check_from = len(self.output_text)
        if self.min_tokens:
            for token_id in new_token_ids:
                self.token_ids.append(token_id)
                self.output_text += decode_next(token_id)
                if len(self.token_ids) <= self.min_tokens:
                    check_from = len(self.output_text)
        else:  # one concatenation per step (the usual step brings one token)
            self.token_ids.extend(new_token_ids)
            self.output_text += "".join([decode_next(t) for t in new_token_ids])
        if skipped is not None:
            self.token_ids.append(skipped)

        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        found = check_stop_strings(self.output_text, len(self.output_text) - check_from, self.stop,
                                   self.include_stop_str_in_output)
        if found is None:
            return None
        stop_string, truncate_to = found
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_string

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now: all of it (delta=False) or what is new since the last call.

        While not finished, the last stop_buffer_length characters are held back:
        they may be the start of a stop string that must not be shown.
        """
        hold = 0 if finished else self.stop_buffer_length
        end = len(self.output_text) - hold
        if not delta:
            return self.output_text[:end] if hold else self.output_text
        start = self._last_output_text_offset
        if start < end:
            self._last_output_text_offset = end
            return self.output_text[start:end]
        return ""
