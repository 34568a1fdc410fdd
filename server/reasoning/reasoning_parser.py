"""The base of reasoning parsers and their registry (vLLM: vllm/reasoning/abs_reasoning_parsers.py
ReasoningParser, ReasoningParserManager; basic_parsers.py BaseThinkingReasoningParser).

A parser splits generated text into (reasoning, content). It is a pure function of the text
generated so far, `final` saying whether more may come: streaming calls it on the growing
text and sends what grew, so for the streamed and the whole-text split to agree, the split of
a prefix must be a prefix (field by field) of the split of the whole. That is why a partial
tag at the end of unfinished text is held back instead of guessed at.

Where reasoning starts depends on the prompt as much as on the output: Qwen3 models open
`<think>` themselves, but the Qwen3.5/3.6 templates (and DeepSeek-R1's) end the prompt with
`<think>\\n`, so the output holds only the closing tag; with enable_thinking false the template
writes an empty `<think></think>` block and nothing is reasoning. `prompt_state` reads that
from the rendered prompt (the last think tag in it decides, as vLLM's is_reasoning_end scans
the prompt's ids backwards).
"""
from __future__ import annotations

import enum
from typing import Optional


class PromptReasoning(enum.Enum):
    OPEN = "open"  # the prompt ends inside a think block: the output starts as reasoning
    CLOSED = "closed"  # the prompt's last think block is closed: no reasoning in the output
    UNKNOWN = "unknown"  # no think tag in the prompt: the output may open one itself


class ReasoningParser:
    name = ""
    start_tag = "<think>"
    end_tag = "</think>"

    def prompt_state(self, prompt: str) -> PromptReasoning:
        start, end = prompt.rfind(self.start_tag), prompt.rfind(self.end_tag)
        if start < 0 and end < 0:
            return PromptReasoning.UNKNOWN
        return PromptReasoning.OPEN if start > end else PromptReasoning.CLOSED

    def split(self, text: str, state: PromptReasoning, final: bool) -> tuple[Optional[str], str]:
        """-> (reasoning, or None when the output has none; content)."""
        if state is PromptReasoning.CLOSED:
            return None, text
        body = text
        if state is PromptReasoning.UNKNOWN:
            head = text.lstrip()
            if head.startswith(self.start_tag):
                body = head[len(self.start_tag):]
            elif not final and self.start_tag.startswith(head):
                return None, ""  # whitespace or part of the tag so far: undecided
            else:
                return None, text  # the model answered without thinking
        at = body.find(self.end_tag)
        if at >= 0:
            return body[:at], body[at + len(self.end_tag):]
        if final:  # cut off (max_tokens) while thinking: all of it is reasoning
            return body, ""
        return body[:len(body) - partial_suffix(body, self.end_tag)], ""


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (held back
    while streaming: the next delta may complete the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}


def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
    REASONING_PARSERS[cls.name] = cls
    return cls


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") \
            from None
