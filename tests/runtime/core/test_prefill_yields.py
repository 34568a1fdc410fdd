"""A long prompt's prefill chunks leave room for the head of the waiting queue (issue 42 #3):
a short request arriving behind a long prefill runs at the next step, not after the whole
prompt; decodes never yield, and a prefill leaves a token for each decode after it."""
from __future__ import annotations

from kiln.runtime.core.sched_output import ModelRunnerOutput

from tests.sched_fakes import create_scheduler, make_request


def _step(s):
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    s.update_from_output(out, ModelRunnerOutput(ids, [[7] for _ in ids]))
    return out.num_scheduled_tokens


def test_short_request_runs_at_the_next_step_behind_a_long_prefill():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=2048, num_blocks=200)
    s.add_request(make_request("long", list(range(1, 1001))))
    assert _step(s) == {"long": 64}
    assert _step(s) == {"long": 64}
    s.add_request(make_request("short", list(range(2000, 2005)), max_tokens=3))
    # Before the fix the long prefill took all 64 tokens for 14 more steps.
    assert _step(s) == {"long": 59, "short": 5}
    # The short one's decodes go on: the prefill before it in the running list leaves them a token.
    assert _step(s) == {"long": 63, "short": 1}
    assert _step(s) == {"long": 63, "short": 1}


def test_a_long_request_behind_a_long_prefill_shares_the_budget():
    s = create_scheduler(max_num_batched_tokens=64, max_model_len=2048, num_blocks=200)
    s.add_request(make_request("a", list(range(1, 1001))))
    _step(s)
    s.add_request(make_request("b", list(range(3000, 3500))))
    assert _step(s) == {"a": 32, "b": 32}
    assert _step(s) == {"a": 64}  # b runs now: running requests share by order, as before


def test_decodes_do_not_yield():
    s = create_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    for i in range(3):
        s.add_request(make_request(f"d{i}", [10 + i, 20 + i], max_tokens=50, ignore_eos=True))
    _step(s)
    s.add_request(make_request("w", list(range(100, 120))))
    assert _step(s) == {"d0": 1, "d1": 1, "d2": 1, "w": 5}


def test_no_reserve_when_max_num_seqs_are_running():
    s = create_scheduler(max_num_batched_tokens=64, max_num_seqs=1)
    s.add_request(make_request("long", list(range(1, 501))))
    _step(s)
    s.add_request(make_request("short", [5, 6, 7]))
    assert _step(s) == {"long": 64}  # max_num_seqs is reached: the short one cannot join
