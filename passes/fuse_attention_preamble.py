"""The attention preamble in one kernel: per-head q/k RMSNorm (optional), RoPE on
q and k, and the write of K and V into the paged cache.

Matches, for each cache_write(k', v, cache, slots) whose cache is read by a
paged_attention(q', ...):  k' = rope([rms_norm](k)), q' = rope([rms_norm](q)).
It becomes attention_preamble(q, k, v, cache, positions, slots[, wq, wk]) whose
outputs keep the names of q' and of the new cache, so consumers need no rewrite.
"""
from __future__ import annotations

from kiln.graph import Graph, Node
from kiln.passes.base import Pass, single_consumer


def _unrope(graph: Graph, t: str) -> tuple[Node, Node | None, str] | None:
    """t = rope([rms_norm](x)) -> (rope node, norm node or None, x)."""
    rope = graph.producer(t)
    if rope is None or rope.op != "rope":
        return None
    src, norm = rope.inputs[0], None
    p = graph.producer(src)
    if p is not None and p.op == "rms_norm" and single_consumer(graph, src):
        norm, src = p, p.inputs[0]
    return rope, norm, src


class FuseAttentionPreamble(Pass):
    name = "fuse_attention_preamble"

    def run(self, graph: Graph) -> bool:
        changed = False
        for cw in [n for n in graph.topo_order() if n.op == "cache_write"]:
            k_r, v, cache, slots = cw.inputs
            attn = [n for n in graph.consumers(cw.outputs[0]) if n.op == "paged_attention"]
            if len(attn) != 1 or not single_consumer(graph, k_r):
                continue
            kq = _unrope(graph, k_r)
            qq = _unrope(graph, attn[0].inputs[0])
            if kq is None or qq is None or not single_consumer(graph, attn[0].inputs[0]):
                continue
            (k_rope, k_norm, k), (q_rope, q_norm, q) = kq, qq
            if (k_norm is None) != (q_norm is None) or k_rope.attrs != q_rope.attrs \
                    or k_rope.inputs[1] != q_rope.inputs[1]:
                continue
            if k_norm is not None and (k_norm.attrs != q_norm.attrs):
                continue
            attrs = dict(q_rope.attrs)
            weights = []
            if q_norm is not None:
                attrs.update(eps=q_norm.attrs["eps"], offset=q_norm.attrs.get("offset", 0.0))
                weights = [graph.tensors[q_norm.inputs[1]], graph.tensors[k_norm.inputs[1]]]
            out_q, out_cache = q_rope.outputs[0], cw.outputs[0]
            for n in (cw, k_rope, q_rope, k_norm, q_norm):
                if n is not None:
                    graph.remove_node(n.name)
            t = graph.tensors
            graph.call("attention_preamble", [t[q], t[k], t[v], t[cache], t[k_rope.inputs[1]], t[slots], *weights],
                       name=cw.name.replace("cache_write", "preamble"), out_names=[out_q, out_cache], **attrs)
            changed = True
        if changed:
            graph.rebuild_edges()
        return changed
