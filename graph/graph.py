"""The Graph: tensors, nodes, topological order and a verifier.

One Graph describes one engine step over a flat batch of T tokens. Nodes are
kept in a networkx DiGraph (edges = tensor producer -> consumer) so passes can
ask structural questions; `topo_order()` is the execution order.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import networkx as nx

from kiln.graph.dtype import DType
from kiln.graph.op import Node, OpRegistry
from kiln.graph.tensor import Dim, Tensor, TensorKind


class GraphError(ValueError):
    """The graph is malformed (a bug in a model builder or a pass, not user input)."""


class Graph:
    def __init__(self, registry: OpRegistry, name: str = "step") -> None:
        self.registry = registry
        self.name = name
        self.tensors: dict[str, Tensor] = {}
        self.nodes: dict[str, Node] = {}
        self.outputs: list[str] = []
        self.attrs: dict[str, Any] = {}  # graph-level facts (e.g. block_size) for executors
        self._dag = nx.DiGraph()
        self._counter = itertools.count()
        self._producer: dict[str, str] = {}

    # -- building -----------------------------------------------------------------
    def _add_tensor(self, name: str, dtype: DType, shape: Sequence[Dim], kind: TensorKind) -> Tensor:
        if name in self.tensors:
            raise GraphError(f"tensor {name!r} defined twice")
        t = Tensor(name, DType(dtype), tuple(shape), kind)
        self.tensors[name] = t
        return t

    def input(self, name: str, dtype: DType, shape: Sequence[Dim]) -> Tensor:
        return self._add_tensor(name, dtype, shape, TensorKind.INPUT)

    def weight(self, name: str, dtype: DType, shape: Sequence[Dim]) -> Tensor:
        return self._add_tensor(name, dtype, shape, TensorKind.WEIGHT)

    def state(self, name: str, dtype: DType, shape: Sequence[Dim]) -> Tensor:
        return self._add_tensor(name, dtype, shape, TensorKind.STATE)

    def fresh_name(self, hint: str) -> str:
        while True:
            name = f"{hint}.{next(self._counter)}"
            if name not in self.tensors and name not in self.nodes:
                return name

    def call(self, op: str, inputs: Sequence[Tensor | None], *, name: str | None = None,
             out_names: Sequence[str] | None = None, **attrs) -> list[Tensor]:
        """Add a node; returns its output tensors (shapes from the op's inference)."""
        opdef = self.registry[op]
        lo, hi = opdef.num_inputs
        if not lo <= len(inputs) <= hi:
            raise GraphError(f"op {op} takes {lo}..{hi} inputs, got {len(inputs)}")
        node_name = name or self.fresh_name(op)
        specs = opdef.infer(list(inputs), attrs)
        if out_names is None:
            out_names = [node_name] if len(specs) == 1 else [f"{node_name}:{i}" for i in range(len(specs))]
        outs = []
        for i, (oname, (dt, shape)) in enumerate(zip(out_names, specs)):
            kind = TensorKind.STATE if i in opdef.inplace else TensorKind.ACTIVATION
            outs.append(self._add_tensor(oname, dt, shape, kind))
        node = Node(node_name, op, [t.name if t is not None else "" for t in inputs],
                    [t.name for t in outs], dict(attrs))
        self._insert(node)
        return outs

    def call1(self, op: str, *inputs: Tensor | None, **attrs) -> Tensor:
        return self.call(op, list(inputs), **attrs)[0]

    def _insert(self, node: Node) -> None:
        if node.name in self.nodes:
            raise GraphError(f"node {node.name!r} defined twice")
        self.nodes[node.name] = node
        self._dag.add_node(node.name)
        for t in node.outputs:
            self._producer[t] = node.name
        for t in node.inputs:
            if t and t in self._producer:
                self._dag.add_edge(self._producer[t], node.name)

    def mark_output(self, *tensors: Tensor) -> None:
        self.outputs.extend(t.name for t in tensors)

    # -- editing (for passes) -------------------------------------------------------
    def remove_node(self, name: str) -> None:
        node = self.nodes.pop(name)
        self._dag.remove_node(name)
        for t in node.outputs:
            self._producer.pop(t, None)
            self.tensors.pop(t, None)

    def replace_uses(self, old: str, new: str) -> None:
        """Point every consumer of tensor `old` at tensor `new`."""
        for node in self.nodes.values():
            if old in node.inputs:
                node.inputs = [new if i == old else i for i in node.inputs]
                if new in self._producer:
                    self._dag.add_edge(self._producer[new], node.name)
        self.outputs = [new if o == old else o for o in self.outputs]

    def rebuild_edges(self) -> None:
        self._dag = nx.DiGraph()
        self._producer = {t: n.name for n in self.nodes.values() for t in n.outputs}
        for n in self.nodes.values():
            self._dag.add_node(n.name)
            for t in n.inputs:
                if t and t in self._producer:
                    self._dag.add_edge(self._producer[t], n.name)

    # -- queries --------------------------------------------------------------------
    def producer(self, tensor: str) -> Node | None:
        name = self._producer.get(tensor)
        return self.nodes[name] if name else None

    def consumers(self, tensor: str) -> list[Node]:
        return [n for n in self.nodes.values() if tensor in n.inputs]

    def topo_order(self) -> list[Node]:
        # lexicographical order on insertion index keeps dumps stable across runs
        index = {name: i for i, name in enumerate(self.nodes)}
        return [self.nodes[n] for n in nx.lexicographical_topological_sort(self._dag, key=index.__getitem__)]

    def tensors_of(self, kind: TensorKind) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.kind == kind]

    @property
    def inputs(self) -> list[Tensor]:
        return self.tensors_of(TensorKind.INPUT)

    @property
    def weights(self) -> list[Tensor]:
        return self.tensors_of(TensorKind.WEIGHT)

    def checkpoint_weights(self) -> dict[str, tuple]:
        """name -> shape of every tensor the graph reads from the checkpoint (stacked
        weights listed by their parts)."""
        out = {}
        for t in self.weights:
            for name, rows in t.parts or ((t.name, t.shape[0]),):
                out[name] = (rows, *t.shape[1:])
        return out

    @property
    def states(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.kind == TensorKind.STATE and self.producer(t.name) is None]

    def verify(self) -> None:
        """Check structural invariants; raise GraphError on the first violation."""
        if not nx.is_directed_acyclic_graph(self._dag):
            raise GraphError(f"graph {self.name} has a cycle")
        for node in self.nodes.values():
            opdef = self.registry[node.op]
            for t in node.inputs:
                if t and t not in self.tensors:
                    raise GraphError(f"node {node.name} reads undefined tensor {t!r}")
            for t in node.outputs:
                if self._producer.get(t) != node.name:
                    raise GraphError(f"tensor {t!r} has an inconsistent producer")
            ins = [self.tensors[t] if t else None for t in node.inputs]
            specs = opdef.infer(ins, node.attrs)
            for t, (dt, shape) in zip(node.outputs, specs):
                have = self.tensors[t]
                if have.dtype != dt or tuple(have.shape) != tuple(shape):
                    raise GraphError(f"node {node.name}: output {t} is {have.dtype}{list(have.shape)}, "
                                     f"inference says {dt}{list(shape)}")
            for o_idx, i_idx in opdef.inplace.items():
                src = self.tensors[node.inputs[i_idx]]
                if src.kind != TensorKind.STATE:
                    raise GraphError(f"node {node.name} updates non-state tensor {src.name}")
        for t in self.tensors.values():
            if t.kind == TensorKind.ACTIVATION and t.name not in self._producer:
                raise GraphError(f"activation {t.name!r} has no producer")
        for o in self.outputs:
            if o not in self.tensors:
                raise GraphError(f"graph output {o!r} is undefined")

    def dump(self) -> str:
        lines = [f"graph {self.name}"]
        for kind in (TensorKind.INPUT, TensorKind.STATE, TensorKind.WEIGHT):
            for t in self.tensors_of(kind):
                if kind != TensorKind.STATE or self.producer(t.name) is None:
                    lines.append(f"  {kind.value} {t!r}")
        for node in self.topo_order():
            outs = ", ".join(repr(self.tensors[o]).split(" (")[0] for o in node.outputs)
            lines.append(f"  {outs} = {node.op}({', '.join(i or '_' for i in node.inputs)})"
                         + (f"  {{{', '.join(f'{k}={v!r}' for k, v in sorted(node.attrs.items()))}}}" if node.attrs else ""))
        lines.append(f"  return {', '.join(self.outputs)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Graph({self.name}, {len(self.nodes)} nodes, {len(self.tensors)} tensors)"
