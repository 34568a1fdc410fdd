"""quant_fp8(rms_norm(x, w))           -> rms_norm_quant(x, w)
   quant_fp8(add_rms_norm(x, r, w)[0]) -> add_rms_norm_quant(x, r, w)

The residual add, the RMSNorm and the FP8 quantisation of its output (graph/fp8_ops.py) in one
op: the norm's kernel writes the e4m3 row and its per-token(-group) scales that the FP8 linears
read, and no [T, H] activation in the model's dtype is written only to be read back and
quantised (vLLM's fused_add_rms_norm + per-token-group quant, its RMSNormQuantFusionPass).

Bits: the fused op is the composition of the two it replaces: the normalised row rounded to
the storage dtype as rms_norm's store does, then quant_fp8's arithmetic on it, so the fused
graph gives the unfused graph's numbers exactly (tests/test_fp8_passes.py).

Only when the quantisation is the norm's output's one reader (the layer's linears share one
quant_fp8 of it, models/fp8_linear.py); static input scales travel along as trailing inputs.
"""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass, single_consumer


class FuseRmsNormQuant(Pass):
    name = "fuse_rmsnorm_quant"

    def run(self, graph: Graph) -> bool:
        changed = False
        for quant in [n for n in graph.topo_order() if n.op == "quant_fp8"]:
            norm = graph.producer(quant.inputs[0])
            if norm is None or norm.op not in ("rms_norm", "add_rms_norm") or norm.outputs[0] != quant.inputs[0]:
                continue
            if not single_consumer(graph, norm.outputs[0]):
                continue
            t = graph.tensors
            ins = [t[i] for i in norm.inputs] + [t[i] for i in quant.inputs[1:]]
            outs = list(quant.outputs) + list(norm.outputs[1:])  # (q, scales[, x + residual])
            attrs = dict(norm.attrs, **quant.attrs)
            graph.remove_node(quant.name)
            graph.remove_node(norm.name)
            graph.call(f"{norm.op}_quant", ins, name=norm.name, out_names=outs, **attrs)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed
