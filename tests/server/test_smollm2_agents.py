"""The default model (SmolLM2-135M-Instruct, its real tokenizer and chat template) answering
agent-style requests through the official openai client against a live server: a
json_schema / json_object answer that parses and validates (jsonschema), tool_choice
required and a named function giving valid calls, tool_choice none leaving the reply as
prose, and streamed tool-call deltas reassembling to the non-streamed call. Greedy and with
max_tokens bounded, so the file stays a few seconds of decoding on two cores."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kiln.entrypoints.async_llm import AsyncLLM
from kiln.entrypoints.engine_args import EngineArgs
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer

NAME = "smollm2"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "country": {"type": "string", "maxLength": 12},
    "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["city", "country", "population_millions"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {
             "name": "get_time", "description": "The local time in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(smollm2_gguf), max_model_len=1024,
                                                  kv_cache_tokens=4096, max_num_seqs=4))
    srv = LiveServer(engine, ServerConfig(served_model_names=(NAME,), tool_call_parser="hermes",
                                          enable_auto_tool_choice=True))
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
        yield c


def chat(c, **kw):
    kw.setdefault("messages", ASK)
    return c.chat.completions.create(model=NAME, temperature=0.0, **kw)


def streamed_calls(c, **kw):
    """A streamed chat reassembled: (content, [(id, name, arguments)], finish_reason). Each call's
    id and name come once, in its first delta; its arguments are the concatenated fragments."""
    content, calls, finish = "", [], None
    for ch in chat(c, stream=True, **kw):
        for choice in ch.choices:
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index == len(calls):
                    assert tc.id and tc.function.name, tc
                    calls.append([tc.id, tc.function.name, ""])
                else:
                    assert tc.id is None and tc.function.name is None, tc
                calls[tc.index][2] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(x) for x in calls], finish


def test_json_schema_answer_validates(client):
    r = chat(client, messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=60,
             response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    (c,) = r.choices
    assert c.finish_reason == "stop", c
    jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_object_answer_is_an_object(client):
    r = chat(client, messages=[{"role": "user", "content": "Give me a JSON object about Paris."}], max_tokens=40,
             response_format={"type": "json_object"})
    (c,) = r.choices
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict), c.message.content
    else:  # an open-ended object may run past max_tokens: what came is an object's start
        assert c.finish_reason == "length" and c.message.content.startswith("{"), c


def _valid_call(call) -> str:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    return call.function.name


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_choice_makes_a_valid_call_and_streams_the_same(client, choice):
    kw = dict(tools=TOOLS, tool_choice=choice, max_tokens=60)
    (c,) = chat(client, **kw).choices
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    names = [_valid_call(t) for t in c.message.tool_calls]
    if isinstance(choice, dict):
        assert names == ["get_time"]
    content, calls, finish = streamed_calls(client, **kw)
    assert not content and finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_tool_choice_none_answers_in_prose(client):
    (c,) = chat(client, tools=TOOLS, tool_choice="none", max_tokens=8).choices
    assert not c.message.tool_calls and c.message.content and c.finish_reason in ("stop", "length"), c


def test_an_agent_turn_with_content_null_renders_as_transformers_renders_empty_content(server, client,
                                                                                       hf_smollm2_tokenizer):
    """The assistant's tool-call turn comes back with content null and a tool message follows:
    the server renders null as empty (vLLM's way; SmolLM2's template cannot take null), so the
    prompt's ids are transformers' apply_chat_template on the same turn with content "", and the
    conversation goes on."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    status, _, body = server.request("POST", "/tokenize", {"model": NAME, "messages": msgs, "tools": TOOLS})
    assert status == 200, body
    want = hf_smollm2_tokenizer.apply_chat_template([{**m, "content": m["content"] or ""} for m in msgs],
                                                    tools=TOOLS, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert json.loads(body)["tokens"] == list(want)
    (c,) = chat(client, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=4).choices
    assert c.message.content and not c.message.tool_calls
