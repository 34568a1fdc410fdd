"""Input that used to reach a 500, an unbounded body or a frozen event loop (issue 42 #4, #9, #10,
#11, #12): each now gets a 4xx in OpenAI's error shape, or is served as vLLM serves it."""
from __future__ import annotations

import json

import openai
import pytest

from kiln import LLM, SamplingParams
from kiln.entrypoints.async_llm import AsyncLLM
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.test_errors import error_of
from tests.server.tiny_chat_model import CHATML, MODEL_NAME, tiny_engine_args

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"Content-Type": "application/json"}


# ---------------------------------------------------------------- #9 logprobs bounds


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": -2}, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": -1}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": -1}, "prompt_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
])
def test_logprobs_bounds(server, path, body, param):
    err = error_of(server.request("POST", path, {**body, "max_tokens": 2}, JSON), 400, param)
    assert "20" in err["message"]


def test_prompt_logprobs_at_the_cap_is_served(server):
    status, _, raw = server.request("POST", COMPLETIONS, {"prompt": "hello there", "max_tokens": 1,
                                                          "prompt_logprobs": 20}, JSON)
    assert status == 200, raw
    lps = json.loads(raw)["choices"][0]["prompt_logprobs"]
    assert lps[0] is None and all(len(p) in (20, 21) for p in lps[1:])


# ---------------------------------------------------------------- #4 content null


def test_assistant_content_null_renders_as_empty(server, tiny_chat_dir):
    """The tool-call turn's shape: rendered as if content were "" (what vLLM does)."""
    with_null = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                 {"role": "user", "content": "again"}]
    as_empty = [{**m, "content": m["content"] or ""} for m in with_null]
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(tiny_chat_dir, kv_cache_tokens=4096).chat(as_empty, p)[0]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
        r = c.chat.completions.create(model=MODEL_NAME, messages=with_null, temperature=0, max_tokens=6,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want.outputs[0].token_ids
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


# ---------------------------------------------------------------- #11 500s on input


def test_deeply_nested_json(server):
    for depth in (10_000, 200):
        body = '{"prompt": "x", "max_tokens": 1, "extra": ' + "[" * depth + "]" * depth + "}"
        err = error_of(server.request("POST", COMPLETIONS, body, JSON), 400)
        assert "nested" in err["message"]


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    (COMPLETIONS, '{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}', "messages"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}], "stop": ["\\ud800"], "max_tokens": 1}', None),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogate(server, path, body, param):
    err = error_of(server.request("POST", path, body, JSON), 400)
    assert "surrogate" in err["message"] or "UTF-8" in err["message"]


def test_paired_surrogates_are_text(server):
    status, _, raw = server.request("POST", "/tokenize", '{"prompt": "\\ud83d\\ude00"}', JSON)
    assert status == 200, raw
    assert json.loads(raw)["count"] == len("\U0001F600".encode())  # the tiny tokenizer: one id a byte


@pytest.fixture(scope="module")
def template_server(tiny_engine):
    def make(template):
        return LiveServer(tiny_engine, ServerConfig(served_model_names=(MODEL_NAME,), chat_template=template))
    return make


@pytest.mark.parametrize("expr", ["(10**100000)|string", "10**(10**10)", "2.0**100000", "'ab' * 10**9", "[1] * 10**9",
                                  "(range(10**9)|list)|length"])
def test_template_with_huge_numbers(template_server, expr):
    srv = template_server("{{ " + expr + " }}" + CHATML)
    try:
        err = error_of(srv.request("POST", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 1}, JSON, timeout=30), 400, "messages")
        assert "template" in err["message"]
    finally:
        srv.stop()


# ---------------------------------------------------------------- #10 early length refusal


def test_prompt_longer_than_the_context_refused_by_its_size(tiny_engine):
    """10 MB of text cannot fit 512 tokens: refused from its length alone (a lower bound on
    its token count), before it is tokenized."""
    srv = LiveServer(tiny_engine, ServerConfig(served_model_names=(MODEL_NAME,), max_body_bytes=32 << 20))
    try:
        for path, body, param in ((COMPLETIONS, {"prompt": "x" * (10 << 20)}, "prompt"),
                                  (CHAT, {"messages": [{"role": "user", "content": "y" * (10 << 20)}]}, "messages")):
            err = error_of(srv.request("POST", path, body, JSON, timeout=60), 400, param)
            assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
        status, _, _ = srv.request("GET", "/health")
        assert status == 200
    finally:
        srv.stop()


# ---------------------------------------------------------------- #12 Content-Type


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_content_type_not_json(server, ctype):
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    err = error_of(server.request("POST", COMPLETIONS, body, {"Content-Type": ctype}), 415)
    assert "application/json" in err["message"]


def test_content_type_json_with_charset(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    status, _, raw = server.request("POST", COMPLETIONS, body, {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200, raw
