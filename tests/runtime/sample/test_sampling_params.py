"""SamplingParams: vLLM's defaults, normalisation and validation rules."""
import math

import pytest

from kiln.errors import KilnError
from kiln.runtime.sample.sampling_params import InvalidSamplingParamsError, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, 0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == () and p.stop_token_ids == () and p.bad_words == ()
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output and not p.ignore_eos
    assert p.logit_bias is None and p.allowed_token_ids is None
    assert p.sampling_type == SamplingType.RANDOM


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("n", 0), ("n", -3),
    ("max_tokens", 0), ("max_tokens", -1),
    ("min_tokens", -1),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", 1e-320), ("repetition_penalty", 1e39),  # 0 or inf in f32: NaN logits
    ("logprobs", -2), ("prompt_logprobs", -5),
    ("stop", ""), ("stop", ["ok", ""]),
    ("stop_token_ids", [1, "2"]),
    ("bad_words", [""]),
])
def test_invalid_value_names_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, KilnError)
    assert info.value.field == field


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidSamplingParamsError, match="min_tokens") as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.field == "min_tokens"
    SamplingParams(max_tokens=None, min_tokens=500)  # no bound without max_tokens
    SamplingParams(max_tokens=5, min_tokens=5)


def test_stop_needs_detokenize():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="x", detokenize=False)


def test_greedy_rules():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2, seed=7)
    assert p.sampling_type == SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)  # truncation is meaningless for argmax
    with pytest.raises(ValueError, match="n"):
        SamplingParams(temperature=0.0, n=2)
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.001).temperature == 0.01  # vLLM's float32 floor


def test_accepted_edge_values():
    for kw in [dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_p=1.0), dict(min_p=0.0),
               dict(min_p=1.0), dict(logprobs=-1), dict(logprobs=0), dict(prompt_logprobs=-1),
               dict(presence_penalty=-2.0), dict(frequency_penalty=2.0), dict(max_tokens=None)]:
        SamplingParams(**kw)


def test_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=[5, 3, 5], bad_words=["a", "a", "b"],
                       logit_bias={"7": 1, 9: -2.5}, allowed_token_ids=[1, 2], seed=-1, logprobs=True)
    assert p.stop == ("END",)
    assert p.stop_token_ids == (5, 3)
    assert p.bad_words == ("a", "b")
    assert p.logit_bias == {7: 1.0, 9: -2.5}
    assert p.allowed_token_ids == (1, 2)
    assert p.seed is None and p.logprobs == 1
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length == 0
    assert p.all_stop_token_ids([2]) == {5, 3, 2}
    with pytest.raises(Exception):
        p.temperature = 0.5  # frozen


def test_verify_against_vocab():
    SamplingParams(logit_bias={3: 1.0}, allowed_token_ids=[0, 9], stop_token_ids=[9]).verify(10)
    for kw, field in [(dict(logit_bias={10: 1.0}), "logit_bias"),
                      (dict(allowed_token_ids=[]), "allowed_token_ids"),
                      (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
                      (dict(stop_token_ids=[12]), "stop_token_ids"),
                      (dict(logprobs=11), "logprobs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw).verify(10)


def test_new_generator_replays_the_seed():
    a, b = SamplingParams(seed=42).new_generator(), SamplingParams(seed=42).new_generator()
    assert (a.random(4) == b.random(4)).all()
    assert SamplingParams().new_generator() is None
    assert SamplingParams(temperature=0, seed=1).new_generator() is None


def test_tokenize_bad_words():
    # A toy tokenizer: words are single ids; a leading space gives a different id.
    vocab = {"foo": 1, " foo": 2, "bar": 3, " bar": 4, "baz": 5}

    def encode(text):
        out, rest = [], text
        while rest:
            for piece in sorted(vocab, key=len, reverse=True):
                if rest.startswith(piece):
                    out.append(vocab[piece])
                    rest = rest[len(piece):]
                    break
            else:
                rest = rest[1:]
        return out

    p = SamplingParams(bad_words=[" foo", "foobar", "baz"])
    # bare form always; the spaced form only when it is a different sequence of the same length
    assert p.tokenize_bad_words(encode) == ((1,), (2,), (1, 3), (2, 3), (5,))
    with pytest.raises(ValueError, match="bad_words"):
        p.tokenize_bad_words(encode, vocab_size=3)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["@@"]).tokenize_bad_words(encode)
