"""GET /openapi.json: every route and request body of this server as an OpenAPI 3.0 document
(issue 42: OpenAI's shapes plus vLLM's extra fields), built from the server's own settings, so
the bounds it states (n, logprobs, stop strings, messages, max_tokens against the context) are
the ones it enforces. vLLM serves FastAPI's generated document and runs schemathesis against
it (tests/entrypoints/openai/test_openai_schema.py); tests/server/test_openapi.py does the same.

The document describes what the server accepts and answers; fields it ignores (newer OpenAI
fields) are allowed (additionalProperties), as the server ignores them.
"""
from __future__ import annotations

from typing import Any

from kiln import __version__
from kiln.runtime.sample.sampling_params import REPETITION_PENALTY_MAX, REPETITION_PENALTY_MIN
from kiln.server.base_handler import BaseHandler
from kiln.server.protocol import SAMPLING_FIELDS, RequestLimits

_KIND_SCHEMAS: dict[str, dict] = {
    "number": {"type": "number"},
    "int": {"type": "integer"},
    "bool": {"type": "boolean"},
    "str": {"type": "string"},
    "str_or_strs": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "strs": {"type": "array", "items": {"type": "string"}},
    "ints": {"type": "array", "items": {"type": "integer"}},
    "token_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
}

# What SamplingParams.verify accepts, field by field (runtime/sample/sampling_params.py).
_RANGES: dict[str, dict] = {
    "temperature": {"minimum": 0}, "top_p": {"minimum": 0, "exclusiveMinimum": True, "maximum": 1}, "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2}, "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"minimum": REPETITION_PENALTY_MIN, "maximum": REPETITION_PENALTY_MAX}, "min_tokens": {"minimum": 0},
    "seed": {"minimum": -(1 << 63), "maximum": (1 << 64) - 1},
}

ERROR = {"$ref": "#/components/schemas/ErrorResponse"}


def _nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


def _sampling(limits: RequestLimits) -> dict[str, dict]:
    props = {}
    for name, kind in SAMPLING_FIELDS.items():
        props[name] = _nullable({**_KIND_SCHEMAS[kind], **_RANGES.get(name, {})})
    props["n"] = _nullable({"type": "integer", "minimum": 1, "maximum": limits.max_n})
    props["stop"] = _nullable({"oneOf": [
        {"type": "string", "minLength": 1, "maxLength": limits.max_stop_string_chars},
        {"type": "array", "maxItems": limits.max_stop_strings,
         "items": {"type": "string", "minLength": 1, "maxLength": limits.max_stop_string_chars}}]})
    return props


def _common(limits: RequestLimits, max_model_len: int) -> dict[str, dict]:
    bounded = {"type": "integer", "minimum": 0, "maximum": limits.max_logprobs}
    return {
        "model": _nullable({"type": "string", "description": "a served model name"}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_usage": _nullable({"type": "boolean"}),
            "continuous_usage_stats": _nullable({"type": "boolean"})}}),
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": max_model_len}),
        "echo": _nullable({"type": "boolean"}),
        "priority": _nullable({"type": "integer", "description": "only with --scheduling-policy priority"}),
        "request_id": _nullable({"type": "string", "minLength": 1, "maxLength": 256,
                                 "description": "echoed in the response id; never the engine's id"}),
        "add_special_tokens": _nullable({"type": "boolean"}),
        "return_tokens_as_token_ids": _nullable({"type": "boolean"}),
        "return_token_ids": _nullable({"type": "boolean"}),
        "prompt_logprobs": _nullable(bounded),
        "structured_outputs": _nullable({"type": "object", "description": "one of json, regex, choice, grammar, "
                                         "json_object"}),
        "guided_json": _nullable({"oneOf": [{"type": "object"}, {"type": "string"}]}),
        "guided_regex": _nullable({"type": "string"}),
        "guided_choice": _nullable({"type": "array", "items": {"type": "string"}}),
        "guided_grammar": _nullable({"type": "string"}),
        **_sampling(limits),
    }


def _message(limits: RequestLimits) -> dict:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text", "input_text"]}, "text": {"type": "string"}}}
    return {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string"},
        "content": _nullable({"oneOf": [{"type": "string"}, {"type": "array", "items": part}]}),
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "tool_call_id": {"type": "string"},
        "reasoning_content": _nullable({"type": "string"})}}


def _body(schema_ref: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": schema_ref}}}}


def _responses(ok: dict | None, *, stream: bool = False, errors: tuple[int, ...] = (400, 401, 404, 413, 415, 503)
               ) -> dict:
    out: dict[str, Any] = {}
    if ok is not None:
        content = {"application/json": {"schema": ok}}
        if stream:
            content["text/event-stream"] = {"schema": {"type": "string"}}
        out["200"] = {"description": "OK", "content": content}
    for code in errors:
        out[str(code)] = {"description": "error", "content": {"application/json": {"schema": ERROR}}}
    out["default"] = {"description": "error", "content": {"application/json": {"schema": ERROR}}}
    return out


def openapi_document(state) -> dict:
    """The OpenAPI document of the app `state` serves."""
    limits: RequestLimits = state.config.limits
    max_len = state.engine.max_model_len
    common = _common(limits, max_len)
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
    completion = {"type": "object", "required": ["prompt"], "properties": {
        **common,
        "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
                             token_ids, {"type": "array", "minItems": 1, "items": token_ids}]},
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": limits.max_logprobs}),
        "best_of": _nullable({"type": "integer", "description": "equal to n when set"}),
        "suffix": {"nullable": True, "description": "not supported: null only", "enum": [None]}}}
    chat = {"type": "object", "required": ["messages"], "properties": {
        **common,
        "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages,
                     "items": {"$ref": "#/components/schemas/ChatMessage"}},
        "max_completion_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": max_len}),
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": limits.max_logprobs,
                                   "description": "needs logprobs true"}),
        "add_generation_prompt": _nullable({"type": "boolean"}),
        "continue_final_message": _nullable({"type": "boolean"}),
        "chat_template_kwargs": _nullable({"type": "object"}),
        "response_format": _nullable({"type": "object", "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object"}}}),
        "tools": _nullable({"type": "array", "items": {"type": "object"}}),
        "tool_choice": _nullable({"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]},
                                            {"type": "object"}]}),
        "documents": _nullable({"type": "array", "items": {"type": "object"}})}}
    tokenize = {"type": "object", "properties": {
        "model": _nullable({"type": "string"}), "prompt": {"type": "string"},
        "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages,
                     "items": {"$ref": "#/components/schemas/ChatMessage"}},
        "add_special_tokens": _nullable({"type": "boolean"}), "return_token_strs": _nullable({"type": "boolean"})}}
    detokenize = {"type": "object", "required": ["tokens"], "properties": {
        "model": _nullable({"type": "string"}), "tokens": {"type": "array", "items": {"type": "integer"}}}}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"}}}
    choices = {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "finish_reason": _nullable({"type": "string"})}}}

    def answer(obj: str) -> dict:
        return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": [obj]},
                               "created": {"type": "integer"}, "model": {"type": "string"},
                               "choices": choices, "usage": usage}}

    model = {"type": "object", "required": ["id", "object"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": ["model"]}}}
    schemas = {
        "CompletionRequest": completion, "ChatCompletionRequest": chat, "ChatMessage": _message(limits),
        "TokenizeRequest": tokenize, "DetokenizeRequest": detokenize,
        "ErrorResponse": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})}}}},
    }
    paths = {
        "/v1/completions": {"post": {"summary": "Create a completion", "operationId": "createCompletion",
                                     "requestBody": _body("#/components/schemas/CompletionRequest"),
                                     "responses": _responses(answer("text_completion"), stream=True)}},
        "/v1/chat/completions": {"post": {"summary": "Create a chat completion", "operationId": "createChatCompletion",
                                          "requestBody": _body("#/components/schemas/ChatCompletionRequest"),
                                          "responses": _responses(answer("chat.completion"), stream=True)}},
        "/v1/models": {"get": {"summary": "List the served models", "operationId": "listModels",
                               "responses": _responses({"type": "object", "required": ["object", "data"],
                                                        "properties": {"object": {"type": "string"},
                                                                       "data": {"type": "array", "items": model}}},
                                                       errors=(401,))}},
        "/v1/models/{model}": {"get": {"summary": "One served model", "operationId": "retrieveModel",
                                       "parameters": [{"name": "model", "in": "path", "required": True,
                                                       "schema": {"type": "string"}}],
                                       "responses": _responses(model, errors=(401, 404))}},
        "/tokenize": {"post": {"summary": "Tokenize a prompt or a conversation (vLLM)", "operationId": "tokenize",
                               "requestBody": _body("#/components/schemas/TokenizeRequest"),
                               "responses": _responses({"type": "object", "required": ["count", "tokens"],
                                                        "properties": {"count": {"type": "integer"},
                                                                       "max_model_len": {"type": "integer"},
                                                                       "tokens": {"type": "array",
                                                                                  "items": {"type": "integer"}}}})}},
        "/detokenize": {"post": {"summary": "Token ids to text (vLLM)", "operationId": "detokenize",
                                 "requestBody": _body("#/components/schemas/DetokenizeRequest"),
                                 "responses": _responses({"type": "object", "required": ["prompt"],
                                                          "properties": {"prompt": {"type": "string"}}})}},
        "/health": {"get": {"summary": "200 while the engine serves; 503 once it died, stalls or the server stops",
                            "operationId": "health",
                            "responses": {"200": {"description": "healthy"},
                                          "503": {"description": "unhealthy",
                                                  "content": {"application/json": {"schema": ERROR}}}}}},
        "/version": {"get": {"summary": "The server's version", "operationId": "version",
                             "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": {
                                 "type": "object", "required": ["version"],
                                 "properties": {"version": {"type": "string"}}}}}}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics",
                             "responses": {"200": {"description": "OK", "content": {"text/plain": {
                                 "schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"summary": "This document", "operationId": "openapi",
                                  "responses": {"200": {"description": "OK", "content": {"application/json": {
                                      "schema": {"type": "object"}}}}}}},
    }
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "kiln OpenAI-compatible server", "version": __version__},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if state.config.api_key is not None:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in paths.items():
            if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    return doc


class OpenAPIHandler(BaseHandler):
    """GET /openapi.json (no API key, as vLLM)."""

    def get(self) -> None:
        self.write_json(openapi_document(self.state))
