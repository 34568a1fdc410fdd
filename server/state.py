"""What every handler of one app shares: the engine, the server's settings, its metrics.

Passed to handlers through Tornado's `initialize(state=...)`; nothing is global, so two
apps (or two servers) in one process keep apart.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kiln.server.protocol import RequestLimits

# Inputs past this many bytes are parsed, rendered and tokenized on the app's worker threads
# (issue 42 #10: a 10 MB prompt froze every other client for 8-10 s); smaller ones inline, where
# the thread hop would cost more than the work.
OFF_LOOP_BYTES = 64 << 10


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
    limits: RequestLimits = RequestLimits()  # what one request may ask, how many may wait (--max-* flags)
    shutdown_timeout: float = 30.0  # SIGTERM: seconds the requests in flight get to finish
    stream_send_timeout: float = 60.0  # a stream's write waiting this long on a client that reads nothing: closed
    backlog: int = 2048  # the listening socket's accept queue (uvicorn's --backlog default; Tornado's is 128)


@dataclass
class ServerState:
    engine: Any  # kiln.runtime.engine.async_llm.AsyncLLM
    config: ServerConfig
    metrics: Any  # kiln.server.metrics.PrometheusStatLogger
    created: int = field(default_factory=lambda: int(time.time()))
    # parsing, chat rendering and tokenization of large inputs (threads start on first use)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, "kiln-server-input"))
    admitted: int = 0  # engine sequences of the requests in flight (the waiting bound counts these)
    active: set = field(default_factory=set)  # the handlers with requests in the engine
    draining: bool = False  # shutting down: new requests and /health get 503

    async def run_sized(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), on a worker thread when the input is larger than OFF_LOOP_BYTES."""
        if size <= OFF_LOOP_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def chat_template(self) -> Optional[str]:
        tok = self.engine.tokenizer
        return self.config.chat_template or (tok.chat_template if tok is not None else None)
