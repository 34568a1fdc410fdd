"""The malformed-request corpus (issue 42): several hundred generated bad requests (every field
with wrong types, out of range, huge, negative, NaN, deeply nested, invalid UTF-8 and lone
surrogates; bad bodies, wrong methods, unknown routes) against a live server: each is a 4xx
with a body in OpenAI's error shape, none is a 5xx, none hangs, and the server serves after."""
from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.tiny_chat_model import MODEL_NAME

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
BASE = {COMPLETIONS: {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
        CHAT: {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 2}}
DEEP = "[" * 5000 + "]" * 5000
# JSON text of values that are wrong for every field of the kind (raw text: NaN, Infinity, deep nesting)
WRONG = {
    "number": ['"x"', "true", "[]", "{}", "NaN", "Infinity", "-Infinity", "1e400", DEEP],
    "int": ['"1"', "1.5", "true", "[]", "{}", "NaN", "1e400", DEEP],
    "bool": ['"true"', "1", "[]", "{}", "NaN", DEEP],
    "str": ["1", "[]", "{}", "true", "NaN", DEEP],
    "str_or_strs": ["1", "[1]", "{}", "[[]]", "true", DEEP],
    "strs": ['"x"', "[1]", "{}", "[null]", DEEP],
    "ints": ['"x"', "[1.5]", "[true]", '["1"]', "{}", DEEP],
    "token_bias": ["[1]", '{"a": 1}', '{"1": "x"}', '{"1": true}', '"x"', DEEP],
    "object": ['"x"', "1", "[]", "true", DEEP],
    "list": ['"x"', "1", "{}", "true"],
}
FIELDS = {  # field -> kind, for both endpoints
    "temperature": "number", "top_p": "number", "top_k": "int", "min_p": "number", "presence_penalty": "number",
    "frequency_penalty": "number", "repetition_penalty": "number", "seed": "int", "stop": "str_or_strs",
    "stop_token_ids": "ints", "include_stop_str_in_output": "bool", "ignore_eos": "bool", "min_tokens": "int",
    "skip_special_tokens": "bool", "spaces_between_special_tokens": "bool", "logit_bias": "token_bias",
    "allowed_token_ids": "ints", "bad_words": "strs", "n": "int", "model": "str", "stream": "bool",
    "stream_options": "object", "max_tokens": "int", "echo": "bool", "priority": "int", "request_id": "str",
    "add_special_tokens": "bool", "return_tokens_as_token_ids": "bool", "return_token_ids": "bool",
    "prompt_logprobs": "int",
}
CHAT_FIELDS = {"logprobs": "bool", "top_logprobs": "int", "max_completion_tokens": "int",
               "add_generation_prompt": "bool", "continue_final_message": "bool", "chat_template_kwargs": "object",
               "response_format": "object", "tools": "list", "documents": "list"}
COMPLETION_FIELDS = {"logprobs": "int", "best_of": "int"}
OUT_OF_RANGE = {  # field -> values in the right type but refused
    "temperature": ["-0.5", "-1e308"], "top_p": ["0", "1.5", "-1"], "top_k": ["-2", "-100"], "min_p": ["-0.1", "1.1"],
    "presence_penalty": ["2.5", "-3"], "frequency_penalty": ["9", "-9"], "repetition_penalty": ["0", "-1", "1e-320"],
    "seed": [str(2 ** 64), str(-2 ** 64)], "n": ["0", "-1", "1000000"], "max_tokens": ["0", "-5", "1000000000"],
    "min_tokens": ["-1", "1000"], "stop": ['""', '["a", ""]', json.dumps(["s"] * 100), json.dumps("x" * 5000)],
    "stop_token_ids": ["[-1]", "[1000000]"], "allowed_token_ids": ["[]", "[-3]", "[99999999]"],
    "logit_bias": ['{"1": 101}', '{"1": -1000}', '{"-1": 1}', '{"999999": 1}'], "bad_words": ['[""]'],
    "prompt_logprobs": ["-1", "21", "-100"], "priority": ["1", "-1"], "request_id": ['""', json.dumps("r" * 300)],
    "model": ['"no-such-model"', '""'], "stream_options": ['{"include_usage": true}'],
}
CHAT_RANGE = {"top_logprobs": ["21", "-1", "5"], "max_completion_tokens": ["0", "-1", "99999999"],
              "response_format": ['{"type": "bogus"}', '{"type": "json_schema"}'],
              "tools": ['[1]', '[{"type": "function"}]'], "chat_template": ['"{{ x }}"']}
COMPLETION_RANGE = {"logprobs": ["-1", "21"], "best_of": ["3"], "suffix": ['"x"']}


def _with(path: str, field: str, raw: str) -> bytes:
    base = {k: v for k, v in BASE[path].items() if k != field}
    text = json.dumps(base)
    return (text[:-1] + f', "{field}": {raw}}}').encode()


def corpus() -> list[tuple[str, str, bytes, dict]]:
    """(method, path, body, headers), each one a request the server must refuse."""
    out = []
    for path, extra, extra_range in ((COMPLETIONS, COMPLETION_FIELDS, COMPLETION_RANGE),
                                     (CHAT, CHAT_FIELDS, CHAT_RANGE)):
        for field, kind in {**FIELDS, **extra}.items():
            for raw in WRONG[kind]:
                out.append(("POST", path, _with(path, field, raw), {}))
        for field, raws in {**OUT_OF_RANGE, **extra_range}.items():
            for raw in raws:
                out.append(("POST", path, _with(path, field, raw), {}))
    prompts = ["null", "[]", "[[]]", '[1, "a"]', "[-1]", "[1000000]", "[[1], []]", '""', "{}", "1", "[1.5]",
               '"\\ud800"', DEEP, '[["a"]]', "true"]
    out += [("POST", COMPLETIONS, _with(COMPLETIONS, "prompt", p), {}) for p in prompts]
    messages = ["null", "[]", '"hi"', "[1]", "[{}]", '[{"role": 1}]', '[{"role": "user", "content": 1}]',
                '[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
                '[{"role": "user", "content": [1]}]', '[{"role": "user", "content": "\\udfff"}]',
                json.dumps([{"role": "user", "content": "x"}] * 5000), DEEP, "{}", "[null]"]
    out += [("POST", CHAT, _with(CHAT, "messages", m), {}) for m in messages]
    bodies = [b"", b"{", b"[]", b'"x"', b"null", b"1", b"\xff\xfe\x00", b'{"prompt": "\xc3\x28"}', DEEP.encode(),
              b'{"prompt": "a", "max_tokens": 2,}', b"{'prompt': 'x'}", b'{"prompt": NaN}', b"\x00" * 100,
              ("{" * 3000).encode()]
    for path in (COMPLETIONS, CHAT, "/tokenize", "/detokenize"):
        out += [("POST", path, b, {}) for b in bodies]
        out += [("POST", path, json.dumps(BASE.get(path, {"prompt": "x"})).encode(), {"Content-Type": ct})
                for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x")]
        out.append(("POST", path, b"x" * (100 << 10), {}))  # over the 64 KiB test body limit: 413
    for path in ("/tokenize",):
        for body in ('{"prompt": 1}', '{}', '{"messages": 1}', '{"prompt": "\\ud800"}', '{"prompt": "x", "model": "zz"}',
                     '{"prompt": "x", "add_special_tokens": "yes"}'):
            out.append(("POST", path, body.encode(), {}))
    for body in ('{"tokens": "x"}', '{}', '{"tokens": [-1]}', '{"tokens": [1.5]}', '{"tokens": [99999999]}',
                 '{"tokens": [1], "model": "zz"}'):
        out.append(("POST", "/detokenize", body.encode(), {}))
    for method, path in [("GET", COMPLETIONS), ("GET", CHAT), ("GET", "/tokenize"), ("PUT", COMPLETIONS),
                         ("DELETE", CHAT), ("PATCH", "/detokenize"), ("POST", "/health"), ("POST", "/metrics"),
                         ("POST", "/v1/models"), ("DELETE", "/v1/models"), ("PUT", "/version"), ("POST", "/version"),
                         ("DELETE", "/openapi.json"), ("POST", "/v1/models/tiny-chat")]:
        out.append((method, path, b"{}" if method != "GET" else b"", {}))
    for path in ("/", "/v2/completions", "/v1/completions/x", "/v1", "/v1/models/no-such-model", "/%00",
                 "/v1/chat", "/" + "a" * 4000, "/v1/../etc/passwd", "/v1/engines", "/docs"):
        out.append(("GET", path, b"", {}))
        out.append(("POST", path, b"{}", {}))
    return out


def send(port: int, method: str, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)  # a hang fails the test here
    try:
        conn.request(method, path, body=body if method != "GET" else None, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_corpus_size():
    assert len(corpus()) >= 300


def test_every_bad_request_is_a_4xx_in_openai_shape(server):
    cases = corpus()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: send(server.port, *c), cases))
    wrong = []
    for (method, path, body, _), (status, headers, raw) in zip(cases, results):
        label = f"{method} {path} {body[:80]!r}: {status} {raw[:200]!r}"
        if not 400 <= status < 500:
            wrong.append(label)
            continue
        try:
            err = json.loads(raw)["error"]
            ok = (headers.get("Content-Type", "").startswith("application/json")
                  and set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
                  and err["message"] and err["type"] == "invalid_request_error" and b"Traceback" not in raw)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            wrong.append(label)
    assert not wrong, f"{len(wrong)} of {len(cases)}:\n" + "\n".join(wrong[:40])
    status, _, raw = server.request("POST", COMPLETIONS, BASE[COMPLETIONS], {"Content-Type": "application/json"})
    assert status == 200, raw
    assert server.request("GET", "/health")[0] == 200
