"""The `<think>...</think>` parsers: qwen3 and deepseek_r1 (vLLM: vllm/reasoning/
qwen3_reasoning_parser.py Qwen3ReasoningParser, deepseek_r1_reasoning_parser.py).

qwen3 follows the prompt (ReasoningParser.prompt_state): Qwen3 opens the block itself,
Qwen3.5/3.6 templates open it in the prompt, and enable_thinking false closes it there.
deepseek_r1's template always opens it in the prompt and its models sometimes repeat
`<think>` anyway, so everything up to `</think>` is reasoning unless the prompt closed the block.
"""
from __future__ import annotations

from typing import Optional

from kiln.server.reasoning.reasoning_parser import PromptReasoning, ReasoningParser, register


@register
class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


@register
class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def split(self, text: str, state: PromptReasoning, final: bool) -> tuple[Optional[str], str]:
        if state is PromptReasoning.CLOSED:
            return None, text
        head = text.lstrip()
        if head.startswith(self.start_tag):
            text = head[len(self.start_tag):]
        elif not final and self.start_tag.startswith(head):
            return None, ""
        return super().split(text, PromptReasoning.OPEN, final)
