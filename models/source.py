"""Open a model from a path: a Hugging Face directory (config.json + safetensors)
or a GGUF file. Gives the parsed config and a lazy weight source; every problem
a user can cause becomes one typed error with one sentence."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, InvalidModelError, ModelNotFoundError
from kiln.models.config import ModelConfig
from kiln.models.fp8_online import OnlineFp8Weights
from kiln.models.fp8_weights import Fp8Weights
from kiln.models.gguf_quant import gguf_blocks
from kiln.models.quant_config import check_quantization_name, resolve_quantization
from kiln.models.registry import WEIGHT_ADAPTERS, get_graph_builder
from kiln.models.weights import WeightSource, gguf_to_hf_config, open_weights


@dataclass
class ModelSource:
    path: Path
    format: str  # "safetensors" or "gguf"
    config: ModelConfig
    weights: WeightSource
    hf_config: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def gguf_metadata(self) -> dict[str, Any] | None:
        # the weights may be a MappedWeights over the GGUF (models/moe_weights.py), which keeps its metadata
        return getattr(self.weights, "metadata", None) if self.format == "gguf" else None


def open_model(path: str | Path, quantization: str | None = None) -> ModelSource:
    """quantization: vLLM's --quantization, checked against the checkpoint's own (an unknown name, or
    another method than the file's, is one sentence); "fp8" on an unquantised checkpoint quantises
    its linears at load (models/fp8_online.py)."""
    check_quantization_name(quantization)  # before anything is read
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf; pass a GGUF file or a model directory")
        weights = open_weights(path)
        hf = gguf_to_hf_config(weights.metadata)
        fmt = "gguf"
    else:
        hf = read_hf_config(path)
        weights = open_weights(path)
        fmt = "safetensors"
    config = ModelConfig.from_hf_dict(hf, source=str(path / "config.json") if fmt == "safetensors" else str(path))
    if fmt == "gguf":  # its tensors in block formats kiln computes in (models/gguf_quant.py)
        config, weights = gguf_blocks(config, weights)
    config = resolve_quantization(config, quantization, fmt, str(path))
    get_graph_builder(config.architecture)  # reject unknown architectures before loading anything
    _check_layer_count(config, weights, path)
    adapt = WEIGHT_ADAPTERS.get(config.architecture)
    if adapt is not None:
        weights = adapt(config, weights)
    if getattr(config.quantization, "online", False):
        weights = OnlineFp8Weights(weights, config.quantization)
    elif config.quantization is not None and fmt != "gguf":
        weights = Fp8Weights(weights)
    return ModelSource(path, fmt, config, weights, hf)


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _check_layer_count(config: ModelConfig, weights: WeightSource, path: Path) -> None:
    """A config claiming more layers than its weights hold is refused before a graph (a node per
    layer per op) or anything else is sized by it (issue 42 #12: num_hidden_layers 1e9 ran the
    machine out of memory). Only the highest layer index any tensor name has is compared, so a
    vision tower or an MTP head can only make the check more lenient."""
    highest = max((int(m[1]) for n in weights.names() if (m := _LAYER_INDEX.search(n))), default=-1)
    if highest >= 0 and config.num_hidden_layers > highest + 1:
        raise InvalidModelError(f"{path}: the config says num_hidden_layers is {config.num_hidden_layers}, "
                                f"but the weights hold {highest + 1} layers")


def read_hf_config(path: Path) -> dict[str, Any]:
    """A model directory's config.json as a dict. A ModelOpt checkpoint's hf_quant_config.json
    becomes its quantization_config when config.json has none (vLLM reads it the same way), so a
    quantized checkpoint is never taken for an unquantized one."""
    hf = _read_json(path / "config.json", missing=f"model directory {path} has no config.json")
    quant = path / "hf_quant_config.json"
    if "quantization_config" not in hf and quant.is_file():
        hf["quantization_config"] = _read_json(quant)
    return hf


def _read_json(file: Path, missing: str = "") -> dict[str, Any]:
    if not file.is_file():
        raise ModelNotFoundError(missing or f"{file} does not exist")
    try:
        d = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidModelError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{file} must hold a JSON object")
    return d
