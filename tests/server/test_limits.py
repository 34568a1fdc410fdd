"""The limits a public server needs (issue 42, "Limits"), each a flag with a default: n, max_tokens
against the context, logprobs, stop strings (count and length), messages per request, and the
requests waiting for the engine (503 with Retry-After past the bound, never an unbounded queue)."""
from __future__ import annotations

import json
import socket
import time

import pytest

from kiln.build import build_parser
from kiln.entrypoints.async_llm import AsyncLLM
from kiln.server.protocol import RequestLimits
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.test_errors import error_of
from tests.server.tiny_chat_model import MODEL_NAME, tiny_engine_args

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"Content-Type": "application/json"}
LIMITS = RequestLimits(max_n=3, max_logprobs=4, max_stop_strings=2, max_stop_string_chars=8, max_messages=3,
                       max_waiting_requests=2)


@pytest.fixture(scope="module")
def small(tiny_chat_dir):
    """A server whose engine runs 2 sequences at once, with small limits."""
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir, max_num_seqs=2))
    srv = LiveServer(engine, ServerConfig(served_model_names=(MODEL_NAME,), limits=LIMITS))
    yield srv
    srv.stop()
    engine.shutdown()


def msgs(k):
    return [{"role": "user", "content": "hi"}] * k


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": "x", "n": 4}, "n"),
    (CHAT, {"messages": msgs(1), "n": 4}, "n"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 5}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 5}, "prompt_logprobs"),
    (CHAT, {"messages": msgs(1), "logprobs": True, "top_logprobs": 5}, "top_logprobs"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": "123456789"}, "stop"),
    (CHAT, {"messages": msgs(1), "stop": ["ok", "123456789"]}, "stop"),
    (CHAT, {"messages": msgs(4)}, "messages"),
    (COMPLETIONS, {"prompt": ["a"] * 5}, "prompt"),  # 5 sequences can never fit 2 running + 2 waiting
    (COMPLETIONS, {"prompt": "x", "max_tokens": 10_000}, "max_tokens"),  # past the 512-token context
    (CHAT, {"messages": msgs(1), "max_completion_tokens": 10_000}, "max_completion_tokens"),
])
def test_past_a_limit_is_a_400(small, path, body, param):
    error_of(small.request("POST", path, {"model": MODEL_NAME, "max_tokens": 2, **body}, JSON), 400, param)


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, {"prompt": "x", "n": 3, "logprobs": 4, "stop": ["a", "12345678"]}),
    (CHAT, {"messages": msgs(3), "logprobs": True, "top_logprobs": 4, "stop": ["12345678", "b"]}),
])
def test_at_the_limits_is_served(small, path, body):
    status, _, raw = small.request("POST", path, {"model": MODEL_NAME, "max_tokens": 2, **body}, JSON)
    assert status == 200, raw


def _open_stream(port: int, i: int) -> socket.socket:
    body = json.dumps({"model": MODEL_NAME, "prompt": f"long {i}", "max_tokens": 400, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def test_waiting_queue_is_bounded(small):
    small.wait_idle()
    socks = [_open_stream(small.port, i) for i in range(4)]  # 2 running + 2 waiting: the bound
    try:
        deadline = time.monotonic() + 30
        while True:
            m = small.metrics()
            if m.get("kiln:num_requests_running") == 2 and m.get("kiln:num_requests_waiting") == 2:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.02)
        for path, body in ((COMPLETIONS, {"prompt": "one more"}), (CHAT, {"messages": msgs(1)})):
            resp = small.request("POST", path, {"model": MODEL_NAME, "max_tokens": 2, **body}, JSON)
            err = error_of(resp, 503)
            assert resp[1]["Retry-After"].isdigit() and err["code"] == "server_overloaded"
    finally:
        for s in socks:
            s.close()
    small.wait_idle()
    status, _, raw = small.request("POST", COMPLETIONS, {"model": MODEL_NAME, "prompt": "after", "max_tokens": 2},
                                   JSON)
    assert status == 200, raw


def test_flags_and_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.max_n, args.max_logprobs, args.max_stop_strings, args.max_stop_string_length, args.max_messages,
            args.max_waiting_requests) == (128, 20, 16, 512, 4096, 1024)
    default = RequestLimits()
    assert (default.max_n, default.max_logprobs, default.max_stop_strings, default.max_stop_string_chars,
            default.max_messages, default.max_waiting_requests) == (128, 20, 16, 512, 4096, 1024)
    args = build_parser().parse_args(["serve", "--max-n", "2", "--max-logprobs", "5", "--max-stop-strings", "1",
                                      "--max-stop-string-length", "3", "--max-messages", "7",
                                      "--max-waiting-requests", "0"])
    assert (args.max_n, args.max_logprobs, args.max_stop_strings, args.max_stop_string_length, args.max_messages,
            args.max_waiting_requests) == (2, 5, 1, 3, 7, 0)
