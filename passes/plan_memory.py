"""Liveness-based reuse of one activation arena.

Every activation gets a byte offset in one arena sized for the largest bucket;
smaller buckets reuse the same offsets (a [T, N] row-major buffer keeps its
row stride whatever T is). Two activations may share bytes only if their
lifetimes (first write .. last read, in execution order) do not overlap.
Reshapes and column slices are views: they alias their input's bytes and extend its lifetime.
State updates alias the state buffer and need no arena bytes.

Placement is greedy by size, largest first, each at the lowest offset that
collides with no already-placed tensor live at the same time (the usual
heuristic of TFLite's and XLA's arena planners).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from kiln.graph import Graph, TensorKind

# outputs that are views of input 0 (the offset of a slice inside its source is the
# lowering's business: plan offsets of views are their owner's)
ALIAS_OPS = ("reshape", "slice_cols")
# MoE experts ops -> the index of their routing-weights input. The lowering may run a layer's
# rank-order sum later (codegen/lower.py _defer_moe_sum), in the launch of the shared expert's
# sigmoid_mul that feeds the add of the layer's output, or in the launch of the norm that reads the
# layer's output (the add's, where there is a shared expert): it reads the routing weights there, and
# the shared expert's x and gate in the norm. So they live until the layer's output is last read
# (_moe_sum_reads), and nothing written meanwhile takes their bytes.
ROUTING_WEIGHTS = {"moe_experts": 2, "moe_experts_gguf": 2, "moe_experts_fp8": 3, "moe_experts_nvfp4": 2}


@dataclass
class MemoryPlan:
    offsets: dict[str, int]  # activation (or view) -> byte offset in the arena
    sizes: dict[str, int]  # bytes at the largest bucket
    arena_bytes: int
    aliases: dict[str, str] = field(default_factory=dict)  # view -> the tensor owning its bytes
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def plan_memory(graph: Graph, dims: Mapping[str, int], alignment: int = 256) -> MemoryPlan:
    order = graph.topo_order()
    aliases: dict[str, str] = {}
    for node in order:
        if node.op in ALIAS_OPS:
            src = node.inputs[0]
            aliases[node.outputs[0]] = aliases.get(src, src)
    owner = lambda t: aliases.get(t, t)  # noqa: E731

    def is_planned(t: str) -> bool:
        return graph.tensors[t].kind == TensorKind.ACTIVATION and owner(t) == t

    life: dict[str, list[int]] = {}
    for i, node in enumerate(order):
        for t in node.outputs:
            o = owner(t)
            if is_planned(o):
                life.setdefault(o, [i, i])
        for t in node.inputs:
            if t and owner(t) in life:
                life[owner(t)][1] = max(life[owner(t)][1], i)
    end = len(order)
    users: dict[str, list] = {}
    for node in order:
        for t in node.inputs:
            if t:
                users.setdefault(t, []).append(node)
    for node in order:
        if node.op not in ROUTING_WEIGHTS:
            continue
        y, reads = _moe_sum_reads(graph, node, users)
        if owner(y) in life:
            for t in reads:
                if owner(t) in life:
                    life[owner(t)][1] = max(life[owner(t)][1], life[owner(y)][1])
    for t in graph.outputs:  # read back after the step
        if owner(t) in life:
            life[owner(t)][1] = end

    sizes = {t: _align(max(1, _nbytes(graph, t, dims)), alignment) for t in life}
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, first, last)
    offsets: dict[str, int] = {}
    for t in sorted(life, key=lambda t: (-sizes[t], life[t][0])):
        first, last = life[t]
        clashes = sorted((o, s) for o, s, f, l_ in placed if f <= last and first <= l_)
        off = 0
        for o, s in clashes:
            if off + sizes[t] <= o:
                break
            off = max(off, o + s)
        offsets[t] = off
        placed.append((off, sizes[t], first, last))
    for view, src in aliases.items():
        if src in offsets:
            offsets[view] = offsets[src]
    arena = max((o + s for o, s, _, _ in placed), default=0)
    return MemoryPlan(offsets, sizes, arena, aliases, {t: tuple(v) for t, v in life.items()})


def _moe_sum_reads(graph: Graph, node, users) -> tuple[str, list[str]]:
    """A MoE experts node -> (the layer's output: its own, or where its one user is an add, the
    add's; what a deferred sum of the layer reads besides the experts' scratch: the routing
    weights, and the inputs of a sigmoid_mul (the shared expert's) that feeds that add)."""
    y, reads = node.outputs[0], [node.inputs[ROUTING_WEIGHTS[node.op]]]
    after = users.get(y, [])
    if len(after) == 1 and after[0].op == "add":
        add = after[0]
        for t in add.inputs:
            src = graph.producer(t) if t != y else None
            if src is not None and src.op == "sigmoid_mul":
                reads += [t for t in src.inputs if t]
        y = add.outputs[0]
    return y, reads


def _nbytes(graph: Graph, name: str, dims: Mapping[str, int]) -> int:
    t = graph.tensors[name]
    n = t.dtype.itemsize
    for d in t.concrete_shape(dims):
        n *= d
    return n
