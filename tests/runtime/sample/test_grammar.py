"""The grammar tokenizer (runtime/sample/grammar.py) with added tokens that are not special, as
Qwen3's <think> and </think> are: llguidance sees them as their text, so a grammar spanning a
think block matches the tokens the model writes, while special tokens stay special. Checked
with llguidance's own matcher and through the engine on a tiny random model whose
tokenizer has the two tags."""
from __future__ import annotations

import re

import numpy as np
import pytest
from tokenizers import Tokenizer

from kiln.runtime.sample.grammar import GrammarTokenizer, RequestGrammar
from kiln.runtime.sample.sampling_params import SamplingParams
from kiln.runtime.sample.structured_outputs import StructuredOutputsParams
from tests.server.tiny_chat_model import VOCAB_SIZE, make_tiny_chat_model, make_tiny_tokenizer

THINK, END_THINK, IM_END = 259, 260, 258


def _think_tokenizer(d) -> Tokenizer:
    tok = make_tiny_tokenizer(d)
    tok.add_tokens(["<think>", "</think>"])  # special: false, as in Qwen3's tokenizer.json
    assert tok.token_to_id("</think>") == END_THINK
    return tok


def _allowed(g: RequestGrammar) -> np.ndarray:
    bits = np.zeros((VOCAB_SIZE + 31) // 32, np.int32)
    assert g.fill(bits)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:VOCAB_SIZE].astype(bool)


def test_plain_added_tokens_match_their_text(tmp_path):
    tok = _think_tokenizer(tmp_path)
    gt = GrammarTokenizer(tok.to_str(), VOCAB_SIZE, [IM_END])
    assert not gt.ll.is_special_token(THINK) and not gt.ll.is_special_token(END_THINK)
    assert gt.ll.is_special_token(IM_END) and gt.ll.is_special_token(VOCAB_SIZE - 1)
    text = "<think>\nhm, ok\n</think>\n\n{\"a\": 7}"
    ids = tok.encode(text).ids
    assert THINK in ids and END_THINK in ids  # the tokenizer writes the tags as one token each
    grammar = RequestGrammar(gt, StructuredOutputsParams(
        grammar='start: "<think>\\n" /[a-z, ]*/ "\\n</think>\\n\\n" json\njson: %json {"type": "object"}'))
    for t in ids:
        assert _allowed(grammar)[t], t
        grammar.accept(t)
        assert not grammar.dead, grammar.matcher.get_error()
    assert _allowed(grammar)[IM_END]  # complete: EOS may end it


def test_masks_change_only_at_the_plain_added_tokens(tmp_path):
    """The rebuilt tokenizer gives the masks llguidance gives from the tokenizer.json itself, but
    for the two tags (which the json-built one bars, or lets through and then refuses)."""
    tok = _think_tokenizer(tmp_path)
    fixed = GrammarTokenizer(tok.to_str(), VOCAB_SIZE, [IM_END])
    as_is = GrammarTokenizer(tok.to_str(), VOCAB_SIZE, [IM_END])
    as_is._plain_added_tokens = lambda: set()  # llguidance's own reading of the file
    so = StructuredOutputsParams(json={"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    a, b = RequestGrammar(fixed, so), RequestGrammar(as_is, so)
    others = np.ones(VOCAB_SIZE, bool)
    others[[THINK, END_THINK]] = False
    for t in tok.encode('{"s":"x <think> y </think> z"}').ids:
        ma, mb = _allowed(a), _allowed(b)
        assert np.array_equal(ma[others], mb[others])
        a.accept(t)
        assert not a.dead and ma[t]
        # the json-built one takes a tag's text byte by byte (ASCII: each byte's token is its character)
        for u in ([tok.token_to_id(c) for c in tok.id_to_token(t)] if t in (THINK, END_THINK) else [t]):
            b.accept(u)
        assert not b.dead
    assert _allowed(a)[IM_END] and _allowed(b)[IM_END]


@pytest.fixture(scope="module")
def think_llm(tmp_path_factory):
    pytest.importorskip("torch")
    from kiln import LLM

    d = make_tiny_chat_model(tmp_path_factory.mktemp("think"))
    _think_tokenizer(d).save(str(d / "tokenizer.json"))
    return LLM(d, max_num_batched_tokens=64, kv_cache_tokens=2048, max_num_seqs=4)


def test_a_grammar_spanning_the_think_block_completes(think_llm):
    """The model's </think> token (made likely by a bias) is taken by a grammar that spells the
    tag: the answer after it is constrained, and the request ends as "stop", not at a dead end."""
    for seed in range(4):
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, logit_bias={THINK: 30, END_THINK: 30},
                            structured_outputs=StructuredOutputsParams(regex="<think>[a-z]{1,6}</think>(yes|no)"))
        (out,) = think_llm.generate(["q"], sp)
        o = out.outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason is None, (o.text, o.stop_reason)
        assert re.fullmatch("<think>[a-z]{1,6}</think>(yes|no)", o.text) and END_THINK in o.token_ids


def test_the_constraint_after_reasoning_may_spell_the_tags(think_llm):
    """Qwen3-style: the model opens and closes its think block (unconstrained), and the answer the
    grammar binds after </think> may itself hold the tags as text."""
    for seed in range(4):
        so = StructuredOutputsParams(regex="the tag is </think>", reasoning_end=(END_THINK,),
                                     reasoning_start=THINK)
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=60, logit_bias={THINK: 30, END_THINK: 30},
                            structured_outputs=so)
        (out,) = think_llm.generate(["q"], sp)
        o = out.outputs[0]
        answer = o.text.split("</think>", 1)[1]
        assert o.finish_reason == "stop" and o.stop_reason is None, (o.text, o.stop_reason)
        assert o.token_ids[0] == THINK and answer == "the tag is </think>", o.text
