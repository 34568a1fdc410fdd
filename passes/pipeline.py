"""The passes, in order: the one place to read what happens to a graph.

Each pass is followed by the verifier. `dump_dir` writes the graph after every
pass (`build.py compile --dump-ir DIR`). Memory planning (plan_memory.py) runs
after these, per target, once the largest bucket is known.
"""
from __future__ import annotations

from pathlib import Path

from kiln.graph import Graph
from kiln.passes.base import Pass
from kiln.passes.eliminate_dead_code import EliminateDeadCode
from kiln.passes.fold_gdn_gates import FoldGdnGates
from kiln.passes.fold_gdn_norm import FoldGdnNorm
from kiln.passes.fuse_router_silu import FuseRouterSilu
from kiln.passes.fuse_conv_silu import FuseConvSilu
from kiln.passes.fuse_add_rmsnorm import FuseAddRmsNorm
from kiln.passes.fold_cast_into_linear import FoldCastIntoLinear
from kiln.passes.fuse_attention_preamble import FuseAttentionPreamble
from kiln.passes.fuse_gate_up_silu import FuseGateUpSilu
from kiln.passes.fuse_residual_into_linear import FuseResidualIntoLinear
from kiln.passes.fuse_rope_into_linear import FuseRopeIntoLinear
from kiln.passes.fuse_rmsnorm_quant import FuseRmsNormQuant
from kiln.passes.fuse_silu_mul import FuseSiluMul
from kiln.passes.fuse_silu_mul_quant import FuseSiluMulQuant
from kiln.passes.merge_parallel_linears import MergeParallelLinears
from kiln.passes.sink_logits_gather import SinkLogitsGather


def default_passes(fuse_silu: bool = True, fuse_residual: bool = True, fuse_rope: bool = True,
                   shard: Pass | None = None) -> list[Pass]:
    """shard: a tensor-parallel rank's ShardTensorParallel (passes/shard_tensor_parallel.py), first:
    the fusions then see the rank's widths;
    fuse_silu=False keeps the MLP's silu_mul a launch of its own after the gate/up GEMM
    (the graph before passes/fuse_gate_up_silu.py, for A/B: bench/gpu_shape_decode.py --fuse-silu);
    fuse_residual=False keeps the residual add in the norm's launch (passes/fuse_residual_into_linear.py);
    fuse_rope=False keeps the attention preamble a launch of its own (passes/fuse_rope_into_linear.py)."""
    return [
        *([shard] if shard is not None else []),
        EliminateDeadCode(),
        SinkLogitsGather(),
        MergeParallelLinears(),
        FuseAddRmsNorm(),
        *([FuseResidualIntoLinear()] if fuse_residual else []),
        FuseSiluMul(),
        *([FuseGateUpSilu()] if fuse_silu else []),
        FuseRmsNormQuant(),  # FP8 checkpoints: the norm writes e4m3 + scales for the FP8 linears
        FuseSiluMulQuant(),  # FP8 checkpoints: SwiGLU writes the down projection's e4m3 input
        FuseAttentionPreamble(),
        *([FuseRopeIntoLinear()] if fuse_rope else []),
        FuseConvSilu(),
        FoldGdnGates(),
        FoldGdnNorm(),
        FuseRouterSilu(),
        FoldCastIntoLinear(),
        EliminateDeadCode(),
    ]


def run_pipeline(graph: Graph, passes: list[Pass] | None = None, dump_dir: str | Path | None = None) -> Graph:
    passes = default_passes() if passes is None else passes
    if dump_dir is not None:
        dump_dir = Path(dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
        (dump_dir / "00_input.txt").write_text(graph.dump() + "\n")
    for i, p in enumerate(passes, start=1):
        p.run(graph)
        graph.verify()
        if dump_dir is not None:
            (dump_dir / f"{i:02d}_{p.name}.txt").write_text(graph.dump() + "\n")
    return graph
