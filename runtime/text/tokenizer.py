"""Text <-> token ids, from a Hugging Face directory or from GGUF metadata.

A thin wrapper over a `tokenizers.Tokenizer` (Rust, fast, no torch) plus what the
engine needs beside it: the ids that end generation, the special token strings chat
templates use, and the chat template itself. Encodings must equal transformers' for the
same files, since the model was trained on transformers' ids; tests check that.

A GGUF carries no tokenizer.json, only llama.cpp's vocabulary metadata; the builder in
gguf_tokenizer.py turns it into the tokenizer transformers builds from the same file.
"""
from __future__ import annotations

import functools
import json
import numbers
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from kiln.errors import ConfigError, InvalidModelError, ModelNotFoundError

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """encode/decode plus the special tokens and chat template of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str | None] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.chat_template = chat_template
        special_tokens = special_tokens or {}
        self.bos_token = special_tokens.get("bos_token")
        self.eos_token = special_tokens.get("eos_token")
        self.unk_token = special_tokens.get("unk_token")
        self.pad_token = special_tokens.get("pad_token")
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.pad_token_id = self.token_to_id(self.pad_token)
        # Generation ends on any of these: the tokenizer's eos plus the ids generation_config
        # (or llama.cpp's eot/eom) names; chat models often end turns on a token other than eos.
        eos = {self.eos_token_id} if self.eos_token_id is not None else set()
        self.eos_token_ids: set[int] = eos | {int(i) for i in extra_eos_token_ids}

    # --- encode / decode -------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_long(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode() for a long text on a worker thread: tokenizers releases the GIL in
        encode_batch only, so other threads (a server's event loop) run meanwhile."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one vocabulary entry spells: a text of C characters has at least
        C / max_token_chars tokens (byte-level entries spell one char per byte, SentencePiece's
        one per char, byte-fallback "<0x41>" more than it stands for), up to what a normalizer
        takes out (composing accents at most halves a text: callers allow for that)."""
        return max(1, max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # transformers 5 skips clean_up_tokenization_spaces for BPE, so this is all it does.
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included (len(hf_tokenizer))."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens, as transformers passes them to chat templates."""
        return {n: getattr(self, n) for n in SPECIAL_NAMES if getattr(self, n) is not None}

    @property
    def all_special_ids(self) -> set[int]:
        return {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos_ids={sorted(self.eos_token_ids)})"

    # --- constructors ----------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face model directory: tokenizer.json, tokenizer_config.json and friends."""
        path = Path(path).expanduser()
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelNotFoundError(f"model directory {path} has no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception for bad JSON
            raise InvalidModelError(f"{tok_file} is not a valid tokenizer.json: {e}") from None
        cfg = _read_json(path / "tokenizer_config.json")
        if "added_tokens_decoder" not in cfg:
            # Older repos name their special tokens in special_tokens_map.json, which then
            # wins over tokenizer_config.json (transformers' legacy path).
            cfg = {**cfg, **_read_json(path / "special_tokens_map.json")}
        special = {n: _token_content(cfg.get(n)) for n in SPECIAL_NAMES}
        add_missing_special_tokens(backend, special.values())
        # tokenizer.json's post-processor decides bos/eos: transformers 5 drops tokenizer_config's
        # add_bos_token/add_eos_token whenever a tokenizer.json exists, and so do we.
        template = _chat_template(path, cfg)
        gen_file = path / "generation_config.json"
        gen = _read_json(gen_file)
        if not gen:
            gen_file = path / "config.json"
            gen = _read_json(gen_file)
        return cls(backend, special_tokens=special, extra_eos_token_ids=_ids(gen.get("eos_token_id"), str(gen_file)),
                   chat_template=template)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """The tokenizer a GGUF describes in its tokenizer.ggml.* metadata."""
        from kiln.runtime.text.gguf_tokenizer import build_gguf_tokenizer

        backend, special, add_bos, add_eos = build_gguf_tokenizer(metadata)
        set_post_processor(backend, special, add_bos, add_eos)
        # llama.cpp ends generation on any end-of-generation token, not only eos.
        extra = _ids([metadata[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                      if metadata.get(k) is not None], "the GGUF metadata's eot/eom token ids")
        return cls(backend, special_tokens=special, extra_eos_token_ids=extra,
                   chat_template=metadata.get("tokenizer.chat_template"))


def add_missing_special_tokens(backend: tokenizers.Tokenizer, tokens: Iterable[str | None]) -> None:
    """Named special tokens must match whole in text; transformers adds any that are not yet
    added tokens. We add only those in the vocabulary: a new id would lie past the model's
    embedding table."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    vocab = backend.get_vocab(with_added_tokens=False)
    new = [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(tokens)
           if t is not None and t not in added and t in vocab]
    if new:
        backend.add_special_tokens(new)


def set_post_processor(backend: tokenizers.Tokenizer, special: dict, add_bos: bool, add_eos: bool) -> None:
    """transformers' TokenizersBackend.update_post_processor: bos/eos around every sequence."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    pairs = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=pairs)


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidModelError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidModelError(f"{file} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config writes a special token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any, source: str) -> list[int]:
    """eos_token_id as generation_config.json / config.json hold it: an id or a list of ids.
    Anything else (issue 42 #12: "abc") is the file's error, said in one sentence."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise ConfigError(f"{source}: eos_token_id must be a token id or a list of token ids, got {value!r}")
    return [int(v) for v in ids]


def _chat_template(path: Path, cfg: dict) -> str | None:
    """chat_template.jinja wins over tokenizer_config's, as in transformers 5."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template
