"""qwen3_coder: the XML calls of Qwen3-Coder and Qwen3.5/3.6 (vLLM: vllm/tool_parsers/
qwen3coder_tool_parser.py Qwen3CoderToolParser):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are bare text converted by the tool's schema (schema_values.py); one newline on each
side of a value is the format's, not the value's. A value ends at a `</parameter>` that is
followed by the next `<parameter=` or by `</function>`, so a value holding the text
`</parameter>` (code, XML) is read whole. A call streams as it goes: its name once the
`<function=...>` header names an offered function, then `{"p": v` as each parameter ends,
`, "q": w` for the next and `}` when the function closes (or the output ends).
"""
from __future__ import annotations

import re

from kiln.server.reasoning.reasoning_parser import partial_suffix
from kiln.server.tool_parsers.json_scan import skip_ws
from kiln.server.tool_parsers.schema_values import convert_value
from kiln.server.tool_parsers.tool_parser import (ContentBuilder, ParsedTools, ToolCallText, ToolParser,
                                                  json_arguments, register)

START, END = "<tool_call>", "</tool_call>"
FN, FN_END, PARAM, PARAM_END = "<function=", "</function>", "<parameter=", "</parameter>"
_HEADER = re.compile(r"<function=([^>\n]+)>")
_PARAM_HEADER = re.compile(r"<parameter=([^>\n]+)>")


@register
class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def parse(self, text: str, final: bool) -> ParsedTools:
        content, calls = ContentBuilder(), []
        pos = 0
        while True:
            at = text.find(START, pos)
            if at < 0:
                tail = text[pos:]
                content.text(tail if final else tail[:len(tail) - partial_suffix(tail, START)])
                break
            content.text(text[pos:at])
            i = skip_ws(text, at + len(START))
            head = _HEADER.match(text, i)
            if head is None or not self.known(head.group(1).strip()):
                if not final and head is None and _maybe_header(text[i:]):
                    break  # the header is still coming
                close = text.find(END, at)  # not a call: the block stays content
                if close < 0 and not final:
                    break
                end = len(text) if close < 0 else close + len(END)
                content.text(text[at:end])
                pos = end
                continue
            content.call()
            call, pos = self._function(text, head, final)
            calls.append(call)
            if not call.complete:
                break
        return ParsedTools(content.result(final), calls)

    def _function(self, text: str, head: re.Match, final: bool) -> tuple[ToolCallText, int]:
        """The call whose header is `head`; -> (call, where parsing goes on)."""
        name = head.group(1).strip()
        schema = self.tools.get(name, {}).get("properties") or {}
        pieces, i = [], head.end()
        while True:
            i = skip_ws(text, i)
            if text.startswith(FN_END, i):
                j = skip_ws(text, i + len(FN_END))
                if text.startswith(END, j):
                    j += len(END)
                elif not final and END.startswith(text[j:]):
                    return _call(name, pieces, False), len(text)
                return _call(name, pieces, True), j
            p = _PARAM_HEADER.match(text, i)
            if p is None:
                rest = text[i:]
                if not final and (PARAM.startswith(rest) or FN_END.startswith(rest)
                                  or (rest.startswith(PARAM) and ">" not in rest and "\n" not in rest)):
                    return _call(name, pieces, False), len(text)
                # stray text (or the end of the output): the call ends here, the text is content
                return _call(name, pieces, True), i
            value_end, nxt = _value_end(text, p.end(), final)
            if value_end is None:
                return _call(name, pieces, False), len(text)
            key = p.group(1).strip()
            value = _strip_newline(text[p.end():value_end])
            pieces.append((key, convert_value(value, schema.get(key))))
            i = nxt

    def __repr__(self) -> str:
        return f"Qwen3CoderToolParser({sorted(self.tools)})"


def _value_end(text: str, i: int, final: bool) -> tuple:
    """-> (end of the value starting at i, where the next item starts), or (None, None) while
    undecided. A `</parameter>` ends the value only if the next parameter or `</function>`
    follows it; else it is part of the value."""
    search = i
    while True:
        close = text.find(PARAM_END, search)
        if close < 0:
            if final:  # the output ended inside the value (or the model skipped the closing tag)
                nxt = min((k for k in (text.find(PARAM, i), text.find(FN_END, i)) if k >= 0), default=len(text))
                return nxt, nxt
            return None, None
        after = skip_ws(text, close + len(PARAM_END))
        rest = text[after:]
        if rest.startswith(PARAM) or rest.startswith(FN_END) or (final and not rest):
            return close, close + len(PARAM_END)
        if not final and (PARAM.startswith(rest) or FN_END.startswith(rest)):
            return None, None
        search = close + len(PARAM_END)


def _strip_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _call(name: str, pieces: list, complete: bool) -> ToolCallText:
    args = "{" + ", ".join(f"{json_arguments(k)}: {json_arguments(v)}" for k, v in pieces)
    return ToolCallText(name, args + "}" if complete else args, complete)


def _maybe_header(s: str) -> bool:
    """Whether unfinished text could still become a `<function=name>` header."""
    return FN.startswith(s) or (s.startswith(FN) and ">" not in s and "\n" not in s)
