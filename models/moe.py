"""The sparse MoE block of Qwen3-MoE, Qwen3.5/3.6-MoE and Qwen3-Next (../shared/specs/qwen3_5.md
7.2), shared by the graph builders of models/qwen3_moe.py and models/qwen3_5.py:

    logits   = linear(x, mlp.gate.weight)                     # [T, E]
    ids, w   = moe_router(logits; k, norm_topk_prob)          # [T, k] each
    routed   = moe_experts(x, ids, w, experts.gate_up_proj, experts.down_proj)        # [T, H]
    shared   = sigmoid_mul(MLP_shared(x), linear(x, shared_expert_gate.weight))    # [T, H] * [T, 1]
    out      = routed + shared                                # the shared expert only where I_s > 0

The router and the shared expert's gate, up and gate-scalar GEMMs are plain linears on the same
x, so passes/merge_parallel_linears.py stacks them into one GEMM (one read of x).

The experts are graph weights under transformers' stacked names, whatever the checkpoint holds:
models/moe_weights.py builds them from per-expert or GGUF tensors at load.

Quantised experts: a GGUF's stay in their blocks (moe_experts_gguf, models/gguf_quant.py); a
block-wise FP8 checkpoint's (Qwen3-30B-A3B-FP8, Qwen3.6-35B-A3B-FP8: per-expert e4m3 weights with
f32 weight_scale_inv per [bn, bk] block) stay e4m3, stacked per layer with their stacked scales
(`{GATE_UP}.weight_scale_inv` [E, 2I/bn, H/bk], `{DOWN}.weight_scale_inv` [E, H/bn, I/bk]), and run
W8A8 as the dense FP8 linears do (moe_experts_fp8, graph/fp8_ops.py: x quantised once per token per
bk columns by a quant_fp8 node, the SiLU-and-mul intermediate per assignment). The shared expert's
linears are FP8 linears where the config quantises them; the router and shared_expert_gate are
plain linears (the published FP8 checkpoints keep them bf16; one stored in FP8 is refused by name:
models/fp8_weights.py). A ModelOpt NVFP4 checkpoint's experts stay packed (two e2m1 a byte) with
their e4m3 block scales and per-tensor scales, stacked per layer, and run W4A16 as its dense linears
do (moe_experts_nvfp4, graph/nvfp4_ops.py). Other quantised MoE experts (FP8 with per-channel or
per-tensor scales, online FP8) are refused in one sentence naming the format.
"""
from __future__ import annotations

from kiln.errors import UnsupportedQuantizationError
from kiln.graph import DType, Graph, Tensor
from kiln.models.config import ModelConfig
from kiln.models.gguf_quant import gguf_experts
from kiln.models.fp8_linear import project, quantize_input
from kiln.models.nvfp4_linear import linear_or_nvfp4
from kiln.models.quant_config import MIN_SCALE_GROUP, Fp8Config

GATE_UP = "mlp.experts.gate_up_proj"  # [E, 2I, H]: each expert's gate rows, then its up rows
DOWN = "mlp.experts.down_proj"  # [E, H, I]
SCALE = ".weight_scale_inv"  # block-wise FP8 experts: {GATE_UP}.weight_scale_inv [E, 2I/bn, H/bk], {DOWN}'s


def _linear(g: Graph, x: Tensor, name: str, n_out: int, n_in: int, dtype: DType, node: str) -> Tensor:
    return g.call1("linear", x, g.weight(name, dtype, (n_out, n_in)), name=node)


def dense_mlp(g: Graph, x: Tensor, p: str, n: str, width: int, hidden: int, dtype: DType, quant=None) -> Tensor:
    """down(silu(gate(x)) * up(x)) with weights {p}.gate_proj/up_proj [width, H], down_proj [H, width]
    (node names {n}.gate_proj, ... as the dense decoders name theirs); quant: a ModelOpt NVFP4
    checkpoint's config (models/nvfp4_linear.py) or an FP8 one's (models/fp8_linear.py: gate and up
    share one quant_fp8 of x, as the dense decoders' do), None for plain weights."""
    if isinstance(quant, Fp8Config):
        gate, up = project(g, quant, x, [(f"{p}.gate_proj", width, f"{n}.gate_proj"),
                                         (f"{p}.up_proj", width, f"{n}.up_proj")], hidden, dtype, False,
                           f"{n}.gate_up_quant")
        act = g.call1("mul", g.call1("silu", gate, name=f"{n}.silu"), up, name=f"{n}.act")
        (down,) = project(g, quant, act, [(f"{p}.down_proj", hidden, f"{n}.down_proj")], width, dtype, False,
                          f"{n}.down_quant")
        return down
    if quant is not None:
        gate = linear_or_nvfp4(g, quant, x, f"{p}.gate_proj", width, hidden, dtype, False, f"{n}.gate_proj")
        up = linear_or_nvfp4(g, quant, x, f"{p}.up_proj", width, hidden, dtype, False, f"{n}.up_proj")
        act = g.call1("mul", g.call1("silu", gate, name=f"{n}.silu"), up, name=f"{n}.act")
        return linear_or_nvfp4(g, quant, act, f"{p}.down_proj", hidden, width, dtype, False, f"{n}.down_proj")
    gate = _linear(g, x, f"{p}.gate_proj.weight", width, hidden, dtype, f"{n}.gate_proj")
    up = _linear(g, x, f"{p}.up_proj.weight", width, hidden, dtype, f"{n}.up_proj")
    act = g.call1("mul", g.call1("silu", gate, name=f"{n}.silu"), up, name=f"{n}.act")
    return _linear(g, act, f"{p}.down_proj.weight", hidden, width, dtype, f"{n}.down_proj")


def moe_block(g: Graph, cfg: ModelConfig, p: str, n: str, x: Tensor, dtype: DType) -> Tensor:
    """The layer's MoE MLP on x [T, H] -> [T, H]; p: the layer's weight prefix (model.layers.{i}),
    n: its node prefix (layers.{i})."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    logits = _linear(g, x, f"{p}.mlp.gate.weight", E, H, dtype, f"{n}.router")  # [T, E]
    ids, weights = g.call("moe_router", [logits], name=f"{n}.topk", top_k=cfg.num_experts_per_tok,
                          renormalize=cfg.norm_topk_prob)
    blocks = gguf_experts(g, cfg.quantization, p, E, I, H) if getattr(cfg.quantization, "weight", None) == "gguf" \
        else None
    q = cfg.quantization if isinstance(cfg.quantization, Fp8Config) else None
    nv = cfg.quantization if getattr(cfg.quantization, "weight", None) == "nvfp4" else None
    if blocks is not None:  # a GGUF's experts in their block formats (models/gguf_quant.py)
        w13, w2, qtypes = blocks
        y = g.call1("moe_experts_gguf", x, ids, weights, w13, w2, qtypes=qtypes, name=f"{n}.experts")
    elif q is not None and q.quantizes(f"{p}.mlp.experts.0.gate_proj"):
        y = _fp8_experts(g, q, p, n, x, ids, weights, E, I, H, dtype)
    elif nv is not None and nv.quantizes(f"{p}.mlp.experts.0.gate_proj"):
        y = _nvfp4_experts(g, nv, p, n, x, ids, weights, E, I, H)
    else:
        w13 = g.weight(f"{p}.{GATE_UP}", dtype, (E, 2 * I, H))
        w2 = g.weight(f"{p}.{DOWN}", dtype, (E, H, I))
        y = g.call1("moe_experts", x, ids, weights, w13, w2, name=f"{n}.experts")
    ish = cfg.shared_expert_intermediate_size
    if not ish:
        return y
    shared = dense_mlp(g, x, f"{p}.mlp.shared_expert", f"{n}.shared_expert", ish, H, dtype, quant=q or nv)
    sg = _linear(g, x, f"{p}.mlp.shared_expert_gate.weight", 1, H, dtype, f"{n}.shared_expert_gate")  # [T, 1]
    # sigmoid rounded to the activation dtype, then the product (HF: F.sigmoid(gate(x)) * out, bf16)
    shared = g.call1("sigmoid_mul", shared, sg, name=f"{n}.shared_expert_scale")
    return g.call1("add", y, shared, name=f"{n}.moe_out")


def _fp8_experts(g: Graph, q: Fp8Config, p: str, n: str, x: Tensor, ids: Tensor, weights: Tensor, E: int, I: int,
                 H: int, dtype: DType) -> Tensor:
    """A block-wise FP8 checkpoint's experts, kept in e4m3 and stacked per layer as the bf16 ones
    are (models/moe_weights.py stacks their weight_scale_inv likewise): moe_experts_fp8 (W8A8,
    graph/fp8_ops.py) on x quantised once per token per bk columns."""
    bn, bk = q.block
    if H % bk or I % bk or I % bn:
        raise UnsupportedQuantizationError(
            f"block-wise FP8 experts with weight_block_size {list(q.block)} on {p}.mlp.experts, whose hidden size {H} "
            f"and moe_intermediate_size {I} are not multiples of the block, are not supported by kiln")
    xq = quantize_input(g, q, x, [f"{p}.mlp.experts"], H, f"{n}.experts_quant")
    w13 = g.weight(f"{p}.{GATE_UP}", DType.fp8e4m3, (E, 2 * I, H))
    s13 = g.weight(f"{p}.{GATE_UP}{SCALE}", DType.f32, (E, 2 * I // bn, H // bk))
    w2 = g.weight(f"{p}.{DOWN}", DType.fp8e4m3, (E, H, I))
    s2 = g.weight(f"{p}.{DOWN}{SCALE}", DType.f32, (E, -(-H // bn), I // bk))
    return g.call1("moe_experts_fp8", *xq, ids, weights, w13, s13, w2, s2, block=(bn, bk), out_dtype=str(dtype),
                   min_scale=MIN_SCALE_GROUP, name=f"{n}.experts")


def _nvfp4_experts(g: Graph, nv, p: str, n: str, x: Tensor, ids: Tensor, weights: Tensor, E: int, I: int,
                   H: int) -> Tensor:
    """A ModelOpt NVFP4 checkpoint's experts, packed e2m1 stacked per layer with their stacked
    scales (models/moe_weights.py): moe_experts_nvfp4 (W4A16, graph/nvfp4_ops.py)."""
    group = nv.group_size
    if H % group or I % group:
        raise UnsupportedQuantizationError(
            f"NVFP4 experts on {p}.mlp.experts, whose hidden size {H} and moe_intermediate_size {I} are not "
            f"multiples of {group}, are not supported by kiln")
    g.attrs.setdefault("quantization", "modelopt NVFP4")  # models/fp8_weights.py says it in its refusals
    w13 = g.weight(f"{p}.{GATE_UP}", DType.u8, (E, 2 * I, H // 2))
    s13 = g.weight(f"{p}.{GATE_UP}.weight_scale", DType.fp8e4m3, (E, 2 * I, H // group))
    g13 = g.weight(f"{p}.{GATE_UP}.weight_scale_2", DType.f32, (E, 2))
    w2 = g.weight(f"{p}.{DOWN}", DType.u8, (E, H, I // 2))
    s2 = g.weight(f"{p}.{DOWN}.weight_scale", DType.fp8e4m3, (E, H, I // group))
    g2 = g.weight(f"{p}.{DOWN}.weight_scale_2", DType.f32, (E, 1))
    return g.call1("moe_experts_nvfp4", x, ids, weights, w13, s13, g13, w2, s2, g2, group=group,
                   name=f"{n}.experts")


def mlp(g: Graph, cfg: ModelConfig, i: int, x: Tensor, dtype: DType) -> Tensor:
    """Layer i's MLP: the MoE block where cfg.layer_is_moe(i) (decoder_sparse_step, mlp_only_layers),
    else the dense one of intermediate_size."""
    p, n = f"model.layers.{i}", f"layers.{i}"
    if cfg.layer_is_moe(i):
        q = cfg.quantization
        if q is not None and q.weight not in ("gguf", "nvfp4") and not (isinstance(q, Fp8Config)
                                                                          and q.weight == "block"):
            what = "online FP8" if getattr(q, "online", False) else f"FP8 with {q.weight}-wise weight scales"
            raise UnsupportedQuantizationError(f"{q.method} {what} MoE layers ({p}.mlp) are not supported by kiln "
                                               f"(its MoE experts run block-wise FP8, NVFP4 and GGUF)")
        return moe_block(g, cfg, p, n, x, dtype)
    q = cfg.quantization
    q = q if isinstance(q, Fp8Config) or getattr(q, "weight", None) == "nvfp4" else None
    return dense_mlp(g, x, f"{p}.mlp", n, cfg.intermediate_size, cfg.hidden_size, dtype, quant=q)
