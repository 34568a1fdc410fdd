"""silu(causal_conv1d(x)) -> causal_conv1d(x, activation="silu"): the Gated DeltaNet conv
applies SiLU to its f32 sums before it stores them (codegen/triton/gdn.py causal_conv1d_kernel),
so the conv output is written once and never re-read for the activation."""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass, single_consumer


class FuseConvSilu(Pass):
    name = "fuse_conv_silu"

    def run(self, graph: Graph) -> bool:
        changed = False
        for silu in [n for n in graph.topo_order() if n.op == "silu"]:
            conv = graph.producer(silu.inputs[0])
            if conv is None or conv.op != "causal_conv1d" or conv.attrs.get("activation") \
                    or conv.outputs[0] != silu.inputs[0] or not single_consumer(graph, conv.outputs[0]):
                continue
            ins, outs, attrs = list(conv.inputs), [silu.outputs[0], conv.outputs[1]], dict(conv.attrs)
            graph.remove_node(silu.name)
            graph.remove_node(conv.name)
            graph.call("causal_conv1d", [graph.tensors[t] for t in ins], name=conv.name, out_names=outs,
                       activation="silu", **attrs)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed
