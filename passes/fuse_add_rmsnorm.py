"""rms_norm(add(x, residual)) -> add_rms_norm(x, residual): the residual add and
the next norm in one kernel. The sum stays a second output because the
residual stream continues to the next layer."""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass


class FuseAddRmsNorm(Pass):
    name = "fuse_add_rmsnorm"

    def run(self, graph: Graph) -> bool:
        changed = False
        for norm in [n for n in graph.topo_order() if n.op == "rms_norm"]:
            add = graph.producer(norm.inputs[0])
            if add is None or add.op != "add":
                continue
            x, residual = (graph.tensors[t] for t in add.inputs)
            if x.shape != residual.shape:
                continue  # a broadcast add is not a residual add
            summed, normed = add.outputs[0], norm.outputs[0]
            w = graph.tensors[norm.inputs[1]]
            graph.remove_node(norm.name)
            graph.remove_node(add.name)
            # keep the fused node's outputs under the old names so later consumers need no rewrite
            graph.call("add_rms_norm", [x, residual, w], name=norm.name, out_names=[normed, summed],
                       **norm.attrs)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed
