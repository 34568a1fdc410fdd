"""A streaming client that stops reading its socket (issue 42's slow reader), against the
engine-process server `build.py serve` runs by default, on loopback.

The client sends a long streaming completion (n=32, logprobs 20: megabytes of events) and reads
nothing. Once the sockets' buffers are full the handler waits on flush and the request's
collector merges what the engine makes; past --max-stream-backlog-tokens (BOUND here) of one
choice the server aborts the request and closes the connection. Sampled on the server's own
loop while it runs, no request ever holds more than BOUND untaken tokens per choice; other
clients meanwhile complete; afterwards the abort is counted and nothing runs.
Before the bound, the request ran to max_tokens with ~all of its tokens waiting in the server.
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import openai
import pytest

from kiln.entrypoints.async_llm import AsyncLLM
from kiln.server.protocol import RequestLimits
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.tiny_chat_model import MODEL_NAME, tiny_engine_args

BOUND = 64  # tokens of one choice a stream may fall behind (the flag's default is 1024)
SLOW_N, SLOW_TOKENS = 32, 480  # 32 x 480 tokens with 20 logprobs each: far more than the sockets buffer
OTHERS, OTHER_TOKENS = 8, 16


@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir, kv_cache_tokens=32 * 1024),
                                       engine_process=True)
    s = LiveServer(engine, ServerConfig(served_model_names=(MODEL_NAME,), model_root="tiny",
                                        limits=RequestLimits(max_stream_backlog_tokens=BOUND)))
    yield s
    s.stop()
    engine.shutdown()


def metric(srv, name: str, label: str = "") -> float:
    _, _, body = srv.request("GET", "/metrics")
    m = re.search(rf'^kiln:{name}(\{{[^}}]*{label}[^}}]*\}})?\s+(\S+)$', body.decode(), re.M)
    return float(m.group(2))


def backlog(srv) -> tuple[int, int]:
    """(largest untaken tokens of one choice in any request's collectors, requests in flight),
    read on the server's loop."""
    async def probe() -> tuple[int, int]:
        hs = list(srv.app.state.active)
        return max((c.pending_tokens() for h in hs for c in getattr(h, "_collectors", ())), default=0), len(hs)
    return asyncio.run_coroutine_threadsafe(probe(), srv.loop).result(10)


async def other_clients(url: str) -> list[tuple[int, str]]:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

    async def one(i: int) -> tuple[int, str]:
        tokens, finish = 0, None
        stream = await c.completions.create(model=MODEL_NAME, prompt=f"other {i}", max_tokens=OTHER_TOKENS,
                                            temperature=1.0, seed=i, stream=True, extra_body={"ignore_eos": True,
                                                                                              "return_token_ids": True})
        async for chunk in stream:
            (ch,) = chunk.choices
            tokens += len(ch.model_extra["token_ids"] or [])
            finish = ch.finish_reason or finish
        return tokens, finish
    try:
        return await asyncio.gather(*[one(i) for i in range(OTHERS)])
    finally:
        await c.close()


def test_a_client_that_stops_reading_is_bounded_then_aborted(srv):
    aborts0 = metric(srv, "request_success_total", 'finished_reason="abort"')
    body = json.dumps({"model": MODEL_NAME, "prompt": "slow", "max_tokens": SLOW_TOKENS, "n": SLOW_N,
                       "logprobs": 20, "temperature": 1.0, "seed": 1, "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's send blocks sooner
    sock.connect(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    try:
        # ... and reads nothing. Others are served meanwhile.
        others = asyncio.run(asyncio.wait_for(other_clients(srv.url), 60))
        assert others == [(OTHER_TOKENS, "length")] * OTHERS
        worst, seen_running, deadline = 0, False, time.monotonic() + 45
        while time.monotonic() < deadline:
            pending, in_flight = backlog(srv)
            worst = max(worst, pending)
            assert pending <= BOUND, f"{pending} tokens of one choice wait for a client that reads nothing"
            seen_running |= in_flight > 0
            if in_flight == 0 and metric(srv, "request_success_total", 'finished_reason="abort"') >= aborts0 + SLOW_N:
                break
            time.sleep(0.02)
        assert seen_running
        # each of its n sequences counts as one aborted engine request
        assert metric(srv, "request_success_total", 'finished_reason="abort"') == aborts0 + SLOW_N, \
            "the stream of a client that reads nothing was not aborted"
        assert metric(srv, "num_requests_running") == 0 and metric(srv, "num_requests_waiting") == 0
        # The server closed the connection: what the client finally reads ends without [DONE].
        sock.settimeout(30)
        got = b""
        try:
            while chunk := sock.recv(1 << 20):
                got += chunk
        except ConnectionResetError:
            pass
        assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in got
    finally:
        sock.close()
    # The server goes on serving.
    assert asyncio.run(asyncio.wait_for(other_clients(srv.url), 60)) == [(OTHER_TOKENS, "length")] * OTHERS
