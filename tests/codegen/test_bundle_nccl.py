"""A tensor-parallel bundle for sm_90 with NCCL calls in the plan, compile only (issue 44;
docs/TENSOR_PARALLEL.md "NCCL in the plan"). Over two ranks every all_reduce is one
ncclAllReduce on this rank's own arena (the partial's offset in, the output's out, the bucket's
element count); over four, an ncclAllGather of the partials into the `nccl_gather` workspace and
the rank-order sum kernel over the four gathered copies; the logits' all_gather is an
ncclAllGather and the kernel that puts the columns side by side. No barrier kernels, no peer
arenas. Rank 1's plan is rank 0's. Nothing here runs on a GPU."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kiln.codegen.buckets import make_buckets
from kiln.codegen.compile import compile_bundle
from kiln.graph import DType
from kiln.loader import tensor_parallel_pass
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import default_passes, run_pipeline
from kiln.passes.plan_memory import plan_memory
from kiln.codegen.compile import plan_dims
from tests.tiny_models import BASE

H = BASE["hidden_size"]


def _graph(cfg, world: int, rank: int):
    return run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16),
                        passes=default_passes(shard=tensor_parallel_pass(cfg, world, rank)))


def _bundle(graph, cfg):
    buckets = make_buckets(8, 64)
    return compile_bundle(graph, target="sm_90", model_config=dataclasses.asdict(cfg), config_hash=cfg.compute_hash(),
                          max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
                          buckets=[buckets[0], buckets[-1]])


def _reduced_offsets(graph, bucket_dims):
    """(input offset, output offset) of every all_reduce, in graph order, from the memory plan."""
    plan = plan_memory(graph, bucket_dims)
    return [(plan.offsets[n.inputs[0]], plan.offsets[n.outputs[0]])
            for n in graph.topo_order() if n.op == "all_reduce"], plan


CFG = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "vocab_size": 250})


@pytest.mark.slow
def test_two_rank_bundle_carries_one_nccl_all_reduce_per_collective():
    g0, g1 = _graph(CFG, 2, 0), _graph(CFG, 2, 1)
    b0, b1 = _bundle(g0, CFG), _bundle(g1, CFG)
    m = b0.manifest
    assert m["plans"] == b1.manifest["plans"] and m["regions"] == b1.manifest["regions"]
    assert m["tensor_parallel"] == {"world_size": 2, "collective": "nccl"}
    regions = m["regions"]
    assert not any(r.startswith(("tp_arena", "tp_flags")) for r in regions)
    assert all(blob[:4] == b"\x7fELF" for blob in b0.kernels.values())
    layers = CFG.num_hidden_layers
    for name, plan in m["plans"].items():
        tokens, _, logits, _ = plan["bucket"]
        launches = plan["launches"]
        kernel = [key if key == "nccl" else m["kernels"][key]["name"] for key, _, _ in launches]
        assert "barrier_kernel" not in kernel and "all_reduce_kernel" not in kernel
        calls = [args for key, _, args in launches if key == "nccl"]
        reduces = [c for c in calls if c["op"] == "all_reduce"]
        gathers = [c for c in calls if c["op"] == "all_gather"]
        assert len(reduces) == 2 * layers + 1, name  # the embedding's, o_proj's and down's of each layer
        assert len(gathers) == 1
        for c in reduces:  # the whole bucket: a fixed count, so the call captures into the decode graph
            assert c["dtype"] == "bfloat16" and c["red"] == "sum" and c["count"] == tokens * H
            assert regions[c["send"][0]] == regions[c["recv"][0]] == "arena" and c["send"] != c["recv"]
        # the memory plan's offsets of each all_reduce's partial and output, in plan order
        offs, _ = _reduced_offsets(g0, plan_dims([_b for _b in make_buckets(8, 64)][::len(make_buckets(8, 64)) - 1],
                                                  -(-256 // 16)))
        assert [(c["send"][1], c["recv"][1]) for c in reduces] == offs
        # the logits: f32 [L, 128] of each rank gathered into [2, L, 128], then side by side
        (g,) = gathers
        assert g["dtype"] == "float32" and g["count"] == logits * 128 and regions[g["recv"][0]] == "nccl_gather"
        i = next(j for j, (key, _, args) in enumerate(launches) if key == "nccl" and args["op"] == "all_gather")
        assert kernel[i + 1] == "all_gather_kernel"
        peers = launches[i + 1][2][:2]
        assert [regions[p[0]] for p in peers] == ["nccl_gather"] * 2
        assert peers[1][1] - peers[0][1] == logits * 128 * 4  # rank 1's copy follows rank 0's
        assert m["region_bytes"]["nccl_gather"] >= 2 * logits * 128 * 4


@pytest.mark.slow
def test_four_rank_bundle_gathers_partials_and_sums_them_in_rank_order():
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "vocab_size": 250,
                                    "num_key_value_heads": 4})
    b = _bundle(_graph(cfg, 4, 0), cfg)
    m = b.manifest
    regions = m["regions"]
    assert m["tensor_parallel"] == {"world_size": 4, "collective": "nccl"}
    for name, plan in m["plans"].items():
        tokens = plan["bucket"][0]
        launches = plan["launches"]
        kernel = [key if key == "nccl" else m["kernels"][key]["name"] for key, _, _ in launches]
        sums = [i for i, k in enumerate(kernel) if k == "all_reduce_kernel"]
        assert len(sums) == 2 * cfg.num_hidden_layers + 1 and "barrier_kernel" not in kernel
        assert not any(args["op"] == "all_reduce" for key, _, args in launches if key == "nccl")
        for i in sums:
            call = launches[i - 1][2]
            assert kernel[i - 1] == "nccl" and call["op"] == "all_gather" and call["count"] == tokens * H
            assert regions[call["recv"][0]] == "nccl_gather" and regions[call["send"][0]] == "arena"
            peers = launches[i][2][:4]  # the four gathered copies, rank order, 2 bytes an element apart by T*H
            assert [regions[p[0]] for p in peers] == ["nccl_gather"] * 4
            assert np.diff([p[1] for p in peers]).tolist() == [tokens * H * 2] * 3
            assert peers[0][1] == call["recv"][1]
            out = launches[i][2][8]
            assert regions[out[0]] == "arena"
