"""Open a model from a path: a Hugging Face directory (config.json + safetensors)
or a GGUF file. Gives the parsed config and a lazy weight source; every problem
a user can cause becomes one typed error with one sentence."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, InvalidModelError, ModelNotFoundError
from kiln.models.config import ModelConfig
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


def open_model(path: str | Path) -> ModelSource:
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
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        try:
            hf = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidModelError(f"{cfg_path} is not valid JSON: {e}") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{cfg_path} must hold a JSON object")
        weights = open_weights(path)
        fmt = "safetensors"
    config = ModelConfig.from_hf_dict(hf, source=str(path / "config.json") if fmt == "safetensors" else str(path))
    get_graph_builder(config.architecture)  # reject unknown architectures before loading anything
    adapt = WEIGHT_ADAPTERS.get(config.architecture)
    if adapt is not None:
        weights = adapt(config, weights)
    return ModelSource(path, fmt, config, weights, hf)
