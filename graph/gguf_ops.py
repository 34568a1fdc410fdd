"""linear_gguf: a linear whose weight stays in its GGUF block format (graph/gguf_blocks.py).

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
