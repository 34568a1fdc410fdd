"""Agent conversations rendered by render_chat and by transformers' apply_chat_template from a
tokenizer directory (the tiny byte-level tokenizer with the template in its
tokenizer_config.json): tools, assistant turns with tool calls and `content: null`,
tool results, reasoning content, enable_thinking, add_generation_prompt on and off.

The SmolLM2 template is the real one (from the default model's GGUF). The two Qwen-style
templates are our own, written with the constructs and formats of the Qwen3 template (hermes
JSON calls, the last user query found by a reverse loop over a namespace, reasoning kept only
after it, string methods, `is string` / `is mapping` tests) and of the Qwen3.5/3.6 ones (XML
"qwen3_coder" calls, `|items`, the generation prompt opening `<think>`), and a
raise_exception on a role they do not know."""
from __future__ import annotations

import json

import pytest
import transformers

from kiln.errors import ChatTemplateError
from kiln.runtime.text.chat_template import render_chat
from tests.server.tiny_chat_model import make_tiny_tokenizer

QWEN3_LIKE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- "# Tools\n\nFunction signatures inside <tools></tools>:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if not ns.multi_step_tool %}{%- break %}{%- endif %}
    {%- if message.role == "user" and message.content is string and not (message.content.startswith('<tool_response>')
          and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}{{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}{%- endif %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}
            {%- set call = tool_call.function if tool_call.function else tool_call %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

QWEN35_LIKE = r"""
{%- set sys = messages[0].content if messages[0].role == 'system' else '' %}
{%- if tools %}
    {{- '<|im_start|>system\n# Tools\n\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool.function | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nCall a function as:\n<tool_call>\n<function=name>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>' }}
    {%- if sys %}{{- '\n\n' + sys | trim }}{%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif sys %}
    {{- '<|im_start|>system\n' + sys | trim + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content | trim if message.content is string else '' %}
    {%- if message.role == 'system' %}{%- continue %}{%- endif %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content | trim if message.reasoning_content is string else '' %}
        {%- if loop.index0 > ns.last_query_index or (preserve_thinking is defined and preserve_thinking) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- set call = tool_call.function %}
                {%- if loop.first and content %}{{- '\n\n' }}{%- elif not loop.first %}{{- '\n' }}{%- endif %}
                {{- '<tool_call>\n<function=' + call.name + '>\n' }}
                {%- for name, value in (call.arguments | items if call.arguments is mapping else []) %}
                    {{- '<parameter=' + name + '>\n' }}
                    {%- if value is mapping or (value is sequence and value is not string) %}{{- value | tojson }}
                    {%- else %}{{- value | string }}{%- endif %}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}
    {%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & \"later\" in a city, é",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "opts": {"type": "object"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def _call(i, name, args):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


def conversations(arguments_as_text: bool):
    """(id, messages): a plain exchange, a tool-call turn with content null and two parallel
    calls and their results, reasoning kept and dropped around the last query, a think block
    written inside content, and a call made from an assistant turn with prose and reasoning."""
    a = (lambda d: json.dumps(d)) if arguments_as_text else (lambda d: d)
    w = a({"city": "Oslo", "days": 2, "opts": {"units": ["C", "F"]}})
    return [
        ("plain", [{"role": "system", "content": "You are terse.\n"}, {"role": "user", "content": "Hi, Ünïcödé?"},
                   {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]),
        ("calls", [{"role": "user", "content": "Weather and time?"},
                   {"role": "assistant", "content": None, "tool_calls": [_call(1, "get_weather", w),
                                                                         _call(2, "get_time", a({}))]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"},
                   {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]),
        ("reasoning", [{"role": "user", "content": "Q1"},
                       {"role": "assistant", "content": "A1", "reasoning_content": "old thought"},
                       {"role": "user", "content": "Q2"},
                       {"role": "assistant", "content": "Let me look.", "reasoning_content": "\nneed a tool\n",
                        "tool_calls": [_call(3, "get_weather", a({"city": "Rome"}))]},
                       {"role": "tool", "tool_call_id": "call_3", "content": "sunny"},
                       {"role": "assistant", "content": "<think>\nit is sunny\n</think>\n\nSunny in Rome."}]),
    ]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """template name -> (its text, transformers' tokenizer loaded from a directory holding it)."""
    out = {}
    for name, template in [("qwen3", QWEN3_LIKE), ("qwen3.5", QWEN35_LIKE)]:
        d = tmp_path_factory.mktemp(name)
        make_tiny_tokenizer(d)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        out[name] = (template, transformers.AutoTokenizer.from_pretrained(d))
    return out


def _both(template, hf, messages, **kw):
    want = hf.apply_chat_template(messages, tokenize=False, **kw)
    got = render_chat(template, messages, **kw, **hf.special_tokens_map)
    return got, want


CASES = [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
         dict(add_generation_prompt=True, enable_thinking=False), dict(add_generation_prompt=True, enable_thinking=True),
         dict(add_generation_prompt=True, preserve_thinking=True)]


@pytest.mark.parametrize("name", ["qwen3", "qwen3.5"])
@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no-tools"])
def test_qwen_style_templates_match_transformers(tokenizers, name, with_tools):
    template, hf = tokenizers[name]
    text_args = name == "qwen3"  # the XML template reads arguments as a mapping only
    for args_as_text in ([False, True] if text_args else [False]):
        for conv_id, messages in conversations(args_as_text):
            for kw in CASES:
                got, want = _both(template, hf, messages, tools=TOOLS if with_tools else None, **kw)
                assert got == want, (conv_id, kw)
    # what the renders hold (so an equality of two empty strings would not pass)
    got, _ = _both(template, hf, conversations(False)[1][1], tools=TOOLS, add_generation_prompt=True)
    assert "<tool_response>\n12:00\n</tool_response><|im_end|>" in got
    assert ("<function=get_weather>\n<parameter=city>\nOslo" in got if name == "qwen3.5"
            else '"arguments": {"city": "Oslo", "days": 2' in got)
    reasoning = conversations(False)[2][1]
    got, _ = _both(template, hf, reasoning, add_generation_prompt=False)
    assert "need a tool" in got and "old thought" not in got
    got, _ = _both(template, hf, reasoning, add_generation_prompt=True, enable_thinking=False)
    assert got.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name", ["qwen3", "qwen3.5"])
def test_unknown_role_raises_in_both(tokenizers, name):
    template, hf = tokenizers[name]
    messages = [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]
    with pytest.raises(Exception, match="Unexpected message role: robot"):
        hf.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError, match="Unexpected message role: robot"):
        render_chat(template, messages)


@pytest.mark.parametrize("kw", CASES[:2], ids=["generation-prompt", "no-generation-prompt"])
def test_smollm2_template_with_tool_turns_matches_transformers(smollm2_weights, hf_smollm2_tokenizer, kw):
    """The real SmolLM2 template (which renders neither tools nor calls) on the same agent
    conversations. Its `message['content']` is undefined in a tool-call turn with content
    null (transformers drops None-valued keys, as render_chat does), and `+` on it fails in
    transformers: render_chat fails too, as a ChatTemplateError (the server's 400)."""
    template = smollm2_weights.metadata["tokenizer.chat_template"]
    for conv_id, messages in conversations(True):
        if conv_id == "calls":
            with pytest.raises(Exception, match="has no attribute 'content'"):
                hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False, tools=TOOLS, **kw)
            with pytest.raises(ChatTemplateError, match="has no attribute 'content'"):
                render_chat(template, messages, tools=TOOLS, **kw, **hf_smollm2_tokenizer.special_tokens_map)
            messages = [{**m, "content": m["content"] or ""} for m in messages]
        got, want = _both(template, hf_smollm2_tokenizer, messages, tools=TOOLS, **kw)
        assert got == want, conv_id
        assert "<|im_start|>tool\n" in got or conv_id != "calls"
