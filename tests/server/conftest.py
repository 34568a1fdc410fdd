"""Server test fixtures: a tiny chat model with a real tokenizer (milliseconds a step),
an AsyncLLM over it, and a live server on loopback (tests/server/live_server.py)."""
from __future__ import annotations

import pytest

from kiln.entrypoints.async_llm import AsyncLLM
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.tiny_chat_model import MODEL_NAME, make_tiny_chat_model, tiny_engine_args


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="module")
def tiny_engine(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir))
    yield engine
    engine.shutdown()


def live_server(engine) -> LiveServer:
    """The server the tests talk to, on `engine` (the module's `server` fixtures)."""
    return LiveServer(engine, ServerConfig(served_model_names=(MODEL_NAME,), model_root="tiny",
                                           max_body_bytes=64 << 10))


@pytest.fixture(scope="module")
def server(tiny_engine):
    srv = live_server(tiny_engine)
    yield srv
    srv.stop()
