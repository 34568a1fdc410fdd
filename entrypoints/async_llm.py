"""AsyncLLM from a model path: the runtime's AsyncLLM (kiln.runtime.engine.async_llm),
plus the constructor that loads the model named by EngineArgs (vLLM's
AsyncLLM.from_engine_args)."""
from __future__ import annotations

from typing import Any, Sequence

from kiln.entrypoints.engine import build_engine, build_engine_process
from kiln.entrypoints.engine_args import EngineArgs
from kiln.runtime.engine.async_llm import AsyncLLM as _RuntimeAsyncLLM
from kiln.runtime.engine.async_llm import EngineDeadError


class AsyncLLM(_RuntimeAsyncLLM):
    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: Sequence[Any] = (), *,
                         engine_process: bool = False) -> "AsyncLLM":
        """Load the model named by EngineArgs (blocking) and start the engine thread.
        engine_process: run the engine core in its own process (runtime/engine/core_client.py),
        as vLLM serves: this process then only tokenises, detokenises and talks HTTP."""
        engine, model = build_engine_process(args) if engine_process else build_engine(args)
        engine.stat_loggers.extend(stat_loggers)
        return cls(engine, args=engine.engine_args or args, model=model)


__all__ = ["AsyncLLM", "EngineArgs", "EngineDeadError"]
