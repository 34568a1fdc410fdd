"""A chat template's output size and render time are bounded (issue 42, template sandbox): a
template that writes without end is stopped with one ChatTemplateError, and a bounded
template renders exactly as Jinja's own render() does."""
from __future__ import annotations

import jinja2
import pytest

from kiln.errors import ChatTemplateError
from kiln.runtime.text import chat_template
from kiln.runtime.text.chat_template import render_chat

MSGS = [{"role": "user", "content": "hi"}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_output_size_is_bounded():
    big = "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="characters"):
        render_chat(big, MSGS)


def test_render_time_is_bounded(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.5)
    slow = "{% for i in range(100000) %}{% for j in range(300) %}{% endfor %}.{% endfor %}"
    with pytest.raises(ChatTemplateError, match="rendered for more than"):  # 3e7 iterations: stopped
        render_chat(slow, MSGS)


def test_same_text_as_jinja_render():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    want = env.from_string(CHATML).render(messages=MSGS, add_generation_prompt=True)
    assert render_chat(CHATML, MSGS) == want


def test_errors_inside_are_still_one_sentence():
    with pytest.raises(ChatTemplateError, match="raised an error: no"):
        render_chat("{{ raise_exception('no') }}", MSGS)
