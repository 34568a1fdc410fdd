"""One rank's share of the step graph under tensor parallelism of size N (issue 44).

Megatron's split as vLLM writes it (vllm/model_executor/layers/linear.py ColumnParallelLinear,
QKVParallelLinear, RowParallelLinear; vocab_parallel_embedding.py), by the checkpoint's names:

- column-parallel (output rows split, no communication): q/k/v (heads split; with fewer KV
  heads than ranks each KV head is replicated on N / Hkv ranks, rank r holding KV head
  r // (N / Hkv), as QKVParallelLinear does), gate/up, the experts' gate_up (each expert's
  intermediate split: tensor-parallel experts), the Gated DeltaNet projections (key and value
  heads split; q|k|v, the conv weights and states split per segment) and their A_log/dt_bias;
- row-parallel (input columns split): o_proj, down, the experts' down, out_proj; each output
  is this rank's partial sum, followed by an `all_reduce` (graph/collective_ops.py). A bias is
  added on rank 0 only (RowParallelLinear: `bias_ = None if tp_rank > 0`);
- vocab-parallel: the embedding becomes a masked lookup of this rank's rows + `all_reduce`;
  the LM head computes this rank's logit columns and an `all_gather` joins them. The vocab is
  padded to a multiple of 64 per rank (vLLM's DEFAULT_VOCAB_PADDING_SIZE) with zero rows;
- replicated: norms, the router, the shared expert's scalar gate, the GDN output norm.

It runs first in passes/pipeline.py, on the graph the model builder made, not on the fused
one: the fusions stack parts that shard differently (q heads vs replicated KV heads, gate vs
up), and after sharding they see each rank's real widths (the SwiGLU interleave needs I / N a
multiple of 16, the merge needs equal attrs), so they fuse the sharded graph unchanged.

What the pass writes: weights get their per-rank shapes and `graph.attrs["tp_slices"]`
(checkpoint name -> (axis, ((start, stop), ...), padded rows)) says what to read of each, so
a rank reads only its slices (models/tp_weights.py); states (KV cache heads, GDN conv channels
and state heads) shrink; reshape and slice_cols attrs follow the widths; shapes are
re-inferred. Every rank's graph has the same shapes (only the masked lookup's vocab range and
rank 0's row-parallel biases differ), which is what lets one GPU bundle serve every rank
with the rank as a run-time argument (docs/TENSOR_PARALLEL.md).

Not split: FP8 / NVFP4 / GGUF-block linears (their block scales would need slicing with the
rows; refused by name), and expert parallelism (whole experts per rank), which is the next
step for the large MoE models.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kiln.graph import Graph, TensorKind
from kiln.passes.base import Pass

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: each rank's vocab rows, a multiple of this

Slice = tuple[int, tuple[tuple[int, int], ...], int]  # (axis, ranges along it, padded length or 0)


class TensorParallelError(ValueError):
    """This model cannot be split over this many ranks (a user's choice of N): one sentence."""


@dataclass(frozen=True)
class TensorParallelDims:
    """The sizes the split needs, from the model's config (plain ints: passes do not read configs)."""
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0


QUANTISED_LINEARS = ("linear_fp8", "linear_nvfp4", "linear_gguf", "moe_experts_fp8", "moe_experts_nvfp4")


class ShardTensorParallel(Pass):
    name = "shard_tensor_parallel"

    def __init__(self, dims: TensorParallelDims, world_size: int, rank: int, *, group_of_one: bool = False) -> None:
        """group_of_one: with world_size 1, rewrite anyway (whole slices, collectives over one
        rank): a tensor-parallel plan that one GPU can run (tests/gpu/test_gpu_nccl.py)."""
        if not 0 <= rank < world_size:
            raise TensorParallelError(f"rank {rank} is not in a tensor-parallel group of {world_size}")
        self.d, self.n, self.r = dims, world_size, rank
        self.group_of_one = group_of_one

    # -- what each rank holds --------------------------------------------------------------
    def check(self) -> None:
        """One sentence for the first size N does not divide."""
        d, n = self.d, self.n
        need = [("attention heads", d.num_heads), ("MLP intermediate size", d.intermediate_size),
                ("expert intermediate size", d.moe_intermediate_size),
                ("shared expert intermediate size", d.shared_expert_intermediate_size),
                ("Gated DeltaNet key heads", d.linear_num_key_heads),
                ("Gated DeltaNet value heads", d.linear_num_value_heads)]
        for what, size in need:
            if size and size % n:
                raise TensorParallelError(f"tensor_parallel_size {n} does not divide the model's {size} {what}")
        kv = d.num_kv_heads
        if kv and (kv % n if kv >= n else n % kv):
            raise TensorParallelError(f"tensor_parallel_size {n} and the model's {kv} KV heads neither divide the "
                                      "other, so the KV heads cannot be split or replicated evenly")

    def _even(self, size: int) -> tuple[int, int]:
        part = size // self.n
        return (self.r * part, (self.r + 1) * part)

    def _kv(self, rows: int) -> tuple[int, int]:
        kv = self.d.num_kv_heads
        if kv >= self.n:
            return self._even(rows)
        per_head = rows // kv
        h = self.r // (self.n // kv)  # this rank's replica of KV head h (QKVParallelLinear)
        return (h * per_head, (h + 1) * per_head)

    def _segments(self, sizes: list[int]) -> tuple[tuple[int, int], ...]:
        """Each segment split evenly, this rank's piece of each, in order (q|k|v of a stack)."""
        out, base = [], 0
        for s in sizes:
            a, b = self._even(s)
            out.append((base + a, base + b))
            base += s
        return tuple(out)

    def vocab_range(self) -> tuple[int, int, int]:
        """-> (first id, end id, padded rows) of this rank's vocabulary shard."""
        v = self.d.vocab_size
        per = math.ceil(v / (self.n * VOCAB_PADDING)) * VOCAB_PADDING
        return min(self.r * per, v), min((self.r + 1) * per, v), per

    def weight_slice(self, name: str, shape: tuple) -> Slice | str | None:
        """-> the Slice this rank reads of checkpoint tensor `name`, "bias0" for a row-parallel
        bias (rank 0 only), or None (replicated)."""
        d = self.d
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            a, b, per = self.vocab_range()
            return (0, ((a, b),), per)
        if re.search(r"self_attn\.q_proj\.(weight|bias)$", name) or \
           re.search(r"(mlp|shared_expert)\.(gate_proj|up_proj)\.(weight|bias)$", name) or \
           re.search(r"linear_attn\.(in_proj_z|in_proj_b|in_proj_a)\.weight$", name) or \
           re.search(r"linear_attn\.(A_log|dt_bias)$", name):
            return (0, (self._even(shape[0]),), 0)
        if re.search(r"self_attn\.[kv]_proj\.(weight|bias)$", name):
            return (0, (self._kv(shape[0]),), 0)
        if re.search(r"linear_attn\.(in_proj_qkv\.weight|conv1d\.weight)$", name):
            kd, vd = d.linear_key_dim, d.linear_value_dim
            return (0, self._segments([kd, kd, vd]), 0)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: each expert's gate rows, then up rows
            i = shape[1] // 2
            return (1, self._segments([i, i]), 0)
        if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            return (2, (self._even(shape[2]),), 0)
        if re.search(r"(self_attn\.o_proj|(mlp|shared_expert)\.down_proj|linear_attn\.out_proj)\.weight$", name):
            return (1, (self._even(shape[1]),), 0)
        if re.search(r"(self_attn\.o_proj|(mlp|shared_expert)\.down_proj)\.bias$", name):
            return "bias0"
        return None

    # -- the rewrite -----------------------------------------------------------------------
    def run(self, graph: Graph) -> bool:
        if self.n == 1 and not self.group_of_one:
            return False
        self.check()
        for node in graph.nodes.values():
            if node.op in QUANTISED_LINEARS:
                raise TensorParallelError(f"tensor parallelism does not split {node.op} layers yet (their block "
                                          f"scales would be sliced with the rows): {node.name} cannot be sharded")
        old = {name: tuple(t.shape) for name, t in graph.tensors.items()}
        slices: dict[str, Slice] = {}
        row_parallel, lm_heads, embeddings = [], [], []
        for t in list(graph.weights):
            spec = self.weight_slice(t.name, tuple(t.shape))
            if spec is None:
                continue
            if spec == "bias0":
                if self.r:
                    self._drop_bias(graph, t.name)
                continue
            axis, ranges, pad = spec
            size = pad or sum(b - a for a, b in ranges)
            t.shape = tuple(size if i == axis else s for i, s in enumerate(t.shape))
            slices[t.name] = spec
        for node in graph.topo_order():
            w = node.inputs[1] if len(node.inputs) > 1 else ""
            spec = slices.get(w)
            if node.op == "embedding" and spec is not None:
                embeddings.append(node)
            elif node.op == "linear" and spec is not None and spec[2]:  # a vocab-padded weight: the LM head
                lm_heads.append(node)
            elif node.op == "linear" and spec is not None and spec[0] == 1:
                row_parallel.append(node)
            elif node.op == "moe_experts" and node.inputs[4] in slices:
                row_parallel.append(node)
        for t in graph.tensors_of(TensorKind.STATE):
            self._shard_state(t)
        self._reinfer(graph, old)
        a, b, _ = self.vocab_range()
        for node in embeddings:
            node.op = "vocab_parallel_embedding"
            node.attrs = dict(vocab_start=a, vocab_end=b)
            self._follow(graph, node, "all_reduce", world_size=self.n)
        for node in row_parallel:
            self._follow(graph, node, "all_reduce", world_size=self.n)
        for node in lm_heads:  # after the f32 cast where there is one: it folds into the head's GEMM
            users = graph.consumers(node.outputs[0])
            if len(users) == 1 and users[0].op == "cast" and node.outputs[0] not in graph.outputs:
                node = users[0]
            self._follow(graph, node, "all_gather", world_size=self.n, size=self.d.vocab_size)
        graph.rebuild_edges()
        self._reinfer(graph, {n: tuple(t.shape) for n, t in graph.tensors.items()})
        graph.attrs.update(tensor_parallel_size=self.n, tensor_parallel_rank=self.r, tp_slices=slices)
        return True

    def _shard_state(self, t) -> None:
        s = list(t.shape)
        if t.name.startswith("kv_cache."):  # [NB, 2, block, Hkv, D]
            s[3] = max(1, s[3] // self.n)
        elif t.name.startswith("gdn_conv."):  # [NS, conv channels (q|k|v), kernel - 1]
            s[1] //= self.n
        elif t.name.startswith("gdn_ssm."):  # [NS, Hv, dk, dv]
            s[1] //= self.n
        t.shape = tuple(s)

    @staticmethod
    def _drop_bias(graph: Graph, name: str) -> None:
        for node in graph.consumers(name):
            node.inputs = [i for i in node.inputs if i != name]
        del graph.tensors[name]

    @staticmethod
    def _follow(graph: Graph, node, op: str, **attrs) -> None:
        """node's output becomes its partial; `op` of it takes the output's name, so every
        consumer reads the collective's result."""
        out = node.outputs[0]
        partial = graph.fresh_name(f"{out}.partial")
        t = graph.tensors.pop(out)
        t.name = partial
        graph.tensors[partial] = t
        node.outputs[0] = partial
        graph.rebuild_edges()
        graph.call(op, [t], name=graph.fresh_name(f"{node.name}.{op}"), out_names=[out], **attrs)

    def _reinfer(self, graph: Graph, old: dict[str, tuple]) -> None:
        """Shapes again in topological order; reshape and slice_cols attrs follow the widths
        their input lost (a per-token width W -> W / N keeps every segment boundary / N)."""
        for node in graph.topo_order():
            ins = [graph.tensors[i] if i else None for i in node.inputs]
            if node.op == "reshape":
                x = ins[0]
                per_token = math.prod(d for d in x.shape[1:])
                shape = list(node.attrs["shape"])
                if len(shape) >= 2:
                    rest = math.prod(shape[2:])
                    if per_token % rest:
                        raise TensorParallelError(f"{node.name}: {per_token} columns do not reshape to {shape}")
                    shape[1] = per_token // rest
                    node.attrs["shape"] = tuple(shape)
            elif node.op == "slice_cols":
                was, now = old.get(node.inputs[0], ins[0].shape)[-1], ins[0].shape[-1]
                if was != now:
                    f = was // now
                    node.attrs["start"] //= f
                    node.attrs["stop"] //= f
            specs = graph.registry[node.op].infer(ins, node.attrs)
            for name, (dt, shape) in zip(node.outputs, specs):
                graph.tensors[name].shape = tuple(shape)
