"""The linears of a decoder layer in a ModelOpt NVFP4 checkpoint (models/nvfp4_config.py), for
models/fp8_linear.project: W4A16, each quantised linear one op on its packed weight and scales,

    y: [T, N] = linear_nvfp4(x [T, K], weight u8 [N, K/2], weight_scale e4m3 [N, K/16],
                             weight_scale_2 f32 [1], [bias])

with x in the model's dtype (no activation quantisation, so input_scale is not read). Modules the
config excludes stay plain `linear`s.
"""
from __future__ import annotations

from kiln.errors import UnsupportedQuantizationError
from kiln.graph import DType, Graph, Tensor
from kiln.models.nvfp4_config import Nvfp4Config


def project_nvfp4(g: Graph, quant: Nvfp4Config, x: Tensor, specs, n_in: int, dtype: DType,
                  bias: bool) -> list[Tensor]:
    """The outputs [T, n_out] of the linears in specs [(module prefix, n_out, node name)], all reading x."""
    group = quant.group_size
    outs = []
    for prefix, n_out, name in specs:
        b = [g.weight(f"{prefix}.bias", dtype, (n_out,))] if bias else []
        if not quant.quantizes(prefix):
            outs.append(g.call1("linear", x, g.weight(f"{prefix}.weight", dtype, (n_out, n_in)), *b, name=name))
            continue
        if n_in % group:
            raise UnsupportedQuantizationError(
                f"NVFP4 on {prefix}, whose {n_in} input features are not a multiple of {group}, is not supported by kiln")
        g.attrs.setdefault("quantization", "modelopt NVFP4")  # models/fp8_weights.py says it in its refusals
        w = g.weight(f"{prefix}.weight", DType.u8, (n_out, n_in // 2))
        ws = g.weight(f"{prefix}.weight_scale", DType.fp8e4m3, (n_out, n_in // group))
        ws2 = g.weight(f"{prefix}.weight_scale_2", DType.f32, (1,))
        outs.append(g.call1("linear_nvfp4", x, w, ws, ws2, *b, group=group, name=name))
    return outs


def linear_or_nvfp4(g: Graph, quant: Nvfp4Config | None, x: Tensor, prefix: str, n_out: int, n_in: int,
                    dtype: DType, bias: bool, name: str) -> Tensor:
    """One linear [T, n_in] -> [T, n_out]: NVFP4 where the checkpoint's config quantises `prefix`,
    else plain (the hybrid builder's linears, models/qwen3_5.py, and the dense MLP of models/moe.py)."""
    if quant is None:
        b = [g.weight(f"{prefix}.bias", dtype, (n_out,))] if bias else []
        return g.call1("linear", x, g.weight(f"{prefix}.weight", dtype, (n_out, n_in)), *b, name=name)
    return project_nvfp4(g, quant, x, [(prefix, n_out, name)], n_in, dtype, bias)[0]
