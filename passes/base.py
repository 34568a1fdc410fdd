"""The pass interface: a named graph -> graph rewrite that says whether it changed anything."""
from __future__ import annotations

from kiln.graph import Graph


class Pass:
    name: str = "pass"

    def run(self, graph: Graph) -> bool:
        """Rewrite `graph` in place; return True if anything changed."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


def single_consumer(graph: Graph, tensor: str) -> bool:
    return len(graph.consumers(tensor)) == 1 and tensor not in graph.outputs
