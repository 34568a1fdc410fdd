"""Lower a fused step graph to launch plans, one per shape bucket.

The kernel wrappers of codegen/triton are driven with *symbolic* device
pointers under launch.recording(): every buffer is `(region << 44) + offset`,
so each recorded launch holds its kernel spec, grid and arguments exactly as the
wrapper computed them, and the runtime relocates pointers once at load by
adding each region's base. Regions: the activation arena (plan_memory), the
step-input block (one layout per bucket), split-K and split-KV workspaces, the
split-KV merge counters, each weight, each state tensor (KV cache per layer), each
constant (RoPE tables). The runtime zeroes the regions it allocates (`sizes`) at
load; the merge counters rely on it (op_paged_attention).
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.codegen.buckets import Bucket
from kiln.codegen.triton import attention_preamble as k_pre
from kiln.codegen.triton import collective as k_coll
from kiln.codegen.triton import fp8_gemm as k_fp8
from kiln.codegen.triton import fp8_quant as k_quant
from kiln.codegen.triton import gather as k_gather
from kiln.codegen.triton import gdn as k_gdn
from kiln.codegen.triton import gemm as k_gemm
from kiln.codegen.triton import gguf_gemm as k_gguf
from kiln.codegen.triton import moe as k_moe
from kiln.codegen.triton import moe_router as k_router
from kiln.codegen.triton import nvfp4_gemm as k_nvfp4
from kiln.codegen.triton import paged_attention_launch as k_attn
from kiln.codegen.triton import rms_norm as k_norm
from kiln.codegen.triton import silu_mul as k_silu
from kiln.codegen.triton.configs import DEFAULT, Configs
from kiln.codegen.triton.launch import Buf, KernelSpec, contiguous_strides, dtype_name, recording
from kiln.graph import Graph, TensorKind, to_numpy
from kiln.graph.rope import rope_tables
from kiln.passes.plan_memory import ROUTING_WEIGHTS, MemoryPlan
from kiln.runtime.worker.bundle import REGION_SHIFT  # the bundle format's pointer encoding

ALIGN = 256
STEP_INPUTS = ("input_ids", "positions", "slot_mapping", "block_table", "seq_lens", "query_start_loc",
               "logits_indices", "num_logits")
# a hybrid model's (Gated DeltaNet layers) one more: each sequence's state slot, before num_logits
# (the last entry: the executor copies the block up to its end)
HYBRID_STEP_INPUTS = STEP_INPUTS[:-1] + ("state_slots", "num_logits")


SPLIT_KV_MAX_SEQS = 64
# How a tensor-parallel plan's collectives run (docs/TENSOR_PARALLEL.md): "nccl", NCCL calls in
# the plan (the runtime built); "peer", the rank-order kernels over the peers' mapped arenas
# between flag barriers (compile only: no runtime maps the peers yet).
COLLECTIVES = ("nccl", "peer")
NCCL_GATHER = "nccl_gather"  # the workspace region NCCL all-gathers into: [WORLD, rows, n]
MERGE_COUNTER = "attn_merge_counter"  # the region of the split-KV merge counters (op_paged_attention)
MOE_EXPERTS = tuple(ROUTING_WEIGHTS)  # the ops that write the `moe_o` scratch (op_moe_experts)
MOE_SUM_NORMS = ("add_rms_norm", "add_rms_norm_quant")  # norms whose launch can run a MoE layer's sum


@dataclass(frozen=True)
class _MoeSum:
    """A MoE layer's rank-order sum not launched yet (lower.py _defer_moe_sum): the expert rows
    (the `moe_o` scratch), the routing weights, the live rows, the shared expert's (x, gate) once
    its sigmoid_mul joined it (else None), and the tensors it reads, which must outlive it."""
    o: Buf
    weights: Buf
    n_rows: Buf
    shared: tuple[Buf, Buf] | None
    reads: tuple[str, ...]


def split_kv(bucket: Bucket) -> bool:
    """Split-KV where a decode step has too few (sequence, KV head) programs to fill the GPU;
    split and unsplit give the same bits, so the choice is free per bucket."""
    return bucket.decode and bucket.seqs <= SPLIT_KV_MAX_SEQS


class LoweringError(ValueError):
    pass


@dataclass
class Regions:
    """Named device allocations a plan points into; index = position in `names`."""
    names: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)  # bytes, for regions the runtime allocates
    consts: dict[str, np.ndarray] = field(default_factory=dict)

    def ptr(self, name: str, offset: int = 0) -> int:
        if name not in self.names:
            self.names.append(name)
        return (self.names.index(name) << REGION_SHIFT) + offset

    def need(self, name: str, nbytes: int) -> None:
        self.sizes[name] = max(self.sizes.get(name, 0), int(nbytes))


def is_hybrid(graph: Graph) -> bool:
    return "state_slots" in graph.tensors


def input_layout(bucket: Bucket, mb: int, hybrid: bool = False) -> dict[str, tuple[int, str, tuple[int, ...]]]:
    """name -> (byte offset, dtype, shape) of the step inputs of this bucket; all i32."""
    t, s, l_ = bucket.tokens, bucket.seqs, bucket.logits
    shapes = {"input_ids": (t,), "positions": (t,), "slot_mapping": (t,), "block_table": (s, mb),
              "seq_lens": (s,), "query_start_loc": (s + 1,), "logits_indices": (l_,), "num_logits": (1,),
              "state_slots": (s,)}
    out, off = {}, 0
    for name in (HYBRID_STEP_INPUTS if hybrid else STEP_INPUTS):
        out[name] = (off, "i32", shapes[name])
        off += -(-4 * int(np.prod(shapes[name])) // ALIGN) * ALIGN
    return out


def input_bytes(bucket: Bucket, mb: int, hybrid: bool = False) -> int:
    lay = input_layout(bucket, mb, hybrid)
    off, _, shape = lay[STEP_INPUTS[-1]]
    return off + 4 * int(np.prod(shape))


class _Lowerer:
    def __init__(self, graph: Graph, plan: MemoryPlan, bucket: Bucket, mb: int, regions: Regions,
                 configs: Configs, arch: str, max_model_len: int, batch_invariant: bool = True,
                 fuse_merge: bool = True, collective: str = "nccl") -> None:
        if collective not in COLLECTIVES:
            raise LoweringError(f"collective {collective!r}: one of {', '.join(COLLECTIVES)}")
        self.collective = collective
        self.g, self.plan, self.bucket, self.regions = graph, plan, bucket, regions
        self.batch_invariant, self.fuse_merge = batch_invariant, fuse_merge
        self.configs, self.arch, self.max_model_len = configs, arch, max_model_len
        self.dims = bucket.dims(mb)
        self.dims["NB"] = 1  # strides of a KV cache do not depend on its block count
        self.dims["NS"] = 1  # nor those of a Gated DeltaNet state on its slot count
        self.hybrid = is_hybrid(graph)
        self.layout = input_layout(bucket, mb, self.hybrid)
        self.users: dict[str, list] = {}  # tensor -> consuming nodes (the graph is fixed while lowering)
        for n in graph.nodes.values():
            for t in n.inputs:
                if t:
                    self.users.setdefault(t, []).append(n)
        self.partials: dict[str, tuple[Buf, int]] = {}  # GEMM output -> (its unreduced split-K partials, S)
        self.done: set[str] = set()  # nodes another op's launches already computed (op_linear_add's norm)
        self.visited: set[str] = set()  # nodes lowered so far, in topological order
        self.position: dict[str, int] = {}  # node -> its place in the topological order (lower())
        self.moe_pending: dict[str, _MoeSum] = {}  # a MoE layer's output -> its sum, not yet launched
        self.unwritten: set[str] = set()  # tensors no launch stores: a later launch computes them inline
        regions.need("inputs", input_bytes(bucket, mb, self.hybrid))

    def state_root(self, name: str) -> str:
        """A state tensor's original name (an updated cache aliases the cache it updated)."""
        while True:
            node = self.g.producer(name)
            if node is None:
                return name
            out_idx = node.outputs.index(name)
            name = node.inputs[self.g.registry[node.op].inplace[out_idx]]

    def buf(self, name: str) -> Buf:
        t = self.g.tensors[name]
        node = self.g.producer(name)
        if node is not None and node.op in ("reshape", "slice_cols"):
            return self.view(node, t)
        shape, dtype = t.concrete_shape(self.dims), to_numpy(t.dtype)
        if t.kind == TensorKind.INPUT:
            off, _, lshape = self.layout[name]
            return Buf(ptr=self.regions.ptr("inputs", off), shape=lshape, dtype=np.int32)
        if t.kind == TensorKind.WEIGHT:
            return Buf(ptr=self.regions.ptr(f"weight:{name}"), shape=shape, dtype=dtype)
        if t.kind == TensorKind.STATE:
            return Buf(ptr=self.regions.ptr(f"state:{self.state_root(name)}"), shape=shape, dtype=dtype)
        return Buf(ptr=self.regions.ptr("arena", self.plan.offsets[name]), shape=shape, dtype=dtype)

    def view(self, node, t) -> Buf:
        """A view's buffer from its source's: same bytes (reshape) or a column window (slice)."""
        src = self.buf(node.inputs[0])
        shape = t.concrete_shape(self.dims)
        if node.op == "slice_cols":
            item = src.np_dtype.itemsize
            return Buf(ptr=src.ptr + node.attrs["start"] * item, shape=shape, dtype=src.np_dtype,
                       strides=src.strides[:-1] + (1,))
        if src.strides == contiguous_strides(src.shape):
            return Buf(ptr=src.ptr, shape=shape, dtype=src.np_dtype)
        # a strided [T, N] source split as [T, a, b] (q heads out of a qkv slice)
        if len(src.shape) == 2 and len(shape) == 3 and shape[0] == src.shape[0] and shape[1] * shape[2] == src.shape[1]:
            return Buf(ptr=src.ptr, shape=shape, dtype=src.np_dtype, strides=(src.strides[0], shape[2], 1))
        raise LoweringError(f"cannot reshape a strided view to {shape} ({node.name})")

    def n_rows(self, name: str) -> Buf:
        """Device scalar holding the live rows of a [T, ...] or [L, ...] tensor."""
        lead = self.g.tensors[name].shape[0]
        if lead == "T":  # &query_start_loc[S]: padded sequences repeat the last offset
            off = self.layout["query_start_loc"][0] + 4 * self.bucket.seqs
        elif lead == "L":
            off = self.layout["num_logits"][0]
        else:
            raise LoweringError(f"no live-row count for a tensor led by {lead!r} ({name})")
        return Buf(ptr=self.regions.ptr("inputs", off), shape=(1,), dtype=np.int32)

    def const(self, key: str, make) -> Buf:
        if key not in self.regions.consts:
            self.regions.consts[key] = make()
        arr = self.regions.consts[key]
        return Buf(ptr=self.regions.ptr(f"const:{key}"), shape=arr.shape, dtype=arr.dtype)

    def workspace(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> Buf:
        self.regions.need(name, np.dtype(dtype).itemsize * int(np.prod(shape)))
        return Buf(ptr=self.regions.ptr(name), shape=shape, dtype=dtype)

    def lower(self) -> list[tuple[KernelSpec, list[Any]]]:
        with recording() as launches:
            order = self.g.topo_order()
            self.position = {n.name: i for i, n in enumerate(order)}
            for node in order:
                self.visited.add(node.name)
                if node.name in self.done:
                    continue
                fn = getattr(self, f"op_{node.op}", None)
                if fn is None:
                    raise LoweringError(f"no GPU kernel for op {node.op!r} (node {node.name})")
                fn(node)
        if self.moe_pending:  # a deferred rank-order sum no shared-expert launch ran: the layer's output never written
            raise LoweringError(f"MoE sums never launched for {sorted(self.moe_pending)}")
        return launches

    # -- one method per op -------------------------------------------------------------
    def op_reshape(self, node) -> None:  # views: buf() resolves them to their source's bytes
        pass

    op_slice_cols = op_reshape

    def op_embedding(self, node) -> None:
        ids, table = node.inputs
        k_gather.embedding(self.buf(ids), self.buf(table), self.buf(node.outputs[0]),
                           n_rows=self.n_rows(node.outputs[0]), configs=self.configs)

    def op_gather_rows(self, node) -> None:
        x, idx = node.inputs
        k_gather.gather_rows(self.buf(x), self.buf(idx), self.buf(node.outputs[0]),
                             n_rows=self.n_rows(node.outputs[0]), configs=self.configs)

    def _gemm_schedule(self, m: int, n: int, k: int, silu_group: int = 0):
        """-> (reduction, tile, fold) of an [m, k] x [n, k]^T GEMM in this bucket: the weight's one
        reduction (or, in the variant that ignores invariance, to measure its cost, no split-K
        where M is large, so a token's sums depend on whether it ran in a decode or a prefill
        bucket), the bucket's tile (widened for the SwiGLU epilogue), and whether split-K folds."""
        red = self.configs.gemm_reduction(n, k)
        if not self.batch_invariant and not self.bucket.decode and red.split_k > 1:
            red = dataclasses.replace(red, split_k=1)
        tile = k_gemm.silu_tile(self.configs.gemm_tile(m, n, k, self.arch), silu_group)
        return red, tile, self.configs.gemm_fold(m, n, k, tile, red, self.arch)

    def _rope_tables(self, a) -> tuple[Buf, Buf]:
        """The preamble's cos/sin tables, f32 [max_pos, rotary_dim / 2], one const per rotary config."""
        max_pos = min(a["max_position"], self.max_model_len)
        digest = hashlib.sha256(repr((a["rotary_dim"], a["theta"], tuple(a["scaling"]), max_pos)).encode())
        key = f"rope_{digest.hexdigest()[:12]}"
        tables = {}

        def make(i):
            if "t" not in tables:
                tables["t"] = rope_tables(a["rotary_dim"], a["theta"], tuple(a["scaling"]), max_pos)
            return tables["t"][i]
        return self.const(key + "_cos", lambda: make(0)), self.const(key + "_sin", lambda: make(1))

    def op_linear(self, node) -> None:
        x, w = node.inputs[0], node.inputs[1]
        bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
        out = self.buf(node.outputs[0])
        n, k = self.g.tensors[w].shape
        m = out.shape[0]
        red, tile, fold = self._gemm_schedule(m, n, k)
        # folded split-K leaves no partials: its output is the reduced one, which the next norm
        # reads as it would read gemm_reduce_kernel's (the same bits as the fused norm's sum,
        # tests/codegen/test_lowering.py)
        fuse = red.split_k > 1 and not fold and bias is None and self._reduced_by_norm(node.outputs[0])
        ws = None
        if k_gemm.needs_workspace(red, tile, fold):
            if fuse and self.partials:
                raise LoweringError(f"{node.name}: split-K partials of {list(self.partials)} are still unread")
            ws = self.workspace("gemm_ws_fused" if fuse else "gemm_ws", (red.split_k, m, n))
        k_gemm.gemm(self.buf(x), self.buf(w), self.buf(bias) if bias else None, out,
                    n_rows=self.n_rows(node.outputs[0]), workspace=ws, tile=tile, red=red, configs=self.configs,
                    arch=self.arch, reduce=not fuse)
        if fuse:  # the next add_rms_norm sums the partials itself: one launch less per GEMM
            self.partials[node.outputs[0]] = (ws, red.split_k)

    def op_linear_rope(self, node) -> None:
        """The q/k/v GEMM with the attention preamble in its epilogue (passes/fuse_rope_into_linear.py,
        gemm.gemm_rope_kernel): q rotated into its output, k and v into the cache. The weight's
        one reduction, split-K always folded (the kernel stores no partials): the bits of
        linear + attention_preamble in every bucket."""
        x, w, cache, pos, slots = node.inputs[:5]
        bias = node.inputs[5] if len(node.inputs) > 5 and node.inputs[5] else None
        q_out = self.buf(node.outputs[0])
        n, k = self.g.tensors[w].shape
        m, h, d = q_out.shape
        red, tile, _ = self._gemm_schedule(m, n, k)
        tile = k_gemm.rope_tile(tile, d, red, k)
        ws = self.workspace("gemm_ws", (red.split_k, m, n)) if k_gemm.needs_workspace(red, tile, bool(tile.fold)) else None
        cos, sin = self._rope_tables(node.attrs)
        k_gemm.gemm_rope(self.buf(x), self.buf(w), self.buf(bias) if bias else None, q_out, self.buf(cache),
                         self.buf(pos), self.buf(slots), cos, sin, h=h, hkv=self.g.tensors[cache].shape[3],
                         n_rows=self.n_rows(x), workspace=ws, tile=tile, red=red, configs=self.configs,
                         arch=self.arch)

    def op_linear_silu_mul(self, node) -> None:
        """The gate/up GEMM with the SwiGLU epilogue (passes/fuse_gate_up_silu.py): the same
        reduction as op_linear's for this weight (split-K folded or not: whichever kernel stores
        y applies the epilogue), so the same bits as linear + silu_mul in every bucket."""
        x, w = node.inputs
        g = node.attrs["group"]
        if self.g.tensors[w].interleave != g:
            raise LoweringError(f"{node.name}: weight {w} is not interleaved in groups of {g} rows")
        out = self.buf(node.outputs[0])
        n, k = self.g.tensors[w].shape
        m = out.shape[0]
        red, tile, fold = self._gemm_schedule(m, n, k, silu_group=g)
        ws = self.workspace("gemm_ws", (red.split_k, m, n)) if k_gemm.needs_workspace(red, tile, fold) else None
        k_gemm.gemm(self.buf(x), self.buf(w), None, out, n_rows=self.n_rows(node.outputs[0]), workspace=ws,
                    tile=tile, red=red, configs=self.configs, arch=self.arch, silu_group=g)

    def op_linear_add(self, node) -> None:
        """h = linear(x, w) + residual (passes/fuse_residual_into_linear.py). In the GEMM's epilogue
        where its program stores y (no unfolded split-K) and the bucket has more than 16 rows;
        otherwise the GEMM writes y (or its split-K partials) to a workspace and the norm of h is
        launched right after it as add_rms_norm, which writes h too: the launches (and, at up to
        16 rows, the plans) the graph had before the pass. The add is elementwise, the same bits
        in either place (test_lowering.py)."""
        x, w, res = node.inputs
        out = self.buf(node.outputs[0])
        n, k = self.g.tensors[w].shape
        m = out.shape[0]
        red, tile, fold = self._gemm_schedule(m, n, k)
        if k_gemm.residual_in_epilogue(m, red.split_k, fold):
            ws = self.workspace("gemm_ws", (red.split_k, m, n)) if k_gemm.needs_workspace(red, tile, fold) else None
            k_gemm.gemm(self.buf(x), self.buf(w), None, out, n_rows=self.n_rows(node.outputs[0]), tile=tile,
                        red=red, configs=self.configs, arch=self.arch, residual=self.buf(res), workspace=ws)
            return
        norms = [c for c in self.users.get(node.outputs[0], []) if c.op == "rms_norm" and c.inputs[0] == node.outputs[0]]
        quant = [c for c in self.users.get(node.outputs[0], []) if c.op == "rms_norm_quant" and c.inputs[0] == node.outputs[0]]
        if len(quant) == 1 and not norms:  # an FP8 model's bf16 linear before its quantising norm
            return self._linear_add_then_norm_quant(node, quant[0], red, tile, fold)
        if len(norms) != 1:
            raise LoweringError(f"{node.name}: linear_add's output needs one rms_norm reading it (has {len(norms)})")
        norm = norms[0]
        split = red.split_k if red.split_k > 1 and not fold else 0
        if split:
            y = self.workspace("gemm_ws_fused", (split, m, n))
        else:
            y = self.workspace("linear_add_y", (m, n), out.np_dtype)
        k_gemm.gemm(self.buf(x), self.buf(w), None, out if split else y, n_rows=self.n_rows(node.outputs[0]),
                    workspace=y if split else None, tile=tile, red=red, configs=self.configs, arch=self.arch,
                    reduce=not split)
        k_norm.add_rms_norm(y, self.buf(res), self.buf(norm.inputs[1]), self.buf(norm.outputs[0]), out,
                            eps=norm.attrs["eps"], offset=norm.attrs.get("offset", 0.0),
                            n_rows=self.n_rows(node.outputs[0]), configs=self.configs, x_split=split)
        self.done.add(norm.name)

    def _reduced_by_norm(self, name: str) -> bool:
        users = self.users.get(name, [])
        return (len(users) == 1 and users[0].op == "add_rms_norm" and name in users[0].inputs[:2]
                and name not in self.g.outputs)

    def op_rms_norm(self, node) -> None:
        x, w = node.inputs
        k_norm.rms_norm(self.buf(x), self.buf(w), self.buf(node.outputs[0]), eps=node.attrs["eps"],
                        offset=node.attrs.get("offset", 0.0), n_rows=self.n_rows(x), configs=self.configs)

    def _pending_moe_input(self, node) -> tuple[_MoeSum, str] | None:
        """A norm's (x, res) where one is a MoE layer's output whose sum this launch runs
        (_norm_takes_moe_sum) -> (that sum, the other one, the residual); else None."""
        x, res = node.inputs[:2]
        y = x if x in self.moe_pending else res if res in self.moe_pending else None
        if y is None:
            return None
        other = res if y == x else x
        if other in self.partials:  # _norm_takes_moe_sum saw it lowered, unsplit
            raise LoweringError(f"{node.name}: a MoE layer's sum and split-K partials in one norm")
        return self.moe_pending.pop(y), other

    def op_add_rms_norm(self, node) -> None:
        x, res, w = node.inputs
        moe = self._pending_moe_input(node)
        if moe is not None:  # the MoE layer's sum in this launch: its moe_sum launch saved
            s, res = moe
            k_norm.add_rms_norm(s.o, self.buf(res), self.buf(w), self.buf(node.outputs[0]), self.buf(node.outputs[1]),
                                eps=node.attrs["eps"], offset=node.attrs.get("offset", 0.0), n_rows=self.n_rows(x),
                                configs=self.configs, moe=(s.weights, s.shared))
            return
        if res in self.partials:  # x + residual is symmetric (one f32 add): the partials go in as x
            x, res = res, x
        xb, split = self.partials.pop(x, (self.buf(x), 0))
        k_norm.add_rms_norm(xb, self.buf(res), self.buf(w), self.buf(node.outputs[0]),
                            self.buf(node.outputs[1]), eps=node.attrs["eps"], offset=node.attrs.get("offset", 0.0),
                            n_rows=self.n_rows(x), configs=self.configs, x_split=split)

    def op_silu_mul(self, node) -> None:
        gate, up = node.inputs
        k_silu.silu_mul(self.buf(gate), self.buf(up), self.buf(node.outputs[0]), n_rows=self.n_rows(gate),
                        configs=self.configs)

    # -- FP8 W8A8 (graph/fp8_ops.py): quantising producers and the FP8 GEMM ------------------
    def _quant_outs(self, node):
        """The (e4m3 [T, N], f32 scales) buffers a quantising op writes."""
        return self.buf(node.outputs[0]), self.buf(node.outputs[1])

    def _static_scales(self, names) -> list[Buf]:
        """A static quantisation's input scales (weights, f32 [1] each; none: dynamic)."""
        return [self.buf(t) for t in names if t]

    def op_quant_fp8(self, node) -> None:
        x = node.inputs[0]
        q, s = self._quant_outs(node)
        k_quant.quant_fp8(self.buf(x), *self._static_scales(node.inputs[1:]), q=q, s=s, group=node.attrs["group"],
                          min_scale=node.attrs.get("min_scale", 0.0), n_rows=self.n_rows(x), configs=self.configs)

    def op_rms_norm_quant(self, node) -> None:
        x, w = node.inputs[:2]
        q, s = self._quant_outs(node)
        a = node.attrs
        k_quant.rms_norm_quant(self.buf(x), self.buf(w), *self._static_scales(node.inputs[2:]), q=q, s=s,
                               eps=a["eps"], offset=a.get("offset", 0.0), group=a["group"],
                               min_scale=a.get("min_scale", 0.0), n_rows=self.n_rows(x), configs=self.configs)

    def op_add_rms_norm_quant(self, node) -> None:
        x, res, w = node.inputs[:3]
        q, s = self._quant_outs(node)
        a = node.attrs
        xb, moe = self.buf(x), None
        pending = self._pending_moe_input(node)
        if pending is not None:  # the MoE layer's sum in this launch (op_add_rms_norm's)
            (ms, res), moe = pending, (pending[0].weights, pending[0].shared)
            xb = ms.o
        k_quant.add_rms_norm_quant(xb, self.buf(res), self.buf(w), *self._static_scales(node.inputs[3:]),
                                   q=q, s=s, res_out=self.buf(node.outputs[2]), eps=a["eps"],
                                   offset=a.get("offset", 0.0), group=a["group"], min_scale=a.get("min_scale", 0.0),
                                   n_rows=self.n_rows(x), configs=self.configs, moe=moe)

    def op_silu_mul_quant(self, node) -> None:
        gate, up = node.inputs[:2]
        q, s = self._quant_outs(node)
        k_quant.silu_mul_quant(self.buf(gate), self.buf(up), *self._static_scales(node.inputs[2:]), q=q, s=s,
                               group=node.attrs["group"], min_scale=node.attrs.get("min_scale", 0.0),
                               n_rows=self.n_rows(gate), configs=self.configs)

    def op_linear_fp8(self, node) -> None:
        """One launch: the K order is the weight's (fp8_gemm.fp8_reduction), the tile the bucket's
        (fp8_gemm.fp8_tile: on sm_90 always e4m3 wgmma), so a token's row has one set of bits."""
        x, xs, w, ws = node.inputs[:4]
        bias = node.inputs[4] if len(node.inputs) > 4 and node.inputs[4] else None
        out = self.buf(node.outputs[0])
        k_fp8.fp8_gemm(self.buf(x), self.buf(xs), self.buf(w), self.buf(ws), self.buf(bias) if bias else None, out,
                       block=tuple(node.attrs["block"]), n_rows=self.n_rows(node.outputs[0]),
                       tile=k_fp8.fp8_tile(out.shape[0], self.arch), arch=self.arch)

    def op_linear_nvfp4(self, node) -> None:
        """W4A16 (codegen/triton/nvfp4_gemm.py): one launch, the K order the weight's, the tile the bucket's."""
        x, w, ws, ws2 = node.inputs[:4]
        bias = node.inputs[4] if len(node.inputs) > 4 and node.inputs[4] else None
        out = self.buf(node.outputs[0])
        k_nvfp4.nvfp4_gemm(self.buf(x), self.buf(w), self.buf(ws), self.buf(ws2), self.buf(bias) if bias else None,
                           out, n_rows=self.n_rows(node.outputs[0]),
                           tile=k_nvfp4.nvfp4_tile(out.shape[0], self.arch), arch=self.arch)

    def op_linear_gguf(self, node) -> None:
        """A GGUF linear: its blocks dequantised in the K loop (codegen/triton/gguf_gemm.py), one
        launch, the K order the weight's in every bucket (the tile is the bucket's)."""
        x, w = node.inputs[0], node.inputs[1]
        bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
        out = self.buf(node.outputs[0])
        k_gguf.gguf_gemm(self.buf(x), self.buf(w), self.buf(bias) if bias else None, out, qtype=node.attrs["qtype"],
                         n_rows=self.n_rows(node.outputs[0]), tile=k_gguf.gguf_tile(out.shape[0], self.arch),
                         arch=self.arch)

    def _linear_add_then_norm_quant(self, node, norm, red, tile, fold) -> None:
        """op_linear_add where its output's norm quantises (a bf16 o_proj or down left unquantised
        by an FP8 checkpoint, before an FP8 layer) and the residual stays out of the epilogue: the
        GEMM writes y (reduced: the quantising norm takes no split-K partials), then
        add_rms_norm_quant adds the residual, writes h and quantises its norm. The graph's bits:
        linear_add rounds y before the add, as this does."""
        x, w, res = node.inputs
        out = self.buf(node.outputs[0])
        n, k = self.g.tensors[w].shape
        m = out.shape[0]
        y = self.workspace("linear_add_y", (m, n), out.np_dtype)
        ws = self.workspace("gemm_ws", (red.split_k, m, n)) if k_gemm.needs_workspace(red, tile, fold) else None
        k_gemm.gemm(self.buf(x), self.buf(w), None, y, n_rows=self.n_rows(node.outputs[0]), workspace=ws, tile=tile,
                    red=red, configs=self.configs, arch=self.arch)
        q, s = self._quant_outs(norm)
        a = norm.attrs
        k_quant.add_rms_norm_quant(y, self.buf(res), self.buf(norm.inputs[1]), *self._static_scales(norm.inputs[2:]),
                                   q=q, s=s, res_out=out, eps=a["eps"], offset=a.get("offset", 0.0), group=a["group"],
                                   min_scale=a.get("min_scale", 0.0), n_rows=self.n_rows(node.outputs[0]),
                                   configs=self.configs)
        self.done.add(norm.name)

    def op_attention_preamble(self, node) -> None:
        q, k, v, cache, pos, slots = node.inputs[:6]
        qw, kw = (node.inputs[6], node.inputs[7]) if len(node.inputs) > 6 else (None, None)
        a = node.attrs
        cos, sin = self._rope_tables(a)
        k_pre.attention_preamble(self.buf(q), self.buf(k), self.buf(v), self.buf(cache), self.buf(pos),
                                 self.buf(slots), cos, sin, self.buf(qw) if qw else None,
                                 self.buf(kw) if kw else None, self.buf(node.outputs[0]),
                                 eps=a.get("eps", 1e-6), offset=a.get("offset", 0.0), is_neox=a["is_neox"],
                                 n_rows=self.n_rows(q), configs=self.configs)

    # -- the hybrids' Gated DeltaNet layers and gated attention (codegen/triton/gdn.py) --------
    def op_causal_conv1d(self, node) -> None:
        x, state, w, sl, qsl, slots = node.inputs
        act = node.attrs.get("activation", "")
        if act not in ("", "silu"):
            raise LoweringError(f"{node.name}: no conv kernel for activation {act!r}")
        k_gdn.causal_conv1d(self.buf(x), self.buf(w), self.buf(state), self.buf(sl), self.buf(qsl), self.buf(slots),
                            self.buf(node.outputs[0]), silu=act == "silu")

    def op_fused_gated_delta_rule(self, node) -> None:
        """Decode buckets: the recurrent kernel. Mixed buckets: the chunked kernel for the
        sequences of several tokens and the recurrent one for the one-token ones, so a decode
        token has the same bits in either bucket (batch invariance)."""
        q, k, v, a, b, a_log, dt_bias, state, sl, qsl, slots = (self.buf(t) for t in node.inputs)
        if node.attrs.get("eps", 1e-6) != 1e-6 or node.attrs.get("chunk_size", k_gdn.CHUNK) != k_gdn.CHUNK:
            raise LoweringError(f"{node.name}: the GDN kernels take eps 1e-6 and {k_gdn.CHUNK}-token chunks")
        out = self.buf(node.outputs[0])
        args = (q, k, v, a, b, a_log, dt_bias, state, sl, qsl, slots, out)
        scale = node.attrs["q_scale"]
        if self.bucket.decode:
            k_gdn.gdn_recurrent(*args, scale=scale)
        else:
            k_gdn.gdn_chunked(*args, scale=scale, mixed=True)
            k_gdn.gdn_recurrent(*args, scale=scale, mixed=True)

    def op_fused_gated_delta_rule_norm(self, node) -> None:
        """passes/fold_gdn_norm.py's op. Decode buckets: the recurrent kernel with the norm (one
        launch; its programs split each head's columns, and the last one of a row norms it). Mixed
        buckets: the chunked kernel, the norm over every row in place (rows it did not
        write are norms of stale values, overwritten next), then the recurrent kernel with the norm
        for the one-token sequences: a decode token gets the decode bucket's bits."""
        ins = [self.buf(t) for t in node.inputs]
        q, k, v, a, b, a_log, dt_bias, state, sl, qsl, slots, z, w = ins
        if node.attrs.get("eps", 1e-6) != 1e-6 or node.attrs.get("chunk_size", k_gdn.CHUNK) != k_gdn.CHUNK:
            raise LoweringError(f"{node.name}: the GDN kernels take eps 1e-6 and {k_gdn.CHUNK}-token chunks")
        out = self.buf(node.outputs[0])
        args = (q, k, v, a, b, a_log, dt_bias, state, sl, qsl, slots, out)
        scale, norm = node.attrs["q_scale"], (z, w, node.attrs["norm_eps"])
        # a head's value columns split over programs: the last of a (token, head) norms the row,
        # counting on an i32 of [T, Hv]; the merge counters' region (zeroed at load, left zero by
        # every launch that counts on it, launches ordered on the stream) serves
        counter = self.workspace(MERGE_COUNTER, (out.shape[0], out.shape[1]), np.int32)
        if self.bucket.decode:
            k_gdn.gdn_recurrent(*args, scale=scale, norm=norm, counter=counter)
        else:
            k_gdn.gdn_chunked(*args, scale=scale, mixed=True)
            k_gdn.gated_rms_norm(out, z, w, out, eps=node.attrs["norm_eps"], n_rows=self.n_rows(node.inputs[2]))
            k_gdn.gdn_recurrent(*args, scale=scale, mixed=True, norm=norm, counter=counter)

    def op_gated_rms_norm(self, node) -> None:
        x, z, w = node.inputs
        k_gdn.gated_rms_norm(self.buf(x), self.buf(z), self.buf(w), self.buf(node.outputs[0]), eps=node.attrs["eps"],
                             n_rows=self.n_rows(x))

    def op_sigmoid_mul(self, node) -> None:
        """The gated attention's [T, H, D] gate, or the shared expert's [T, 1] (one gate a token,
        broadcast over the row, which is run as one head of H columns). A product whose one
        user is an add (the shared expert's output joining the routed experts') is added in the
        same launch, with the graph's two roundings, and the add node is done."""
        x, gate = node.inputs
        out = node.outputs[0]
        users = self.users.get(out, [])
        fused = users[0] if len(users) == 1 and users[0].op == "add" and out not in self.g.outputs else None
        routed = next((t for t in fused.inputs if t in self.moe_pending), None) if fused is not None else None
        if routed is not None:  # the routed experts' rank-order sum, this product and the add: one launch
            s = self.moe_pending.pop(routed)
            s = dataclasses.replace(s, shared=(self.buf(x), self.buf(gate)), reads=s.reads + (x, gate))
            y = fused.outputs[0]
            self.done.add(fused.name)
            self.unwritten.add(out)
            if self._norm_takes_moe_sum(y, self.position[node.name], s.reads):  # later still: in the norm
                self.moe_pending[y] = s
                self.unwritten.add(y)
            else:
                k_moe.moe_sum(s.o, s.weights, self.buf(y), n_rows=s.n_rows, shared=s.shared)
            return
        addend = None
        if fused is not None:
            other = [t for t in fused.inputs if t != out]
            src = self.g.producer(other[0]) if len(other) == 1 else None
            # the addend must be computed already (launches run in this order)
            addend = self.buf(other[0]) if len(other) == 1 and (src is None or src.name in self.visited) else None
            if addend is None or addend.shape != self.buf(out).shape:
                fused = addend = None
        xb, gb = self.buf(x), self.buf(gate)
        yb = self.buf(fused.outputs[0] if fused is not None else out)
        if len(xb.shape) == 2:
            t, hd = xb.shape
            if gb.shape != (t, 1) or any(b.strides != (hd, 1) for b in (xb, yb, addend or xb)):
                raise LoweringError(f"{node.name}: sigmoid_mul of [T, N] takes packed rows and a [T, 1] gate")
            xb, yb, addend = (None if b is None else Buf(ptr=b.ptr, shape=(t, 1, hd), dtype=b.np_dtype)
                              for b in (xb, yb, addend))
            gb = Buf(ptr=gb.ptr, shape=(t, 1, 1), dtype=gb.np_dtype, strides=(gb.strides[0], 1, 1))
        k_gdn.sigmoid_mul(xb, gb, yb, n_rows=self.n_rows(x), add=addend)
        if fused is not None:
            self.done.add(fused.name)
            self.unwritten.add(out)

    # -- tensor parallel (issue 44, docs/TENSOR_PARALLEL.md): one plan for every rank --------
    # Every rank's plan is the same (same shapes, same arena offsets), so rank r's copy of a
    # tensor sits at the same arena offset in rank r's arena: region "tp_arena:r" is rank r's
    # arena mapped into this rank (its own for r = rank), resolved per rank at load like
    # "tp_flags:r" (rank r's barrier flags), "tp_own_flags", "tp_epoch", "tp_rank" and
    # "tp_vocab_start" (this rank's first vocabulary id). The runtime that maps them is not built.
    def _tp_peers(self, name: str, world: int) -> list[Buf]:
        t = self.g.tensors[name]
        if t.kind != TensorKind.ACTIVATION or name not in self.plan.offsets or self.g.producer(name).op in (
                "reshape", "slice_cols"):
            raise LoweringError(f"a collective's input must be an arena tensor of its own ({name})")
        off = self.plan.offsets[name]
        return [Buf(ptr=self.regions.ptr(f"tp_arena:{r}", off), shape=t.concrete_shape(self.dims),
                    dtype=to_numpy(t.dtype)) for r in range(world)]

    def _tp_barrier(self, world: int) -> None:
        i32 = np.int32
        for r in range(world):
            self.regions.need(f"tp_flags:{r}", 4 * world)
        for name, n in (("tp_own_flags", world), ("tp_epoch", 1), ("tp_rank", 1)):
            self.regions.need(name, 4 * n)
        k_coll.barrier([Buf(ptr=self.regions.ptr(f"tp_flags:{r}"), shape=(world,), dtype=i32) for r in range(world)],
                       Buf(ptr=self.regions.ptr("tp_own_flags"), shape=(world,), dtype=i32),
                       Buf(ptr=self.regions.ptr("tp_epoch"), shape=(1,), dtype=i32),
                       Buf(ptr=self.regions.ptr("tp_rank"), shape=(1,), dtype=i32))

    def _nccl_gathered(self, x: str, world: int) -> list[Buf]:
        """NCCL all-gathers every rank's x into this rank's workspace [WORLD, *x]: the ranks'
        copies of x, each a buffer in this rank's memory."""
        xb = self.buf(x)
        ws = self.workspace(NCCL_GATHER, (world, *xb.shape), xb.np_dtype)
        k_coll.nccl_all_gather(xb, ws)
        return k_coll.rank_slices(ws)

    def op_all_reduce(self, node) -> None:
        """nccl: two ranks (or a group of one: tests/gpu/test_gpu_nccl.py), one ncclAllReduce (a
        sum of two addends is the same bits in either order and every NCCL algorithm adds them
        once, so it equals the rank-order reference in every bucket); more ranks, ncclAllGather
        of the partials and the rank-order sum kernel over the gathered copies (NCCL's own
        reduction order for three or more follows the message size, i.e. the bucket:
        docs/TENSOR_PARALLEL.md).
        peer: barrier (every rank's partial written), the rank-order sum over the peers'
        arenas, barrier (every rank done reading before any partial's bytes are reused)."""
        (x,), (out,) = node.inputs, node.outputs
        world = int(node.attrs["world_size"])
        if self.collective == "nccl":
            if world <= 2:
                k_coll.nccl_all_reduce(self.buf(x), self.buf(out))
            else:
                k_coll.all_reduce(self._nccl_gathered(x, world), self.buf(out), n_rows=self.n_rows(out))
            return
        peers = self._tp_peers(x, world)
        self._tp_barrier(world)
        k_coll.all_reduce(peers, self.buf(out), n_rows=self.n_rows(out))
        self._tp_barrier(world)

    def op_all_gather(self, node) -> None:
        (x,), (out,) = node.inputs, node.outputs
        world = int(node.attrs["world_size"])
        if self.collective == "nccl":  # NCCL gathers whole buffers; the columns go side by side here
            k_coll.all_gather(self._nccl_gathered(x, world), int(node.attrs["size"]), self.buf(out),
                              n_rows=self.n_rows(out))
            return
        peers = self._tp_peers(x, world)
        self._tp_barrier(world)
        k_coll.all_gather(peers, int(node.attrs["size"]), self.buf(out), n_rows=self.n_rows(out))
        self._tp_barrier(world)

    def op_vocab_parallel_embedding(self, node) -> None:
        """The rank's first id from the device; every id < V, so a rank's padding rows (ids
        vocab_end .. vocab_start + Vp) are never asked for and every rank takes Vp rows."""
        ids, table = node.inputs
        self.regions.need("tp_vocab_start", 4)
        vp = int(self.g.tensors[table].shape[0])
        k_coll.vocab_embedding(self.buf(ids), self.buf(table), Buf(ptr=self.regions.ptr("tp_vocab_start"),
                                                                     shape=(1,), dtype=np.int32),
                               vp, self.buf(node.outputs[0]), n_rows=self.n_rows(node.outputs[0]))

    def op_moe_router(self, node) -> None:
        (logits,) = node.inputs
        ids, weights = node.outputs
        k_router.moe_router(self.buf(logits), top_k=node.attrs["top_k"], renormalize=node.attrs["renormalize"],
                            ids=self.buf(ids), weights=self.buf(weights), n_rows=self.n_rows(logits))

    def op_moe_router_silu_mul(self, node) -> None:
        """passes/fuse_router_silu.py's op: the router's launch computes the shared expert's act too."""
        logits, gate, up = node.inputs
        ids, weights, act = node.outputs
        k_router.moe_router(self.buf(logits), top_k=node.attrs["top_k"], renormalize=node.attrs["renormalize"],
                            ids=self.buf(ids), weights=self.buf(weights), n_rows=self.n_rows(logits),
                            silu=(self.buf(gate), self.buf(up), self.buf(act)))

    def op_moe_experts(self, node) -> None:
        """The decode path (no sort) for buckets of few assignments, else align + grouped GEMMs
        (codegen/triton/moe.py): a choice of speed only, both give a token the same bits, so the
        path and tiles are the bucket's schedule (Configs.moe: schedules/<arch>/moe.yaml, else
        the defaults). The scratch (sorted ids, the [T*k, I] intermediate, ...) is one region per
        name, shared by every layer and bucket (launches are ordered on the stream)."""
        x, ids, weights, w13, w2 = (self.buf(t) for t in node.inputs)
        t, k = ids.shape
        e, two_i, h = w13.shape
        dt = dtype_name(x)
        cfg = self.configs.moe(t, k, e, h, two_i // 2, dt, self.arch)
        path, tiles = cfg.path, cfg.tiles
        need = k_moe.moe_workspace(t, k, e, h, two_i // 2, dt, path=path, block_m=tiles[0].block_m)
        ws = {name: self.workspace(f"moe_{name}", shape, x.np_dtype if d == dt else np.dtype(d))
              for name, (shape, d) in need.items()}
        defer = self._defer_moe_sum(node, path)
        k_moe.moe_experts(x, ids, weights, w13, w2, self.buf(node.outputs[0]), path=path, tiles=tiles,
                          n_rows=self.n_rows(node.inputs[0]), workspace=ws, arch=self.arch, defer_sum=defer)
        if defer:
            self._pend_moe_sum(node, ws["o"], weights)

    def _pend_moe_sum(self, node, o: Buf, weights: Buf) -> None:
        tw = node.inputs[ROUTING_WEIGHTS[node.op]]
        self.moe_pending[node.outputs[0]] = _MoeSum(o, weights, self.n_rows(node.inputs[0]), None, (tw,))
        self.unwritten.add(node.outputs[0])

    def _lives_until(self, names, hi: int) -> bool:
        """Whether these tensors' bytes are still theirs at the launch of node number hi: the
        memory plan's lifetimes (passes/plan_memory.py ROUTING_WEIGHTS keeps a deferred MoE
        sum's operands so); tensors it does not plan (weights, inputs) always are."""
        return all(self.plan.lifetimes.get(self.plan.aliases.get(t, t), (0, hi))[1] >= hi for t in names)

    def _no_moe_between(self, lo: int, hi: int) -> bool:
        """No MoE experts layer (the `moe_o` scratch's other writers) lowers strictly between."""
        return not any(self.position[n.name] in range(lo + 1, hi) for n in self.g.nodes.values()
                       if n.op in MOE_EXPERTS)

    def _defer_moe_sum(self, node, path: str) -> bool:
        """Whether a MoE layer's rank-order sum (moe_sum_kernel) waits for a later launch that runs
        it beside its own work: the next norm's, where the layer's output y goes straight into it
        (_norm_takes_moe_sum: no shared expert), or else the shared expert's sigmoid_mul's, which
        runs it with its product and the add (op_sigmoid_mul, moe.moe_sum) or hands all three on
        to the norm after the add. The latter where y has one user, an add with the output of a
        sigmoid_mul of [T, H] by a [T, 1] gate that has no other user and runs later, and no other
        MoE layer (the `moe_o` scratch's other writer) lowers in between. Numerics unchanged: the
        same sum, rounding, product and add as the three ops (issue 37: the decode path then has
        gate_up, down and this launch, as many as before its down GEMM was split by assignment;
        with the norm taking it, one launch fewer than that)."""
        y = node.outputs[0]
        if path not in ("decode", "grouped") or y in self.g.outputs:
            return False
        lo = self.position[node.name]
        tw = node.inputs[ROUTING_WEIGHTS[node.op]]
        if self._norm_takes_moe_sum(y, lo, (tw,)):  # no shared expert: straight into the next norm
            return True
        users = self.users.get(y, [])
        if len(users) != 1 or users[0].op != "add":
            return False
        add = users[0]
        other = [t for t in add.inputs if t != y]
        sm = self.g.producer(other[0]) if len(other) == 1 else None
        if sm is None or sm.op != "sigmoid_mul" or sm.name in self.visited or other[0] in self.g.outputs:
            return False
        if [u.name for u in self.users.get(other[0], [])] != [add.name]:
            return False
        xs, gs = (self.g.tensors[t] for t in sm.inputs)
        ys = self.g.tensors[y]
        if tuple(xs.shape) != tuple(ys.shape) or len(gs.shape) != 2 or gs.shape[1] != 1 or xs.dtype != ys.dtype:
            return False
        hi = self.position[sm.name]
        # the routing weights are read by the deferred sum: their bytes must outlive the shared
        # expert's launches (passes/plan_memory.py ROUTING_WEIGHTS keeps them so)
        return self._lives_until((tw,), hi) and self._no_moe_between(lo, hi)

    def _norm_takes_moe_sum(self, y: str, lo: int, reads: tuple[str, ...]) -> bool:
        """Whether the launch of the norm after a MoE layer can run the layer's sum (its rows in
        `moe_o` as written by the experts lowered at node lo, the routing weights and, once the
        shared expert's sigmoid_mul joined it, that product: `reads`), so that the layer's output
        y is never written and its moe_sum launch is saved (rms_norm.py, fp8_quant.py: the same
        moe_sum_row, so the same bits). Where y has one user, an add_rms_norm(_quant) taking it
        as x or res, whose other operand is lowered already and not split-K partials; no other
        MoE layer (the `moe_o` scratch's other writer) lowers before the norm; and every tensor
        read lives until the norm's launch (passes/plan_memory.py keeps them so)."""
        users = self.users.get(y, [])
        if y in self.g.outputs or len(users) != 1 or users[0].op not in MOE_SUM_NORMS:
            return False
        norm = users[0]
        pair = norm.inputs[:2]
        if y not in pair or pair[0] == pair[1] or norm.name in self.done:
            return False
        res = pair[1] if pair[0] == y else pair[0]
        src = self.g.producer(res)
        if res in self.partials or (src is not None and src.name not in self.visited):
            return False
        ys, rs = self.g.tensors[y], self.g.tensors[res]
        if len(ys.shape) != 2 or tuple(ys.shape) != tuple(rs.shape) or ys.dtype != rs.dtype:
            return False
        hi = self.position[norm.name]
        return self._lives_until(reads, hi) and self._no_moe_between(lo, hi)

    def op_moe_experts_gguf(self, node) -> None:
        """op_moe_experts with the experts in GGUF blocks (graph/gguf_ops.py): the same path, tiles
        and scratch as the bf16 experts of these shapes, the blocks dequantised in the expert
        GEMMs' K loops (codegen/triton/moe_gemm.py)."""
        x, ids, weights, w13, w2 = (self.buf(t) for t in node.inputs)
        self._quantised_moe(node, x, ids, weights, w13, w2, qtypes=tuple(node.attrs["qtypes"]))

    def op_moe_experts_fp8(self, node) -> None:
        """op_moe_experts with block-wise FP8 experts (graph/fp8_ops.py moe_experts_fp8): x e4m3 with
        its scales (the layer's quant_fp8), the e4m3 experts and their block scales read by the same
        expert GEMMs (codegen/triton/moe_gemm.py FP8, the intermediate quantised in down's K loop);
        the same path and scratch as the bf16 experts of these shapes, the tiles made wgmma tiles on
        sm_90 (moe.fp8_tiles)."""
        xq, xs, ids, weights, w13, s13, w2, s2 = (self.buf(t) for t in node.inputs)
        self._quantised_moe(node, xq, ids, weights, w13, w2, fp8=(xs, s13, s2), block=tuple(node.attrs["block"]),
                            min_scale=node.attrs.get("min_scale", 0.0))

    def op_moe_experts_nvfp4(self, node) -> None:
        """op_moe_experts with ModelOpt NVFP4 experts (graph/nvfp4_ops.py moe_experts_nvfp4, W4A16): the
        packed e2m1 experts dequantised with their block scales in the expert GEMMs' K loops, the
        per-tensor scales on the f32 sums (codegen/triton/moe_gemm.py NV); the bf16 experts' path,
        tiles and scratch."""
        x, ids, weights, w13, s13, g13, w2, s2, g2 = (self.buf(t) for t in node.inputs)
        self._quantised_moe(node, x, ids, weights, w13, w2, nvfp4=(s13, g13, s2, g2))

    def _quantised_moe(self, node, x, ids, weights, w13, w2, **quant) -> None:
        """A MoE experts layer over quantised experts (GGUF blocks, FP8, NVFP4): its path, tiles and scratch
        are the bf16 experts' of these shapes and the activation dtype (the output's)."""
        out = self.buf(node.outputs[0])
        t, k = ids.shape
        e, two_i, _ = w13.shape
        h = out.shape[1]
        dt = dtype_name(out)
        cfg = self.configs.moe(t, k, e, h, two_i // 2, dt, self.arch)
        tiles = k_moe.quantised_tiles(cfg.tiles, self.arch, fp8="fp8" in quant, nvfp4="nvfp4" in quant)
        need = k_moe.moe_workspace(t, k, e, h, two_i // 2, dt, path=cfg.path, block_m=tiles[0].block_m)
        ws = {name: self.workspace(f"moe_{name}", shape, out.np_dtype if d == dt else np.dtype(d))
              for name, (shape, d) in need.items()}
        defer = self._defer_moe_sum(node, cfg.path)
        k_moe.moe_experts(x, ids, weights, w13, w2, out, path=cfg.path, tiles=tiles,
                          n_rows=self.n_rows(node.inputs[0]), workspace=ws, arch=self.arch, defer_sum=defer, **quant)
        if defer:
            self._pend_moe_sum(node, ws["o"], weights)

    def op_paged_attention(self, node) -> None:
        q, cache, bt, sl, qsl = node.inputs
        out = self.buf(node.outputs[0])
        t, h, d = out.shape
        hkv = self.g.tensors[cache].shape[3]
        split = split_kv(self.bucket)
        ws = counter = None
        if split:
            cfg = self.configs.attention(h, hkv, d, self.max_model_len, to_numpy(self.g.tensors[cache].dtype).name)
            segs = -(-self.max_model_len // cfg.seg)
            ws = (self.workspace("attn_ws_acc", (t, segs, h, d)), self.workspace("attn_ws_ml", (t, segs, h, 2)))
        if k_attn.merges_in_kernel(split, self.bucket.decode, self.fuse_merge):
            # the kernel's last segment program of each (sequence, KV head) merges and zeroes
            # its counter again; every layer and bucket shares the region (launches are ordered
            # on the stream), which starts zeroed at load (runtime/worker/cuda_executor.py)
            counter = self.workspace(MERGE_COUNTER, (self.bucket.seqs, hkv), np.int32)
        k_attn.paged_attention(self.buf(q), self.buf(cache), self.buf(bt), self.buf(sl), self.buf(qsl), out,
                               scale=node.attrs["scale"], sliding_window=node.attrs.get("sliding_window", 0),
                               split=split, max_model_len=self.max_model_len, positions=self.buf("positions"),
                               workspace=ws, counter=counter, configs=self.configs, decode=self.bucket.decode,
                               fuse_merge=self.fuse_merge)


def lower_bucket(graph: Graph, plan: MemoryPlan, bucket: Bucket, *, max_blocks_per_seq: int, regions: Regions,
                 max_model_len: int, configs: Configs = DEFAULT, arch: str = "sm_90", batch_invariant: bool = True,
                 fuse_merge: bool = True, collective: str = "nccl"):
    """-> [(KernelSpec, args)] for one bucket; args hold symbolic pointers into `regions`;
    a tensor-parallel graph's NCCL calls are (NcclCall, None) entries among them.
    batch_invariant=False exists only to measure what invariance costs (docs/BENCHMARKS.md);
    fuse_merge=False (split-KV decode merges in a second launch, same bits) only to A/B it."""
    return _Lowerer(graph, plan, bucket, max_blocks_per_seq, regions, configs, arch, max_model_len,
                    batch_invariant, fuse_merge, collective).lower()


def encode_ptr(p: int) -> list[int]:
    return [p >> REGION_SHIFT, p & ((1 << REGION_SHIFT) - 1)]


def encode_nccl(call: k_coll.NcclCall) -> dict[str, Any]:
    """A plan's NCCL entry: op, dtype, element count, reduction, send/recv as [region, offset]."""
    return {"op": call.op, "dtype": call.dtype, "count": call.count, "red": call.red,
            "send": encode_ptr(call.send.data_ptr()), "recv": encode_ptr(call.recv.data_ptr())}


def encode_args(spec: KernelSpec, args: list[Any]) -> list[Any]:
    """Plan JSON: pointers as [region, offset], scalars as numbers (types from the signature)."""
    out = []
    for (name, ty), a in zip(spec.signature.items(), args):
        if ty.startswith("*"):
            p = a.data_ptr()
            out.append([p >> REGION_SHIFT, p & ((1 << REGION_SHIFT) - 1)])
        else:
            out.append(float(a) if ty.startswith("fp") else int(a))
    return out
