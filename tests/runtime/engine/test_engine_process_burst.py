"""A burst through the engine-process channel completes (issue 42 #7): 3,000 requests queued
without reading, while the core streams steps back, once filled both directions of the pipe and
each side blocked writing forever (the front in EngineCoreClient._send, the core in its step
sends). Bounded: the burst runs on a thread given a deadline, and a hang kills the core."""
from __future__ import annotations

import threading
import time

import pytest

from kiln.entrypoints.engine import build_engine_process
from kiln.entrypoints.engine_args import EngineArgs
from kiln.runtime.sample.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

N = 3000


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("burst")
    make_tiny_model(d, "llama_gqa_untied")
    eng, _ = build_engine_process(EngineArgs(model=str(d), skip_tokenizer_init=True, kv_cache_tokens=16 * 1024,
                                             max_num_seqs=256))
    yield eng
    eng.core.shutdown()


def test_a_burst_fills_the_pipe_both_ways_and_completes(engine):
    # The first step's message is larger than the pipe holds (prompt logprobs: 4 requests x 500
    # positions x 21): the core blocks sending it while the front, not reading yet, writes the
    # burst's 3,000 adds (~4 MB) into the other direction. Before the fix both waited forever.
    first = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[(i * 7 + j) % 250 + 1 for j in range(64)] for i in range(N)]
    done: dict[str, int] = {}

    def burst():
        for k in range(4):  # one step: ~0.5 MB of prompt logprobs, twice what the pipe holds
            engine.add_request(f"first{k}", [(j * (k + 1)) % 250 + 1 for j in range(500)], first)
        time.sleep(0.5)  # the core takes it and runs its step
        for i, p in enumerate(prompts):
            engine.add_request(f"b{i}", p, sp)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = len(out.outputs[0].token_ids)

    t = threading.Thread(target=burst, daemon=True)
    t.start()
    t.join(120)
    if t.is_alive():
        engine.core.process.kill()  # release the stuck front so the suite goes on
        pytest.fail(f"the burst hung: {len(done)} of {N} requests finished")
    assert len(done) == N + 4 and [done.pop(f"first{k}") for k in range(4)] == [1] * 4
    assert set(done.values()) == {4}


def test_one_request_with_n_1000_completes(engine):
    """n: 3000 on the server hung the same way: one add per child, written while the core streams."""
    sp = SamplingParams(temperature=1.0, seed=3, n=1000, max_tokens=3, ignore_eos=True)
    result = []

    def run():
        engine.add_request("fan", [7, 8, 9, 10] * 8, sp)
        while engine.has_unfinished_requests():
            result.extend(o for o in engine.step() if o.finished)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    if t.is_alive():
        engine.core.process.kill()
        pytest.fail("the n=1000 request hung")
    assert len(result) == 1 and len(result[0].outputs) == 1000
    assert all(len(c.token_ids) == 3 for c in result[0].outputs)
