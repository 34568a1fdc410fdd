"""A client's request id is echoed, never trusted (issue 42 #1): two clients that send the same
`request_id` (or X-Request-Id) each get their own complete answer, with the id they sent in the
response; the engine runs each under an id of the server's own."""
from __future__ import annotations

import asyncio

import openai
import pytest

from kiln import LLM, SamplingParams
from tests.server.tiny_chat_model import MODEL_NAME

LONG = dict(max_tokens=48, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def expected(tiny_chat_dir):
    llm = LLM(tiny_chat_dir, kv_cache_tokens=4096)
    p = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0)
    return {"a": llm.generate("first client", p)[0].outputs[0].token_ids,
            "b": llm.generate("second client", p)[0].outputs[0].token_ids,
            "chat": llm.chat([{"role": "user", "content": "hi"}], p)[0].outputs[0].token_ids}


async def _completion(c, prompt, stream, rid):
    body = {"return_token_ids": True, "ignore_eos": True, "request_id": rid}
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=48, temperature=0.0, extra_body=body)
    if not stream:
        r = await c.completions.create(**kw)
        return r.id, r.choices[0].model_extra["token_ids"], r.choices[0].finish_reason
    ids, finish, rids = [], None, set()
    async for chunk in await c.completions.create(stream=True, **kw):
        rids.add(chunk.id)
        ids += chunk.choices[0].model_extra["token_ids"]
        finish = chunk.choices[0].finish_reason or finish
    assert len(rids) == 1
    return rids.pop(), ids, finish


@pytest.mark.parametrize("stream", [False, True])
def test_same_request_id_from_two_clients(server, expected, stream):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            return await asyncio.gather(_completion(c, "first client", stream, "dup1"),
                                        _completion(c, "second client", stream, "dup1"))

    (id_a, toks_a, fin_a), (id_b, toks_b, fin_b) = asyncio.run(main())
    assert (toks_a, fin_a) == (expected["a"], "length")
    assert (toks_b, fin_b) == (expected["b"], "length")
    assert id_a == id_b == "cmpl-dup1"  # the client's id, echoed
    server.wait_idle()


def test_same_request_id_chat(server, expected):
    async def one(c):
        r = await c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=48, temperature=0.0,
                                            extra_body={"ignore_eos": True, "request_id": "dup2",
                                                        "return_token_ids": True})
        return r.id, r.choices[0].model_extra["token_ids"], r.choices[0].finish_reason

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            return await asyncio.gather(one(c), one(c), one(c))

    for rid, toks, fin in asyncio.run(main()):
        assert (rid, toks, fin) == ("chatcmpl-dup2", expected["chat"], "length")


def test_x_request_id_header_echoed(server):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    status, headers, _ = server.request("POST", "/v1/completions", body,
                                        {"Content-Type": "application/json", "X-Request-Id": "trace-7"})
    assert status == 200 and headers["X-Request-Id"] == "trace-7"
    # without one, the server's own unique id comes back, different for every request
    seen = {server.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})[1]
            ["X-Request-Id"] for _ in range(3)}
    assert len(seen) == 3


def test_request_id_is_bounded(server):
    for body, headers in (({"request_id": "x" * 1000}, {}), ({}, {"X-Request-Id": "y" * 1000})):
        status, _, raw = server.request("POST", "/v1/completions",
                                        {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **body},
                                        {"Content-Type": "application/json", **headers})
        assert status == 400, raw
