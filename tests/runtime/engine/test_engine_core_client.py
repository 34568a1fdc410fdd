"""The engine core process ships each step's outputs as one list per field; what the front
unpacks must equal what the core's step returned."""
import pickle

import numpy as np

from kiln.runtime.engine.core_client import pack_outputs, unpack_outputs
from kiln.runtime.core.request import FinishReason
from kiln.runtime.sample.sampler import LogprobsTensors
from kiln.runtime.core.sched_output import EngineCoreOutput


def test_packed_outputs_survive_the_pipe_unchanged():
    rng = np.random.default_rng(0)
    lps = LogprobsTensors(rng.integers(0, 9, (1, 3)), rng.standard_normal((1, 3)).astype(np.float32),
                          rng.integers(1, 9, (1, 3)))
    outs = [EngineCoreOutput("a", [5]),
            EngineCoreOutput("b", [7, 8], FinishReason.STOP, stop_reason=8, num_cached_tokens=32),
            EngineCoreOutput("c", [1], FinishReason.LENGTH, new_logprobs=lps),
            EngineCoreOutput("d", [], new_prompt_logprobs=lps),
            EngineCoreOutput("e", [3], FinishReason.ABORT, stop_reason="gone")]
    got = unpack_outputs(pickle.loads(pickle.dumps(pack_outputs(outs))))
    assert [type(o) for o in got] == [EngineCoreOutput] * len(outs)
    for g, o in zip(got, outs):
        for f in ("request_id", "new_token_ids", "finish_reason", "stop_reason", "num_cached_tokens"):
            assert getattr(g, f) == getattr(o, f)
        assert type(g.finish_reason) is type(o.finish_reason)
        for f in ("new_logprobs", "new_prompt_logprobs"):
            a, b = getattr(g, f), getattr(o, f)
            assert (a is None) == (b is None)
            if a is not None:
                for name in ("token_ids", "logprobs", "ranks"):
                    np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert unpack_outputs(pickle.loads(pickle.dumps(pack_outputs([])))) == []
