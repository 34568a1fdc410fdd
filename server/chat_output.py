"""One chat choice's text -> the message fields: reasoning, content, tool calls; whole
(non-streaming) or as stream deltas.

The reasoning parser splits first, and the tool parser (or the forced tool choice) reads only
the answer, so a `<tool_call>` inside `<think>` is reasoning, never a call (vllm#21544).
Streaming re-parses the text received so far and sends what grew since the last delta.
Every parser here keeps the prefix property (a partial parse is a prefix of the final
one, field by field), so the concatenated deltas equal the non-streamed message by
construction, a tag split across deltas included (vllm#30439). Re-parsing costs a scan of
the output per delta; the scans are str.find and regex searches, cheap beside a step.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from kiln.server.reasoning import PromptReasoning, ReasoningParser
from kiln.server.tool_parsers.json_scan import INCOMPLETE, INVALID, skip_ws, value_end
from kiln.server.tool_parsers.tool_parser import ParsedTools, ToolCallText, ToolParser, json_arguments


@dataclass
class ParsedChoice:
    reasoning: Optional[str]
    content: str
    calls: list[ToolCallText] = field(default_factory=list)


class ForcedToolChoice:
    """tool_choice "required" or a named function: a grammar made the answer JSON (vLLM's
    form: the named function's arguments, or a list of {"name", "parameters"}), which this
    reads back as calls. Named calls stream their arguments as the text grows."""

    def __init__(self, name: Optional[str]) -> None:
        self.name = name  # None: "required"

    def parse(self, text: str, final: bool) -> ParsedTools:
        if self.name is not None:
            args = text.strip() if final else text.rstrip()
            return ParsedTools("", [ToolCallText(self.name, args, final)])
        calls, i = [], skip_ws(text, 0)
        if not text.startswith("[", i):
            return ParsedTools(text if final else "", [])
        i += 1
        while True:
            i = skip_ws(text, i)
            end = value_end(text, i)
            if end is INCOMPLETE or end == INVALID:
                break
            try:
                item = json.loads(text[i:end])
                calls.append(ToolCallText(item["name"], json_arguments(item.get("parameters", {})), True))
            except (ValueError, KeyError, TypeError):
                break
            i = skip_ws(text, end)
            if text.startswith(",", i):
                i += 1
            else:
                break
        return ParsedTools("", calls)


class ChoiceParser:
    def __init__(self, reasoning: Optional[ReasoningParser], prompt_state: PromptReasoning,
                 tools: Optional[ToolParser | ForcedToolChoice]) -> None:
        self.reasoning = reasoning
        self.prompt_state = prompt_state
        self.tools = tools

    def parse(self, text: str, final: bool) -> ParsedChoice:
        reasoning, answer = None, text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.split(text, self.prompt_state, final)
        if self.tools is None:
            return ParsedChoice(reasoning, answer)
        parsed = self.tools.parse(answer, final)
        return ParsedChoice(reasoning, parsed.content, parsed.calls)

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tools is None


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def message_fields(p: ParsedChoice) -> dict[str, Any]:
    """The non-streamed message's parsed fields. Content is null when the answer is only
    calls or only reasoning, as OpenAI sends it."""
    calls = [{"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in p.calls]
    content = p.content if p.content or (not calls and p.reasoning is None) else None
    return {"content": content, "reasoning_content": p.reasoning, "reasoning": p.reasoning, "tool_calls": calls}


class ChoiceStream:
    """The deltas of one streamed choice: what each re-parse adds to what was sent."""

    def __init__(self, parser: ChoiceParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0
        self.sent_calls: list[int] = []  # per call: characters of its arguments sent

    @property
    def called(self) -> bool:
        return bool(self.sent_calls)

    def delta(self, new_text: str, final: bool) -> dict[str, Any]:
        self.text += new_text
        if self.parser.plain:
            return {"content": new_text} if new_text else {}
        p = self.parser.parse(self.text, final)
        out: dict[str, Any] = {}
        r = p.reasoning or ""
        if len(r) > self.sent_reasoning:
            out["reasoning_content"] = out["reasoning"] = r[self.sent_reasoning:]
            self.sent_reasoning = len(r)
        if len(p.content) > self.sent_content:
            out["content"] = p.content[self.sent_content:]
            self.sent_content = len(p.content)
        calls = []
        for i, c in enumerate(p.calls):
            if i == len(self.sent_calls):
                calls.append({"index": i, "id": tool_call_id(), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}})
                self.sent_calls.append(len(c.arguments))
            elif len(c.arguments) > self.sent_calls[i]:
                calls.append({"index": i, "function": {"arguments": c.arguments[self.sent_calls[i]:]}})
                self.sent_calls[i] = len(c.arguments)
        if calls:
            out["tool_calls"] = calls
        return out
