"""render_chat against transformers' apply_chat_template(tokenize=False), and the sandbox."""
from __future__ import annotations

import dataclasses

import pytest

from kiln.errors import ChatTemplateError
from kiln.runtime.text.chat_template import render_chat

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! Ünïcödé and 🤖?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def template(smollm2_weights):
    return smollm2_weights.metadata["tokenizer.chat_template"]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:2]], ids=["multi-turn", "no-system"])
def test_smollm2_template_matches_transformers(template, hf_smollm2_tokenizer, messages, add_generation_prompt):
    hf = hf_smollm2_tokenizer
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = render_chat(template, messages, add_generation_prompt=add_generation_prompt, **hf.special_tokens_map)
    assert got == want
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_continue_final_message_matches_transformers(template, hf_smollm2_tokenizer):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two, "}]
    want = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert render_chat(template, messages, add_generation_prompt=False, continue_final_message=True) == want
    assert want.endswith("One, two, ")


# Exercises what transformers adds to plain Jinja: tojson without HTML escaping and with
# indent, namespace, dict(), loop controls, {% generation %}, None-valued keys dropped,
# reasoning aliases, extra kwargs and tools.
FEATURES = """{%- set ns = namespace(n=0) -%}
{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}
{{ m | tojson }}{% generation %}[{{ m.content }}]{% endgeneration %}
{% endfor %}
{{ tools | tojson(indent=2) }}|{{ bos_token }}|{{ ns.n }}|{{ enable_thinking }}|{{ dict(a=1) | tojson }}|{{ documents }}
{{ strftime_now('%Y') | length }}"""


def test_transformers_extensions_match(hf_smollm2_tokenizer):
    @dataclasses.dataclass
    class Message:
        role: str
        content: str

    messages = [{"role": "user", "content": "<b>&'é</b>", "tool_calls": None}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "ok", "reasoning_content": "hmm"}, Message("user", "dc")]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    want = hf_smollm2_tokenizer.apply_chat_template(
        messages, chat_template=FEATURES, tokenize=False, tools=tools, enable_thinking=False)
    got = render_chat(FEATURES, messages, add_generation_prompt=False, tools=tools, enable_thinking=False,
                      **hf_smollm2_tokenizer.special_tokens_map)
    assert got == want
    assert '"<b>&\'é</b>"' in got and "tool_calls" not in got and '"thinking": "hmm"' in got


def test_raise_exception_is_a_chat_template_error():
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="Conversations must start with a user"):
        render_chat(template, [{"role": "system", "content": "x"}])
    assert render_chat(template, [{"role": "user", "content": "x"}]) == ""


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{% set x = namespace() %}{% set x._secret = 1 %}",
    "{{ messages.append(1) }}",  # immutable sandbox: no mutating the caller's data
])
def test_sandbox_refuses_unsafe_access(template):
    with pytest.raises(ChatTemplateError, match="unsafe"):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_sandbox_prints_unsafe_attributes_as_nothing():
    # Jinja's sandbox turns an unsafe attribute into an undefined value: printing it alone
    # gives "" (as in transformers); any further use raises, as tested above.
    assert render_chat("{{ raise_exception.__globals__ }}", [{"role": "user", "content": "x"}]) == ""


def test_other_template_failures_are_typed():
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat("{{ 1 + messages[0].content }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        render_chat("x", [])
    with pytest.raises(ChatTemplateError, match="both"):
        render_chat("x", [{"role": "user", "content": "x"}], continue_final_message=True)
