"""--distributed-executor-backend ray (issue 44): the tensor-parallel ranks as Ray actors in a
placement group on a local Ray cluster the test starts (two CPUs, no GPU): the tokens of the
one-process numpy engine, and a killed actor fails the engine with one error, not a hang."""
from __future__ import annotations

import os
import signal

import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.worker.multiproc_executor import WorkerDiedError
from tests.tiny_models import make_tiny_model

ray = pytest.importorskip("ray")  # a test dependency (pyproject [test]); absent only outside CI


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_ranks_give_the_one_process_tokens_and_a_killed_actor_fails_the_engine(tmp_path, cluster, monkeypatch):
    make_tiny_model(tmp_path, "qwen3_qknorm")
    prompts = [[5, 6, 7, 8, 9, 10], [200, 3], list(range(40, 75))]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    monkeypatch.setenv("KILN_CPU_BACKEND", "numpy")
    want = [o.outputs[0].token_ids for o in LLM(tmp_path, skip_tokenizer_init=True).generate(prompts, greedy)]
    llm = LLM(tmp_path, skip_tokenizer_init=True, tensor_parallel_size=2, distributed_executor_backend="ray",
              kv_cache_tokens=2048)
    ex = llm.model.executor
    assert type(ex).__name__ == "RayExecutor" and len(set(ex.pids)) == 2 and os.getpid() not in ex.pids
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want

    llm.engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50))
    llm.engine.step()
    os.kill(ex.pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match="Ray worker failed"):
        for _ in range(50):
            llm.engine.step()
    assert ray.util.placement_group_table(ex.pg)["state"] == "REMOVED"
