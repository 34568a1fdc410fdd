"""LogprobsProcessor over a tiny byte-level BPE tokenizer built in the test."""
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kiln.runtime.sample.logprobs import Logprob, LogprobsProcessor
from kiln.runtime.sample.sampler import LogprobsTensors, compute_logprobs, gather_logprobs
from kiln.runtime.sample.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok():
    # Every byte is a token (GPT-2's byte alphabet), plus a few merges; multi-byte
    # characters such as "😀" therefore span several tokens.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("h", "i"), ("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<eos>"])
    return t


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def step_tensors(vocab, sampled, seed, k):
    """The sampler's logprobs for one step whose sampled token is `sampled`."""
    logits = np.random.default_rng(seed).standard_normal((1, vocab)).astype(np.float32)
    lp = compute_logprobs(logits)
    return gather_logprobs(lp, k, np.array([sampled])), lp[0]


def test_positions_ranks_and_cumulative_logprob(tok):
    V = tok.get_vocab_size()
    proc = LogprobsProcessor.from_new_request(tok, SamplingParams(logprobs=2))
    sampled = ids_of(tok, "hi the")
    total = 0.0
    for n, token in enumerate(sampled):
        tensors, lp = step_tensors(V, token, n, k=4)  # the batch asked for 4; this request for 2
        proc.update_from_output(sample=tensors)
        pos = proc.logprobs[-1]
        top = np.argsort(-lp)[:2].tolist()
        assert set(pos) == {token, *top}  # the sampled token plus this request's top 2
        assert pos[token] == Logprob(pytest.approx(float(lp[token])), int((lp > lp[token]).sum()) + 1,
                                     tok.decode([token]))
        assert [pos[t].rank for t in top] == [1, 2]
        total += float(lp[token])
    assert len(proc.logprobs) == len(sampled)
    assert proc.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_split_utf8_characters_are_decoded_with_context(tok):
    V = tok.get_vocab_size()
    proc = LogprobsProcessor(tok, num_logprobs=0, num_prompt_logprobs=None)
    sampled = ids_of(tok, "a😀é")
    assert len(sampled) == 1 + 4 + 2
    for n, token in enumerate(sampled):
        proc.update_from_output(sample=step_tensors(V, token, n, k=0)[0])
    texts = [next(iter(pos.values())).decoded_token for pos in proc.logprobs]
    # partial characters show as "", the token completing one carries the whole character
    assert texts == ["a", "", "", "", "😀", "", "é"]


def test_prompt_logprobs_and_pop(tok):
    prompt = ids_of(tok, "hi the")
    proc = LogprobsProcessor.from_new_request(tok, SamplingParams(prompt_logprobs=1))
    assert proc.logprobs is None and proc.cumulative_logprob is None
    lp = compute_logprobs(np.random.default_rng(0).standard_normal((len(prompt) - 1, tok.get_vocab_size())))
    tensors = gather_logprobs(lp, 1, np.array(prompt[1:]))
    proc.update_from_output(prompt=tensors.slice(0, 1))  # two prefill chunks
    proc.update_from_output(prompt=tensors.slice(1, len(prompt) - 1))
    out = proc.pop_prompt_logprobs()
    assert out[0] is None and len(out) == len(prompt)
    for i, pos in enumerate(out[1:]):
        assert pos[prompt[i + 1]].logprob == pytest.approx(float(lp[i, prompt[i + 1]]))
    assert proc.pop_prompt_logprobs() == []


def test_without_tokenizer_texts_are_none():
    proc = LogprobsProcessor(None, num_logprobs=1, num_prompt_logprobs=None)
    proc.update_from_output(sample=LogprobsTensors(np.array([[3, 3]]), np.array([[-0.5, -0.5]]), np.array([[1, 1]])))
    assert proc.logprobs == [{3: Logprob(-0.5, 1, None)}]
    assert proc.cumulative_logprob == -0.5
