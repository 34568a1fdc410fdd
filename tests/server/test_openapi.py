"""GET /openapi.json describes every route and request body, and schemathesis, generating
requests from it against a live server (as vLLM's tests/entrypoints/openai/test_openai_schema.py
does), finds no 5xx and no response that breaks the document (issue 42: /openapi.json)."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, settings

from kiln.entrypoints.async_llm import AsyncLLM
from kiln.server.protocol import RequestLimits
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.tiny_chat_model import MODEL_NAME, tiny_engine_args

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import (  # noqa: E402
    content_type_conformance, not_a_server_error, response_headers_conformance, response_schema_conformance,
    status_code_conformance)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


@pytest.fixture(scope="module")
def api_server(tiny_chat_dir):
    """A short context (32 tokens) and small limits keep every generated request cheap."""
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir, max_model_len=32))
    srv = LiveServer(engine, ServerConfig(served_model_names=(MODEL_NAME,), max_body_bytes=64 << 10,
                                          limits=RequestLimits(max_n=2, max_logprobs=3, max_messages=4,
                                                               max_stop_strings=2, max_stop_string_chars=8)))
    yield srv
    srv.stop()
    engine.shutdown()


def test_every_route_is_described(api_server):
    status, headers, raw = api_server.request("GET", "/openapi.json")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    doc = json.loads(raw)
    routes = {r.matcher.regex.pattern.rstrip("$") for r in api_server.app.wildcard_router.rules}
    described = {p.replace("{model}", "(.+)") for p in doc["paths"]}
    assert routes == described
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method == "post":
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.split("/")[-1] in doc["components"]["schemas"], path
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["n"]["maximum"] == 2 and chat["top_logprobs"]["maximum"] == 3
    assert chat["messages"]["maxItems"] == 4 and chat["max_completion_tokens"]["maximum"] == 32
    for name in ("temperature", "top_k", "seed", "logit_bias", "guided_json", "request_id", "prompt_logprobs"):
        assert name in chat  # OpenAI's fields and vLLM's extras


@pytest.fixture(scope="module")
def api_schema(api_server):
    return schemathesis.openapi.from_url(api_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_schemathesis(case):
    case.call_and_validate(checks=CHECKS, timeout=60)
