"""The official openai client against a live server: chat and completions, streamed
and not, with usage; seeded sampling at temperature > 0 gives the offline LLM's tokens."""
from __future__ import annotations

import openai
import pytest

from kiln import LLM, SamplingParams
from tests.server.tiny_chat_model import MODEL_NAME

PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
SAMPLING = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_chat_dir):
    llm = LLM(tiny_chat_dir, kv_cache_tokens=4096)
    params = SamplingParams(**SAMPLING)
    return {"completion": llm.generate(PROMPT, params)[0], "chat": llm.chat(MESSAGES, params)[0]}


def extra(obj, name):
    return (obj.model_extra or {})[name]


def test_completion_equals_offline(client, offline):
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **SAMPLING,
                                     extra_body={"return_token_ids": True})
    want = offline["completion"]
    choice = resp.choices[0]
    assert extra(choice, "token_ids") == want.outputs[0].token_ids
    assert choice.text == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert resp.object == "text_completion" and resp.model == MODEL_NAME
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_equals_offline(client, offline):
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True, **SAMPLING,
                                       stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True})
    text, ids, finish, usage = "", [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        (c,) = chunk.choices
        text += c.text
        ids += extra(c, "token_ids")
        finish.append(c.finish_reason)
    want = offline["completion"].outputs[0]
    assert ids == want.token_ids and text == want.text
    assert finish[-1] == want.finish_reason and all(f is None for f in finish[:-1])
    assert usage.completion_tokens == len(want.token_ids)
    assert usage.prompt_tokens == len(offline["completion"].prompt_token_ids)


def test_chat_equals_offline(client, offline):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **SAMPLING,
                                          extra_body={"return_token_ids": True})
    want = offline["chat"]
    (choice,) = resp.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == want.outputs[0].text
    assert extra(choice, "token_ids") == want.outputs[0].token_ids
    assert resp.object == "chat.completion"
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_chat_stream_equals_offline(client, offline):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **SAMPLING,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    body = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in body)
    ids = [t for c in body[1:] for t in extra(c.choices[0], "token_ids")]
    want = offline["chat"].outputs[0]
    assert text == want.text and ids == want.token_ids
    assert body[-1].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(offline["chat"].prompt_token_ids)


def test_continuous_usage_stats(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, max_tokens=6,
                                            temperature=0, stream_options={"include_usage": True,
                                                                           "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in stream]
    assert counts == sorted(counts) and counts[-1] >= 1


def test_prefix_cache_hit_is_reported(client):
    prompt = "A prompt long enough to fill more than two KV blocks of sixteen tokens each."
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


def test_n_choices_and_list_of_prompts(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=["one", "two"], n=2, max_tokens=5, seed=7,
                                     temperature=1.0, extra_body={"return_token_ids": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == sum(len(extra(c, "token_ids")) for c in resp.choices)
    assert resp.usage.prompt_tokens == sum(len(extra(c, "prompt_token_ids")) for c in resp.choices[::2])
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=3, max_tokens=4, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_completion_logprobs_and_echo(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=4, temperature=0, logprobs=2,
                                     echo=True)
    (c,) = resp.choices
    lp = c.logprobs
    assert c.text.startswith("abc")
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3 + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_stop_string_and_vllm_extras(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.01,
                                                 "repetition_penalty": 1.1, "min_tokens": 2})
    text = base.choices[0].text
    assert base.usage.completion_tokens == 12
    visible = [ch for ch in text[1:] if ch.isprintable() and ch.strip()]
    if visible:
        stop = visible[0]
        cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.01,
                                                    "repetition_penalty": 1.1, "min_tokens": 2})
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text[1:]


def test_models_endpoints(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_unknown_model_is_404_for_the_client(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-7", messages=MESSAGES, max_tokens=2)
    assert e.value.body["param"] == "model"
