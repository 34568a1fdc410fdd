"""The linears of a decoder layer, plain or FP8 as the checkpoint's quantization config says
(models/quant_config.py), for the graph builders (models/llama.py).

The linears that read one input (q/k/v, gate/up) share one quant_fp8 of it: the same input
quantised the same way once, as vLLM's merged QKV and gate/up layers do. An FP8 linear is then

    xq: e4m3 [T, K], xs: f32 [T, G] = quant_fp8(x[, input_scale...])
    y: [T, N] = linear_fp8(xq, xs, weight e4m3 [N, K], weight scale, [bias])

with G = K / bk per token for block-wise weights (dynamic per-token-group activations), 1 per
token for compressed-tensors' FP8_DYNAMIC, 1 static scale for ModelOpt. Weight scales:
block-wise `weight_scale_inv` [ceil(N/bn), ceil(K/bk)]; per channel `weight_scale` [N, 1]; per
tensor `weight_scale` [1] (models/fp8_weights.py shows ModelOpt's scalars as [1]).
"""
from __future__ import annotations

from kiln.errors import UnsupportedQuantizationError
from kiln.graph import DType, Graph, Tensor
from kiln.models.gguf_quant import project_gguf
from kiln.models.nvfp4_linear import project_nvfp4
from kiln.models.quant_config import MIN_SCALE_GROUP, MIN_SCALE_TOKEN, Fp8Config

# (checkpoint module prefix, output features, node name)
LinearSpec = tuple[str, int, str]


def project(g: Graph, quant: Fp8Config | None, x: Tensor, specs: list[LinearSpec], n_in: int, dtype: DType,
            bias: bool, quant_name: str) -> list[Tensor]:
    """The outputs [T, n_out] of the linears in specs, all reading x [T, n_in]."""
    if quant is not None and quant.weight == "gguf":  # GGUF blocks dequantised in the GEMM (models/gguf_quant.py)
        return project_gguf(g, quant, x, specs, n_in, dtype, bias)
    if quant is not None and quant.weight == "nvfp4":  # W4A16, no activation quantisation
        return project_nvfp4(g, quant, x, specs, n_in, dtype, bias)
    fp8 = [s for s in specs if quant is not None and quant.quantizes(s[0])]
    xq = quantize_input(g, quant, x, [p for p, _, _ in fp8], n_in, quant_name) if fp8 else None
    outs = []
    for prefix, n_out, name in specs:
        on = xq is not None and (prefix, n_out, name) in fp8
        w = g.weight(f"{prefix}.weight", DType.fp8e4m3 if on else dtype, (n_out, n_in))
        b = [g.weight(f"{prefix}.bias", dtype, (n_out,))] if bias else []
        if on:
            ws, block = _weight_scale(g, quant, prefix, n_out, n_in)
            outs.append(g.call1("linear_fp8", *xq, w, ws, *b, block=block, out_dtype=str(dtype), name=name))
        else:
            outs.append(g.call1("linear", x, w, *b, name=name))
    return outs


def quantize_input(g: Graph, quant: Fp8Config, x: Tensor, prefixes: list[str], n_in: int, name: str):
    """x quantised to e4m3 once for the FP8 linears (or stacked experts) named by prefixes that read it:
    static (ModelOpt input_scale), per 128-column group (block-wise) or per token (channel-wise)."""
    g.attrs.setdefault("quantization", quant.method)  # models/fp8_weights.py says it in its refusals
    if quant.activation == "static":
        # one [1] f32 input scale per linear; quant_fp8 takes their max (they are equal in ModelOpt's export)
        scales = [g.weight(f"{p}.input_scale", DType.f32, (1,)) for p in prefixes]
        return g.call("quant_fp8", [x, *scales], name=name, group=n_in)
    if quant.activation == "group":
        bk = quant.block[1]
        if n_in % bk:
            raise UnsupportedQuantizationError(
                f"block-wise FP8 with weight_block_size {list(quant.block)} on {prefixes[0]}, whose {n_in} input "
                f"features are not a multiple of {bk}, is not supported by kiln")
        return g.call("quant_fp8", [x], name=name, group=bk, min_scale=MIN_SCALE_GROUP)
    return g.call("quant_fp8", [x], name=name, group=n_in, min_scale=MIN_SCALE_TOKEN)


def _weight_scale(g: Graph, quant: Fp8Config, prefix: str, n: int, k: int) -> tuple[Tensor, tuple[int, int]]:
    """-> (the weight's scale tensor, its (rows, columns) per scale)."""
    name = f"{prefix}.{quant.scale_name}"
    if quant.weight == "block":
        bn, bk = quant.block
        return g.weight(name, DType.f32, (-(-n // bn), -(-k // bk))), (bn, bk)
    if quant.weight == "channel":
        return g.weight(name, DType.f32, (n, 1)), (1, k)
    return g.weight(name, DType.f32, (1,)), (n, k)
