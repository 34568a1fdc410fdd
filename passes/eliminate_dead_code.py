"""Remove nodes whose outputs nobody reads.

Nodes that update state (a KV-cache write) are live by definition: the next
step reads what they wrote, even when nothing in this step does.
"""
from __future__ import annotations

from kiln.graph import Graph, TensorKind
from kiln.passes.base import Pass


class EliminateDeadCode(Pass):
    name = "eliminate_dead_code"

    def run(self, graph: Graph) -> bool:
        changed = False
        while True:
            dead = [n for n in graph.nodes.values()
                    if not graph.registry[n.op].inplace
                    and all(not graph.consumers(t) and t not in graph.outputs for t in n.outputs)]
            if not dead:
                break
            for n in dead:
                graph.remove_node(n.name)
            changed = True
        used = {t for n in graph.nodes.values() for t in n.inputs} | set(graph.outputs)
        for t in [t for t in graph.tensors.values()
                  if t.kind in (TensorKind.WEIGHT, TensorKind.INPUT) and t.name not in used]:
            if t.kind == TensorKind.WEIGHT:  # step inputs stay: every executor fills them all
                del graph.tensors[t.name]
                changed = True
        return changed
