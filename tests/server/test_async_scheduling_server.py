"""The served path with --async-scheduling: the concurrency, client-disconnect and
engine-process tests run again on engines that schedule step N+1 while step N executes.
Their oracles are the synchronous offline engine's outputs and a KV pool that is whole
again after clients leave; the aborts are checked to land while a step was executing."""
from __future__ import annotations

import pytest

from kiln.entrypoints.async_llm import AsyncLLM
from tests.server.conftest import live_server
from tests.server.test_concurrency import (  # noqa: F401  (collected here, with this module's fixtures)
    expected,
    test_64_concurrent_streams,
    test_client_that_leaves_frees_its_blocks,
)
from tests.server.test_engine_process import (  # noqa: F401
    test_abort_frees_blocks_in_the_core,
    test_same_tokens_as_offline,
)
from tests.server.tiny_chat_model import tiny_engine_args

ABORTS_IN_FLIGHT: list[int] = []  # steps in flight when each abort reached the core


@pytest.fixture(scope="module")
def async_engine(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir, async_scheduling=True))
    core = engine.engine.core
    assert core.async_scheduling
    abort = core.abort_requests

    def recording_abort(ids):  # runs on the engine thread, between steps
        ABORTS_IN_FLIGHT.append(len(core._batch_queue))
        return abort(ids)

    core.abort_requests = recording_abort
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(async_engine):
    srv = live_server(async_engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def proc_engine(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir, async_scheduling=True), engine_process=True)
    yield engine
    engine.shutdown()


def test_client_aborts_landed_while_a_step_executed(server):
    """After test_client_that_leaves_frees_its_blocks: the disconnects aborted requests
    while the engine had a step in flight (the case async scheduling must get right)."""
    assert ABORTS_IN_FLIGHT and max(ABORTS_IN_FLIGHT) >= 1
