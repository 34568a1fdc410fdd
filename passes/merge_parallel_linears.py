"""Linears that read the same input become one GEMM over stacked weights.

    q = x @ Wq^T, k = x @ Wk^T, v = x @ Wv^T  ->  qkv = x @ [Wq; Wk; Wv]^T,
    q, k, v = slice_cols(qkv, ...)            (views: rows keep qkv's stride)

and the same for gate/up (vLLM's QKVParallelLinear and MergedColumnParallelLinear).
A decode step then streams the layer's weights in 4 launches instead of 7, with
wider N (more programs per launch, less tail). The stacked weight is a new graph
weight whose `parts` name the checkpoint tensors; executors stack them at load
(the CUDA executor uploads each part at its row offset, no host copy).

Each output element still reduces the same K in the same order; only the weight
a GEMM config is chosen for changes, and it is the same weight in every bucket,
so invariance holds. Linears merge only when input, K, dtypes, attrs and bias
presence agree.
"""
from __future__ import annotations

from kiln.graph import Graph, Node, TensorKind
from kiln.passes.base import Pass


def _common_name(names: list[str]) -> str:
    """model.layers.0.mlp.gate_proj.weight + ...up_proj.weight -> model.layers.0.mlp.gate_proj+up_proj.weight"""
    split = [n.split(".") for n in names]
    head = 0
    while all(len(s) > head + 1 for s in split) and len({s[head] for s in split}) == 1:
        head += 1
    tail = 0
    while all(len(s) > head + tail + 1 for s in split) and len({s[-1 - tail] for s in split}) == 1:
        tail += 1
    mid = "+".join(".".join(s[head:len(s) - tail]) for s in split)
    return ".".join(split[0][:head] + [mid] + (split[0][len(split[0]) - tail:] if tail else []))


class MergeParallelLinears(Pass):
    name = "merge_parallel_linears"

    def run(self, graph: Graph) -> bool:
        groups: dict[tuple, list[Node]] = {}
        t = graph.tensors
        for n in graph.topo_order():
            if n.op not in ("linear", "linear_gguf"):  # GGUF blocks stack by rows too (same qtype: attrs)
                continue
            w = t[n.inputs[1]]
            if w.kind != TensorKind.WEIGHT or w.parts:
                continue
            has_bias = len(n.inputs) > 2 and bool(n.inputs[2])
            key = (n.inputs[0], w.shape[1], w.dtype, tuple(sorted(n.attrs.items())), has_bias, n.op)
            groups.setdefault(key, []).append(n)
        changed = False
        for (x, k, dtype, _, has_bias, _op), nodes in groups.items():
            if len(nodes) < 2:
                continue
            self._merge(graph, x, nodes, has_bias)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed

    @staticmethod
    def _merge(graph: Graph, x: str, nodes: list[Node], has_bias: bool) -> None:
        t = graph.tensors
        ws = [t[n.inputs[1]] for n in nodes]
        widths = [w.shape[0] for w in ws]
        merged_w = graph.weight(_common_name([w.name for w in ws]), ws[0].dtype, (sum(widths), ws[0].shape[1]))
        merged_w.parts = tuple((w.name, w.shape[0]) for w in ws)
        ins = [t[x], merged_w]
        if has_bias:
            bs = [t[n.inputs[2]] for n in nodes]
            merged_b = graph.weight(_common_name([b.name for b in bs]), bs[0].dtype, (sum(widths),))
            merged_b.parts = tuple((b.name, b.shape[0]) for b in bs)
            ins.append(merged_b)
        attrs = dict(nodes[0].attrs)
        outs = [n.outputs[0] for n in nodes]
        for n in nodes:
            graph.remove_node(n.name)
        name = _common_name([n.name for n in nodes])
        y = graph.call1(nodes[0].op, *ins, name=name, **attrs)
        start = 0
        for out, width in zip(outs, widths):
            graph.call("slice_cols", [y], name=f"{out}.slice", out_names=[out], start=start, stop=start + width)
            start += width
