"""append_and_check_stop calls check_stop only where it can say yes; the verdicts, statuses and
stop reasons must be what calling check_stop after every token gives."""
import numpy as np
import pytest

from kiln.runtime.core.stop_check import append_and_check_stop, check_stop
from tests.sched_fakes import make_request


@pytest.mark.parametrize("seed", range(20))
def test_append_and_check_stop_equals_checking_every_token(seed):
    rng = np.random.default_rng(seed)
    max_model_len = int(rng.integers(8, 40))
    prompt = [int(t) for t in rng.integers(1, 10, int(rng.integers(1, 8)))]
    sp = dict(max_tokens=None if rng.random() < 0.2 else int(rng.integers(1, 30)),
              min_tokens=int(rng.integers(0, 6)) if rng.random() < 0.5 else 0,
              ignore_eos=bool(rng.random() < 0.3),
              stop_token_ids=[int(t) for t in rng.integers(0, 10, int(rng.integers(0, 3)))])
    fast, slow = make_request("a", prompt, **sp), make_request("a", prompt, **sp)
    while True:
        tok = int(rng.integers(0, 10))
        stopped = append_and_check_stop(fast, [tok], max_model_len)
        slow.append_output_token_ids(tok)
        assert stopped == check_stop(slow, max_model_len)
        assert (fast.status, fast.stop_reason, fast.all_token_ids) == (slow.status, slow.stop_reason, slow.all_token_ids)
        if stopped:
            break
