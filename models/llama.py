"""Llama: config -> the Graph of one engine step over a flat batch of T tokens.

Qwen3 is this graph plus per-head q/k RMSNorm (models/qwen3.py), so the decoder
builder takes that as a flag rather than duplicating the layer.

Step inputs (see runtime/worker/input_batch.py for how they are filled):
  input_ids, positions, slot_mapping: i32[T]   block_table: i32[S, MB]
  seq_lens: i32[S]   query_start_loc: i32[S1] (S1 = S + 1)   logits_indices: i32[L]
State: kv_cache.{i}: [NB, 2, block_size, Hkv, D] per layer, in `kv_cache_dtype` (default: the
model's dtype; fp8e4m3 is vLLM's --kv-cache-dtype fp8: K and V stored with scale 1.0, read back
into the model's dtype by the attention). Output: logits f32[L, V].
"""
from __future__ import annotations

from typing import Callable

from kiln.graph import OPS, DType, Graph, Tensor
from kiln.models.config import ModelConfig
from kiln.models.fp8_linear import project

MlpBuilder = Callable[[Graph, ModelConfig, int, Tensor, DType], Tensor]

STEP_INPUTS = {
    "input_ids": ("T",), "positions": ("T",), "slot_mapping": ("T",),
    "block_table": ("S", "MB"), "seq_lens": ("S",), "query_start_loc": ("S1",),
    "logits_indices": ("L",),
}


def build_graph(cfg: ModelConfig, *, dtype: DType = DType.f32, block_size: int = 16,
                kv_cache_dtype: DType | None = None) -> Graph:
    return build_decoder(cfg, dtype=dtype, block_size=block_size, qk_norm=False, kv_cache_dtype=kv_cache_dtype)


def build_decoder(cfg: ModelConfig, *, dtype: DType, block_size: int, qk_norm: bool,
                  kv_cache_dtype: DType | None = None, mlp: MlpBuilder | None = None) -> Graph:
    """mlp(g, cfg, layer, x, dtype) -> [T, H]: the layer's MLP (models/moe.py's for Qwen3-MoE);
    None: the dense SwiGLU MLP."""
    g = Graph(OPS, name=cfg.architecture)
    kv_dtype = DType(kv_cache_dtype or dtype)
    g.attrs.update(block_size=block_size, config_hash=cfg.compute_hash(), kv_cache_dtype=str(kv_dtype))
    inp = {name: g.input(name, DType.i32, shape) for name, shape in STEP_INPUTS.items()}
    embed = g.weight("model.embed_tokens.weight", dtype, (cfg.vocab_size, cfg.hidden_size))
    h = g.call1("embedding", inp["input_ids"], embed, name="embed")
    for i in range(cfg.num_hidden_layers):
        h = _decoder_layer(g, cfg, i, h, inp, dtype, kv_dtype, block_size, qk_norm, mlp)
    # Only the rows that sample need the final norm and the LM head.
    h = g.call1("gather_rows", h, inp["logits_indices"], name="gather_logits_rows")
    h = g.call1("rms_norm", h, g.weight("model.norm.weight", dtype, (cfg.hidden_size,)),
                eps=cfg.rms_norm_eps, name="final_norm")
    if cfg.tie_word_embeddings:
        logits = g.call1("linear", h, embed, name="lm_head")
    elif getattr(cfg.quantization, "weight", None) == "gguf":  # an untied GGUF head may stay in its blocks
        (logits,) = project(g, cfg.quantization, h, [("lm_head", cfg.vocab_size, "lm_head")], cfg.hidden_size,
                            dtype, False, "lm_head_quant")
    else:
        logits = g.call1("linear", h, g.weight("lm_head.weight", dtype, (cfg.vocab_size, cfg.hidden_size)),
                         name="lm_head")
    if logits.dtype != DType.f32:
        logits = g.call1("cast", logits, dtype=DType.f32, name="logits_f32")
    g.mark_output(logits)
    g.verify()
    return g


def _linear(g: Graph, x: Tensor, prefix: str, n_out: int, n_in: int, dtype: DType, bias: bool,
            name: str) -> Tensor:
    w = g.weight(f"{prefix}.weight", dtype, (n_out, n_in))
    b = g.weight(f"{prefix}.bias", dtype, (n_out,)) if bias else None
    return g.call1("linear", x, w, *([b] if b is not None else []), name=name)


def _decoder_layer(g: Graph, cfg: ModelConfig, i: int, h: Tensor, inp: dict, dtype: DType, kv_dtype: DType,
                   block_size: int, qk_norm: bool, mlp: MlpBuilder | None) -> Tensor:
    p, n = f"model.layers.{i}", f"layers.{i}"
    H, nh, nkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    x = g.call1("rms_norm", h, g.weight(f"{p}.input_layernorm.weight", dtype, (H,)), eps=eps,
                name=f"{n}.input_norm")
    ab = cfg.attention_bias
    # plain or FP8 as the checkpoint says (models/fp8_linear.py); q, k, v share one quantised x
    q, k, v = project(g, cfg.quantization, x, [(f"{p}.self_attn.{c}_proj", w, f"{n}.{c}_proj") for c, w in
                                              (("q", nh * D), ("k", nkv * D), ("v", nkv * D))],
                      H, dtype, ab, f"{n}.qkv_quant")
    q = g.call1("reshape", q, shape=("T", nh, D), name=f"{n}.q_heads")   # [T, nh, D]
    k = g.call1("reshape", k, shape=("T", nkv, D), name=f"{n}.k_heads")  # [T, nkv, D]
    v = g.call1("reshape", v, shape=("T", nkv, D), name=f"{n}.v_heads")
    if qk_norm:
        q = g.call1("rms_norm", q, g.weight(f"{p}.self_attn.q_norm.weight", dtype, (D,)), eps=eps,
                    name=f"{n}.q_norm")
        k = g.call1("rms_norm", k, g.weight(f"{p}.self_attn.k_norm.weight", dtype, (D,)), eps=eps,
                    name=f"{n}.k_norm")
    rope = dict(theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim, is_neox=cfg.rope_is_neox,
                scaling=cfg.rope_scaling, max_position=cfg.max_position_embeddings)
    q = g.call1("rope", q, inp["positions"], name=f"{n}.q_rope", **rope)
    k = g.call1("rope", k, inp["positions"], name=f"{n}.k_rope", **rope)
    cache = g.state(f"kv_cache.{i}", kv_dtype, ("NB", 2, block_size, nkv, D))
    cache = g.call1("cache_write", k, v, cache, inp["slot_mapping"], name=f"{n}.cache_write")
    a = g.call1("paged_attention", q, cache, inp["block_table"], inp["seq_lens"],
                inp["query_start_loc"], scale=D ** -0.5, name=f"{n}.attn")
    a = g.call1("reshape", a, shape=("T", nh * D), name=f"{n}.attn_flat")
    (o,) = project(g, cfg.quantization, a, [(f"{p}.self_attn.o_proj", H, f"{n}.o_proj")], nh * D, dtype, ab,
                   f"{n}.o_quant")
    h = g.call1("add", h, o, name=f"{n}.attn_residual")
    x = g.call1("rms_norm", h, g.weight(f"{p}.post_attention_layernorm.weight", dtype, (H,)),
                eps=eps, name=f"{n}.post_attn_norm")
    if mlp is not None:
        return g.call1("add", h, mlp(g, cfg, i, x, dtype), name=f"{n}.mlp_residual")
    I, mb = cfg.intermediate_size, cfg.mlp_bias
    gate, up = project(g, cfg.quantization, x, [(f"{p}.mlp.gate_proj", I, f"{n}.gate_proj"),
                                                (f"{p}.mlp.up_proj", I, f"{n}.up_proj")], H, dtype, mb,
                       f"{n}.gate_up_quant")
    act = g.call1("mul", g.call1("silu", gate, name=f"{n}.silu"), up, name=f"{n}.act")
    (down,) = project(g, cfg.quantization, act, [(f"{p}.mlp.down_proj", H, f"{n}.down_proj")], I, dtype, mb,
                      f"{n}.down_quant")
    return g.call1("add", h, down, name=f"{n}.mlp_residual")
