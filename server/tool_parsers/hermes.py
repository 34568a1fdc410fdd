"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call
(vLLM: vllm/tool_parsers/hermes_tool_parser.py Hermes2ProToolParser). Qwen3, Qwen2.5 and
most other chat models call tools this way.

A block ends where its JSON value ends (json_scan.value_end), so `</tool_call>` inside an
argument string does not cut it (vllm#19056). A call is reported once its block is complete
(or, at the end of the output, once its JSON is), with its arguments as one piece: whether a
block is a call is known only when its JSON parses, and a streamed call cannot be taken back.
A block that is not `{"name": str, "arguments": object}` naming an offered function is
left in the content.
"""
from __future__ import annotations

import json

from kiln.server.reasoning.reasoning_parser import partial_suffix
from kiln.server.tool_parsers.json_scan import INCOMPLETE, INVALID, skip_ws, value_end
from kiln.server.tool_parsers.tool_parser import (ContentBuilder, ParsedTools, ToolCallText, ToolParser,
                                                  json_arguments, register)

START, END = "<tool_call>", "</tool_call>"


@register
class HermesToolParser(ToolParser):
    name = "hermes"

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
            block = self._block(text, at + len(START), final)
            if block is None:  # undecided until more text comes
                break
            end, call = block
            if call is None:
                content.text(text[at:end])
            else:
                content.call()
                calls.append(call)
            pos = end
        return ParsedTools(content.result(final), calls)

    def _block(self, text: str, i: int, final: bool):
        """-> (end of the block, the call or None if malformed), or None while undecided."""
        j = skip_ws(text, i)
        end = value_end(text, j)
        if end is INCOMPLETE:
            return (len(text), None) if final else None
        if end != INVALID:
            k = skip_ws(text, end)
            rest = text[k:k + len(END)]
            if rest == END or (final and k == len(text)):  # an unterminated last call still counts
                return k + len(rest), self._call(text[j:end])
            if not final and END.startswith(rest):
                return None
        close = text.find(END, i)  # malformed: the block runs to its closing tag, if any
        if close < 0:
            return (len(text), None) if final else None
        return close + len(END), None

    def _call(self, raw: str):
        try:
            obj = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not self.known(obj["name"]):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models send the arguments as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCallText(obj["name"], json_arguments(args), complete=True)
