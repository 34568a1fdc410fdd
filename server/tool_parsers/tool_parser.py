"""The base of tool-call parsers and their registry (vLLM: vllm/tool_parsers/abstract_tool_parser.py
ToolParser, ToolParserManager).

A parser turns the answer text (what follows the reasoning) into content and tool calls.
Like the reasoning parsers it is a pure function of the text so far and `final`; streaming
re-parses the growing text and sends what grew (server/chat_output.py). So a partial parse
must be a prefix of the final one: content never takes back text, a call is reported only
once its name is settled, and its arguments only grow. Text a parser cannot read as a call
(bad JSON, an unknown function) stays in the content, as the model wrote it; never an error.

Content around calls: text before the first call keeps its leading whitespace but not the
whitespace just before a call; text after a call loses its leading whitespace (the newlines
models put between calls); trailing whitespace of unfinished text is held back, since a call
may follow it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ToolCallText:
    name: str
    arguments: str  # JSON text of an object; while streaming, a prefix of the final text
    complete: bool = False


@dataclass
class ParsedTools:
    content: str = ""
    calls: list[ToolCallText] = field(default_factory=list)


class ContentBuilder:
    """Content made of the text between calls, with the whitespace rules above."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.after_call = False

    def text(self, s: str) -> None:
        if self.after_call:
            s = s.lstrip()
        if s:
            self.parts.append(s)
            self.after_call = False

    def call(self) -> None:
        if self.parts:
            self.parts[-1] = self.parts[-1].rstrip()
        self.after_call = True

    def result(self, final: bool) -> str:
        out = "".join(self.parts)
        return out if final else out.rstrip()


class ToolParser:
    name = ""

    def __init__(self, tools: Optional[list[dict]]) -> None:
        # name -> its JSON schema of parameters ({} when it gives none)
        self.tools: dict[str, dict] = {}
        for t in tools or []:
            fn = t.get("function", {}) if isinstance(t, dict) else {}
            if isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                self.tools[fn["name"]] = params if isinstance(params, dict) else {}

    def known(self, name: str) -> bool:
        """Whether the request offers this function (with no tools given, any name is taken)."""
        return not self.tools or name in self.tools

    def parse(self, text: str, final: bool) -> ParsedTools:
        raise NotImplementedError


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    TOOL_PARSERS[cls.name] = cls
    return cls


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


def json_arguments(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)
