"""Render a chat template exactly as transformers' apply_chat_template(tokenize=False).

Chat templates ship with model files, so they are untrusted code: they run in Jinja2's
ImmutableSandboxedEnvironment, see only plain JSON-like data (never the caller's objects,
whose methods the sandbox cannot judge), and every failure, whether a syntax error,
raise_exception() or a sandbox refusal, becomes one ChatTemplateError the server can
answer with a 400.

The environment, globals and data preparation follow transformers 5
(utils/chat_template_utils.py: _cached_compile_jinja_template, render_jinja_template,
_normalize_chat_messages), so a prompt renders byte for byte the same, which matters:
the model was tuned on exactly those bytes.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import ChatTemplateError

# Names a message's reasoning comes under; templates read the first (transformers aliases them).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering ignores it, but a template using it must still parse."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateDict:
    # `dict` for templates, without the type itself (and so its attributes) in reach.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, which could reach CPython internals."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attribute {name!r} on a namespace")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


MAX_POWER_BITS = 4096  # the largest integer `**` may make (10**1233); CPython prints up to 4300 digits
MAX_REPEAT_ITEMS = 1 << 20  # the longest string or list `*` may make


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with `**` and `*` bounded (issue 42 #11): `10**100000` failed to print, and
    `10**10**10` or `'a' * 10**9` would run for minutes or fill memory. Intercepted operators
    are also never folded into constants when the template compiles, which evaluated them then."""

    intercepted_binops = frozenset({"**", "*"})

    def call_binop(self, context, operator, left, right):
        if operator == "**" and _is_number(left) and _is_number(right):
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 \
                    and right * abs(left).bit_length() > MAX_POWER_BITS:
                raise jinja2.exceptions.SecurityError(f"{left} ** {right} is larger than a chat template may make")
            try:
                return left ** right
            except OverflowError:
                raise jinja2.exceptions.SecurityError(f"{left} ** {right} overflows") from None
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                        and len(seq) * max(times, 0) > MAX_REPEAT_ITEMS:
                    raise jinja2.exceptions.SecurityError(
                        f"repeating a {type(seq).__name__} {times} times is larger than a chat template may make")
        return super().call_binop(context, operator, left, right)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """The compiled template (cached: a server renders the same one for every request)."""
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_Namespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None
    except Exception as e:  # compiling evaluates constant expressions too
        raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from None


def render_chat(
    template: str,
    messages: list,
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    continue_final_message: bool | str = False,
    **kwargs: Any,
) -> str:
    """The prompt for `messages`. Extra kwargs (enable_thinking, pad_token, ...) reach the
    template as variables; bos/eos are left undefined when None, as in transformers."""
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ChatTemplateError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise ChatTemplateError("documents must be dicts with 'title' and 'text' keys")
    specials = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
    kwargs = plain_template_data({**specials, **kwargs})
    chat = plain_template_data(normalize_messages(messages))
    chat = [_alias_reasoning(m) for m in chat]
    field = None
    if continue_final_message:
        field, final = _tag_final_message(chat, template, continue_final_message)

    compiled = compile_template(template)
    try:
        rendered = _render_bounded(compiled, dict(
            messages=chat, tools=plain_template_data(tools), documents=plain_template_data(documents),
            add_generation_prompt=add_generation_prompt, **kwargs))
    except ChatTemplateError:
        raise
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template attempted an unsafe operation: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template raised an error: {e.message or e}") from None
    except Exception as e:  # template code failing on the request's data (None + str, ...)
        raise ChatTemplateError(f"chat template failed on this conversation: {type(e).__name__}: {e}") from None
    if field is not None:
        rendered = _cut_after_final_message(rendered, final)
    return rendered


MAX_RENDER_CHARS = 16 << 20  # no context holds a prompt this long
MAX_RENDER_SECONDS = 10.0


def _render_bounded(compiled: jinja2.Template, variables: dict) -> str:
    """compiled.render(**variables), stopped with one ChatTemplateError once the output passes
    MAX_RENDER_CHARS or rendering MAX_RENDER_SECONDS (issue 42: a template's output size and
    render time are bounded). Checked at each piece of output the template yields, so a loop
    that writes nothing for 10^10 iterations (two nested range(100000)) is not stopped."""
    ctx = compiled.new_context(variables)
    parts, size, deadline = [], 0, time.monotonic() + MAX_RENDER_SECONDS
    try:
        for piece in compiled.root_render_func(ctx):
            parts.append(piece)
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise ChatTemplateError(f"chat template output passed {MAX_RENDER_CHARS} characters; stopped")
            if time.monotonic() > deadline:
                raise ChatTemplateError(f"chat template rendered for more than {MAX_RENDER_SECONDS:g} s; stopped")
    except ChatTemplateError:
        raise
    except Exception:
        compiled.environment.handle_exception()  # Jinja's own traceback rewriting, as render() does
    return "".join(parts)


def normalize_messages(messages: list) -> list[dict]:
    """Message objects (pydantic, dataclasses) to dicts; keys whose value is None dropped,
    since templates handle a missing key but render None as "None"."""
    out = []
    for message in messages:
        message = _to_dicts(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be dicts, got {type(message).__name__}")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _to_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _to_dicts(value.model_dump())
    return value


def plain_template_data(value: Any) -> Any:
    """Only JSON-like builtins reach the template; anything else becomes "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (str enums, numpy float64) carry extra methods: strip them to the base type.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_template_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(v) for v in value)
    if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy placeholder
        return plain_template_data(value.item())
    if (dataclasses.is_dataclass(value) and not isinstance(value, type)) or callable(getattr(value, "model_dump", None)):
        return plain_template_data(_to_dicts(value))
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(chat: list[dict], template: str, which: bool | str) -> tuple[str, str]:
    """Mark the end of the last message so the rendered prompt can be cut right after it."""
    field = which if isinstance(which, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ChatTemplateError(f"continue_final_message is set but the final message has no {field!r}")
    fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final] if field in REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ChatTemplateError(f"continue_final_message names {field!r}, which the chat template never reads")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return field, final
        raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return field, final


def _cut_after_final_message(rendered: str, final: str) -> str:
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ChatTemplateError("continue_final_message is set but the template dropped part of the final message")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space
