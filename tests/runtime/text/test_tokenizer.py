"""Our tokenizer against transformers' for the same GGUF (and the same saved directory)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from gguf import GGUFValueType, GGUFWriter

from kiln.errors import InvalidModelError, ModelNotFoundError, UnsupportedArchitectureError
from kiln.runtime.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The capital of France is",
    "  leading spaces,\n\ttabs and\r\nCRLF   ",
    "naïve café — “quotes” Ünïcödé 日本語のテキスト, русский текст",
    "emoji 🤖🎉 👍🏽 and flags 🇫🇷 and ZWJ 👩‍👩‍👧",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "glued<|im_start|>special<|im_end|>tokens<|endoftext|>",
    "12345 3.14159 1,000,000 and 2024-01-01",
    "don't I'm we'll THEY'RE it's",
    "def f(x):\n    return x ** 2  # comment\n",
    "",
    " ",
    "\x00\x7f\ufeff\u200b",
]


@pytest.fixture(scope="module")
def ours(smollm2_weights):
    return Tokenizer.from_gguf_metadata(smollm2_weights.metadata)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, hf_smollm2_tokenizer, text):
    ids = ours.encode(text)
    assert ids == hf_smollm2_tokenizer(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
    # Byte-level BPE loses nothing: decoding gives the text back, special tokens kept.
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_special_tokens(ours, hf_smollm2_tokenizer):
    hf = hf_smollm2_tokenizer
    assert ours.encode("<|im_start|>") == [1] and ours.decode([1, 2]) == ""
    assert ours.bos_token_id == hf.bos_token_id == 1 and ours.bos_token == hf.bos_token == "<|im_start|>"
    assert ours.eos_token_id == hf.eos_token_id == 2 and ours.eos_token_ids == {2}
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.vocab_size == len(hf) == 49152
    assert ours.id_to_token(2) == "<|im_end|>" and ours.id_to_token(19556) == hf.convert_ids_to_tokens(19556)
    assert ours.chat_template == hf.chat_template and "<|im_start|>" in ours.chat_template
    assert ours.all_special_ids == set(hf.all_special_ids) | set(range(17))


def test_from_dir_matches_transformers(hf_smollm2_tokenizer, tmp_path):
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_dir(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == reloaded(text)["input_ids"] == hf_smollm2_tokenizer(text)["input_ids"]
    assert tok.eos_token_ids == {0, 2} and tok.chat_template == hf_smollm2_tokenizer.chat_template


def test_from_dir_tokenizer_json_decides_bos(hf_smollm2_tokenizer, tmp_path):
    # transformers 5 ignores tokenizer_config's add_bos_token when tokenizer.json exists.
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    tok = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode("Hi") == hf("Hi")["input_ids"] == [26843]


def test_from_dir_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(InvalidModelError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_unsupported_gguf_tokenizer():
    with pytest.raises(UnsupportedArchitectureError, match="'llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(InvalidModelError, match="merges"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})


def write_tokenizer_gguf(path, metadata: dict) -> None:
    """A GGUF holding only metadata (and one tiny tensor), for transformers to build its
    tokenizer from: SmolLM2's vocabulary under other tokenizer settings, no other model needed."""
    def vtype(v):
        return {bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32,
                str: GGUFValueType.STRING}[type(v)]

    writer = GGUFWriter(str(path), metadata["general.architecture"])
    for key, value in metadata.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if isinstance(value, list):
            sub = GGUFValueType.INT32 if isinstance(value[0], int) else vtype(value[0])
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub)
        else:
            writer.add_key_value(key, value, vtype(value))
    writer.add_tensor("output_norm.weight", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_gguf_pre_tokenizers_and_flags_match_transformers(smollm2_weights, tmp_path, pre):
    metadata = dict(smollm2_weights.metadata)
    types = list(metadata["tokenizer.ggml.token_type"])
    types[19556] = 4  # "Hello" as a USER_DEFINED token: it must match whole, even inside words
    metadata.update({"tokenizer.ggml.pre": pre, "tokenizer.ggml.token_type": types,
                     "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.eot_token_id": 0})
    write_tokenizer_gguf(tmp_path / "t.gguf", metadata)
    tok = Tokenizer.from_gguf_metadata(metadata)
    # The class AutoTokenizer picks for a byte-level GGUF, without its config parsing.
    hf = transformers.TokenizersBackend.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in TEXTS + ["SayHello123456789 it's", "abc\n\n\n  def 9999999"]:
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
    assert tok.encode("x")[0] == 1 and tok.eos_token_ids == {0, 2}
