"""cast(linear(x, w), f32) -> linear(x, w, out_dtype=f32): the GEMM stores its f32
accumulator directly (bf16 models' logits), one launch and one rounding fewer."""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass, single_consumer


class FoldCastIntoLinear(Pass):
    name = "fold_cast_into_linear"

    def run(self, graph: Graph) -> bool:
        changed = False
        for cast in [n for n in graph.topo_order() if n.op == "cast"]:
            lin = graph.producer(cast.inputs[0])
            if lin is None or lin.op not in ("linear", "linear_gguf") or not single_consumer(graph, cast.inputs[0]):
                continue
            t = graph.tensors
            ins = [t[i] for i in lin.inputs if i]
            out, attrs = cast.outputs[0], dict(lin.attrs, out_dtype=str(cast.attrs["dtype"]))
            graph.remove_node(cast.name)
            graph.remove_node(lin.name)
            graph.call(lin.op, ins, name=lin.name, out_names=[out], **attrs)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed
