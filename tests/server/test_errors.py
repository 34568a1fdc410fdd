"""Every error a client can cause, one test each, over raw HTTP: the status, OpenAI's
body shape {"error": {"message", "type", "param", "code"}} naming the field, and
never a traceback."""
from __future__ import annotations

import http.client
import json

import pytest

from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.tiny_chat_model import MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def error_of(resp, status: int, param=None) -> dict:
    code, headers, body = resp
    assert code == status, body
    assert headers["Content-Type"].startswith("application/json")
    assert b"Traceback" not in body and b'File "' not in body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    return err


def test_malformed_json(server):
    err = error_of(server.request("POST", COMPLETIONS, b'{"prompt": "hi",'), 400)
    assert "JSON" in err["message"] and err["code"] == "invalid_json"


def test_body_not_an_object(server):
    error_of(server.request("POST", CHAT, b'["hi"]'), 400)


def test_empty_body(server):
    error_of(server.request("POST", COMPLETIONS, b""), 400)


def test_missing_prompt(server):
    error_of(server.request("POST", COMPLETIONS, {"model": MODEL_NAME}), 400, "prompt")


def test_missing_messages(server):
    error_of(server.request("POST", CHAT, {"model": MODEL_NAME}), 400, "messages")


def test_wrong_type(server):
    err = error_of(server.request("POST", COMPLETIONS, {"prompt": "hi", "temperature": "hot"}), 400, "temperature")
    assert "number" in err["message"]


def test_out_of_range(server):
    error_of(server.request("POST", CHAT, {"messages": MESSAGES, "top_p": 2.0}), 400, "top_p")


def test_bad_max_completion_tokens(server):
    error_of(server.request("POST", CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}), 400,
             "max_completion_tokens")


def test_bad_logit_bias(server):
    error_of(server.request("POST", COMPLETIONS, {"prompt": "hi", "logit_bias": {"x": 1}}), 400, "logit_bias")


def test_token_ids_outside_the_vocabulary(server):
    error_of(server.request("POST", COMPLETIONS, {"prompt": [1, 2, 99999]}), 400, "prompt")


def test_stop_token_ids_outside_the_vocabulary(server):
    error_of(server.request("POST", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [99999]}), 400, "stop_token_ids")


def test_stream_options_without_stream(server):
    error_of(server.request("POST", CHAT, {"messages": MESSAGES, "stream_options": {"include_usage": True}}), 400,
             "stream_options")


def test_top_logprobs_without_logprobs(server):
    error_of(server.request("POST", CHAT, {"messages": MESSAGES, "top_logprobs": 2}), 400, "top_logprobs")


def test_unsupported_content_part(server):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    error_of(server.request("POST", CHAT, {"messages": msgs}), 400, "messages[0].content")


def test_priority_needs_priority_scheduling(server):
    error_of(server.request("POST", COMPLETIONS, {"prompt": "hi", "priority": 3}), 400, "priority")


def test_unknown_model(server):
    err = error_of(server.request("POST", CHAT, {"model": "gpt-9", "messages": MESSAGES}), 404, "model")
    assert "gpt-9" in err["message"] and err["code"] == "model_not_found"


def test_unknown_route(server):
    err = error_of(server.request("GET", "/v2/everything"), 404)
    assert "/v2/everything" in err["message"]


def test_wrong_method(server):
    resp = server.request("GET", COMPLETIONS)
    error_of(resp, 405)
    assert resp[1]["Allow"] == "POST"
    error_of(server.request("DELETE", "/health"), 405)


@pytest.mark.parametrize("size", [100 << 10, 4 << 20])
def test_body_too_large(server, size):
    # The test server's limit is 64 KiB; the client sends its whole body before reading.
    big = json.dumps({"prompt": "x" * size})
    err = error_of(server.request("POST", COMPLETIONS, big), 413)
    assert str(64 << 10) in err["message"] and str(len(big)) in err["message"]


def test_chunked_body_too_large(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    chunks = (b"x" * (16 << 10) for _ in range(8))  # 128 KiB without a Content-Length
    conn.request("POST", COMPLETIONS, body=chunks, encode_chunked=True,
                 headers={"Transfer-Encoding": "chunked"})
    resp = conn.getresponse()
    error_of((resp.status, dict(resp.getheaders()), resp.read()), 413)
    conn.close()


def test_prompt_too_long(server):
    err = error_of(server.request("POST", COMPLETIONS, {"prompt": "ab" * 400}), 400, "prompt")
    assert "512" in err["message"] and "800" in err["message"] and err["code"] == "context_length_exceeded"


def test_chat_prompt_too_long(server):
    msgs = [{"role": "user", "content": "ab" * 400}]
    err = error_of(server.request("POST", CHAT, {"messages": msgs}), 400, "messages")
    assert "512" in err["message"]


def test_max_tokens_past_the_context(server):
    err = error_of(server.request("POST", COMPLETIONS, {"prompt": "hello", "max_tokens": 600}), 400, "max_tokens")
    assert "512" in err["message"] and "600" in err["message"]


def test_internal_error_has_no_traceback(server, monkeypatch):
    import kiln.server.serving_completion as sc

    def boom(body):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(sc, "parse_completion_request", boom)
    _, _, body = resp = server.request("POST", COMPLETIONS, {"prompt": "hi"})
    error_of(resp, 500)
    assert b"secret" not in body


@pytest.fixture(scope="module")
def keyed_server(tiny_engine):
    srv = LiveServer(tiny_engine, ServerConfig(served_model_names=(MODEL_NAME,), api_key="s3cret"))
    yield srv
    srv.stop()


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "s3cret", "Basic s3cret"])
def test_bad_or_missing_api_key(keyed_server, auth):
    headers = {} if auth is None else {"Authorization": auth}
    err = error_of(keyed_server.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 1}, headers), 401)
    assert err["code"] == "invalid_api_key"
    error_of(keyed_server.request("GET", "/v1/models", headers=headers), 401)


def test_right_api_key_and_open_endpoints(keyed_server):
    ok = {"Authorization": "Bearer s3cret"}
    status, _, body = keyed_server.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 1}, ok)
    assert status == 200, body
    for path in ("/health", "/version", "/metrics"):
        assert keyed_server.request("GET", path)[0] == 200
