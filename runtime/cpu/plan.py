"""The fused step graph lowered to a short list of compiled calls over one arena.

Each node of the graph after the passes (merged q/k/v with RoPE and the KV write, gate/up with
SwiGLU, residual adds inside the GEMMs' consumers) becomes one step: a closure over its arena
buffers that calls one or two compiled kernels with the step's row count. Views (reshape,
slice_cols) and in-place outputs (the KV cache) cost nothing at run time. A graph with an op or a
dtype this target has no kernel for is refused with NotCompilable, and the caller runs numpy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kiln.graph import DType, Graph, TensorKind
from kiln.graph.paged_attention_ref import paged_attention_ref
from kiln.graph.rope import rope_tables
from kiln.runtime.cpu import linear_kernels as LK
from kiln.runtime.cpu import op_kernels as OK
from kiln.runtime.cpu.arena import Arena, ArenaLayout
from kiln.runtime.cpu.linear import Scratch, dequant_rows, linear, run_sized
from kiln.runtime.cpu.packed import PackedWeight

VIEW_OPS = ("reshape", "slice_cols")
OPS = ("embedding", "rms_norm", "add_rms_norm", "linear", "linear_add", "linear_silu_mul", "linear_rope",
       "attention_preamble", "paged_attention", "gather_rows") + VIEW_OPS
_EMPTY = np.zeros(0, np.float32)
# A sequence with at least this many query rows in a step (a prefill chunk) attends through the
# numpy reference (graph/paged_attention_ref.py: BLAS products per query tile), the others through
# OK.paged_attention. CPU time on one thread, SmolLM2's 9 x 64 heads over 3 KV heads, a fresh
# prompt of n tokens (2026-12-07): n = 32: kernel 0.12 ms, reference 0.15; n = 128: 1.58 vs 1.11;
# n = 512: 32.3 vs 9.2 (the kernel's dot products per key do not reuse a key across the rows and
# heads that read it; BLAS does). The reference also runs on OpenBLAS's threads in a prefill step,
# where numba keeps one.
ATTENTION_BLAS_ROWS = 64


class NotCompilable(Exception):
    """One sentence: why the compiled CPU target cannot run this graph."""


def check_graph(graph: Graph) -> dict[str, str]:
    """Raise NotCompilable (one sentence) where this target cannot run the graph; else
    -> activation name -> its leading dim (T or L)."""
    rows: dict[str, str] = {}
    in_place = set()  # outputs that are a new version of a state (the KV cache written in place)
    for node in graph.topo_order():
        if node.op not in OPS:
            raise NotCompilable(f"the compiled CPU target has no kernel for {node.op!r}")
        in_place.update(node.outputs[i] for i in graph.registry[node.op].inplace)
    for t in graph.tensors.values():
        if t.kind in (TensorKind.WEIGHT, TensorKind.INPUT) or t.name in in_place:
            continue
        if t.dtype != DType.f32:
            raise NotCompilable(f"the compiled CPU target runs f32; {t.name} is {t.dtype.value}")
        if t.kind == TensorKind.ACTIVATION:
            if t.shape[0] not in ("T", "L") or any(isinstance(d, str) for d in t.shape[1:]):
                raise NotCompilable(f"{t.name} has shape {t.shape}, not [T or L, fixed dims]")
            rows[t.name] = t.shape[0]
    for t in graph.states:
        if t.rank != 5 or any(isinstance(d, str) for d in t.shape[1:]):
            raise NotCompilable(f"state {t.name} is not a paged KV cache")
    return rows


@dataclass
class StepContext:
    T: int
    L: int
    inp: dict[str, np.ndarray]
    seq_of: np.ndarray
    max_len: int = 0  # the longest context in the step (attention's work)


@dataclass
class Step:
    label: str
    kernels: tuple = ()  # numba dispatchers it calls (for compile progress)
    make: Callable[[Callable[[str], Any]], Callable[[StepContext], None]] = None  # buffers -> fn(ctx)
    extra: dict = field(default_factory=dict)


def _linear_kernels(w: PackedWeight, act_quant: str = "") -> tuple:
    if w.kind == "q4" and act_quant == "q8_1":
        return LK.gemv_q4_q8, LK.quantize_q8_1, LK.dequant_q4_t
    return {"q4": (LK.gemv_q4, LK.dequant_q4_t), "q8": (LK.gemv_q8, LK.dequant_q8_t),
            "bf16": (LK.gemv_bf16, LK.dequant_bf16_t), "f32": (LK.gemv_f32, LK.dequant_f32_t)}[w.kind]


class Plan:
    def __init__(self, graph: Graph, weights: dict[str, Any], states: dict[str, np.ndarray],
                 act_quant: str = "") -> None:
        self.graph, self.weights, self.states = graph, weights, states
        self.scratch = Scratch(act_quant)  # act_quant: linear.linear's activation rounding
        self.order = graph.topo_order()
        self.alias: dict[str, tuple[str, Callable]] = {}  # view -> (its base tensor, base view -> view)
        self.rows: dict[str, str] = {}  # activation -> its leading dim symbol
        self._check()
        self.layout = ArenaLayout()
        self.widths: dict[str, tuple[int, ...]] = {}
        self.steps = [self._lower(n) for n in self.order]
        self._plan_memory()
        self._bound: tuple[int, list] | None = None

    # -- checks and memory -----------------------------------------------------------------
    def _check(self) -> None:
        self.rows.update(check_graph(self.graph))

    def _base(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name][0]
        return name

    def _plan_memory(self) -> None:
        g = self.graph
        last: dict[str, int] = {}
        for i, node in enumerate(self.order):
            for t in node.inputs:
                if t and t in self.rows:
                    last[self._base(t)] = i
        for out in g.outputs:
            last[self._base(out)] = len(self.order)
        for i, (node, step) in enumerate(zip(self.order, self.steps)):
            for t in node.outputs:
                if t in self.rows and t not in self.alias:
                    self.widths[t] = tuple(int(d) for d in g.tensors[t].shape[1:])
                    self.layout.alloc(t, int(np.prod(self.widths[t])))
            for name, width in step.extra.get("scratch", {}).items():
                self.widths[name] = (width,)
                self.layout.alloc(name, width)
            for name in step.extra.get("scratch", {}):
                self.layout.free(name)
            for t in node.outputs:
                if t in self.rows and t not in self.alias and last.get(t, -1) < i:
                    self.layout.free(t)  # never read (dead outputs of multi-output ops)
            for t in {self._base(t) for t in node.inputs if t and t in self.rows}:
                if last.get(t) == i:
                    self.layout.free(t)

    # -- binding to an arena ---------------------------------------------------------------
    def bind(self, cap: int) -> list[Callable[[StepContext], None]]:
        """The step functions over an arena of `cap` rows (kept while steps fit)."""
        if self._bound and self._bound[0] >= cap:
            return self._bound[1]
        arena = Arena(self.layout, cap)
        views: dict[str, np.ndarray] = {}

        def buf(name: str):
            if name in views:
                return views[name]
            if name in self.alias:
                base, f = self.alias[name]
                v = f(buf(base), cap)
            elif name in self.widths:
                v = arena.buffer(name, self.widths[name])
            elif name in self.states:
                return self.states[name]
            elif name in self.weights:
                return self.weights[name]
            else:
                return None  # a step input: read from the context
            views[name] = v
            return v

        fns = [s.make(buf) for s in self.steps]
        self._bound = (cap, fns)
        self._buf = buf
        return fns

    def buffer(self, name: str) -> np.ndarray:
        """The bound arena view of an activation (after bind)."""
        return self._buf(name)

    # -- lowering -------------------------------------------------------------------------
    def _lower(self, node) -> Step:
        return getattr(self, "_op_" + node.op)(node, node.attrs, [t or None for t in node.inputs], node.outputs)

    def _view(self, node, f) -> Step:
        src, out = node.inputs[0], node.outputs[0]
        self.alias[out] = (src, f)
        self.rows[out] = self.rows[src]
        return Step(node.name, (), lambda buf: (lambda ctx: None))

    def _op_reshape(self, node, attrs, ins, outs) -> Step:
        shape = attrs["shape"]
        if shape[0] != self.rows.get(ins[0]):
            raise NotCompilable(f"reshape {node.name} changes the leading dim")
        rest = tuple(int(d) for d in shape[1:])

        def f(base, cap):
            v = base.view()
            v.shape = (cap, *rest)  # raises where a copy would be needed
            return v
        return self._view(node, f)

    def _op_slice_cols(self, node, attrs, ins, outs) -> Step:
        a, b = attrs["start"], attrs["stop"]
        return self._view(node, lambda base, cap: base[..., a:b])

    def _op_embedding(self, node, attrs, ins, outs) -> Step:
        ids, table = ins
        w = self.weights[table]

        def make(buf):
            out = buf(outs[0])
            return lambda ctx: dequant_rows(w, ctx.inp[ids], out)
        return Step(node.name, _kernel_of_rows(w), make)

    def _op_rms_norm(self, node, attrs, ins, outs) -> Step:
        eps, off = float(attrs["eps"]), float(attrs.get("offset", 0.0))
        x, w = ins
        heads = int(np.prod(self.graph.tensors[x].shape[1:-1], dtype=np.int64))

        def make(buf):
            xv, wv, ov = buf(x), buf(w), buf(outs[0])
            if xv.ndim > 2:
                xv, ov = xv.reshape(-1, xv.shape[-1]), ov.reshape(-1, ov.shape[-1])
            return lambda ctx: OK.rms_norm(xv, wv, eps, off, ov, _rows(ctx, self.rows[x]) * heads)
        return Step(node.name, (OK.rms_norm,), make)

    def _op_add_rms_norm(self, node, attrs, ins, outs) -> Step:
        eps, off = float(attrs["eps"]), float(attrs.get("offset", 0.0))
        x, r, w = ins

        def make(buf):
            xv, rv, wv, o0, o1 = buf(x), buf(r), buf(w), buf(outs[0]), buf(outs[1])
            return lambda ctx: OK.add_rms_norm(xv, rv, wv, eps, off, o0, o1, _rows(ctx, self.rows[x]))
        return Step(node.name, (OK.add_rms_norm,), make)

    def _linear_step(self, node, x, wname, bias, out_name, epilogue, scratch_width=0, extra_kernels=()) -> Step:
        w = self.weights[wname]
        extra = {"scratch": {node.name + ".gemm": scratch_width}} if scratch_width else {}

        def make(buf):
            xv, bv = buf(x), (buf(bias)[None, :] if bias else None)
            yv = buf(node.name + ".gemm") if scratch_width else buf(out_name)
            rows = self.rows[x]
            post = epilogue(buf, yv)

            def fn(ctx):
                T = _rows(ctx, rows)
                linear(w, xv, yv, T, self.scratch)
                if bv is not None:
                    OK.add_rows(yv, bv, T)
                post(ctx, T)
            return fn
        kernels = _linear_kernels(w, self.scratch.act_quant) + ((OK.add_rows,) if bias else ()) + extra_kernels
        return Step(node.name, kernels, make, extra)

    def _op_linear(self, node, attrs, ins, outs) -> Step:
        if attrs.get("out_dtype") not in (None, "f32"):
            raise NotCompilable(f"linear {node.name} stores {attrs['out_dtype']}")
        return self._linear_step(node, ins[0], ins[1], ins[2] if len(ins) > 2 else None, outs[0],
                                 lambda buf, y: (lambda ctx, T: None))

    def _op_linear_add(self, node, attrs, ins, outs) -> Step:
        def epi(buf, y):
            res = buf(ins[2])
            return lambda ctx, T: OK.add_rows(y, res, T)
        return self._linear_step(node, ins[0], ins[1], None, outs[0], epi, extra_kernels=(OK.add_rows,))

    def _op_linear_silu_mul(self, node, attrs, ins, outs) -> Step:
        group = int(attrs["group"])
        w = self.weights[ins[1]]

        def epi(buf, y):
            out = buf(outs[0])
            return lambda ctx, T: OK.silu_mul_grouped(y, group, out, T)
        return self._linear_step(node, ins[0], ins[1], None, outs[0], epi, scratch_width=w.n,
                                 extra_kernels=(OK.silu_mul_grouped,))

    def _rope_tables(self, attrs):
        cos, sin = rope_tables(int(attrs["rotary_dim"]), float(attrs["theta"]), tuple(attrs.get("scaling", ())),
                               int(attrs.get("max_position", 2048)))
        return cos, sin

    def _op_linear_rope(self, node, attrs, ins, outs) -> Step:
        x, wname, cache, pos, slots = ins[:5]
        bias = ins[5] if len(ins) > 5 else None
        h, d = int(attrs["heads"]), int(attrs["head_dim"])
        hkv = int(self.graph.tensors[cache].shape[3])
        cos, sin = self._rope_tables(attrs)
        rd, neox = int(attrs["rotary_dim"]), bool(attrs.get("is_neox", True))
        self.alias[outs[1]] = (cache, None)
        w = self.weights[wname]

        def epi(buf, y):
            q = y[:, :h * d].reshape(y.shape[0], h, d)
            k = y[:, h * d:(h + hkv) * d].reshape(y.shape[0], hkv, d)
            v = y[:, (h + hkv) * d:].reshape(y.shape[0], hkv, d)
            c, qo = buf(cache), buf(outs[0])
            return lambda ctx, T: OK.rope_kv(q, k, v, c, ctx.inp[pos], ctx.inp[slots], cos, sin, rd, neox,
                                             _EMPTY, _EMPTY, 0.0, 0.0, qo, T)
        return self._linear_step(node, x, wname, bias, outs[0], epi, scratch_width=w.n,
                                 extra_kernels=(OK.rope_kv,))

    def _op_attention_preamble(self, node, attrs, ins, outs) -> Step:
        q, k, v, cache, pos, slots = ins[:6]
        qn, kn = (ins[6], ins[7]) if len(ins) > 7 else (None, None)
        cos, sin = self._rope_tables(attrs)
        rd, neox = int(attrs["rotary_dim"]), bool(attrs.get("is_neox", True))
        eps, off = float(attrs.get("eps", 1e-6)), float(attrs.get("offset", 0.0))
        self.alias[outs[1]] = (cache, None)

        def make(buf):
            qv, kv, vv, c, qo = buf(q), buf(k), buf(v), buf(cache), buf(outs[0])
            qw = buf(qn) if qn else _EMPTY
            kw = buf(kn) if kn else _EMPTY
            rows = self.rows[q]
            return lambda ctx: OK.rope_kv(qv, kv, vv, c, ctx.inp[pos], ctx.inp[slots], cos, sin, rd, neox,
                                          qw, kw, eps, off, qo, _rows(ctx, rows))
        return Step(node.name, (OK.rope_kv,), make)

    def _op_paged_attention(self, node, attrs, ins, outs) -> Step:
        q, cache, bt, sl, qsl = ins
        scale, window = float(attrs["scale"]), int(attrs.get("sliding_window", 0) or 0)

        def make(buf):
            qv, c, o = buf(q), buf(self._base(cache)), buf(outs[0])
            hd = qv.shape[1] * qv.shape[2]

            def fn(ctx):
                block_table, seq_lens, starts = ctx.inp[bt], ctx.inp[sl], ctx.inp[qsl]
                seq_of = ctx.seq_of
                n = np.diff(starts)
                long = np.flatnonzero(n >= ATTENTION_BLAS_ROWS) if ctx.T >= ATTENTION_BLAS_ROWS else ()
                for s in long:  # prefill chunks: the numpy reference's BLAS products
                    q0, q1 = int(starts[s]), int(starts[s + 1])
                    o[q0:q1] = paged_attention_ref(qv[q0:q1], c, block_table[s:s + 1], seq_lens[s:s + 1],
                                                   np.array([0, q1 - q0], np.int32), scale=scale,
                                                   sliding_window=window)
                if len(long):
                    if len(long) == len(n):
                        return
                    seq_of = np.where(np.isin(seq_of, long), -1, seq_of).astype(np.int32)
                # multiply-adds: q.k and p.v per key (SmolLM2 decode at 129 keys: 31 -> 19 us on 2 threads)
                run_sized(2 * ctx.T * ctx.max_len * hd, OK.paged_attention, qv, c, block_table, seq_lens,
                          starts, scale, window, o, seq_of)
            return fn
        return Step(node.name, (OK.paged_attention,), make)

    def _op_gather_rows(self, node, attrs, ins, outs) -> Step:
        x, idx = ins
        self.rows[outs[0]] = "L"

        def make(buf):
            xv, o = buf(x), buf(outs[0])

            def fn(ctx):
                np.take(xv, ctx.inp[idx], axis=0, out=o[:ctx.L])
            return fn
        return Step(node.name, (), make)


def _rows(ctx: StepContext, sym: str) -> int:
    return ctx.T if sym == "T" else ctx.L


def _kernel_of_rows(w: PackedWeight) -> tuple:
    return ({"q4": LK.dequant_q4_rows, "q8": LK.dequant_q8_rows, "bf16": LK.dequant_bf16_rows,
             "f32": LK.dequant_f32_rows}[w.kind],)
