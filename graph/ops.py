"""The op library: shape inference and the numpy reference of every op.

References compute in float32 whatever the storage dtype and return the
declared output dtype. Shapes in comments use the symbols of graph/tensor.py.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import numpy as np

from kiln.graph.dtype import DType, to_numpy
from kiln.graph.op import OpRegistry
from kiln.graph.paged_attention_ref import paged_attention_ref
from kiln.graph.rope import rope_parameters
from kiln.graph.tensor import Tensor

OPS = OpRegistry()

_f32 = np.float32
_FP8 = to_numpy(DType.fp8e4m3)
_FP8_MAX = _f32(448.0)  # e4m3fn's largest finite value


def _like(i: int = 0):
    def infer(ins: Sequence[Tensor], attrs: Mapping[str, Any]):
        return [(ins[i].dtype, ins[i].shape)]
    return infer


def _as(x: np.ndarray, like: np.ndarray) -> np.ndarray:
    return x if x.dtype == like.dtype else x.astype(like.dtype)


# -- embedding and projections -------------------------------------------------------

@OPS.register("embedding", inputs=2,
              infer=lambda ins, a: [(ins[1].dtype, (ins[0].shape[0], ins[1].shape[1]))])
def embedding(ids, table):
    """ids: i32[T], table: [V, H] -> [T, H]"""
    return table[ids]


def _infer_linear(ins, attrs):
    x, w = ins[0], ins[1]
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: x has K={x.shape[-1]}, weight {w.name} has K={w.shape[1]}")
    out = DType(attrs["out_dtype"]) if attrs.get("out_dtype") else x.dtype
    return [(out, (*x.shape[:-1], w.shape[0]))]


@OPS.register("linear", inputs=(2, 3), infer=_infer_linear)
def linear(x, w, bias=None, *, out_dtype=None):
    """x: [..., K], w: [N, K] (the HF layout), bias: [N] -> [..., N]; out_dtype
    (e.g. f32 logits from bf16 operands) stores the f32 accumulator without rounding to x's dtype."""
    y = x.astype(_f32, copy=False) @ w.astype(_f32, copy=False).T
    if bias is not None:
        y += bias.astype(_f32, copy=False)
    return y.astype(to_numpy(DType(out_dtype))) if out_dtype else _as(y, x)


@OPS.register("gather_rows", inputs=2,
              infer=lambda ins, a: [(ins[0].dtype, (ins[1].shape[0], *ins[0].shape[1:]))])
def gather_rows(x, idx):
    """x: [T, ...], idx: i32[L] -> [L, ...]; picks the rows whose logits are sampled"""
    return x[idx]


# -- elementwise and norms -----------------------------------------------------------

@OPS.register("rms_norm", inputs=2, infer=_like())
def rms_norm(x, w, *, eps: float, offset: float = 0.0):
    """x: [..., H], w: [H]. Normalises over the last dim (per-head q/k norm passes
    x: [T, heads, D]). offset=1 gives the Gemma/Qwen3-Next (1 + w) form."""
    xf = x.astype(_f32, copy=False)
    var = np.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * (1.0 / np.sqrt(var + _f32(eps)))
    # Llama-style: cast the normalised value to the storage dtype, then scale (HF LlamaRMSNorm)
    y = _as(y, x).astype(_f32, copy=False) * (w.astype(_f32) + _f32(offset))
    return _as(y, x)


@OPS.register("add", inputs=2, infer=_like())
def add(a, b):
    return _as(a.astype(_f32, copy=False) + b.astype(_f32, copy=False), a)


@OPS.register("mul", inputs=2, infer=_like())
def mul(a, b):
    return _as(a.astype(_f32, copy=False) * b.astype(_f32, copy=False), a)


def _silu(x):
    xf = x.astype(_f32, copy=False)
    return xf / (1.0 + np.exp(-xf))


@OPS.register("silu", inputs=1, infer=_like())
def silu(x):
    return _as(_silu(x), x)


@OPS.register("silu_mul", inputs=2, infer=_like())
def silu_mul(gate, up):
    """silu(gate) * up, the SwiGLU activation"""
    return _as(_silu(gate) * up.astype(_f32, copy=False), gate)


def _infer_linear_silu_mul(ins, attrs):
    x, w = ins
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear_silu_mul: x has K={x.shape[-1]}, weight {w.name} has K={w.shape[1]}")
    g = attrs["group"]
    if w.interleave != g or w.shape[0] % (2 * g):
        raise ValueError(f"linear_silu_mul: weight {w.name} must be a gate/up stack interleaved in groups of "
                         f"{g} rows (it has interleave={w.interleave}, {w.shape[0]} rows)")
    return [(x.dtype, (*x.shape[:-1], w.shape[0] // 2))]


@OPS.register("linear_silu_mul", inputs=2, infer=_infer_linear_silu_mul)
def linear_silu_mul(x, w, *, group: int):
    """silu_mul(gate, up) of linear(x, [Wg; Wu]), with w stored block-interleaved in groups of
    `group` rows (graph/layout.py): [g x group, u x group, ...]. The GEMM's output is rounded
    to x's dtype, its columns regrouped into gate and up, then silu_mul (passes/fuse_gate_up_silu.py)."""
    y = linear(x, w)
    lead = y.shape[:-1]
    y = y.reshape(*lead, -1, 2, group)
    gate = np.ascontiguousarray(y[..., 0, :]).reshape(*lead, -1)
    up = np.ascontiguousarray(y[..., 1, :]).reshape(*lead, -1)
    return silu_mul(gate, up)


def _infer_reshape(ins, attrs):
    return [(ins[0].dtype, tuple(attrs["shape"]))]


@OPS.register("reshape", inputs=1, infer=_infer_reshape)
def reshape(x, *, shape):
    """At most one symbolic dim; it becomes -1."""
    return x.reshape(tuple(d if isinstance(d, int) else -1 for d in shape))


def _infer_slice_cols(ins, attrs):
    start, stop = attrs["start"], attrs["stop"]
    width = ins[0].shape[-1]
    if not (isinstance(width, int) and 0 <= start < stop <= width):
        raise ValueError(f"slice_cols: [{start}, {stop}) is not inside {ins[0].name}'s {width} columns")
    return [(ins[0].dtype, (*ins[0].shape[:-1], stop - start))]


@OPS.register("slice_cols", inputs=1, infer=_infer_slice_cols)
def slice_cols(x, *, start: int, stop: int):
    """x[..., start:stop]: a view (its rows keep x's stride), e.g. q out of a merged qkv."""
    return x[..., start:stop]


@OPS.register("cast", inputs=1, infer=lambda ins, a: [(DType(a["dtype"]), ins[0].shape)])
def cast(x, *, dtype):
    return x.astype(to_numpy(DType(dtype)))


# -- rotary embedding ----------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _inv_freq(rotary_dim: int, theta: float, scaling: tuple, max_position: int):
    return rope_parameters(rotary_dim, theta, dict(scaling), max_position)


@OPS.register("rope", inputs=2, infer=_like())
def rope(x, positions, *, theta: float, rotary_dim: int, is_neox: bool = True,
         scaling: tuple = (), max_position: int = 2048):
    """x: [T, heads, D], positions: i32[T]. Rotates the first rotary_dim dims.
    neox layout pairs dim i with i + rotary_dim/2; gpt-j pairs 2i with 2i+1."""
    inv_freq, attn_factor = _inv_freq(rotary_dim, theta, scaling, max_position)
    ang = positions.astype(_f32)[:, None] * inv_freq[None, :]  # [T, rd/2]
    cos = (np.cos(ang) * _f32(attn_factor))[:, None, :]
    sin = (np.sin(ang) * _f32(attn_factor))[:, None, :]
    xf = x.astype(_f32, copy=True)
    rot = xf[..., :rotary_dim]
    if is_neox:
        x1, x2 = rot[..., : rotary_dim // 2].copy(), rot[..., rotary_dim // 2:].copy()
        rot[..., : rotary_dim // 2] = x1 * cos - x2 * sin
        rot[..., rotary_dim // 2:] = x2 * cos + x1 * sin
    else:
        x1, x2 = rot[..., 0::2].copy(), rot[..., 1::2].copy()
        rot[..., 0::2] = x1 * cos - x2 * sin
        rot[..., 1::2] = x2 * cos + x1 * sin
    return _as(xf, x)


# -- paged KV cache and attention ----------------------------------------------------

@OPS.register("cache_write", inputs=4, inplace={0: 2}, infer=lambda ins, a: [(ins[2].dtype, ins[2].shape)])
def cache_write(k, v, cache, slot_mapping):
    """k, v: [T, Hkv, D]; cache: [NB, 2, BS, Hkv, D]; slot_mapping: i32[T] (block * BS + offset,
    -1 for padding). Writes in place and returns the cache (the new version of the state)."""
    bs = cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offs = slots // bs, slots % bs
    cache[blocks, 0, offs] = to_cache(k[valid], cache.dtype)
    cache[blocks, 1, offs] = to_cache(v[valid], cache.dtype)
    return cache


def to_cache(x: np.ndarray, dtype) -> np.ndarray:
    """K or V values in the cache's dtype. An fp8 cache (vLLM's --kv-cache-dtype fp8, scale 1.0)
    saturates to the largest finite value, as the GPU's cvt.rn.satfinite does and as vLLM's
    scaled_fp8_conversion clamps; e4m3fn has no infinity, a plain cast would give NaN."""
    if dtype == _FP8:
        return np.clip(x.astype(_f32, copy=False), -_FP8_MAX, _FP8_MAX).astype(dtype)
    return x.astype(dtype, copy=False)


@OPS.register("paged_attention", inputs=5, infer=_like())
def paged_attention(q, cache, block_table, seq_lens, query_start_loc, *, scale: float,
                    sliding_window: int = 0):
    """q: [T, H, D]; cache: [NB, 2, BS, Hkv, D]; block_table: i32[S, MB]; seq_lens: i32[S]
    (context length including this step's tokens); query_start_loc: i32[S+1].
    Sequence s owns query rows qsl[s]:qsl[s+1], the last of its seq_lens[s] positions.
    Causal; GQA by grouping H // Hkv query heads per KV head. Tiled over queries, BLAS
    products, causally dead key blocks skipped (graph/paged_attention_ref.py says why)."""
    return _as(paged_attention_ref(q, cache, block_table, seq_lens, query_start_loc, scale=scale,
                                   sliding_window=sliding_window), q)


# -- fused ops (produced by passes/) -------------------------------------------------

def _infer_add_rms_norm(ins, attrs):
    return [(ins[0].dtype, ins[0].shape), (ins[0].dtype, ins[0].shape)]


@OPS.register("add_rms_norm", inputs=3, infer=_infer_add_rms_norm)
def add_rms_norm(x, residual, w, *, eps: float, offset: float = 0.0):
    """-> (rms_norm(x + residual) * w, x + residual): vLLM's fused_add_rms_norm, which
    returns the new residual stream next to the normalised activation."""
    s = add(x, residual)
    return rms_norm(s, w, eps=eps, offset=offset), s


def _infer_linear_add(ins, attrs):
    x, w, res = ins
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear_add: x has K={x.shape[-1]}, weight {w.name} has K={w.shape[1]}")
    out = (*x.shape[:-1], w.shape[0])
    if tuple(res.shape) != out or res.dtype != x.dtype:
        raise ValueError(f"linear_add: the residual {res.name} is {res.dtype} {list(res.shape)}, the GEMM gives "
                         f"{x.dtype} {list(out)}")
    return [(x.dtype, out)]


@OPS.register("linear_add", inputs=3, infer=_infer_linear_add)
def linear_add(x, w, residual):
    """linear(x, w) + residual, the GEMM's output rounded to x's dtype first, as linear's own
    store does (passes/fuse_residual_into_linear.py): add_rms_norm's residual add moved into
    the GEMM that produces its input."""
    return add(linear(x, w), residual)


def _infer_linear_rope(ins, attrs):
    x, w, cache = ins[0], ins[1], ins[2]
    h, d = attrs["heads"], attrs["head_dim"]
    hkv = cache.shape[3]
    if x.shape[-1] != w.shape[1] or w.shape[0] != (h + 2 * hkv) * d:
        raise ValueError(f"linear_rope: weight {w.name} {list(w.shape)} is not [(H + 2 Hkv) D = {(h + 2 * hkv) * d}, "
                         f"{x.shape[-1]}]")
    return [(x.dtype, (x.shape[0], h, d)), (cache.dtype, cache.shape)]


@OPS.register("linear_rope", inputs=(5, 6), inplace={1: 2}, infer=_infer_linear_rope)
def linear_rope(x, w, cache, positions, slot_mapping, bias=None, *, heads: int, head_dim: int, theta: float,
                rotary_dim: int, is_neox: bool = True, scaling: tuple = (), max_position: int = 2048):
    """attention_preamble (no q/k norm) of the q, k and v heads of linear(x, w[, bias]), w the
    stacked [Wq; Wk; Wv] (passes/fuse_rope_into_linear.py): -> (rotated q [T, H, D], cache)."""
    y = linear(x, w, *([] if bias is None else [bias]))
    t, hkv, d = y.shape[0], cache.shape[3], head_dim
    q = y[:, :heads * d].reshape(t, heads, d)
    k = np.ascontiguousarray(y[:, heads * d:(heads + hkv) * d]).reshape(t, hkv, d)
    v = np.ascontiguousarray(y[:, (heads + hkv) * d:]).reshape(t, hkv, d)
    return attention_preamble(np.ascontiguousarray(q), k, v, cache, positions, slot_mapping, theta=theta,
                              rotary_dim=rotary_dim, is_neox=is_neox, scaling=scaling, max_position=max_position)


def _infer_preamble(ins, attrs):
    return [(ins[0].dtype, ins[0].shape), (ins[3].dtype, ins[3].shape)]


@OPS.register("attention_preamble", inputs=(6, 8), inplace={1: 3}, infer=_infer_preamble)
def attention_preamble(q, k, v, cache, positions, slot_mapping, q_norm_w=None, k_norm_w=None, *,
                       eps: float = 1e-6, offset: float = 0.0, theta: float, rotary_dim: int,
                       is_neox: bool = True, scaling: tuple = (), max_position: int = 2048):
    """q: [T, H, D], k, v: [T, Hkv, D], cache: [NB, 2, BS, Hkv, D] (written in place),
    positions, slot_mapping: i32[T]; q_norm_w, k_norm_w: [D] or None (both or neither).
    -> (rotated q, cache). By definition the composition of the ops it replaces:
    per-head q/k rms_norm (Qwen3), rope on q and k, cache_write."""
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("attention_preamble: q and k norm weights come together")
    if q_norm_w is not None:
        q = rms_norm(q, q_norm_w, eps=eps, offset=offset)
        k = rms_norm(k, k_norm_w, eps=eps, offset=offset)
    r = dict(theta=theta, rotary_dim=rotary_dim, is_neox=is_neox, scaling=tuple(scaling), max_position=max_position)
    return rope(q, positions, **r), cache_write(rope(k, positions, **r), v, cache, slot_mapping)
