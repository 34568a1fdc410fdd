"""A tensor-parallel bundle for sm_90, compile only (issue 44; docs/TENSOR_PARALLEL.md): rank 0's
graph of a tiny Qwen3 over two ranks lowers with its collectives in the plan (a barrier, the
rank-order all-reduce reading both ranks' arenas at the partial's offset, a barrier; the masked
vocabulary lookup reading the rank's first id from the device; the logits' all-gather) and its
kernels compile; rank 1's graph lowers to the very same plan, which is what lets one bundle
serve every rank with the rank a run-time argument. Nothing here runs on a GPU."""
from __future__ import annotations

import dataclasses

import pytest

from kiln.codegen.buckets import make_buckets
from kiln.codegen.compile import compile_bundle
from kiln.graph import DType
from kiln.loader import tensor_parallel_pass
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import default_passes, run_pipeline
from tests.tiny_models import BASE


def _bundle(cfg, rank: int):  # the peer-memory kernels (NCCL is the default: test_bundle_nccl.py)
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16),
                         passes=default_passes(shard=tensor_parallel_pass(cfg, 2, rank)))
    buckets = make_buckets(8, 64)
    return compile_bundle(graph, target="sm_90", model_config=dataclasses.asdict(cfg), config_hash=cfg.compute_hash(),
                          max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
                          buckets=[buckets[0], buckets[-1]], collective="peer")


@pytest.mark.slow
def test_two_rank_bundle_compiles_with_its_collectives_and_one_plan_serves_both_ranks():
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "vocab_size": 250})
    b0, b1 = _bundle(cfg, 0), _bundle(cfg, 1)
    assert b0.manifest["plans"] == b1.manifest["plans"] and b0.manifest["regions"] == b1.manifest["regions"]
    regions = b0.manifest["regions"]
    kernel = {k: m["name"] for k, m in b0.manifest["kernels"].items()}
    assert all(blob[:4] == b"\x7fELF" for blob in b0.kernels.values())
    for name, plan in b0.manifest["plans"].items():
        names = [kernel[key] for key, _, _ in plan["launches"]]
        layers = cfg.num_hidden_layers
        assert names.count("all_reduce_kernel") == 2 * layers + 1, name  # embedding, o_proj and down of each layer
        assert names.count("all_gather_kernel") == 1 and names.count("vocab_embedding_kernel") == 1
        assert names.count("barrier_kernel") == 2 * (2 * layers + 2)
        for i, n in enumerate(names):
            if n in ("all_reduce_kernel", "all_gather_kernel"):
                assert names[i - 1] == names[i + 1] == "barrier_kernel"
                args = plan["launches"][i][2]
                ranks = [regions[args[r][0]] for r in range(2)]
                assert ranks == ["tp_arena:0", "tp_arena:1"] and args[0][1] == args[1][1]  # one offset, both arenas
            if n == "vocab_embedding_kernel":
                assert regions[plan["launches"][i][2][4][0]] == "tp_vocab_start"
                assert plan["launches"][i][2][5] == 128  # each rank's 128 rows (250 ids padded to 64 a rank)
