"""A tiny random llama with a real (byte-level BPE) tokenizer and a ChatML chat
template saved beside it: a model the server can serve in milliseconds a step.

The tokenizer has the 256 byte symbols plus three special tokens; the model's
vocabulary is a little larger, so every id the tokenizer knows is in range.
Random weights sample bytes that are often not valid UTF-8, which exercises
the incremental detokenizer's held-back partial characters too.
"""
from __future__ import annotations

import json
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from tests.tiny_models import BASE, randomize

MODEL_NAME = "tiny-chat"  # the name test servers serve it under
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 264  # 256 bytes + 3 specials, rounded up
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_tiny_tokenizer(out_dir: Path) -> Tokenizer:
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}))
    return tok


def make_tiny_chat_model(out_dir: Path, *, seed: int = 0) -> Path:
    """Save the model and its tokenizer under out_dir; -> out_dir."""
    out_dir = Path(out_dir)
    cfg = transformers.LlamaConfig(**{**BASE, "vocab_size": VOCAB_SIZE}, tie_word_embeddings=False,
                                   architectures=["LlamaForCausalLM"], bos_token_id=257, eos_token_id=258,
                                   pad_token_id=256)
    model = randomize(transformers.LlamaForCausalLM(cfg).eval(), seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    make_tiny_tokenizer(out_dir)
    return out_dir


def tiny_engine_args(model_dir, **kw):
    from kiln.entrypoints.engine_args import EngineArgs

    kw.setdefault("kv_cache_tokens", 16 * 512)
    return EngineArgs(model=str(model_dir), **kw)
