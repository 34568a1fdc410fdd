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
"""
from __future__ import annotations

from kiln.errors import UnsupportedQuantizationError
from kiln.graph import DType, Graph, Tensor
from kiln.models.config import ModelConfig
from kiln.models.gguf_quant import gguf_experts
from kiln.models.fp8_linear import project
from kiln.models.nvfp4_linear import linear_or_nvfp4
from kiln.models.quant_config import Fp8Config

GATE_UP = "mlp.experts.gate_up_proj"  # [E, 2I, H]: each expert's gate rows, then its up rows
DOWN = "mlp.experts.down_proj"  # [E, H, I]


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
    if blocks is not None:  # a GGUF's experts in their block formats (models/gguf_quant.py)
        w13, w2, qtypes = blocks
        y = g.call1("moe_experts_gguf", x, ids, weights, w13, w2, qtypes=qtypes, name=f"{n}.experts")
    else:
        w13 = g.weight(f"{p}.{GATE_UP}", dtype, (E, 2 * I, H))
        w2 = g.weight(f"{p}.{DOWN}", dtype, (E, H, I))
        y = g.call1("moe_experts", x, ids, weights, w13, w2, name=f"{n}.experts")
    ish = cfg.shared_expert_intermediate_size
    if not ish:
        return y
    shared = dense_mlp(g, x, f"{p}.mlp.shared_expert", f"{n}.shared_expert", ish, H, dtype)
    sg = _linear(g, x, f"{p}.mlp.shared_expert_gate.weight", 1, H, dtype, f"{n}.shared_expert_gate")  # [T, 1]
    # sigmoid rounded to the activation dtype, then the product (HF: F.sigmoid(gate(x)) * out, bf16)
    shared = g.call1("sigmoid_mul", shared, sg, name=f"{n}.shared_expert_scale")
    return g.call1("add", y, shared, name=f"{n}.moe_out")


def mlp(g: Graph, cfg: ModelConfig, i: int, x: Tensor, dtype: DType) -> Tensor:
    """Layer i's MLP: the MoE block where cfg.layer_is_moe(i) (decoder_sparse_step, mlp_only_layers),
    else the dense one of intermediate_size."""
    p, n = f"model.layers.{i}", f"layers.{i}"
    if cfg.layer_is_moe(i):
        if cfg.quantization is not None and cfg.quantization.weight != "gguf":
            raise UnsupportedQuantizationError(f"{cfg.quantization.method} quantised MoE layers ({p}.mlp) are not "
                                               f"supported by kiln")
        return moe_block(g, cfg, p, n, x, dtype)
    q = cfg.quantization
    q = q if isinstance(q, Fp8Config) or getattr(q, "weight", None) == "nvfp4" else None
    return dense_mlp(g, x, f"{p}.mlp", n, cfg.intermediate_size, cfg.hidden_size, dtype, quant=q)
