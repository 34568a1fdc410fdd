"""silu_mul(slice(gate_up, 0, I), slice(gate_up, I, 2I)), gate_up = linear(x, [Wg; Wu])
    -> linear_silu_mul(x, [Wg; Wu] interleaved in groups of 16 rows)

The stacked gate/up GEMM (merge_parallel_linears.py) then writes h = silu(g) * u, [T, I],
from its epilogue (codegen/triton/gemm.py SILU_GROUP): no silu_mul launch and no [T, 2I]
intermediate. The weight is stored as [g0..g15, u0..u15, g16..g31, u16..u31, ...]
(Tensor.interleave, graph/layout.py), so every GEMM tile of a multiple of 32 columns holds
matching gate and up columns; the executors build that layout at load.

Bits: the GEMM rounds g and u to the output dtype as its plain store did and applies
silu_mul's f32 formula to them; permuting W's rows moves no element's K sum. So the result
is gemm + silu_mul's, in every bucket (tests/codegen/test_lowering.py compares a model's
logits with and without this pass). It applies whatever the weight's split-K: folded or not,
the kernel that stores y (gemm_kernel, or gemm_reduce_kernel after the ordered sum of the
partials) applies the epilogue, so nothing here depends on the configs or the bucket.

Only the plain pattern: two equal parts, gate first, no bias, no out_dtype, I a multiple of
16, and nothing else reading the stack, its halves or its weight.
"""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass, single_consumer

GROUP = 16  # rows per gate (or up) run of the interleaved weight; GEMM tiles are multiples of 2 x GROUP


class FuseGateUpSilu(Pass):
    name = "fuse_gate_up_silu"

    def __init__(self, group: int = GROUP) -> None:
        self.group = group

    def run(self, graph: Graph) -> bool:
        changed = False
        for node in [n for n in graph.topo_order() if n.op == "silu_mul"]:
            m = self._match(graph, node)
            if m is None:
                continue
            lin, slices, x, w = m
            out = node.outputs[0]
            for n in (node, *slices, lin):
                graph.remove_node(n.name)
            w.interleave = self.group
            graph.call("linear_silu_mul", [x, w], name=lin.name, out_names=[out], group=self.group)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed

    def _match(self, graph: Graph, node):
        t = graph.tensors
        slices = [graph.producer(name) for name in node.inputs]
        if any(s is None or s.op != "slice_cols" or not single_consumer(graph, s.outputs[0]) for s in slices):
            return None
        gate, up = slices
        if gate.inputs[0] != up.inputs[0]:
            return None
        y = gate.inputs[0]
        lin = graph.producer(y)
        if lin is None or lin.op != "linear" or len(graph.consumers(y)) != 2 or y in graph.outputs:
            return None
        if (len(lin.inputs) > 2 and lin.inputs[2]) or lin.attrs.get("out_dtype"):
            return None
        w = t[lin.inputs[1]]
        if len(w.parts) != 2 or w.interleave or len(graph.consumers(w.name)) != 1:
            return None
        i = w.parts[0][1]
        if w.parts[1][1] != i or i % self.group or t[y].dtype != t[lin.inputs[0]].dtype:
            return None
        if (gate.attrs["start"], gate.attrs["stop"], up.attrs["start"], up.attrs["stop"]) != (0, i, i, 2 * i):
            return None
        return lin, slices, t[lin.inputs[0]], w
