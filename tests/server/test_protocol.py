"""Request parsing: every OpenAI and vLLM sampling field reaches SamplingParams; bad
values are APIError(400) naming their field."""
from __future__ import annotations

import pytest

from kiln.server.errors import APIError
from kiln.server.protocol import parse_chat_request, parse_completion_request

MSGS = [{"role": "user", "content": "hi"}]

ALL_SAMPLING = {
    "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "presence_penalty": 0.5,
    "frequency_penalty": -0.5, "repetition_penalty": 1.2, "seed": 11, "stop": ["a", "b"], "stop_token_ids": [5],
    "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "logit_bias": {"7": 3.5}, "allowed_token_ids": [1, 2, 3],
    "bad_words": ["zz"], "n": 2,
}


def test_every_sampling_field_reaches_sampling_params():
    req = parse_completion_request({"prompt": "x", **ALL_SAMPLING, "max_tokens": 9, "logprobs": 3,
                                    "prompt_logprobs": 1})
    sp = req.to_sampling_params(req.max_tokens, req.logprobs, "logprobs")
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.7, 0.9, 40, 0.05)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.2)
    assert sp.seed == 11 and sp.stop == ("a", "b") and sp.stop_token_ids == (5,)
    assert sp.include_stop_str_in_output and sp.ignore_eos and sp.min_tokens == 2
    assert not sp.skip_special_tokens and not sp.spaces_between_special_tokens
    assert sp.logit_bias == {7: 3.5} and sp.allowed_token_ids == (1, 2, 3) and sp.bad_words == ("zz",)
    assert sp.n == 2 and sp.max_tokens == 9 and sp.logprobs == 3 and sp.prompt_logprobs == 1


def test_chat_fields():
    req = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}],
                              "max_tokens": 4, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2,
                              "stream": True, "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True},
                              "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True})
    assert req.messages[0]["content"] == "a\nb"
    assert req.max_tokens == 7 and req.max_tokens_param == "max_completion_tokens"
    assert req.stream_options.include_usage and req.stream_options.continuous_usage_stats
    assert req.chat_template_kwargs == {"enable_thinking": False}
    sp = req.to_sampling_params(req.max_tokens, req.top_logprobs, "top_logprobs")
    assert sp.logprobs == 2 and sp.max_tokens == 7


def test_defaults_and_lenient_ints():
    req = parse_completion_request({"prompt": [[1, 2], [3]], "max_tokens": 5.0, "unknown_field": 1})
    assert req.prompts == [[1, 2], [3]] and req.max_tokens == 5 and not req.stream and req.add_special_tokens
    assert not parse_chat_request({"messages": MSGS}).add_special_tokens


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options.include_usage"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
])
def test_bad_completion_fields(body, param):
    with pytest.raises(APIError) as e:
        req = parse_completion_request(body)
        req.to_sampling_params(req.max_tokens, req.logprobs, "logprobs")
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": MSGS, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": MSGS, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MSGS, "tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]"),
    ({"messages": MSGS, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSGS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"messages": MSGS, "response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ({"messages": MSGS, "chat_template": "{{ x }}"}, "chat_template"),
    ({"messages": MSGS, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"messages": MSGS, "temperature": 0, "n": 2}, "n"),
])
def test_bad_chat_fields(body, param):
    with pytest.raises(APIError) as e:
        req = parse_chat_request(body)
        req.to_sampling_params(req.max_tokens, req.top_logprobs, "top_logprobs")
    assert e.value.status == 400 and e.value.param == param


def test_stream_chunks_are_the_json_of_the_chunk_dict():
    """StreamChunks (the head encoded once per stream) writes what json.dumps writes."""
    import json

    from kiln.server.serving_engine import StreamChunks

    head = {"id": "cmpl-ü\"1", "object": "text_completion", "created": 1700000000, "model": "m/ö"}
    chunk = StreamChunks(head)
    choices = [{"index": 0, "text": "h\u00e9llo \U0001f600 \"q\"\n", "logprobs": None, "finish_reason": None,
                "stop_reason": None, "token_ids": [1, 2]}]
    use = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
    assert chunk(choices) == json.dumps({**head, "choices": choices}, ensure_ascii=False)
    assert chunk(choices, use) == json.dumps({**head, "choices": choices, "usage": use}, ensure_ascii=False)
    assert chunk([], use) == json.dumps({**head, "choices": [], "usage": use}, ensure_ascii=False)
