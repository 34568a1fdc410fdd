"""Graph builders keyed by the HF `architectures` name. Unknown names are rejected by name."""
from __future__ import annotations

from typing import Callable

from kiln.errors import UnsupportedArchitectureError
from kiln.graph import Graph
from kiln.models import llama, moe_weights, qwen3, qwen3_5, qwen3_moe

GraphBuilder = Callable[..., Graph]

ARCHITECTURES: dict[str, GraphBuilder] = {
    "LlamaForCausalLM": llama.build_graph,
    "Qwen3ForCausalLM": qwen3.build_graph,
    "Qwen3_5ForCausalLM": qwen3_5.build_graph,
    "Qwen3_5ForConditionalGeneration": qwen3_5.build_graph,
    "Qwen3NextForCausalLM": qwen3_5.build_graph,
    "Qwen3MoeForCausalLM": qwen3_moe.build_graph,
    "Qwen3_5MoeForCausalLM": qwen3_5.build_graph,
    "Qwen3_5MoeForConditionalGeneration": qwen3_5.build_graph,
}

# architecture -> fn(config, weights) -> the weights under the graph's tensor names
WEIGHT_ADAPTERS = {arch: qwen3_5.adapt_weights for arch in
                   ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3NextForCausalLM",
                    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")}
WEIGHT_ADAPTERS["Qwen3MoeForCausalLM"] = moe_weights.adapt_weights  # stacked experts from any layout


def get_graph_builder(architecture: str) -> GraphBuilder:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported by kiln "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})") from None
