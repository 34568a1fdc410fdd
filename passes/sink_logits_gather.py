"""gather_rows(add(a, b), idx) -> add(gather_rows(a, idx), gather_rows(b, idx)).

Only the rows that sample reach the final norm; moving the gather above the
last residual add lets fuse_add_rmsnorm fold that add into the final norm, and
the add runs on L rows instead of T."""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass, single_consumer


class SinkLogitsGather(Pass):
    name = "sink_logits_gather"

    def run(self, graph: Graph) -> bool:
        changed = False
        for g in [n for n in graph.topo_order() if n.op == "gather_rows"]:
            add = graph.producer(g.inputs[0])
            if add is None or add.op != "add" or not single_consumer(graph, g.inputs[0]):
                continue
            t = graph.tensors
            a, b, idx = t[add.inputs[0]], t[add.inputs[1]], t[g.inputs[1]]
            out = g.outputs[0]
            graph.remove_node(g.name)
            graph.remove_node(add.name)
            ga = graph.call1("gather_rows", a, idx, name=f"{g.name}.a")
            gb = graph.call1("gather_rows", b, idx, name=f"{g.name}.b")
            graph.call("add", [ga, gb], name=add.name, out_names=[out])
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed
