"""GGUF checkpoints computed in their block formats: which tensors stay quantised, the weight
names the graph reads their raw blocks under, the linears that read them, and the load log.

A GGUF stores each tensor in its own ggml type. Those of the block formats kiln computes in
(Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: graph/gguf_blocks.py) stay in that format when a linear of
the graph reads them: the builder (models/llama.py through models/fp8_linear.project, and the
untied LM head) asks for `{module}.gguf_weight`, u8 [N, K / B * TS], the file's rows of blocks,
and computes linear_gguf (graph/gguf_ops.py). Everything else keeps today's path: `{module}.weight`
dequantised at load (f32 on the cpu target, bf16 on a GPU), whatever its type: the embedding
(a gather, no block kernel yet: with tied embeddings the LM head reads it too), norms, the MoE
blocks' router and shared experts. A MoE layer's experts (llama.cpp's ffn_{gate,up,down}_exps)
stay in their blocks where gate and up share a type (gguf_experts): moe_experts_gguf over
`{layer}.mlp.experts.gate_up_proj.gguf_weight` [E, 2I, RB] (gate and up blocks stacked by
models/moe_weights.py, expert_blocks below) and `{layer}.mlp.experts.down_proj.gguf_weight`.

The cpu target runs the numpy reference, which dequantises a quantised weight on every call:
right, and the same logits as dequantising at load, but a decode step then costs a whole
model's dequantisation. So the cpu target dequantises at load unless asked (loader.build_graph's
gguf_blocks); the GPU targets compute in the blocks.
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from kiln.graph import DType, Graph, Tensor
from kiln.graph.gguf_blocks import BLOCKS, row_bytes
from kiln.models.weights import WeightSource

SUFFIX = ".gguf_weight"  # {module}.gguf_weight: the raw blocks of {module}.weight


@dataclass(frozen=True)
class GgufConfig:
    """The GGUF tensors (HF names) stored in a block format kiln computes in, and their types."""
    types: tuple[tuple[str, str], ...]  # (tensor name, ggml type name), in file order
    method: str = "gguf"  # vLLM's name for GGUF quantization
    weight: str = "gguf"  # how models/fp8_linear.project tells the formats apart

    def qtype(self, name: str) -> str | None:
        """The block format of tensor `name`, None where it is not one kiln computes in."""
        return dict(self.types).get(name)


def gguf_blocks(config, weights: WeightSource):
    """(ModelConfig, GGUF weights) -> (the config with its GgufConfig, or unchanged where no tensor
    is in a block format kiln computes in; the weights with each such tensor's raw blocks also
    under `{module}.gguf_weight`)."""
    types = getattr(weights, "ggml_type", None)
    found = tuple((n, types(n).name) for n in weights.names() if types is not None and types(n).name in BLOCKS)
    if not found:
        return config, weights
    return dataclasses.replace(config, quantization=GgufConfig(found)), GgufBlockWeights(weights, found)


class GgufBlockWeights(WeightSource):
    """The GGUF's tensors (dequantised on `get`, as GGUFWeights gives them) plus, for each tensor
    in a block format, its raw blocks as u8 [..., N, K / B * TS] under `{module}.gguf_weight`
    (q/k rows of llama files un-permuted as the dequantised rows are: a row's blocks are its own)."""

    def __init__(self, inner: WeightSource, types: tuple[tuple[str, str], ...]):
        shapes = {n: inner.shape(n) for n in inner.names()}
        for name, qtype in types:
            *lead, k = inner.shape(name)
            shapes[name.removesuffix(".weight") + SUFFIX] = (*lead, row_bytes(qtype, k))
        super().__init__(inner.path, shapes)
        self.inner, self.metadata = inner, getattr(inner, "metadata", None)
        self._raw = {name.removesuffix(".weight") + SUFFIX: name for name, _ in types}

    @property
    def tied_embeddings(self) -> bool:
        return self.inner.tied_embeddings

    def ggml_type(self, name: str):
        return self.inner.ggml_type(self._raw.get(name, name))

    def _load(self, name: str, keep_dtype: bool) -> np.ndarray:
        if name in self._raw:
            return self.inner.raw_blocks(self._raw[name])
        return self.inner.get(name, keep_dtype=keep_dtype)


def project_gguf(g: Graph, quant: GgufConfig, x: Tensor, specs, n_in: int, dtype: DType, bias: bool) -> list[Tensor]:
    """models/fp8_linear.project for a GGUF: each linear of specs (module prefix, n_out, node name)
    reading x [T, n_in] is linear_gguf over its blocks where its weight is in a block format, else
    the plain linear over the weight dequantised at load."""
    outs = []
    for prefix, n_out, name in specs:
        qtype = quant.qtype(f"{prefix}.weight")
        b = [g.weight(f"{prefix}.bias", dtype, (n_out,))] if bias else []
        if qtype is None:
            outs.append(g.call1("linear", x, g.weight(f"{prefix}.weight", dtype, (n_out, n_in)), *b, name=name))
            continue
        w = g.weight(prefix + SUFFIX, DType.u8, (n_out, row_bytes(qtype, n_in)))
        outs.append(g.call1("linear_gguf", x, w, *b, qtype=qtype, name=name))
    return outs


def gguf_experts(g: Graph, quant: GgufConfig, p: str, e: int, inter: int, hidden: int):
    """A MoE layer's experts in their GGUF blocks: (w13 u8 [E, 2I, RB], w2 u8 [E, H, RB'], (w13's type,
    w2's type)), or None where they are not all in block formats kiln computes in with gate and up
    alike (then they are dequantised at load)."""
    x = f"{p}.mlp.experts"
    q13 = quant.qtype(f"{x}.gate_up_proj.weight")
    gate, up = quant.qtype(f"{x}.gate_proj.weight"), quant.qtype(f"{x}.up_proj.weight")
    q13 = q13 or (gate if gate == up else None)
    q2 = quant.qtype(f"{x}.down_proj.weight")
    if q13 is None or q2 is None or hidden % BLOCKS[q13][0] or inter % BLOCKS[q2][0]:
        return None
    w13 = g.weight(f"{x}.gate_up_proj{SUFFIX}", DType.u8, (e, 2 * inter, row_bytes(q13, hidden)))
    w2 = g.weight(f"{x}.down_proj{SUFFIX}", DType.u8, (e, hidden, row_bytes(q2, inter)))
    return w13, w2, (q13, q2)


def expert_blocks(cfg, rename: dict[str, str], weights: WeightSource) -> dict[str, tuple]:
    """models/moe_weights.py's derived weights for the GGUF experts' blocks: each MoE layer's
    `gate_up_proj.gguf_weight` [E, 2I, RB], its gate blocks' rows then its up blocks' (as the
    dequantised stack is), where the file holds ffn_gate_exps and ffn_up_exps of one row length."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        x = f"model.layers.{i}.mlp.experts"
        g, u = rename.get(f"{x}.gate_proj{SUFFIX}"), rename.get(f"{x}.up_proj{SUFFIX}")
        if g is None or u is None or weights.shape(g) != weights.shape(u):
            continue
        e, rows, rb = weights.shape(g)
        out[f"{x}.gate_up_proj{SUFFIX}"] = ((e, 2 * rows, rb), lambda get, a=g, b=u: np.concatenate(
            [get(a), get(b)], axis=1))
    return out


def without_blocks(config):
    """The config whose GGUF tensors are all dequantised at load (today's path)."""
    return dataclasses.replace(config, quantization=None) if isinstance(config.quantization, GgufConfig) else config


_LAYER = re.compile(r"\.layers\.\d+\.")
_PLAIN_TYPES = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


def _file(weights):
    """The GGUFWeights under a chain of wrappers (GgufBlockWeights, models/moe_weights.py's MappedWeights)."""
    while weights is not None and not hasattr(weights, "raw_blocks"):
        weights = getattr(weights, "inner", None)
    return weights


def load_report(graph: Graph, weights: WeightSource) -> str:
    """Two lines for the load log: the GGUF tensors the graph computes in their block format (by
    type), and the file's other quantised tensors, dequantised at load; layer indices folded
    (model.layers.*.mlp.down_proj). "" for a source that is not a GGUF."""
    src = _file(weights)
    if src is None:
        return ""
    read = {name for t in graph.weights for name, _ in (t.parts or ((t.name, 0),))}
    kept: Counter = Counter()
    kept_names, deq = set(), set()
    for name in src.names():
        qtype = src.ggml_type(name).name
        if qtype in _PLAIN_TYPES:
            continue
        module = name.removesuffix(".weight")
        stacked = re.sub(r"\.experts\.(gate|up)_proj$", ".experts.gate_up_proj", module)  # expert_blocks'
        if module + SUFFIX in read or stacked + SUFFIX in read:
            kept[qtype] += 1
            kept_names.add(_LAYER.sub(".layers.*.", module))
        else:
            deq.add(f"{_LAYER.sub('.layers.*.', name)} ({qtype})")
    return (f"GGUF: {sum(kept.values())} tensors stay in their block format, dequantised inside the GEMMs "
            f"({', '.join(f'{q}: {c}' for q, c in sorted(kept.items())) or 'none'}): "
            f"{', '.join(sorted(kept_names)) or '-'}\n"
            f"GGUF: quantised tensors dequantised at load: {', '.join(sorted(deq)) or 'none'}")
