"""The shared expert's SiLU-and-mul folded into the router's launch:

    ids, w = moe_router(slice(M));  act = silu_mul(slice(M), slice(M))
    => ids, w, act = moe_router_silu_mul(slice(M), slice(M), slice(M))

M is the one GEMM that merge_parallel_linears made of the router and the shared expert's gate,
up and gate-scalar projections, so both ops read their columns of the same rows right after it.
Both are per-row (the router a program per token), and silu_mul is elementwise, so the fused
launch gives the same bits as the two: a decode step of Qwen3.6-35B-A3B has one launch fewer in
each of its 40 MoE layers (535 -> 495 at batch 1). The op's numpy reference composes the two
references."""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass


def _slice_source(graph: Graph, tensor: str) -> str | None:
    node = graph.producer(tensor)
    return node.inputs[0] if node is not None and node.op == "slice_cols" else None


class FuseRouterSilu(Pass):
    name = "fuse_router_silu"

    def run(self, graph: Graph) -> bool:
        changed = False
        for router in [n for n in graph.topo_order() if n.op == "moe_router"]:
            src = _slice_source(graph, router.inputs[0])
            if src is None:
                continue
            act = next((n for n in graph.topo_order() if n.op == "silu_mul"
                        and all(_slice_source(graph, t) == src for t in n.inputs)), None)
            if act is None:
                continue
            ins = [router.inputs[0], *act.inputs]
            outs = [*router.outputs, act.outputs[0]]
            attrs = dict(router.attrs)
            graph.remove_node(act.name)
            graph.remove_node(router.name)
            graph.call("moe_router_silu_mul", [graph.tensors[t] for t in ins], name=router.name, out_names=outs,
                       **attrs)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed
