"""Qwen3.5 / Qwen3.6 and Qwen3-Next: hybrids of Gated DeltaNet and gated full attention
(../shared/specs/qwen3_5.md). One engine step over a flat batch of T tokens, as models/llama.py,
with per-request state for the GDN layers.

Architectures: Qwen3_5ForConditionalGeneration (the layout Qwen3.5/3.6 checkpoints ship: the
text tower under `model.language_model.`; the vision tower and the MTP head are skipped, text
only), Qwen3_5ForCausalLM (`model.`), and Qwen3NextForCausalLM (`model.`, its GDN input
projections interleaved by key-head group, converted to the flat layout at load: spec 6.1).
The graph names every weight as a Qwen3_5ForCausalLM checkpoint does; `adapt_weights` maps
those names onto the files of the other two. The MoE variants (Qwen3_5MoeForConditionalGeneration,
Qwen3_5MoeForCausalLM, Qwen3-Next with experts) take models/moe.py's sparse block (routed experts
and the gated shared expert) in every layer `layer_is_moe` picks; their experts are stacked at
load from any layout (models/moe_weights.py).

Step inputs: models/llama.py's, plus state_slots: i32[S], each sequence's GDN state slot.
State: kv_cache.{i} [NB, 2, block_size, Hkv, D] per full-attention layer; gdn_conv.{i}
[NS, conv_dim, K-1] (the activation dtype) and gdn_ssm.{i} [NS, Hv, dk, dv] (f32) per GDN layer.
"""
from __future__ import annotations

import logging

import numpy as np

from kiln.errors import InvalidModelError
from kiln.graph import OPS, DType, Graph, Tensor
from kiln.models import moe
from kiln.models.config import ModelConfig
from kiln.models.fp8_linear import project
from kiln.models.llama import STEP_INPUTS
from kiln.models.mapped_weights import MappedWeights
from kiln.models.nvfp4_linear import linear_or_nvfp4
from kiln.models.quant_config import Fp8Config
from kiln.models.moe_weights import expert_weights
from kiln.models.weights import WeightSource

log = logging.getLogger("kiln.models")

HYBRID_STEP_INPUTS = {**STEP_INPUTS, "state_slots": ("S",)}


def build_graph(cfg: ModelConfig, *, dtype: DType = DType.f32, block_size: int = 16,
                kv_cache_dtype: DType | None = None) -> Graph:
    g = Graph(OPS, name=cfg.architecture)
    kv_dtype = DType(kv_cache_dtype or dtype)
    g.attrs.update(block_size=block_size, config_hash=cfg.compute_hash(), kv_cache_dtype=str(kv_dtype),
                   hybrid=True)
    inp = {name: g.input(name, DType.i32, shape) for name, shape in HYBRID_STEP_INPUTS.items()}
    H, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
    embed = g.weight("model.embed_tokens.weight", dtype, (cfg.vocab_size, H))
    h = g.call1("embedding", inp["input_ids"], embed, name="embed")
    for i in range(cfg.num_hidden_layers):
        p, n = f"model.layers.{i}", f"layers.{i}"
        x = g.call1("rms_norm", h, g.weight(f"{p}.input_layernorm.weight", dtype, (H,)), eps=eps, offset=off,
                    name=f"{n}.input_norm")
        if cfg.layer_type(i) == "full_attention":
            o = _gated_attention(g, cfg, p, n, i, x, inp, dtype, kv_dtype, block_size)
        else:
            o = _gated_deltanet(g, cfg, p, n, i, x, inp, dtype)
        h = g.call1("add", h, o, name=f"{n}.attn_residual")
        x = g.call1("rms_norm", h, g.weight(f"{p}.post_attention_layernorm.weight", dtype, (H,)), eps=eps,
                    offset=off, name=f"{n}.post_attn_norm")
        # the sparse MoE block (with its shared expert) where layer_is_moe, else the dense MLP
        h = g.call1("add", h, moe.mlp(g, cfg, i, x, dtype), name=f"{n}.mlp_residual")
    h = g.call1("gather_rows", h, inp["logits_indices"], name="gather_logits_rows")
    h = g.call1("rms_norm", h, g.weight("model.norm.weight", dtype, (H,)), eps=eps, offset=off, name="final_norm")
    head = embed if cfg.tie_word_embeddings else g.weight("lm_head.weight", dtype, (cfg.vocab_size, H))
    logits = g.call1("linear", h, head, name="lm_head")
    if logits.dtype != DType.f32:
        logits = g.call1("cast", logits, dtype=DType.f32, name="logits_f32")
    g.mark_output(logits)
    g.verify()
    return g


def _project(g: Graph, cfg: ModelConfig, x: Tensor, specs: list[tuple[str, int, str]], n_in: int, dtype: DType,
             bias: bool, quant_name: str) -> list[Tensor]:
    """The linears in specs [(weight prefix, n_out, node name)], all reading x [T, n_in]: plain, NVFP4
    where a ModelOpt NVFP4 checkpoint quantises them (models/nvfp4_linear.py), or FP8 W8A8 where an
    FP8 checkpoint does (models/fp8_linear.py: the FP8 ones share one quant_fp8 of x, named
    quant_name, as vLLM's merged in_proj_qkvz / qkv_proj layers quantise their input once)."""
    if isinstance(cfg.quantization, Fp8Config):
        return project(g, cfg.quantization, x, specs, n_in, dtype, bias, quant_name)
    return [linear_or_nvfp4(g, cfg.quantization, x, prefix, n_out, n_in, dtype, bias, name)
            for prefix, n_out, name in specs]


def _linear(g: Graph, cfg: ModelConfig, x: Tensor, prefix: str, n_out: int, n_in: int, dtype: DType, bias: bool,
            name: str) -> Tensor:
    """One linear reading x (its input quantised by a quant_fp8 of its own in an FP8 checkpoint)."""
    return _project(g, cfg, x, [(prefix, n_out, name)], n_in, dtype, bias, f"{name}_quant")[0]


def _gated_attention(g: Graph, cfg: ModelConfig, p: str, n: str, i: int, x: Tensor, inp: dict, dtype: DType,
                     kv_dtype: DType, block_size: int) -> Tensor:
    """Spec 5: q_proj gives per head [query (D) | gate (D)]; (1 + w) q/k norms before a partial
    NeoX rope; the attention output times sigmoid(gate), then o_proj."""
    H, nh, nkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps, off, ab = cfg.rms_norm_eps, cfg.norm_offset, cfg.attention_bias
    qg, k, v = _project(g, cfg, x, [(f"{p}.self_attn.q_proj", nh * 2 * D, f"{n}.q_proj"),
                                    (f"{p}.self_attn.k_proj", nkv * D, f"{n}.k_proj"),
                                    (f"{p}.self_attn.v_proj", nkv * D, f"{n}.v_proj")], H, dtype, ab, f"{n}.qkv_quant")
    qg = g.call1("reshape", qg, shape=("T", nh, 2 * D), name=f"{n}.qg_heads")
    q = g.call1("slice_cols", qg, start=0, stop=D, name=f"{n}.q_heads")
    gate = g.call1("slice_cols", qg, start=D, stop=2 * D, name=f"{n}.gate_heads")
    k = g.call1("reshape", k, shape=("T", nkv, D), name=f"{n}.k_heads")
    v = g.call1("reshape", v, shape=("T", nkv, D), name=f"{n}.v_heads")
    q = g.call1("rms_norm", q, g.weight(f"{p}.self_attn.q_norm.weight", dtype, (D,)), eps=eps, offset=off,
                name=f"{n}.q_norm")
    k = g.call1("rms_norm", k, g.weight(f"{p}.self_attn.k_norm.weight", dtype, (D,)), eps=eps, offset=off,
                name=f"{n}.k_norm")
    rope = dict(theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim, is_neox=True, scaling=cfg.rope_scaling,
                max_position=cfg.max_position_embeddings)
    q = g.call1("rope", q, inp["positions"], name=f"{n}.q_rope", **rope)
    k = g.call1("rope", k, inp["positions"], name=f"{n}.k_rope", **rope)
    cache = g.state(f"kv_cache.{i}", kv_dtype, ("NB", 2, block_size, nkv, D))
    cache = g.call1("cache_write", k, v, cache, inp["slot_mapping"], name=f"{n}.cache_write")
    a = g.call1("paged_attention", q, cache, inp["block_table"], inp["seq_lens"], inp["query_start_loc"],
                scale=D ** -0.5, name=f"{n}.attn")
    a = g.call1("sigmoid_mul", a, gate, name=f"{n}.attn_gate")
    a = g.call1("reshape", a, shape=("T", nh * D), name=f"{n}.attn_flat")
    return _linear(g, cfg, a, f"{p}.self_attn.o_proj", H, nh * D, dtype, ab, f"{n}.o_proj")


def _gated_deltanet(g: Graph, cfg: ModelConfig, p: str, n: str, i: int, x: Tensor, inp: dict,
                    dtype: DType) -> Tensor:
    """Spec 6: projections, causal conv + SiLU over q|k|v, gates, l2-normed q/k, the gated delta
    rule from the request's state slot, the gated output norm, out_proj."""
    H, eps = cfg.hidden_size, cfg.rms_norm_eps
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    kd, vd, cd, kc = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
    la = f"{p}.linear_attn"
    # Qwen3.5/3.6 FP8 checkpoints leave in_proj_b/in_proj_a (hv rows) in bf16 (modules_to_not_convert;
    # vLLM: "ba_proj doesn't support blockwise fp8 quantization"): those stay plain linears of x
    qkv, z, b, a = _project(g, cfg, x, [(f"{la}.in_proj_qkv", cd, f"{n}.in_proj_qkv"),
                                        (f"{la}.in_proj_z", vd, f"{n}.in_proj_z"),
                                        (f"{la}.in_proj_b", hv, f"{n}.in_proj_b"),
                                        (f"{la}.in_proj_a", hv, f"{n}.in_proj_a")], H, dtype, False,
                            f"{n}.in_proj_quant")
    conv_state = g.state(f"gdn_conv.{i}", dtype, ("NS", cd, kc - 1))
    xc, _ = g.call("causal_conv1d", [qkv, conv_state, g.weight(f"{la}.conv1d.weight", dtype, (cd, 1, kc)),
                                     inp["seq_lens"], inp["query_start_loc"], inp["state_slots"]],
                   name=f"{n}.conv1d")
    xc = g.call1("silu", xc, name=f"{n}.conv_silu")
    q = g.call1("reshape", g.call1("slice_cols", xc, start=0, stop=kd, name=f"{n}.q_cols"),
                shape=("T", hk, dk), name=f"{n}.q_heads")
    k = g.call1("reshape", g.call1("slice_cols", xc, start=kd, stop=2 * kd, name=f"{n}.k_cols"),
                shape=("T", hk, dk), name=f"{n}.k_heads")
    v = g.call1("reshape", g.call1("slice_cols", xc, start=2 * kd, stop=cd, name=f"{n}.v_cols"),
                shape=("T", hv, dv), name=f"{n}.v_heads")
    # A_log and dt_bias stay f32 whatever the model's dtype (vLLM creates A_log in f32)
    gate, beta = g.call("gdn_gates", [a, b, g.weight(f"{la}.A_log", DType.f32, (hv,)),
                                      g.weight(f"{la}.dt_bias", DType.f32, (hv,))], name=f"{n}.gates")
    q = g.call1("l2norm", q, eps=1e-6, scale=dk ** -0.5, name=f"{n}.q_l2norm")
    k = g.call1("l2norm", k, eps=1e-6, name=f"{n}.k_l2norm")
    ssm = g.state(f"gdn_ssm.{i}", DType.f32, ("NS", hv, dk, dv))
    o, _ = g.call("gated_delta_rule", [q, k, v, gate, beta, ssm, inp["seq_lens"], inp["query_start_loc"],
                                       inp["state_slots"]], name=f"{n}.delta_rule")
    z = g.call1("reshape", z, shape=("T", hv, dv), name=f"{n}.z_heads")
    o = g.call1("gated_rms_norm", o, z, g.weight(f"{la}.norm.weight", dtype, (dv,)), eps=eps, name=f"{n}.out_norm")
    o = g.call1("reshape", o, shape=("T", vd), name=f"{n}.out_flat")
    return _linear(g, cfg, o, f"{la}.out_proj", H, vd, dtype, False, f"{n}.out_proj")


# -- weights: the names of each checkpoint layout -> the graph's (Qwen3_5ForCausalLM's) --------

def adapt_weights(cfg: ModelConfig, weights: WeightSource) -> WeightSource:
    """The checkpoint's tensors under the graph's names (see the module docstring)."""
    names = list(weights.names())
    if cfg.architecture.endswith("ForConditionalGeneration"):
        prefix = "model.language_model."
        skipped = [nm for nm in names if nm.startswith(("model.visual.", "mtp."))]
        if skipped:
            log.info("text-only: skipping %d vision-tower and MTP tensors of %s", len(skipped), weights.path)
        rename = {("model." + nm[len(prefix):]): nm for nm in names if nm.startswith(prefix)}
        rename.update({nm: nm for nm in names if nm == "lm_head.weight"})
    else:
        skipped = [nm for nm in names if nm.startswith("mtp.")]
        if skipped:
            log.info("skipping %d MTP tensors of %s", len(skipped), weights.path)
        rename = {nm: nm for nm in names if not nm.startswith("mtp.")}
    derived: dict[str, tuple] = {}
    if cfg.architecture == "Qwen3NextForCausalLM":
        for i in range(cfg.num_hidden_layers):
            if cfg.layer_type(i) == "linear_attention":
                derived.update(_deinterleave(cfg, f"model.layers.{i}.linear_attn", rename))
    # stacked experts from any layout, block-wise FP8 ones with their scales (models/moe_weights.py)
    derived.update(expert_weights(cfg, rename, dtype=getattr(weights, "dtype", None)))
    return MappedWeights(weights, rename, derived)


def _deinterleave(cfg: ModelConfig, la: str, rename: dict[str, str]) -> dict[str, tuple]:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba, interleaved by key-head group, as Qwen3.5's flat
    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (spec 6.1's conversion)."""
    hk, hv, dk, dv, H = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim, cfg.hidden_size)
    r = hv // hk
    qkvz, ba = rename.pop(f"{la}.in_proj_qkvz.weight", None), rename.pop(f"{la}.in_proj_ba.weight", None)
    if qkvz is None or ba is None:
        missing = f"{la}.in_proj_qkvz.weight" if qkvz is None else f"{la}.in_proj_ba.weight"
        raise InvalidModelError(f"weight {missing!r} is missing from the model files")

    def split_qkvz(get):
        w = get(qkvz)
        if w.shape != (2 * hk * dk + 2 * hv * dv, H):
            raise InvalidModelError(f"weight {qkvz!r} has shape {list(w.shape)}, the config implies "
                                    f"{[2 * hk * dk + 2 * hv * dv, H]}")
        wy = w.reshape(hk, 2 * dk + 2 * r * dv, H)
        return np.split(wy, [dk, 2 * dk, 2 * dk + r * dv], axis=1)

    def split_ba(get):
        w = get(ba)
        if w.shape != (2 * hv, H):
            raise InvalidModelError(f"weight {ba!r} has shape {list(w.shape)}, the config implies {[2 * hv, H]}")
        return w.reshape(hk, 2 * r, H)

    def qkv(get):
        wq, wk, wv, _ = split_qkvz(get)
        return np.concatenate([wq.reshape(-1, H), wk.reshape(-1, H), wv.reshape(-1, H)])

    return {
        f"{la}.in_proj_qkv.weight": ((cfg.linear_conv_dim, H), qkv),
        f"{la}.in_proj_z.weight": ((hv * dv, H), lambda get: split_qkvz(get)[3].reshape(-1, H)),
        f"{la}.in_proj_b.weight": ((hv, H), lambda get: split_ba(get)[:, :r].reshape(-1, H)),
        f"{la}.in_proj_a.weight": ((hv, H), lambda get: split_ba(get)[:, r:].reshape(-1, H)),
    }
