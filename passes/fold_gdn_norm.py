"""The GDN output's gated RMSNorm folded into the recurrence that produces it, so out_proj's input
is written once, normed:

    fused_gated_delta_rule -> o -> gated_rms_norm(o, z, w)
    => fused_gated_delta_rule_norm(..., z, w) -> gated_rms_norm(o, z, w)

On the GPU (codegen/lower.py) a decode bucket runs it as one launch: the recurrent kernel splits
a head's value columns over programs, and the last of a row's programs to store its columns
norms the whole row in place (vLLM runs fused_recurrent_gated_delta_rule, then RMSNormGated:
two). A mixed bucket runs the chunked kernel,
the norm over the rows in place, then the recurrent kernel with the norm for the tokens alone in
their 64-window: a token's bits still depend only on which form computed it, never on its
bucket. The norm-in-GEMM-prologue alternative (out_proj normalising its own A tiles) lost
1.7-2.4x on the H200's decode GEMMs (docs/GPU_NOTES.md), so the norm goes to the producer.
The op's numpy reference composes the two references: the same numbers on the cpu."""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass, single_consumer


class FoldGdnNorm(Pass):
    name = "fold_gdn_norm"

    def run(self, graph: Graph) -> bool:
        changed = False
        for rule in [n for n in graph.topo_order() if n.op == "fused_gated_delta_rule"]:
            o = rule.outputs[0]
            if not single_consumer(graph, o):
                continue
            norm = graph.consumers(o)[0]
            if norm.op != "gated_rms_norm" or norm.inputs[0] != o:
                continue
            ins = [*rule.inputs, norm.inputs[1], norm.inputs[2]]
            attrs = dict(rule.attrs, norm_eps=norm.attrs["eps"])
            outs = [norm.outputs[0], rule.outputs[1]]
            graph.remove_node(norm.name)
            graph.remove_node(rule.name)
            graph.call("fused_gated_delta_rule_norm", [graph.tensors[t] for t in ins], name=rule.name,
                       out_names=outs, **attrs)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed
