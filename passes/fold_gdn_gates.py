"""The Gated DeltaNet preamble folded into its recurrence:

    l2norm(q) * dk^-0.5, l2norm(k), gdn_gates(a, b, A_log, dt_bias) -> gated_delta_rule
    => fused_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, ...)

The kernels (codegen/triton/gdn.py) normalise each token's q and k rows and compute its decay
and beta where they load them, so neither the normed q/k nor the f32 gates go through memory
(vLLM's fused_recurrent_gated_delta_rule and fused_gdn_gating do the same in two kernels).
The fused op's numpy reference composes the same references: the same numbers on the cpu."""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass, single_consumer


class FoldGdnGates(Pass):
    name = "fold_gdn_gates"

    def run(self, graph: Graph) -> bool:
        changed = False
        for rule in [n for n in graph.topo_order() if n.op == "gated_delta_rule"]:
            qn, kn, gates = (graph.producer(t) for t in (rule.inputs[0], rule.inputs[1], rule.inputs[3]))
            if not (qn is not None and qn.op == "l2norm" and kn is not None and kn.op == "l2norm"
                    and gates is not None and gates.op == "gdn_gates" and rule.inputs[4] == gates.outputs[1]
                    and rule.inputs[3] == gates.outputs[0]
                    and qn.attrs.get("eps", 1e-6) == kn.attrs.get("eps", 1e-6) and kn.attrs.get("scale", 1.0) == 1.0
                    and all(single_consumer(graph, t) for t in (qn.outputs[0], kn.outputs[0], *gates.outputs))):
                continue
            q, k, v, state, seq_lens, qsl, slots = (rule.inputs[i] for i in (0, 1, 2, 5, 6, 7, 8))
            ins = [qn.inputs[0], kn.inputs[0], v, *gates.inputs, state, seq_lens, qsl, slots]
            attrs = dict(q_scale=qn.attrs.get("scale", 1.0), eps=qn.attrs.get("eps", 1e-6), **rule.attrs)
            outs = list(rule.outputs)
            for node in (rule, qn, kn, gates):
                graph.remove_node(node.name)
            graph.call("fused_gated_delta_rule", [graph.tensors[t] for t in ins], name=rule.name, out_names=outs,
                       **attrs)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed
