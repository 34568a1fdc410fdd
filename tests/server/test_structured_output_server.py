"""Structured output, tool calling and reasoning through the official openai client against a
live server on the tiny random model: its outputs are garbage, so whatever holds, the
grammar made hold. The chat template is one of our own (tools, tool calls, tool results,
think blocks switched by chat_template_kwargs), and the tokenizer gains `<think>` and
`</think>` as single tokens, as Qwen's have."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer

from kiln.entrypoints.async_llm import AsyncLLM
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.tiny_chat_model import MODEL_NAME, make_tiny_chat_model, tiny_engine_args

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{% for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- elif enable_thinking is defined %}<think>\n{% endif %}{% endif %}")
THINK, END_THINK = 259, 260  # the ids the two tags get below
# Five schemas (nested objects, arrays with min/max items, enums, required fields, bounded
# numbers). Strings are bounded and objects closed: a random model otherwise writes on until
# max_tokens (every byte is as likely as a closing quote), which is its nature, not a grammar's.
SCHEMAS = [
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "address": {"type": "object", "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                               "minItems": 2, "maxItems": 4}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "string", "enum": ["S", "M", "L"]}},
     "required": ["colour", "size"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10 ** 6},
                                      "ok": {"type": "boolean"},
                                      "note": {"type": "string", "maxLength": 4}},
     "required": ["id", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                      "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                                      "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}, "maxItems": 3}},
     "required": ["age", "score", "items"], "additionalProperties": False},
]
REQUESTS_PER_SCHEMA = 100
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
                                                                                        "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    d = make_tiny_chat_model(tmp_path_factory.mktemp("tiny_think"))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens(["<think>", "</think>"])  # ids 259, 260: inside the model's 264 rows
    assert tok.token_to_id("</think>") == END_THINK
    tok.save(str(d / "tokenizer.json"))
    return d


def _server(engine, **kw):
    return LiveServer(engine, ServerConfig(served_model_names=(MODEL_NAME,), chat_template=TEMPLATE, **kw))


@pytest.fixture(scope="module")
def engine(think_model):
    eng = AsyncLLM.from_engine_args(tiny_engine_args(think_model, max_num_seqs=32))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module", params=["hermes", "qwen3_coder"])
def client(request, engine):
    srv = _server(engine, reasoning_parser="qwen3", tool_call_parser=request.param, enable_auto_tool_choice=True)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        c.parser, c.srv = request.param, srv
        yield c
    srv.stop()


def chat(c, thinking=False, **kw):
    """thinking: False renders enable_thinking=false (the prompt closes the think block, so a
    constraint binds from the first token), None leaves it out (the model may open <think>)."""
    if thinking is not None:
        extra = dict(kw.pop("extra_body", None) or {})
        extra.setdefault("chat_template_kwargs", {"enable_thinking": thinking})
        kw["extra_body"] = extra
    return c.chat.completions.create(model=MODEL_NAME, messages=kw.pop("messages", MSGS), **kw)


def stream_chat(c, thinking=False, **kw):
    """A streamed chat reassembled: (reasoning, content, [(name, arguments)], finish_reason)."""
    reasoning, content, calls, finish = "", "", [], None
    for ch in chat(c, thinking, stream=True, **kw):
        for choice in ch.choices:
            d = choice.delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index == len(calls):
                    calls.append([tc.function.name, ""])
                calls[tc.index][1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, [tuple(x) for x in calls], finish


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_json_schema_holds_for_seeded_random_sampling(client, schema):
    if client.parser != "hermes":
        pytest.skip("the parser plays no part: one server is enough")

    def one(seed):
        # no max_tokens: the rest of the context (a bounded number's fraction may run long)
        r = chat(client, temperature=1.0, seed=seed,
                 response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        return r.choices[0]

    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(one, range(REQUESTS_PER_SCHEMA)))
    for c in choices:
        assert c.finish_reason == "stop" and c.message.content is not None, c
        jsonschema.validate(json.loads(c.message.content), schema)
    assert len({c.message.content for c in choices}) > 2  # sampled, not one fixed answer


def test_regex_choice_and_json_object(client):
    """As the schemas: 100 seeded requests each for a regex and a choice (the issue's count), and
    json_object on 10 (an open object can run long on garbage weights)."""
    def regex(seed):
        return client.completions.create(model=MODEL_NAME, prompt="x", temperature=1.0, seed=seed, max_tokens=40,
                                         extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}})

    def choice(seed):
        return chat(client, temperature=1.0, seed=seed, max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})

    with ThreadPoolExecutor(16) as pool:
        texts = [r.choices[0].text for r in pool.map(regex, range(REQUESTS_PER_SCHEMA))]
        picks = [r.choices[0].message.content for r in pool.map(choice, range(REQUESTS_PER_SCHEMA))]
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2,4}", t) for t in texts), texts
    assert set(picks) <= {"yes", "no"} and len(set(texts)) > 2
    for seed in range(10):
        r = chat(client, temperature=1.0, seed=seed, max_tokens=200, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":  # an open object may run past max_tokens
            assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_choice_required_and_named_make_calls(client, choice):
    for seed in range(5):
        r = chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=150)
        (c,) = r.choices
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
        for call in c.message.tool_calls:
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schema)
        if isinstance(choice, dict):
            assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
        streamed = stream_chat(client, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=150)
        assert streamed == ("", "", [(t.function.name, t.function.arguments) for t in c.message.tool_calls],
                            "tool_calls")


def forced_output(c, text: str, thinking=False, **kw):
    """Chat whose output is exactly `text` (a regex of it forces the random model), both ways."""
    kw.setdefault("extra_body", {"guided_regex": re.escape(text)})
    body = dict(temperature=1.0, seed=3, max_tokens=400, **kw)
    return chat(c, thinking, **body).choices[0], stream_chat(c, thinking, **body)


def test_auto_tool_calls_parsed_from_forced_model_output(client):
    if client.parser == "hermes":
        text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    else:
        text = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                "<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>")
    whole, streamed = forced_output(client, text, tools=TOOLS)
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert calls == [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    assert streamed == ("", "Let me check.", [(t.function.name, t.function.arguments)
                                              for t in whole.message.tool_calls], "tool_calls")
    # a malformed call is content, finished as "stop"
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    whole, streamed = forced_output(client, bad, tools=TOOLS)
    assert whole.message.content == bad and not whole.message.tool_calls and whole.finish_reason == "stop"
    assert streamed == ("", bad, [], "stop")
    # tool_choice none: the same text is content
    none = chat(client, tools=TOOLS, tool_choice="none", temperature=1.0, seed=3, max_tokens=400,
                extra_body={"guided_regex": re.escape(text)}).choices[0]
    assert none.message.content == text and none.finish_reason == "stop"


def test_reasoning_split_and_template_kwargs(client):
    # Qwen3: no think tag in the prompt, the model opens <think> itself. The grammar binds only
    # after </think>, so the bias makes the random model open and close the block; what it
    # thinks between is its own (more <think> tokens), the answer is the regex's.
    for seed in range(3):
        kw = dict(temperature=1.0, seed=seed, max_tokens=100, logit_bias={str(THINK): 100, str(END_THINK): 100},
                  extra_body={"guided_regex": "The answer[.]"})
        whole = chat(client, None, **kw).choices[0]
        reasoning = whole.message.model_extra["reasoning_content"]
        assert re.fullmatch("(<think>)*", reasoning) and whole.message.content == "The answer."
        assert whole.message.model_extra["reasoning"] == reasoning
        assert stream_chat(client, None, **kw) == (reasoning, "The answer.", [], "stop")
    # enable_thinking false: the template closes the block in the prompt; no reasoning at all
    # (a forced text holding </think> works too since the grammar tokenizer reads plain added
    # tokens as text: tests/runtime/sample/test_grammar.py)
    whole, streamed = forced_output(client, "Plain text")
    assert whole.message.model_extra["reasoning_content"] is None and whole.message.content == "Plain text"
    assert streamed == ("", "Plain text", [], "stop")


def test_constraint_starts_after_reasoning_in_an_opened_think_block(client):
    """Qwen3.5-style: the prompt opens <think>, so only </think> is generated; the schema binds
    the answer after it. logit_bias makes the random model close the block first."""
    schema = SCHEMAS[2]
    for seed in range(5):
        kw = dict(temperature=1.0, seed=seed, max_tokens=60, logit_bias={str(END_THINK): 100},
                  response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        c = chat(client, True, **kw).choices[0]
        assert c.message.model_extra["reasoning_content"] == ""
        jsonschema.validate(json.loads(c.message.content), schema)
        assert stream_chat(client, True, **kw) == ("", c.message.content, [], "stop")


def test_tool_results_render_through_the_template(client):
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    status, _, body = client.srv.request("POST", "/tokenize", {"model": MODEL_NAME, "messages": msgs, "tools": TOOLS})
    assert status == 200, body
    status, _, text = client.srv.request("POST", "/detokenize", {"model": MODEL_NAME,
                                                                 "tokens": json.loads(body)["tokens"]})
    text = json.loads(text)["prompt"]
    assert '{"name": "get_time", "arguments": {"zone": "UTC"}}' in text  # the arguments as an object
    assert "<tool_response>\n12:00\n</tool_response>" in text and "Tools: get_weather get_time" in text


@pytest.mark.parametrize("kw,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "objekt"}}}),
     "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "([a-z"}}), "structured_outputs"),
    (dict(extra_body={"guided_json": {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}}),
     "guided_json"),
    (dict(extra_body={"guided_grammar": "start: missing_rule"}), "guided_grammar"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "launch_rockets"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "properties": {"a": "int"}}}}]),
     "tools[0]"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
          tool_choice="required"), "tools[0]"),
])
def test_bad_input_is_400_before_queueing(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=5, **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"]


def test_auto_tool_choice_needs_the_flags(engine):
    srv = _server(engine)  # no --enable-auto-tool-choice
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
                chat(c, tools=TOOLS, tool_choice="auto", max_tokens=5)
            r = chat(c, tools=TOOLS, max_tokens=5)  # tools without tool_choice: rendered, not parsed
            assert r.choices[0].message.tool_calls == [] or r.choices[0].message.tool_calls is None
    finally:
        srv.stop()
