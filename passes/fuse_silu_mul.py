"""mul(silu(gate), up) -> silu_mul(gate, up): one pass over the MLP activation
instead of writing silu(gate) to memory and reading it back."""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass, single_consumer


class FuseSiluMul(Pass):
    name = "fuse_silu_mul"

    def run(self, graph: Graph) -> bool:
        changed = False
        for mul in [n for n in graph.topo_order() if n.op == "mul"]:
            for i in (0, 1):
                src = graph.producer(mul.inputs[i])
                if src is not None and src.op == "silu" and single_consumer(graph, src.outputs[0]):
                    other = mul.inputs[1 - i]
                    out = mul.outputs[0]
                    graph.remove_node(mul.name)
                    graph.remove_node(src.name)
                    graph.call("silu_mul", [graph.tensors[src.inputs[0]], graph.tensors[other]],
                               name=mul.name, out_names=[out])
                    changed = True
                    break
        if changed:
            graph.rebuild_edges()
        return changed
