"""NVFP4 weights (ModelOpt `quant_algo: NVFP4`, models/nvfp4_config.py) and the W4A16 linear
that reads them.

The format, from its definition (NVIDIA's NVFP4: OCP MX e2m1 elements, an e4m3 scale per 16
elements, an f32 scale per tensor; ModelOpt's NVFP4QTensor packs `(q[..., 1::2] << 4) |
q[..., 0::2]`, vLLM's break_fp4_bytes reads the low nibble first):

  e2m1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal
        (0 or 0.5), else 2^(e-1) * (1 + m/2): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
  weight         uint8 [N, K/2]: byte j of a row holds column 2j (low nibble), 2j+1 (high)
  weight_scale   e4m3 [N, K/16]
  weight_scale_2 f32 [1]
  W[n, k] = e2m1[n, k] * weight_scale[n, k // 16] * weight_scale_2

The elements decode through ml_dtypes' float4_e2m1fn (one value a byte in its low 4 bits) and
the scales through its float8_e4m3fn: the format's own types, not a table written here.

linear_nvfp4 computes what the GPU's W4A16 GEMM does (codegen/triton/nvfp4_gemm.py): the
activations in their dtype, the weight's e2m1 * block scale (exact in bf16: 2 significant bits
times 4, and e4m3's exponent range sits inside bf16's), an f32 matmul, then the per-tensor
scale once on the f32 sum, then the bias; rounded to x's dtype. vLLM's Marlin path on Hopper
does the same with the global scale folded into its epilogue.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from kiln.graph.dtype import DType, to_numpy
from kiln.graph.moe_ops import experts_by_rank
from kiln.graph.ops import OPS

_f32 = np.float32
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
_E4M3 = to_numpy(DType.fp8e4m3)
GROUP = 16


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., K/2] -> f32 [..., K]: each byte's low nibble, then its high nibble."""
    p = np.asarray(packed, np.uint8)
    nibbles = np.stack((p & 0x0F, p >> 4), axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    return nibbles.view(E2M1).astype(_f32)


def dequantize_nvfp4(w: np.ndarray, ws: np.ndarray, ws2=None, group: int = GROUP) -> np.ndarray:
    """w: uint8 [N, K/2], ws: e4m3 [N, K/group] (any dtype holding e4m3 values), ws2: f32
    per-tensor scale or None -> f32 [N, K] = e2m1 * block scale (* ws2)."""
    q = unpack_e2m1(w)
    n, k = q.shape
    s = np.asarray(ws).astype(_E4M3).astype(_f32).reshape(n, k // group)  # e4m3 values, exactly
    out = (q.reshape(n, k // group, group) * s[..., None]).reshape(n, k)
    if ws2 is not None:
        out = out * _f32(np.asarray(ws2, _f32).reshape(-1)[0])
    return out


def _infer_linear_nvfp4(ins, attrs):
    x, w, ws, ws2 = ins[:4]
    group = attrs["group"]
    k = x.shape[-1]
    if len(x.shape) != 2 or not isinstance(k, int) or k % group:
        raise ValueError(f"linear_nvfp4: {x.name} must be [T, K] with K a multiple of {group}")
    n = w.shape[0]
    if w.dtype != DType.u8 or tuple(w.shape) != (n, k // 2):
        raise ValueError(f"linear_nvfp4: weight {w.name} must be u8 [N, {k // 2}] (two e2m1 a byte)")
    if ws.dtype != DType.fp8e4m3 or tuple(ws.shape) != (n, k // group):
        raise ValueError(f"linear_nvfp4: weight scale {ws.name} must be e4m3 [{n}, {k // group}]")
    if ws2.dtype != DType.f32 or tuple(ws2.shape) != (1,):
        raise ValueError(f"linear_nvfp4: per-tensor scale {ws2.name} must be f32 [1]")
    if len(ins) > 4 and ins[4] is not None and tuple(ins[4].shape) != (n,):
        raise ValueError(f"linear_nvfp4: bias {ins[4].name} must be [{n}]")
    return [(x.dtype, (x.shape[0], n))]


@OPS.register("linear_nvfp4", inputs=(4, 5), infer=_infer_linear_nvfp4)
def linear_nvfp4(x, w, ws, ws2, bias=None, *, group: int = GROUP):
    """x: [T, K], w: u8 [N, K/2], ws: e4m3 [N, K/16], ws2: f32 [1], bias: [N] -> [T, N] in x's
    dtype: ((x @ (e2m1 * ws)^T) * ws2 + bias), f32 throughout, rounded once."""
    y = x.astype(_f32, copy=False) @ dequantize_nvfp4(w, ws, group=group).T
    y *= _f32(np.asarray(ws2, _f32).reshape(-1)[0])
    if bias is not None:
        y += bias.astype(_f32, copy=False)
    return y.astype(x.dtype)


# -- MoE experts in NVFP4 (models/moe.py) ------------------------------------------------------

def _infer_moe_experts_nvfp4(ins, attrs):
    x, ids, w, w13, s13, g13, w2, s2, g2 = ins
    group = attrs["group"]
    if x.rank != 2 or w13.dtype != DType.u8 or w2.dtype != DType.u8 or len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError(f"moe_experts_nvfp4: x {x.name} must be [T, H], {w13.name} and {w2.name} u8 [E, rows, K/2]")
    e, two_i, h2 = w13.shape
    h, i = x.shape[1], two_i // 2
    if two_i % 2 or h2 * 2 != h or tuple(w2.shape) != (e, h, i // 2) or h % group or i % group:
        raise ValueError(f"moe_experts_nvfp4: {w13.name} {list(w13.shape)} and {w2.name} {list(w2.shape)} are not "
                         f"[E, 2I, H/2] and [E, H, I/2] for x [T, {h}] in groups of {group}")
    for s, shape in ((s13, (e, two_i, h // group)), (s2, (e, h, i // group))):
        if s.dtype != DType.fp8e4m3 or tuple(s.shape) != shape:
            raise ValueError(f"moe_experts_nvfp4: block scales {s.name} must be e4m3 {list(shape)}")
    for s, shape in ((g13, (e, 2)), (g2, (e, 1))):
        if s.dtype != DType.f32 or tuple(s.shape) != shape:
            raise ValueError(f"moe_experts_nvfp4: per-tensor scales {s.name} must be f32 {list(shape)}")
    if tuple(ids.shape) != tuple(w.shape) or ids.shape[0] != x.shape[0] or ids.dtype != DType.i32:
        raise ValueError(f"moe_experts_nvfp4: topk ids {list(ids.shape)} and weights {list(w.shape)} must be [T, k]")
    return [(x.dtype, x.shape)]


@OPS.register("moe_experts_nvfp4", inputs=9, infer=_infer_moe_experts_nvfp4)
def moe_experts_nvfp4(x, topk_ids, topk_weights, w13, s13, g13, w2, s2, g2, *, group: int = GROUP):
    """graph/moe_ops.py moe_experts with ModelOpt NVFP4 experts, W4A16 as linear_nvfp4: w13 u8
    [E, 2I, H/2] (each expert's gate rows, then its up rows, two e2m1 a byte) with block scales s13
    e4m3 [E, 2I, H/16] and per-tensor scales g13 f32 [E, 2] (the gate's, the up's: ModelOpt
    calibrates each linear's weight_scale_2 on its own); w2 u8 [E, H, I/2], s2, g2 [E, 1]. Each
    expert's gate, up and down is linear_nvfp4 of its own rows and scales (the per-tensor scale on
    the f32 sum, rounded to x's dtype), then moe_experts' SiLU-and-mul and rank-order sum."""
    inter = w13.shape[1] // 2

    def gate_up(e, xe):
        return np.concatenate([linear_nvfp4(xe, w13[e, :inter], s13[e, :inter], g13[e, 0], group=group),
                               linear_nvfp4(xe, w13[e, inter:], s13[e, inter:], g13[e, 1], group=group)], axis=1)

    return experts_by_rank(x, topk_ids, topk_weights, gate_up,
                           lambda e, a: linear_nvfp4(a, w2[e], s2[e], g2[e, 0], group=group), w2.shape[1])
