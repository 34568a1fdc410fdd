"""attention_preamble(q, k, v, ...) of the q, k and v heads of y = linear(x, [Wq; Wk; Wv])
    -> linear_rope(x, [Wq; Wk; Wv], cache, positions, slot_mapping[, bias])

The stacked q/k/v GEMM (merge_parallel_linears.py) then does the preamble's work in its
epilogue (codegen/triton/gemm.py gemm_rope_kernel): RoPE on the q and k heads of the tile it
holds, q to its output, k and v into the paged cache. No preamble launch and no [T, (H + 2 Hkv) D]
intermediate: on the H200 the preamble took ~2.6 us a layer of the batch-1 decode step and
~15 us of a 2,048-token prefill.

Bits: the GEMM rounds y to the model's dtype as its plain store does, and the epilogue is the
preamble kernel's f32 formula (one explicit fma) on those values, so the result is linear +
attention_preamble's in every bucket (tests/codegen/test_lowering.py compares a model's logits
with and without this pass). A neox pair (i, i + D/2) must sit in one tile: the kernel gives a
program narrower than a head the two matching halves of it (gemm._rope_pair_cols).

Only the plain pattern: no q/k norm (Qwen3's per-head norm keeps the preamble: its sum over D
would be another reduction order), full rotary (rotary_dim = D, a power of two), neox pairs,
whole heads at offsets 0, H D and (H + Hkv) D of y, and nothing else reading y or its views.
"""
from __future__ import annotations

from kiln.graph import Graph
from kiln.passes.base import Pass, single_consumer


class FuseRopeIntoLinear(Pass):
    name = "fuse_rope_into_linear"

    def run(self, graph: Graph) -> bool:
        changed = False
        for pre in [n for n in graph.topo_order() if n.op == "attention_preamble"]:
            m = self._match(graph, pre)
            if m is None:
                continue
            lin, views, x, w, bias = m
            q_rope, cache_out = pre.outputs
            cache, pos, slots = pre.inputs[3:6]
            _, h, d = graph.tensors[q_rope].shape
            attrs = {k: pre.attrs[k] for k in ("theta", "rotary_dim", "is_neox", "scaling", "max_position")
                     if k in pre.attrs}
            for n in (pre, *views, lin):
                graph.remove_node(n.name)
            t = graph.tensors
            graph.call("linear_rope", [t[x], t[w], t[cache], t[pos], t[slots], *([t[bias]] if bias else [])],
                       name=lin.name, out_names=[q_rope, cache_out], heads=h, head_dim=d, **attrs)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed

    def _match(self, graph: Graph, pre):
        if len(pre.inputs) != 6 or not pre.attrs.get("is_neox", True):
            return None
        t = graph.tensors
        _, h, d = t[pre.outputs[0]].shape
        hkv = t[pre.inputs[1]].shape[1]
        if pre.attrs["rotary_dim"] != d or d & (d - 1):
            return None
        views, src, spans = [], None, []
        for i, name in enumerate(pre.inputs[:3]):
            r = graph.producer(name)
            if r is None or r.op != "reshape" or not single_consumer(graph, name):
                return None
            s = graph.producer(r.inputs[0])
            if s is None or s.op != "slice_cols" or not single_consumer(graph, r.inputs[0]):
                return None
            if src is not None and s.inputs[0] != src:
                return None
            src = s.inputs[0]
            views += [r, s]
            spans.append((s.attrs["start"], s.attrs["stop"]))
        if spans != [(0, h * d), (h * d, (h + hkv) * d), ((h + hkv) * d, (h + 2 * hkv) * d)]:
            return None
        lin = graph.producer(src)
        if lin is None or lin.op != "linear" or len(graph.consumers(src)) != 3 or src in graph.outputs:
            return None
        if lin.attrs.get("out_dtype") or t[src].dtype != t[lin.inputs[0]].dtype or t[src].shape[-1] != (h + 2 * hkv) * d:
            return None
        bias = lin.inputs[2] if len(lin.inputs) > 2 and lin.inputs[2] else None
        return lin, views, lin.inputs[0], lin.inputs[1], bias
