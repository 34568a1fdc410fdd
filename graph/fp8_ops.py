"""FP8 W8A8 ops: activation quantisation to e4m3, the FP8 linear, and their fusions with the
norm and the SwiGLU activation that produce the quantised input (passes/fuse_rmsnorm_quant.py,
passes/fuse_silu_mul_quant.py).

The numpy references do what the GPU will: activations quantised to e4m3 with one f32 scale
per token per `group` columns, the matmul of the e4m3 values accumulated in f32 one activation
group at a time, each group's partial sum times its activation and weight scales. They follow
vLLM's references in tests/kernels/quant_utils.py: `native_per_token_group_quant_fp8` (scale =
max(amax, 1e-10) / 448, q = clamp(x / scale, +-448) cast to e4m3), `ref_dynamic_per_token_quant`
(the same per token, the scale clamped at 1 / (448 * 512)) and `native_w8a8_block_matmul` (for
each k-block, C += (A_q[:, kb] @ B_q[nb, kb]^T) * As[:, kb] * Bs[nb, kb]). A static scale
(ModelOpt's input_scale) is the same quantisation with a given scale.

Why ops of their own and not attrs on `linear`: an fp8 weight on a plain `linear` is exactly the
bug being fixed (e4m3 values used without scales), and a target that does not know these ops
refuses them by name (codegen/lower.py: "no GPU kernel for op ...") instead of running them as
bf16 GEMMs. The quantisation is an op too, so the passes can fuse it into its producer.
"""
from __future__ import annotations

import numpy as np

from kiln.graph.dtype import DType, to_numpy
from kiln.graph.ops import OPS, add_rms_norm, rms_norm, silu_mul

_f32 = np.float32
_FP8 = to_numpy(DType.fp8e4m3)
_FP8_MAX = _f32(448.0)


def quantize_fp8(x: np.ndarray, scales: tuple[np.ndarray, ...], group: int, min_scale: float):
    """x: [T, K] -> (e4m3 [T, K], f32 scales [T, K // group]). Dynamic: each token's group of
    `group` columns gets scale max(amax / 448, min_scale) (a zero group gets min_scale and
    quantises to zeros). Static (scales given): the largest of them, for every token (vLLM's
    merged q/k/v or gate/up layers take the max of their input scales; ModelOpt writes them equal)."""
    xf = x.astype(_f32, copy=False)
    t, k = xf.shape
    if scales:
        s = np.full((t, 1), max(_f32(np.asarray(v, _f32).max()) for v in scales), _f32)
        q = np.clip(xf / s, -_FP8_MAX, _FP8_MAX)
        return q.astype(_FP8), s
    g = xf.reshape(t, k // group, group)
    s = np.maximum(np.abs(g).max(axis=-1) / _FP8_MAX, _f32(min_scale)).astype(_f32)  # [T, K / group]
    q = np.clip(g / s[..., None], -_FP8_MAX, _FP8_MAX).reshape(t, k)
    return q.astype(_FP8), s


def _infer_quant(ins, attrs):
    x = ins[0]
    group, k = attrs["group"], x.shape[-1]
    if len(x.shape) != 2 or not isinstance(k, int) or k % group:
        raise ValueError(f"quant_fp8: {x.name} must be [T, K] with K a multiple of the group {group}")
    n = 1 if len(ins) > 1 else k // group
    return [(DType.fp8e4m3, x.shape), (DType.f32, (x.shape[0], n))]


@OPS.register("quant_fp8", inputs=(1, 4), infer=_infer_quant)
def quant_fp8(x, *scales, group: int, min_scale: float = 0.0):
    """x: [T, K], scales: static per-tensor input scales ([1] each) or none (dynamic)
    -> (e4m3 [T, K], f32 [T, K // group] dynamic or [T, 1] static)."""
    return quantize_fp8(x, scales, group, min_scale)


def _infer_linear_fp8(ins, attrs):
    x, xs, w, ws = ins[:4]
    (n, k), (bn, bk) = w.shape, attrs["block"]
    if x.shape[-1] != k or x.dtype != DType.fp8e4m3 or w.dtype != DType.fp8e4m3:
        raise ValueError(f"linear_fp8: x {x.name} and weight {w.name} must be e4m3 with the same K")
    if -(-n // bn) * -(-k // bk) != int(np.prod(ws.shape)):
        raise ValueError(f"linear_fp8: weight scale {ws.name} {list(ws.shape)} is not one per [{bn}, {bk}] block "
                         f"of {w.name} [{n}, {k}]")
    groups = xs.shape[-1]
    if k % groups or bk % (k // groups):
        raise ValueError(f"linear_fp8: {groups} activation groups do not tile weight {w.name}'s {bk}-column blocks")
    return [(DType(attrs["out_dtype"]), (x.shape[0], n))]


@OPS.register("linear_fp8", inputs=(4, 5), infer=_infer_linear_fp8)
def linear_fp8(x, xs, w, ws, bias=None, *, block, out_dtype):
    """x: e4m3 [T, K] with scales xs: f32 [T, G] (one per K / G columns); w: e4m3 [N, K] with
    scales ws: one per [bn, bk] block (block = (bn, bk); per channel (1, K), per tensor (N, K)),
    bias: [N] -> [T, N] in out_dtype. Accumulates in f32 over the activation groups in order."""
    t, k = x.shape
    n = w.shape[0]
    bn, bk = block
    ws = np.asarray(ws, _f32).reshape(-(-n // bn), -(-k // bk))
    gk = k // xs.shape[1]  # columns per activation scale
    xf, wf = x.astype(_f32), w.astype(_f32)
    acc = np.zeros((t, n), _f32)
    for j in range(xs.shape[1]):
        cols = slice(j * gk, (j + 1) * gk)
        w_scale = np.repeat(ws[:, (j * gk) // bk], bn)[:n]  # [N]: each row's block scale
        acc += (xf[:, cols] @ wf[:, cols].T) * xs[:, j:j + 1] * w_scale[None, :]
    if bias is not None:
        acc += bias.astype(_f32, copy=False)
    return acc.astype(to_numpy(DType(out_dtype)))


# -- fused producers: the op they replace, then quant_fp8, by definition -----------------

def _infer_norm_quant(ins, attrs, n_lead: int):
    x = ins[0]
    q, s = _infer_quant([x, *ins[n_lead:]], attrs)
    return [q, s]


@OPS.register("rms_norm_quant", inputs=(2, 5), infer=lambda ins, a: _infer_norm_quant(ins, a, 2))
def rms_norm_quant(x, w, *scales, eps: float, offset: float = 0.0, group: int, min_scale: float = 0.0):
    """quant_fp8(rms_norm(x, w)): the normalised row rounded to x's dtype, then quantised."""
    return quantize_fp8(rms_norm(x, w, eps=eps, offset=offset), scales, group, min_scale)


def _infer_add_norm_quant(ins, attrs):
    x = ins[0]
    return [*_infer_norm_quant(ins, attrs, 3), (x.dtype, x.shape)]


@OPS.register("add_rms_norm_quant", inputs=(3, 6), infer=_infer_add_norm_quant)
def add_rms_norm_quant(x, residual, w, *scales, eps: float, offset: float = 0.0, group: int,
                       min_scale: float = 0.0):
    """-> (e4m3 [T, H], scales, x + residual): add_rms_norm, its normalised output quantised."""
    normed, summed = add_rms_norm(x, residual, w, eps=eps, offset=offset)
    return (*quantize_fp8(normed, scales, group, min_scale), summed)


@OPS.register("silu_mul_quant", inputs=(2, 5), infer=lambda ins, a: _infer_norm_quant(ins, a, 2))
def silu_mul_quant(gate, up, *scales, group: int, min_scale: float = 0.0):
    """quant_fp8(silu_mul(gate, up)): the SwiGLU activation rounded to gate's dtype, then quantised."""
    return quantize_fp8(silu_mul(gate, up), scales, group, min_scale)
