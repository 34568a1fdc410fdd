"""Many clients at once, and clients that leave: every stream gets exactly its own
answer, and afterwards nothing runs and every KV block is free (read from /metrics)."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import openai
import pytest

from kiln import LLM, SamplingParams
from tests.server.tiny_chat_model import MODEL_NAME

NUM_CLIENTS = 64
MAX_TOKENS = 16


def prompt(i: int) -> str:
    return f"client {i} says hello"


@pytest.fixture(scope="module")
def expected(tiny_chat_dir):
    llm = LLM(tiny_chat_dir, kv_cache_tokens=4096)
    outs = llm.generate([prompt(i) for i in range(NUM_CLIENTS)],
                        [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS) for i in range(NUM_CLIENTS)])
    return [o.outputs[0] for o in outs]


async def one_client(client: openai.AsyncOpenAI, i: int) -> dict:
    stream = await client.completions.create(model=MODEL_NAME, prompt=prompt(i), max_tokens=MAX_TOKENS,
                                             temperature=1.0, seed=i, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"return_token_ids": True})
    got = {"ids": set(), "text": "", "tokens": [], "finish": [], "usage": None}
    async for chunk in stream:
        got["ids"].add(chunk.id)
        if chunk.usage is not None:
            got["usage"] = chunk.usage
            continue
        (c,) = chunk.choices
        assert c.index == 0
        got["text"] += c.text
        got["tokens"] += c.model_extra["token_ids"]
        got["finish"].append(c.finish_reason)
    return got


def test_64_concurrent_streams(server, expected):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*[one_client(c, i) for i in range(NUM_CLIENTS)])

    before = server.metrics().get("kiln:request_success_total", 0)
    results = asyncio.run(main())
    ids = set()
    for i, (got, want) in enumerate(zip(results, expected)):
        assert len(got["ids"]) == 1, f"client {i} saw several response ids"
        ids |= got["ids"]
        assert got["tokens"] == want.token_ids, f"client {i} got another request's tokens"
        assert got["text"] == want.text
        assert [f for f in got["finish"] if f is not None] == [want.finish_reason]
        assert got["finish"][-1] is not None
        assert got["usage"].completion_tokens == len(want.token_ids)
    assert len(ids) == NUM_CLIENTS
    m = server.wait_idle()
    assert m["kiln:num_requests_running"] == 0 and m["kiln:kv_cache_usage_perc"] == 0
    assert m["kiln:request_success_total"] - before == NUM_CLIENTS


def read_until(sock: socket.socket, marker: bytes, timeout: float = 30) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_leaves_frees_its_blocks(server, stream):
    """The client closes its socket mid-request; the server aborts the request and its
    KV blocks go back to the pool (the request would otherwise run to 480 tokens)."""
    before = server.wait_idle()
    body = json.dumps({"model": MODEL_NAME, "prompt": "a long story", "max_tokens": 480, "ignore_eos": True,
                       "temperature": 0, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    if stream:
        assert b"data: " in read_until(sock, b"data: ")  # it is running and streaming
    else:
        deadline = time.monotonic() + 30
        while server.metrics().get("kiln:num_requests_running", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    sock.close()
    t0 = time.monotonic()
    m = server.wait_idle(timeout=30)
    assert m["kiln:kv_cache_usage_perc"] == 0 and m["kiln:num_requests_running"] == 0
    assert time.monotonic() - t0 < 10
    generated = m["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"]
    assert generated < 480, "the request ran to the end after its client left"
