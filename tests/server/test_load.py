"""The load test (issue 42): 256 concurrent streaming clients against the engine-process server
`build.py serve` runs by default, 50 of them killed mid-stream. Every other answer is complete,
exactly once and the offline engine's; afterwards nothing runs or waits, the KV cache is empty,
and /metrics counts the 50 aborts."""
from __future__ import annotations

import asyncio
import json
import re
import time

import openai
import pytest

from kiln import LLM, SamplingParams
from kiln.entrypoints.async_llm import AsyncLLM
from tests.server.conftest import live_server
from tests.server.tiny_chat_model import MODEL_NAME, tiny_engine_args

NUM_CLIENTS = 256
NUM_KILLED = 50
MAX_TOKENS = 8


def prompt(i: int) -> str:
    return f"load {i}"


@pytest.fixture(scope="module")
def proc_server(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir, kv_cache_tokens=16 * 1024),
                                       engine_process=True)
    srv = live_server(engine)
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_chat_dir):
    llm = LLM(tiny_chat_dir, kv_cache_tokens=16 * 1024)
    keep = range(NUM_KILLED, NUM_CLIENTS)
    outs = llm.generate([prompt(i) for i in keep],
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS) for i in keep])
    return {i: o.outputs[0] for i, o in zip(keep, outs)}


def aborts(srv) -> float:
    _, _, body = srv.request("GET", "/metrics")
    m = re.search(r'^kiln:request_success_total\{[^}]*finished_reason="abort"[^}]*\}\s+(\S+)$', body.decode(), re.M)
    return float(m.group(1))


async def killed_client(port: int, i: int, started: asyncio.Event) -> None:
    """A long stream whose client goes away after its first tokens."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt(i), "max_tokens": 400, "ignore_eos": True,
                       "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while got.count(b"data: ") < 2:
        chunk = await asyncio.wait_for(reader.read(65536), 120)
        assert chunk, "the stream ended before it was killed"
        got += chunk
    started.set()
    writer.transport.abort()  # the client is killed: no FIN handshake, the socket just goes


async def client(c: openai.AsyncOpenAI, i: int) -> dict:
    stream = await c.completions.create(model=MODEL_NAME, prompt=prompt(i), max_tokens=MAX_TOKENS, temperature=1.0,
                                        seed=i, stream=True, extra_body={"return_token_ids": True})
    got = {"ids": set(), "tokens": [], "text": "", "finish": []}
    async for chunk in stream:
        got["ids"].add(chunk.id)
        (ch,) = chunk.choices
        got["text"] += ch.text
        got["tokens"] += ch.model_extra["token_ids"]
        got["finish"].append(ch.finish_reason)
    return got


def test_256_streams_50_killed(proc_server, expected):
    srv = proc_server
    srv.wait_idle()
    before = aborts(srv)

    async def main():
        started = [asyncio.Event() for _ in range(NUM_KILLED)]
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            kills = [asyncio.ensure_future(killed_client(srv.port, i, started[i])) for i in range(NUM_KILLED)]
            rest = [asyncio.ensure_future(client(c, i)) for i in range(NUM_KILLED, NUM_CLIENTS)]
            await asyncio.gather(*kills)
            return await asyncio.gather(*rest)

    results = asyncio.run(asyncio.wait_for(main(), 300))
    ids = set()
    for i, got in zip(range(NUM_KILLED, NUM_CLIENTS), results):
        want = expected[i]
        assert len(got["ids"]) == 1
        ids |= got["ids"]
        assert got["tokens"] == want.token_ids and got["text"] == want.text, f"client {i}"
        assert [f for f in got["finish"] if f is not None] == [want.finish_reason]
    assert len(ids) == NUM_CLIENTS - NUM_KILLED
    m = srv.wait_idle(timeout=60)
    assert m["kiln:num_requests_running"] == 0 and m["kiln:num_requests_waiting"] == 0
    assert m["kiln:kv_cache_usage_perc"] == 0
    end = time.monotonic() + 30  # the aborts are counted as the engine applies them
    while aborts(srv) < before + NUM_KILLED and time.monotonic() < end:
        time.sleep(0.05)
    assert aborts(srv) == before + NUM_KILLED


def test_n_at_the_limit_through_the_engine_process(proc_server):
    """One request with n at --max-n's default (128 children through the pipe both ways)."""
    srv = proc_server
    n = srv.config.limits.max_n
    status, _, raw = srv.request("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "many", "n": n,
                                                             "max_tokens": 4, "temperature": 1.0, "seed": 3,
                                                             "ignore_eos": True},
                                 {"Content-Type": "application/json"}, timeout=120)
    assert status == 200, raw[:300]
    body = json.loads(raw)
    assert sorted(c["index"] for c in body["choices"]) == list(range(n))
    assert body["usage"]["completion_tokens"] == n * 4
    status, _, raw = srv.request("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "many", "n": n + 1,
                                                             "max_tokens": 4, "temperature": 1.0},
                                 {"Content-Type": "application/json"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "n"
    srv.wait_idle()
