"""Reasoning and tool-call parsers on model outputs written here: the split, the calls, and
streaming, where every way of cutting the text into deltas must concatenate to the
non-streamed message (the parsers' prefix property, server/chat_output.py)."""
from __future__ import annotations

import json
import random

import pytest

from kiln.server.chat_output import ChoiceParser, ChoiceStream, ForcedToolChoice, message_fields
from kiln.server.reasoning import PromptReasoning, get_reasoning_parser
from kiln.server.tool_parsers import get_tool_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "ratio": {"type": "number"},
                                     "opts": {"type": "object"}, "tags": {"type": "array"}}}}},
         {"type": "function", "function": {"name": "run_code", "parameters": {
             "type": "object", "properties": {"code": {"type": "string"}}}}}]
QWEN3 = get_reasoning_parser("qwen3")
OPEN, CLOSED, UNKNOWN = PromptReasoning.OPEN, PromptReasoning.CLOSED, PromptReasoning.UNKNOWN


def parser(tools=None, reasoning=QWEN3, state=UNKNOWN):
    tp = get_tool_parser(tools)(TOOLS) if isinstance(tools, str) else tools
    return ChoiceParser(reasoning, state, tp)


def streamed(p: ChoiceParser, text: str, cuts: list[int]) -> dict:
    """Concatenate the deltas of `text` cut at `cuts` into one message."""
    s = ChoiceStream(p)
    msg = {"reasoning": "", "content": "", "calls": []}
    bounds = [0] + cuts + [len(text)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        d = s.delta(text[a:b], final=k == len(bounds) - 2)
        assert d.get("reasoning") == d.get("reasoning_content")
        msg["reasoning"] += d.get("reasoning", "")
        msg["content"] += d.get("content", "")
        for c in d.get("tool_calls", []):
            if c["index"] == len(msg["calls"]):  # a new call: id and name once
                assert c["id"] and c["function"]["name"] and c["type"] == "function"
                msg["calls"].append({"name": c["function"]["name"], "arguments": ""})
            else:
                assert "name" not in c["function"] and "id" not in c
            msg["calls"][c["index"]]["arguments"] += c["function"]["arguments"]
    return msg


def check_streaming(p: ChoiceParser, text: str) -> dict:
    """Non-streamed fields; asserts every one-character cut, and random cuts, stream to them."""
    whole = message_fields(p.parse(text, final=True))
    want = {"reasoning": whole["reasoning_content"] or "", "content": whole["content"] or "",
            "calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in whole["tool_calls"]]}
    rng = random.Random(0)
    cutss = [list(range(1, len(text)))] + [sorted(rng.sample(range(1, len(text)), min(k, len(text) - 1)))
                                           for k in (1, 2, 5, 17) for _ in range(5)]
    for cuts in cutss:
        assert streamed(p, text, cuts) == want, cuts
    return whole


# ---------------------------------------------------------------- reasoning

def test_qwen3_opens_think_itself():
    text = "<think>\nThe user wants a colour.\n</think>\n\nBlue."
    m = check_streaming(parser(), text)
    assert m["reasoning_content"] == m["reasoning"] == "\nThe user wants a colour.\n"
    assert m["content"] == "\n\nBlue."


def test_qwen3_5_prompt_opens_think():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert QWEN3.prompt_state(prompt) is OPEN
    m = check_streaming(parser(state=OPEN), "Let me think </thin about it.</think>Red.")
    assert m["reasoning_content"] == "Let me think </thin about it." and m["content"] == "Red."
    cut = check_streaming(parser(state=OPEN), "still thinking when max_tokens hit")
    assert cut["reasoning_content"] == "still thinking when max_tokens hit" and cut["content"] is None


def test_enable_thinking_false_gives_no_reasoning():
    prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert QWEN3.prompt_state(prompt) is CLOSED
    m = check_streaming(parser(state=CLOSED), "Green, <think>not reasoning</think>.")
    assert m["reasoning_content"] is None and m["content"] == "Green, <think>not reasoning</think>."
    plain = check_streaming(parser(state=UNKNOWN), "No thinking here.")
    assert plain["reasoning_content"] is None and plain["content"] == "No thinking here."


# ---------------------------------------------------------------- hermes

HERMES_TWO = ('<think>I should call <tool_call>{"name": "run_code", "arguments": {}}</tool_call> maybe</think>'
              'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
              '</tool_call>\n<tool_call>\n{"name": "run_code", "arguments": {"code": "print(\\"</tool_call>\\")"}}'
              '\n</tool_call>\n')


def test_hermes_parallel_calls_tag_in_argument_and_call_in_think():
    m = check_streaming(parser("hermes"), HERMES_TWO)
    assert m["reasoning_content"].startswith("I should call <tool_call>")  # a call inside <think> is thinking
    assert m["content"] == "Checking both."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("run_code", {"code": 'print("</tool_call>")'})]
    assert len({c["id"] for c in m["tool_calls"]}) == 2


@pytest.mark.parametrize("text", [
    'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> done',  # bad JSON
    '<tool_call>{"name": "delete_everything", "arguments": {}}</tool_call>',  # not an offered function
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    '<tool_call>["get_weather"]</tool_call>',
])
def test_hermes_malformed_calls_stay_content(text):
    m = check_streaming(parser("hermes", reasoning=None), text)
    assert m["tool_calls"] == [] and m["content"] == text


def test_hermes_content_before_and_after():
    text = 'A\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\nB  '
    m = check_streaming(parser("hermes"), text)
    assert m["content"] == "AB  " and len(m["tool_calls"]) == 1


# ---------------------------------------------------------------- qwen3_coder

CODER = ("I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n<parameter=ratio>\n0.5\n"
         "</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=tags>\n['x', 'y']\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=run_code>\n<parameter=code>\nx = '</parameter>'\n"
         "if x:\n    print(x)\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_values_by_schema_type_and_parallel_calls():
    m = check_streaming(parser("qwen3_coder", state=OPEN), "Plan: call get_weather.</think>\n\n" + CODER)
    assert m["reasoning_content"] == "Plan: call get_weather." and m["content"] == "\n\nI'll look."
    (w, r) = m["tool_calls"]
    assert json.loads(w["function"]["arguments"]) == {"city": "New York", "days": 3, "metric": False, "ratio": 0.5,
                                                      "opts": {"a": [1, 2]}, "tags": ["x", "y"]}
    assert json.loads(r["function"]["arguments"]) == {"code": "x = '</parameter>'\nif x:\n    print(x)"}


def test_qwen3_coder_streams_arguments_per_parameter():
    s = ChoiceStream(parser("qwen3_coder", reasoning=None))
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
    first = s.delta(head, False)
    assert "content" not in first
    # the name as soon as the header is read; "Rome" waits: a `</parameter>` ends a value only
    # when the next parameter or `</function>` follows it
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{"}
    second = s.delta("<parameter=days>\n2\n</parameter>\n", False)
    assert second["tool_calls"] == [{"index": 0, "function": {"arguments": '"city": "Rome"'}}]
    last = s.delta("</function>\n</tool_call>", True)
    assert last["tool_calls"] == [{"index": 0, "function": {"arguments": ', "days": 2}'}}]


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=unknown_fn>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\nnot a function header\n</tool_call> after",
])
def test_qwen3_coder_malformed_calls_stay_content(text):
    m = check_streaming(parser("qwen3_coder", reasoning=None), text)
    assert m["tool_calls"] == [] and m["content"] == text


def test_qwen3_coder_cut_off_call_keeps_its_parameters():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n<parameter=days>\n4"
    m = check_streaming(parser("qwen3_coder", reasoning=None), text)
    assert json.loads(m["tool_calls"][0]["function"]["arguments"]) == {"city": "Lima", "days": 4}


# ---------------------------------------------------------------- forced tool choice

def test_forced_tool_choice_forms():
    named = check_streaming(ChoiceParser(None, CLOSED, ForcedToolChoice("get_weather")), '{"city": "Kyiv"}')
    assert named["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Kyiv"}'}
    required = check_streaming(ChoiceParser(QWEN3, OPEN, ForcedToolChoice(None)),
                               'hmm</think>[{"name": "get_weather", "parameters": {"city": "A"}}, '
                               '{"name": "run_code", "parameters": {"code": "1"}}]')
    assert [c["function"]["name"] for c in required["tool_calls"]] == ["get_weather", "run_code"]
    assert required["reasoning_content"] == "hmm" and required["content"] is None
