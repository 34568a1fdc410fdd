"""AsyncLLM: the engine on its own thread behind asyncio. Outputs reach the right
request, lagging consumers get merged deltas, aborts free blocks, two engines in one
process keep apart, and an engine that fails fails every request and turns /health 503."""
from __future__ import annotations

import asyncio
import json

import pytest

from kiln import LLM, SamplingParams
from kiln.entrypoints.async_llm import AsyncLLM, EngineDeadError
from kiln.runtime.engine.outputs import OutputKind, RequestOutput
from kiln.server.state import ServerConfig
from tests.server.live_server import LiveServer
from tests.server.tiny_chat_model import MODEL_NAME, tiny_engine_args

PARAMS = [SamplingParams(temperature=0.8, seed=i, max_tokens=12) for i in range(8)]
PROMPTS = [f"prompt number {i}" for i in range(8)]


@pytest.fixture(scope="module")
def offline(tiny_chat_dir):
    llm = LLM(tiny_chat_dir, kv_cache_tokens=4096)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


async def collect(engine: AsyncLLM, i: int, rid: str) -> list[int]:
    ids = []
    async for out in engine.generate(PROMPTS[i], PARAMS[i], rid):
        assert out.request_id == rid
        ids += out.outputs[0].token_ids
    return ids


def test_two_engines_in_one_process_do_not_collide(tiny_chat_dir, offline):
    a = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir))
    b = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir))
    try:
        async def main():
            # the same request ids in both engines, all running at once
            return await asyncio.gather(*[collect(e, i, f"r{i}") for e in (a, b) for i in range(8)])

        got = asyncio.run(main())
        assert got[:8] == offline and got[8:] == offline
    finally:
        a.shutdown()
        b.shutdown()
    assert not a.is_running and not b.is_running


async def until_all_delivered(c) -> None:
    """Wait, without reading, until the collector holds the request's final output. (The engine's
    stats can say no request is running before the front thread's last delivery has run on the
    loop: waiting on them alone raced under load.)"""
    async def finished():
        while not (isinstance(c._item, RequestOutput) and c._item.finished):
            await asyncio.sleep(0.01)
    await asyncio.wait_for(finished(), 120)


def test_lagging_consumer_gets_merged_deltas(tiny_engine, offline):
    async def main():
        c = await tiny_engine.add_request("lag", PROMPTS[0], PARAMS[0], output_kind=OutputKind.DELTA)
        await until_all_delivered(c)
        out = await c.get()  # everything arrived while nobody read: one merged output
        return out

    out = asyncio.run(main())
    assert out.finished and out.outputs[0].token_ids == offline[0]


def test_merged_deltas_equal_the_offline_output(tiny_engine, tiny_chat_dir):
    """n=2 with logprobs, nobody reading until both finish: the one merged output holds each
    choice's text, token ids, logprobs and finish as LLM.generate gives them."""
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=10, n=2, logprobs=2)
    want = LLM(tiny_chat_dir, kv_cache_tokens=4096).generate(PROMPTS[1], params)[0]

    async def main():
        c = await tiny_engine.add_request("lag-n2", PROMPTS[1], params, output_kind=OutputKind.DELTA)
        await until_all_delivered(c)
        return c.get_nowait(), c.get_nowait()

    out, nothing_more = asyncio.run(main())
    assert nothing_more is None and out.finished and out.request_id == "lag-n2"
    assert [c.index for c in out.outputs] == [0, 1]
    for got, w in zip(out.outputs, sorted(want.outputs, key=lambda c: c.index)):
        assert got.token_ids == w.token_ids and len(got.token_ids) == 10
        assert got.text == w.text
        assert got.finish_reason == w.finish_reason and got.stop_reason == w.stop_reason
        assert got.logprobs == w.logprobs and len(got.logprobs) == 10
        assert got.cumulative_logprob == pytest.approx(w.cumulative_logprob)
    assert out.prompt_token_ids == want.prompt_token_ids


def test_abort_frees_blocks_and_ends_the_stream(tiny_engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        agen = tiny_engine.generate("abort me", params, "to-abort")
        seen = 0
        async for _ in agen:
            seen += 1
            if seen == 2:
                await tiny_engine.abort("to-abort")
        stats = await tiny_engine.stats()
        return seen, stats

    seen, stats = asyncio.run(main())
    assert seen <= 3
    assert stats["num_running_reqs"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"] - 1


def test_bad_request_raises_before_any_output(tiny_engine):
    async def main():
        with pytest.raises(ValueError):
            await tiny_engine.add_request("bad", [1, 2, 10 ** 6], SamplingParams())
        with pytest.raises(ValueError):  # the id is free again after the failure
            await tiny_engine.add_request("bad", "", SamplingParams())

    asyncio.run(main())
    assert tiny_engine.is_running


def test_shutdown_fails_new_requests(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir))
    engine.shutdown()

    async def main():
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "hi", SamplingParams())
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    asyncio.run(main())
    assert engine.errored and not engine.is_running


def test_engine_failure_fails_requests_and_health(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir))
    srv = LiveServer(engine, ServerConfig(served_model_names=(MODEL_NAME,)))
    try:
        assert srv.request("GET", "/health")[0] == 200

        def broken_step():
            raise RuntimeError("device lost")

        engine.engine.step = broken_step
        status, _, body = srv.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4})
        assert status == 503 and json.loads(body)["error"]["code"] == "engine_dead"
        assert b"Traceback" not in body and b"device lost" not in body
        status, _, body = srv.request("GET", "/health")
        assert status == 503
        assert srv.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                             "stream": True})[0] == 503
    finally:
        srv.stop()
        engine.shutdown()


def test_engine_failure_mid_stream_sends_an_error_event(tiny_chat_dir):
    engine = AsyncLLM.from_engine_args(tiny_engine_args(tiny_chat_dir))
    srv = LiveServer(engine, ServerConfig(served_model_names=(MODEL_NAME,)))
    try:
        real_step, calls = engine.engine.step, []

        def failing_step():
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("device lost")
            return real_step()

        engine.engine.step = failing_step
        status, _, body = srv.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 50, "ignore_eos": True})
        assert status == 200
        frames = [f[len("data: "):] for f in body.decode().split("\n\n") if f]
        assert frames[-1] == "[DONE]"
        err = json.loads(frames[-2])["error"]
        assert err["code"] == "engine_dead" and "device lost" not in err["message"]
    finally:
        srv.stop()
        engine.shutdown()
