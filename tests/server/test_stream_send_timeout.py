"""A streaming client that stops reading while its request finishes (issue 42's slow reader, the
case --max-stream-backlog-tokens does not cover): the engine makes every token, fewer than the
backlog bound, and the stream's last frames wait in the server for a client that reads nothing.
Against the engine-process server `build.py serve` runs by default, on loopback.

Past --stream-send-timeout (TIMEOUT here) of a write waiting, the server closes the connection:
the request leaves the server's books (its sequences no longer count against the waiting bound)
and its unsent frames are freed. Before the timeout the handler waited on flush forever, holding
its connection, its frames and its admitted sequences.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from kiln.entrypoints.async_llm import AsyncLLM
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.test_slow_reader import OTHER_TOKENS, OTHERS, metric, other_clients
from tests.server.tiny_chat_model import MODEL_NAME, tiny_engine_args

TIMEOUT = 10.0  # seconds (the flag's default is 60); the engine finishes the request well within it
# 16 prompts of ~450 tokens with 20 prompt logprobs each (the tiny tokenizer: a token a character):
# ~10 MB of events, far more than the sockets buffer, from a few prefill steps, so the engine is done
# long before TIMEOUT; 2 tokens each, far under --max-stream-backlog-tokens (1024), which never acts
PROMPTS = [f"{i} slow " * 60 for i in range(16)]

@pytest.fixture(scope="module")
def srv(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir, kv_cache_tokens=16 * 1024),
                                       engine_process=True)
    s = LiveServer(engine, ServerConfig(served_model_names=(MODEL_NAME,), model_root="tiny",
                                        stream_send_timeout=TIMEOUT))
    yield s
    s.stop()
    engine.shutdown()


def books(srv) -> tuple[int, int]:
    """(requests in flight, sequences admitted) as the server counts them, read on its loop."""
    async def probe() -> tuple[int, int]:
        return len(srv.app.state.active), srv.app.state.admitted
    return asyncio.run_coroutine_threadsafe(probe(), srv.loop).result(10)


def test_a_finished_stream_nobody_reads_is_closed(srv):
    done0 = metric(srv, "request_success_total", 'finished_reason="length"')
    aborts0 = metric(srv, "request_success_total", 'finished_reason="abort"')
    body = json.dumps({"model": MODEL_NAME, "prompt": PROMPTS, "max_tokens": 2, "prompt_logprobs": 20,
                       "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's send blocks sooner
    sock.connect(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    try:
        # ... and reads nothing. The engine finishes every choice (not the backlog bound's abort) ...
        t0 = time.monotonic()
        while metric(srv, "request_success_total", 'finished_reason="length"') < done0 + len(PROMPTS):
            assert metric(srv, "request_success_total", 'finished_reason="abort"') == aborts0, \
                "aborted before the engine finished it: the machine is too slow for TIMEOUT"
            assert time.monotonic() < t0 + 60, "the request did not finish in the engine"
            time.sleep(0.1)
        print(f"engine finished the request {time.monotonic() - t0:.1f} s after it was sent")
        assert metric(srv, "request_success_total", 'finished_reason="abort"') == aborts0
        assert books(srv) == (1, len(PROMPTS))  # its frames wait in the server for the client
        # ... and within the timeout (plus the loop's slack) the server lets go of it.
        deadline = time.monotonic() + TIMEOUT + 20
        while books(srv) != (0, 0):
            assert time.monotonic() < deadline, f"a finished stream nobody reads is still held: {books(srv)}"
            time.sleep(0.1)
        # The server closed the connection: the client reads what the kernel had taken, then EOF, no [DONE].
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
