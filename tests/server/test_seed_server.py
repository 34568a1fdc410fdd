"""seed over HTTP (issue 42 #8): a negative seed samples and replays (before, it raised inside
the engine's step and every later request failed too); one past a signed 64-bit integer is a 400
naming `seed`; the server serves on after either."""
from __future__ import annotations

import json

from tests.server.test_errors import error_of
from tests.server.tiny_chat_model import MODEL_NAME

COMPLETIONS = "/v1/completions"


def _complete(server, **kw):
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 6, "temperature": 1.0, **kw}
    return server.request("POST", COMPLETIONS, body)


def test_negative_seed_samples_and_replays(server):
    texts = []
    for _ in range(2):
        code, _, body = _complete(server, seed=-5)
        assert code == 200, body
        texts.append(json.loads(body)["choices"][0]["text"])
    assert texts[0] == texts[1]
    assert _complete(server, seed=7)[0] == 200


def test_seed_past_int64_is_a_400_naming_seed(server):
    err = error_of(_complete(server, seed=2 ** 63), 400, "seed")
    assert "seed must be an integer in" in err["message"]
    assert _complete(server, seed=1)[0] == 200
