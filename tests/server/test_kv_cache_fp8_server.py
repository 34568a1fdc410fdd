"""The served path with --kv-cache-dtype fp8: 64 concurrent streams get exactly the offline fp8
engine's tokens, and clients that leave mid-stream give their (e4m3) blocks back."""
from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from kiln.entrypoints.async_llm import AsyncLLM
from tests.server.conftest import live_server
from tests.server.test_concurrency import (  # noqa: F401  (collected here, with this module's fixtures)
    MAX_TOKENS,
    NUM_CLIENTS,
    prompt,
    test_64_concurrent_streams,
    test_client_that_leaves_frees_its_blocks,
)
from tests.server.tiny_chat_model import tiny_engine_args


@pytest.fixture(scope="module")
def fp8_engine(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir, kv_cache_dtype="fp8"))
    assert {str(t.dtype) for t in engine.model.graph.states} == {"fp8e4m3"}
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(fp8_engine):
    srv = live_server(fp8_engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(tiny_chat_dir):
    llm = LLM(tiny_chat_dir, kv_cache_tokens=4096, kv_cache_dtype="fp8")
    outs = llm.generate([prompt(i) for i in range(NUM_CLIENTS)],
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS) for i in range(NUM_CLIENTS)])
    return [o.outputs[0] for o in outs]
