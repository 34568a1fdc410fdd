"""The endpoints beside generation: /tokenize, /detokenize (vLLM's shapes), /health,
/version, /metrics (vLLM's metric names under kiln:, one registry per app)."""
from __future__ import annotations

import json

import kiln
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.tiny_chat_model import MODEL_NAME

EXPECTED_METRICS = [
    "kiln:num_requests_running", "kiln:num_requests_waiting", "kiln:kv_cache_usage_perc",
    "kiln:prefix_cache_queries_total", "kiln:prefix_cache_hits_total", "kiln:num_preemptions_total",
    "kiln:prompt_tokens_total", "kiln:generation_tokens_total", "kiln:request_success_total",
    "kiln:time_to_first_token_seconds_bucket", "kiln:inter_token_latency_seconds_bucket",
    "kiln:e2e_request_latency_seconds_bucket", "kiln:iteration_tokens_total_bucket",
    "kiln:request_prompt_tokens_bucket", "kiln:request_generation_tokens_bucket",
    "kiln:request_params_n_bucket", "kiln:request_params_max_tokens_bucket",
    "kiln:request_time_per_output_token_seconds_bucket", "kiln:cache_config_info",
]


def post(server, path, body):
    status, _, raw = server.request("POST", path, body)
    assert status == 200, raw
    return json.loads(raw)


def test_tokenize_and_detokenize_round_trip(server, tiny_engine):
    out = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": "héllo", "return_token_strs": True})
    assert out["tokens"] == tiny_engine.encode("héllo") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512 and len(out["token_strs"]) == out["count"]
    assert post(server, "/detokenize", {"model": MODEL_NAME, "tokens": out["tokens"]}) == {"prompt": "héllo"}


def test_tokenize_messages_matches_chat_prompt(server):
    msgs = [{"role": "user", "content": "hi"}]
    out = post(server, "/tokenize", {"messages": msgs})
    status, _, raw = server.request("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert json.loads(raw)["usage"]["prompt_tokens"] == out["count"]


def test_detokenize_rejects_bad_ids(server):
    status, _, raw = server.request("POST", "/detokenize", {"tokens": [1, -5]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tokens"


def test_health_and_version(server):
    assert server.request("GET", "/health")[0] == 200
    status, _, raw = server.request("GET", "/version")
    assert status == 200 and json.loads(raw) == {"version": kiln.__version__}


def test_metrics_names_and_counts(server):
    before = server.wait_idle()
    post(server, "/v1/completions", {"prompt": "count me", "max_tokens": 3, "ignore_eos": True})
    m = server.wait_idle()
    for name in EXPECTED_METRICS:
        assert name in m, name
    assert m["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] == 3
    assert m["kiln:request_success_total"] - before["kiln:request_success_total"] == 1
    assert m["kiln:e2e_request_latency_seconds_count"] - before["kiln:e2e_request_latency_seconds_count"] == 1
    # a non-streaming request has its first token and inter-token times measured too
    assert m["kiln:time_to_first_token_seconds_count"] - before["kiln:time_to_first_token_seconds_count"] == 1
    assert m["kiln:inter_token_latency_seconds_count"] - before["kiln:inter_token_latency_seconds_count"] == 2
    _, headers, _ = server.request("GET", "/metrics")
    assert headers["Content-Type"].startswith("text/plain")


def test_each_app_has_its_own_registry(tiny_engine, server):
    other = LiveServer(tiny_engine, ServerConfig(served_model_names=("other-name",)))
    try:
        _, _, mine = server.request("GET", "/metrics")
        _, _, theirs = other.request("GET", "/metrics")
        assert b'model_name="other-name"' in theirs and b'model_name="other-name"' not in mine
        assert f'model_name="{MODEL_NAME}"'.encode() not in theirs
    finally:
        other.stop()
