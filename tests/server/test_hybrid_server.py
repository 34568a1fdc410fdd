"""A Qwen3.5 hybrid behind the server (engine core in its own process): concurrent streams get
the offline engine's tokens, /metrics reports the state slots (the KV cache's second group)
in use and free again afterwards, and a client that leaves mid-stream frees its slot."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import openai
import pytest

from kiln import LLM, SamplingParams
from kiln.entrypoints.async_llm import AsyncLLM
from kiln.entrypoints.engine_args import EngineArgs
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.test_concurrency import read_until
from tests.server.tiny_chat_model import VOCAB_SIZE, make_tiny_tokenizer
from tests.tiny_models import make_tiny_hybrid

NAME = "tiny-hybrid"
PROMPTS = [f"request {i} " * (1 + 9 * (i % 3)) for i in range(8)]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_hybrid_server")
    make_tiny_hybrid(d, "qwen3_5_conditional", vocab_size=VOCAB_SIZE)
    make_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def server(hybrid_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(hybrid_dir), kv_cache_tokens=16 * 256),
                                       engine_process=True)
    srv = LiveServer(engine, ServerConfig(served_model_names=(NAME,), model_root="tiny"))
    yield srv
    srv.stop()
    engine.shutdown()


def test_streams_match_offline_and_free_their_slots(server, hybrid_dir):
    want = [o.outputs[0].text for o in LLM(str(hybrid_dir), kv_cache_tokens=16 * 256).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]

    async def one(client, p):
        text = ""
        async for chunk in await client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0,
                                                           stream=True, extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
        return text

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*[one(c, p) for p in PROMPTS])

    assert asyncio.run(main()) == want
    m = server.wait_idle()
    assert "kiln:state_slot_usage_perc" in m and m["kiln:state_slot_usage_perc"] == 0


def test_a_client_that_leaves_frees_its_state_slot(server):
    server.wait_idle()
    body = json.dumps({"model": NAME, "prompt": "a long story", "max_tokens": 400, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert b"data: " in read_until(sock, b"data: ")
    deadline = time.monotonic() + 30
    while server.metrics().get("kiln:state_slot_usage_perc", 0) == 0:  # it holds a slot while it runs
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    m = server.wait_idle(timeout=30)
    assert m["kiln:state_slot_usage_perc"] == 0 and m["kiln:kv_cache_usage_perc"] == 0
