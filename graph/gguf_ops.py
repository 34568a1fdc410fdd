"""linear_gguf: a linear whose weight stays in its GGUF block format (graph/gguf_blocks.py); and
moe_experts_gguf, the MoE experts likewise (llama.cpp's ffn_{gate,up,down}_exps).

    y: [T, N] = linear_gguf(x: [T, K], w: u8 [N, K / B * TS], [bias: [N]]; qtype, out_dtype)

The weight's rows are the raw bytes of the file's blocks, so a Q4_K model keeps 4.5 bits a weight
in memory and a decode step reads only those (the GPU kernel, codegen/triton/gguf_gemm.py,
dequantises inside its K loop). The reference dequantises per call, rounds the weights to x's
dtype and runs `linear`: exactly what `linear` computes on the weights dequantised at load and
stored in the graph's dtype (f32 on the cpu target: the same logits as that path, bit for bit;
bf16 on a GPU: the kernel's own rounding of each dequantised weight to bf16).

An op of its own, not an attr on `linear`, as linear_fp8 is (graph/fp8_ops.py): a target that
lacks its kernel refuses it by name instead of reading the bytes as numbers.
"""
from __future__ import annotations

from kiln.graph.dtype import DType, to_numpy
from kiln.graph.gguf_blocks import BLOCKS, dequantize, k_of
from kiln.graph.moe_ops import moe_experts
from kiln.graph.ops import OPS, linear


def _infer_linear_gguf(ins, attrs):
    x, w = ins[0], ins[1]
    qtype = attrs["qtype"]
    if qtype not in BLOCKS:
        raise ValueError(f"linear_gguf: no block format {qtype!r} (known: {', '.join(BLOCKS)})")
    if w.dtype != DType.u8 or len(w.shape) != 2:
        raise ValueError(f"linear_gguf: weight {w.name} must be u8 [N, bytes a row]")
    k = k_of(qtype, w.shape[1])
    if x.shape[-1] != k:
        raise ValueError(f"linear_gguf: x has K={x.shape[-1]}, {qtype} weight {w.name} holds K={k}")
    out = DType(attrs["out_dtype"]) if attrs.get("out_dtype") else x.dtype
    return [(out, (*x.shape[:-1], w.shape[0]))]


@OPS.register("linear_gguf", inputs=(2, 3), infer=_infer_linear_gguf)
def linear_gguf(x, w, bias=None, *, qtype: str, out_dtype=None):
    """x: [..., K], w: u8 [N, K / B * TS] blocks of `qtype`, bias: [N] -> [..., N] (out_dtype: as
    `linear`'s). The weights dequantised in f32, rounded to x's dtype, then `linear`."""
    wf = dequantize(w, qtype).astype(x.dtype, copy=False)
    return linear(x, wf, bias, out_dtype=out_dtype)


def _infer_moe_experts_gguf(ins, attrs):
    x, ids, weights, w13, w2 = ins
    q13, q2 = attrs["qtypes"]
    if w13.dtype != DType.u8 or w2.dtype != DType.u8 or len(w13.shape) != 3 or len(w2.shape) != 3:
        raise ValueError(f"moe_experts_gguf: {w13.name} and {w2.name} must be u8 [E, rows, bytes a row]")
    h, i = k_of(q13, w13.shape[2]), k_of(q2, w2.shape[2])
    if x.shape[-1] != h or w13.shape[1] != 2 * i or w2.shape[:2] != (w13.shape[0], h):
        raise ValueError(f"moe_experts_gguf: {w13.name} {list(w13.shape)} ({q13}) and {w2.name} {list(w2.shape)} "
                         f"({q2}) are not [E, 2I, H] and [E, H, I] blocks for x [T, {x.shape[-1]}]")
    return [(x.dtype, x.shape)]


@OPS.register("moe_experts_gguf", inputs=5, infer=_infer_moe_experts_gguf)
def moe_experts_gguf(x, topk_ids, topk_weights, w13, w2, *, qtypes):
    """moe_experts (graph/moe_ops.py) with the stacked experts in GGUF blocks: w13 u8 [E, 2I, RB]
    (each expert's gate rows, then its up rows, in qtypes[0]), w2 u8 [E, H, RB'] (qtypes[1]).
    The experts dequantised in f32, rounded to x's dtype, then moe_experts: the numbers of the
    experts dequantised at load (codegen/triton/moe_gemm.py dequantises them in its K loop)."""
    q13, q2 = qtypes
    return moe_experts(x, topk_ids, topk_weights, dequantize(w13, q13).astype(x.dtype, copy=False),
                       dequantize(w2, q2).astype(x.dtype, copy=False))
