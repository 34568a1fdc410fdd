"""The engine core in its own process (what `build.py serve` runs by default): same
tokens as the offline API, aborts free blocks in the core, and a core that dies
fails every request and turns /health 503 instead of hanging."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from kiln import LLM, SamplingParams
from kiln.entrypoints.async_llm import AsyncLLM, EngineDeadError
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.tiny_chat_model import MODEL_NAME, tiny_engine_args

PARAMS = [SamplingParams(temperature=0.8, seed=i, max_tokens=12) for i in range(8)]
PROMPTS = [f"prompt number {i}" for i in range(8)]


@pytest.fixture(scope="module")
def proc_engine(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir), engine_process=True)
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLM, prompt, params, rid: str) -> list[int]:
    ids = []
    async for out in engine.generate(prompt, params, rid):
        ids += out.outputs[0].token_ids
    return ids


def test_same_tokens_as_offline(proc_engine, tiny_chat_dir):
    offline = [o.outputs[0].token_ids for o in LLM(tiny_chat_dir, kv_cache_tokens=4096).generate(PROMPTS, PARAMS)]

    async def main():
        return await asyncio.gather(*[collect(proc_engine, p, sp, f"r{i}")
                                      for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))])

    assert asyncio.run(main()) == offline
    assert proc_engine.engine.core.process.pid != os.getpid()


def test_abort_frees_blocks_in_the_core(proc_engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        seen = 0
        async for _ in proc_engine.generate("abort me", params, "to-abort"):
            seen += 1
            if seen == 2:
                await proc_engine.abort("to-abort")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the core frees asynchronously, then reports
            stats = await proc_engine.stats()
            if stats["num_running_reqs"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"] - 1:
                return seen, stats
            await asyncio.sleep(0.05)
        return seen, stats

    seen, stats = asyncio.run(main())
    assert seen <= 3
    assert stats["num_running_reqs"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"] - 1


def test_a_dead_core_fails_requests_and_health(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir), engine_process=True)
    srv = LiveServer(engine, ServerConfig(served_model_names=(MODEL_NAME,)))
    try:
        assert srv.request("GET", "/health")[0] == 200

        async def long_request():
            return await collect(engine, "hi", SamplingParams(max_tokens=100, ignore_eos=True), "x")

        os.kill(engine.engine.core.process.pid, signal.SIGKILL)
        # gone before the request is sent (sending it fails): the caller still hears that the
        # engine is dead (the core's death found by a step instead is the other order)
        engine.engine.core.process.join(10)
        with pytest.raises(EngineDeadError):
            asyncio.run(long_request())
        assert srv.request("GET", "/health")[0] == 503
    finally:
        srv.stop()
        engine.shutdown()
