"""What every handler of one app shares: the engine, the server's settings, its metrics.

Passed to handlers through Tornado's `initialize(state=...)`; nothing is global, so two
apps (or two servers) in one process keep apart.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    model_root: Optional[str] = None  # the model path, reported by /v1/models
    api_key: Optional[str] = None
    chat_template: Optional[str] = None  # overrides the tokenizer's template
    enable_force_include_usage: bool = False  # a usage chunk at the end of every stream
    max_body_bytes: int = 16 << 20  # larger request bodies get 413
    scheduling_policy: str = "fcfs"  # "priority" accepts the `priority` field
    reasoning_parser: Optional[str] = None  # server/reasoning: splits <think> into reasoning_content
    tool_call_parser: Optional[str] = None  # server/tool_parsers: reads tool calls out of the output
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)


@dataclass
class ServerState:
    engine: Any  # kiln.runtime.engine.async_llm.AsyncLLM
    config: ServerConfig
    metrics: Any  # kiln.server.metrics.PrometheusStatLogger
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def chat_template(self) -> Optional[str]:
        tok = self.engine.tokenizer
        return self.config.chat_template or (tok.chat_template if tok is not None else None)
