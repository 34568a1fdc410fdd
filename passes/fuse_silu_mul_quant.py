"""quant_fp8(silu_mul(gate, up)) -> silu_mul_quant(gate, up)

The SwiGLU activation and the FP8 quantisation of its output (the down projection's input) in
one op (graph/fp8_ops.py): the kernel writes the e4m3 row and its per-token(-group) scales, and
the [T, I] activation in the model's dtype, the widest activation of the layer, is never
written (vLLM's silu_and_mul + per-token-group quant fusion, its ActivationQuantFusionPass).

Bits: silu_mul_quant is silu_mul's f32 formula rounded to the storage dtype, then quant_fp8's
arithmetic, the composition of the two ops it replaces, so the numbers do not change
(tests/test_fp8_passes.py). Only when the quantisation is silu_mul's one reader.
"""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass, single_consumer


class FuseSiluMulQuant(Pass):
    name = "fuse_silu_mul_quant"

    def run(self, graph: Graph) -> bool:
        changed = False
        for quant in [n for n in graph.topo_order() if n.op == "quant_fp8"]:
            act = graph.producer(quant.inputs[0])
            if act is None or act.op != "silu_mul" or not single_consumer(graph, act.outputs[0]):
                continue
            t = graph.tensors
            ins = [t[i] for i in act.inputs] + [t[i] for i in quant.inputs[1:]]
            outs, attrs = list(quant.outputs), dict(quant.attrs)
            graph.remove_node(quant.name)
            graph.remove_node(act.name)
            graph.call("silu_mul_quant", ins, name=act.name, out_names=outs, **attrs)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed
