"""Reasoning parsers: split a model's thinking from its answer (vLLM: vllm/reasoning/)."""
from kiln.server.reasoning.reasoning_parser import (REASONING_PARSERS, PromptReasoning, ReasoningParser,
                                                    get_reasoning_parser)
from kiln.server.reasoning import think_tags  # noqa: F401  (registers qwen3 and deepseek_r1)

__all__ = ["REASONING_PARSERS", "PromptReasoning", "ReasoningParser", "get_reasoning_parser"]
