"""/metrics after a client leaves (issue 42 #2), in the engine-process mode `build.py serve`
runs by default and in-process: running requests and KV usage go back to 0 without another
request arriving, and the abort is counted in request_success_total{finished_reason="abort"}."""
from __future__ import annotations

import json
import re
import socket
import time

import pytest

from kiln.entrypoints.async_llm import AsyncLLM
from tests.server.conftest import live_server
from tests.server.tiny_chat_model import MODEL_NAME, tiny_engine_args


@pytest.fixture(scope="module", params=[True, False], ids=["engine_process", "in_process"])
def any_server(request, tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir), engine_process=request.param)
    srv = live_server(engine)
    yield srv
    srv.stop()
    engine.shutdown()


def aborts(srv) -> float:
    _, _, body = srv.request("GET", "/metrics")
    m = re.search(r'^kiln:request_success_total\{[^}]*finished_reason="abort"[^}]*\}\s+(\S+)$', body.decode(), re.M)
    return float(m.group(1))


def start_and_leave(srv, stream: bool) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": "a long story", "max_tokens": 400, "ignore_eos": True,
                       "temperature": 0, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 30
    if stream:
        sock.settimeout(30)
        got = b""
        while got.count(b"data: ") < 3:  # it is running and streaming
            got += sock.recv(65536)
    else:
        while srv.metrics().get("kiln:num_requests_running", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    sock.close()


@pytest.mark.parametrize("stream", [True, False])
def test_gauges_and_abort_count_after_disconnect(any_server, stream):
    srv = any_server
    srv.wait_idle()
    before = aborts(srv)
    start_and_leave(srv, stream)
    m = srv.wait_idle(timeout=15)  # no other request arrives to push the gauges
    assert m["kiln:num_requests_running"] == 0 and m["kiln:kv_cache_usage_perc"] == 0
    deadline = time.monotonic() + 15
    while aborts(srv) != before + 1:
        assert time.monotonic() < deadline, (before, aborts(srv))
        time.sleep(0.05)
    time.sleep(0.3)  # counted once, not again later
    assert aborts(srv) == before + 1
