"""Rebuild a byte-level BPE tokenizer from a GGUF's tokenizer.ggml.* metadata.

A port of what transformers does for a GGUF (integrations/gguf/gguf_tokenizer_mapping.py:
byte_level_tokenizer, add_gguf_special_tokens, set_split_regex, then GPT2Tokenizer's
pipeline), so that ids equal transformers' for the same file:

- the vocabulary is the token list, with any token not spelled in GPT-2's byte alphabet
  respelled byte by byte (llama.cpp writes some added tokens as raw UTF-8);
- the pre-tokenizer is GPT-2's ByteLevel regex unless tokenizer.ggml.pre names a split
  transformers knows (llama3, qwen2, ...); "smollm" is not one, so SmolLM2 gets GPT-2's
  regex, as in transformers;
- CONTROL tokens (type 3) become special added tokens, USER_DEFINED (type 4) plain added
  tokens, so both match whole in text instead of being cut into bytes.

It takes the metadata dict only, so the runtime needs no gguf package.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from kiln.errors import InvalidModelError, UnsupportedArchitectureError
from kiln.runtime.text.tokenizer import add_missing_special_tokens

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> split regex, as transformers' GGUF_PRE_TOKENIZER_SPLITS. Any other
# value keeps GPT-2's ByteLevel regex, which is what transformers does with it too.
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}

# Special token name -> tokenizer.ggml key of its id.
SPECIAL_IDS = {
    "bos_token": "bos_token_id", "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id", "pad_token": "padding_token_id",
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (transformers' convert_slow_tokenizer)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_gguf_tokenizer(metadata: dict[str, Any]) -> tuple[tokenizers.Tokenizer, dict[str, str | None], bool, bool]:
    """(backend, special token strings, add_bos, add_eos) for a GGUF's tokenizer metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedArchitectureError(
            f"GGUF tokenizer type {kind!r} is not supported by kiln (only byte-level BPE, 'gpt2'); "
            "load the model's Hugging Face directory instead")
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise InvalidModelError("GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    token_types = metadata.get("tokenizer.ggml.token_type") or ()

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Later duplicates win, as in transformers' dict comprehension.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    try:
        pairs = [tuple(m.split(" ")) for m in merges]
        backend = tokenizers.Tokenizer(models.BPE(
            vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
            end_of_word_suffix="", fuse_unk=False))
    except Exception as e:  # the Rust side raises a bare Exception on a bad merge
        raise InvalidModelError(f"GGUF tokenizer merges are inconsistent with its vocabulary: {e}") from None

    split = PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()

    # A CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel; adding it
    # would mint an id past the embedding table, so transformers skips it and so do we.
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types) if kind == CONTROL and set(t) <= alphabet]
    if control:
        backend.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types) if kind == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)

    special = {}
    for name, key in SPECIAL_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        special[name] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    # GPT2Tokenizer's own default special token is added too when the vocabulary has it.
    add_missing_special_tokens(backend, ["<|endoftext|>", *special.values()])
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    return backend, special, add_bos, add_eos
