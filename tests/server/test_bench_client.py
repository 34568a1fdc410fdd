"""The server benchmark's lean streaming client (bench/server_workload.py SSEConnection) against a
live server, checked against the official openai client on the same requests: the same token ids
in the same chunks, keep-alive across requests, and errors raised rather than counted."""
from __future__ import annotations

import asyncio

import openai
import pytest

from kiln.bench.server_workload import SSEConnection, timings
from kiln.errors import KilnError
from tests.server.tiny_chat_model import MODEL_NAME

PROMPTS = [[5, 17, 42, 99, 7], [200, 3, 64]]


def body(prompt, max_tokens=12, **kw):
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, **kw}


def openai_chunks(server, prompt, max_tokens=12) -> list[list[int]]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        return [c.choices[0].model_extra["token_ids"] for c in stream
                if c.choices and c.choices[0].model_extra.get("token_ids")]


def test_lean_client_sees_what_the_openai_client_sees(server):
    async def run():
        conn = SSEConnection(server.url)
        try:  # one connection, several requests: keep-alive as the benchmark's workers use it
            return [await conn.completion(body(p)) for p in PROMPTS]
        finally:
            conn.close()
    results = asyncio.run(run())
    for prompt, (sent, events) in zip(PROMPTS, results):
        want = openai_chunks(server, prompt)
        assert sum(len(ids) for _, ids in events) == 12
        assert [t for _, ids in events for t in ids] == [t for ids in want for t in ids]
        ttft, tpot, tokens = timings(sent, events)
        assert tokens == 12 and ttft > 0 and tpot >= 0
        assert all(a <= b for (a, _), (b, _) in zip(events, events[1:]))


def test_lean_client_raises_on_errors(server):
    async def run(b):
        conn = SSEConnection(server.url)
        try:
            return await conn.completion(b)
        finally:
            conn.close()
    with pytest.raises(KilnError, match="404"):
        asyncio.run(run({**body(PROMPTS[0]), "model": "no-such-model"}))
    with pytest.raises(KilnError, match="400"):
        asyncio.run(run(body(PROMPTS[0], max_tokens=0)))
