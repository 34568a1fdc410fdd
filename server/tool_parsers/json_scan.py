"""Find where a JSON value ends in text that may still be growing.

Tool-call parsers need the end of a JSON value inside model output: a hermes call is
`<tool_call>{json}</tool_call>`, and an argument may itself hold the text `</tool_call>`
(vllm#19056), so the block ends where the JSON value ends, not at the first closing tag.
Plain runs of text are skipped with a regex, so long arguments cost little on each re-scan.
"""
from __future__ import annotations

import re
from typing import Optional

_STRUCT = re.compile(r'[{}\[\]"]')  # outside strings: what changes the nesting
_IN_STRING = re.compile(r'["\\]')  # inside a string: its end or an escape
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
INCOMPLETE = None
INVALID = -1


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def value_end(text: str, i: int) -> Optional[int]:
    """The index just past the JSON value starting at text[i]; INCOMPLETE (None) when the text
    ends first, INVALID (-1) when it cannot be JSON. Brackets and strings are checked; what
    lies between them is left to json.loads of the whole value."""
    if i >= len(text):
        return INCOMPLETE
    c = text[i]
    if c == '"':
        return _string_end(text, i + 1)
    if c not in "{[":
        m = _SCALAR.match(text, i)
        if m is None:
            return INCOMPLETE if _scalar_prefix(text[i:]) else INVALID
        return INCOMPLETE if m.end() == len(text) and c in "-0123456789" else m.end()
    stack = [c]
    pos = i + 1
    while stack:
        m = _STRUCT.search(text, pos)
        if m is None:
            return INCOMPLETE
        ch = m.group()
        if ch == '"':
            end = _string_end(text, m.end())
            if end is INCOMPLETE:
                return INCOMPLETE
            pos = end
            continue
        if ch in "{[":
            stack.append(ch)
        elif (ch == "}") != (stack.pop() == "{"):
            return INVALID
        pos = m.end()
    return pos


def _string_end(text: str, pos: int) -> Optional[int]:
    while True:
        m = _IN_STRING.search(text, pos)
        if m is None:
            return INCOMPLETE
        if m.group() == '"':
            return m.end()
        pos = m.end() + 1  # an escape: skip the escaped character
        if pos > len(text):
            return INCOMPLETE


def _scalar_prefix(s: str) -> bool:
    return any(word.startswith(s) for word in ("true", "false", "null")) or bool(re.fullmatch(r"-?\d*\.?\d*", s))
