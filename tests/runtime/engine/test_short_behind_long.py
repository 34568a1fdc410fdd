"""A 5-token request behind a long prefill gets its first token within one chunk's time (issue
42 #3), through the whole engine on a tiny model. Counted in engine steps, not seconds: the
short request's first token comes at the first step after it arrives, and its later tokens keep
coming while the long prompt is still prefilling."""
from __future__ import annotations

import numpy as np
import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.engine.outputs import OutputKind
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("short_behind_long")
    make_tiny_model(d, "llama_gqa_untied")
    return LLM(d, skip_tokenizer_init=True, kv_cache_tokens=4096, max_num_batched_tokens=64)


def test_short_request_behind_a_long_prefill_gets_its_first_token_at_the_next_step(llm):
    eng = llm.engine
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request("long", rng.integers(0, 256, size=500).tolist(), sp, output_kind=OutputKind.DELTA)
    eng.step()
    eng.step()  # the long prompt is two chunks in (of 8)
    eng.add_request("short", [3, 1, 4, 1, 5], sp, output_kind=OutputKind.DELTA)
    got: dict[str, list[int]] = {"short": [], "long": []}
    steps_to_first = steps_to_all = None
    for step in range(1, 40):
        for o in eng.step():
            got[o.request_id] += o.outputs[0].token_ids
        if got["short"] and steps_to_first is None:
            steps_to_first = step
        if len(got["short"]) == 4 and steps_to_all is None:
            steps_to_all, long_then = step, list(got["long"])
        if not eng.has_unfinished_requests():
            break
    # Before the fix: the short request waited for all 6 remaining chunks of the long prompt.
    assert steps_to_first == 1
    assert steps_to_all == 4 and long_then == []  # its decodes did not wait for the prefill either
    assert len(got["long"]) == 4
