"""Lazy weight sources: tensors named as in the Hugging Face checkpoint, read on demand.

A model's weights come from a safetensors directory (one file or shards with an index)
or from a GGUF file. Both answer the same questions (which names, which shapes) without
reading tensor data, and hand out one tensor at a time, so a builder can walk a model
bigger than RAM. Every problem a user can cause (missing path, truncated file, unknown
dtype) is found as early as possible and raised as one typed error with one sentence.

`get(name)` gives float32 for float tensors because the numpy reference computes in
float32; `get(name, keep_dtype=True)` gives the stored dtype (bf16 through ml_dtypes)
for code that packs weights for the GPU and must not round twice.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from kiln.errors import InvalidModelError, ModelNotFoundError

if TYPE_CHECKING:  # for type checkers and linters; at run time __getattr__ below imports them
    from kiln.models.gguf_config import gguf_to_hf_config
    from kiln.models.gguf_weights import GGUFWeights
    from kiln.models.safetensors_weights import SafetensorsWeights

# Stored float dtypes that get(name) widens to float32. Integer tensors (rare: quantizer
# metadata) are returned as stored, since widening them would change their meaning.
FLOAT_DTYPES = frozenset(
    np.dtype(d)
    for d in (
        np.float16, np.float32, np.float64, ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu,
    )
)


class WeightSource:
    """Names, shapes and on-demand tensors of one checkpoint, HF names and [out, in] layout.

    Subclasses fill `_shapes` (name -> shape, in file order) when they open the file and
    implement `_load`; nothing else reads tensor data.
    """

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]]):
        self.path = path
        self._shapes = shapes

    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        self._check(name)
        return self._shapes[name]

    def _load(self, name: str, keep_dtype: bool) -> np.ndarray:
        raise NotImplementedError

    def _check(self, name: str) -> None:
        if name not in self._shapes:
            # A graph asking for a weight the file lacks means the file does not match its
            # config (a pruned or mislabelled checkpoint), which the user can fix.
            raise InvalidModelError(f"model {self.path} has no tensor named {name!r}")

    def get(self, name: str, keep_dtype: bool = False) -> np.ndarray:
        self._check(name)
        arr = self._load(name, keep_dtype)
        if not keep_dtype and arr.dtype in FLOAT_DTYPES and arr.dtype != np.float32:
            arr = arr.astype(np.float32)
        return arr

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {len(self)} tensors)"


def open_weights(path: str | Path) -> WeightSource:
    """The weight source for a model directory (safetensors) or a .gguf / .safetensors file."""
    from kiln.models.gguf_weights import GGUFWeights
    from kiln.models.safetensors_weights import SafetensorsWeights

    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix == ".gguf":
            return GGUFWeights(path)
        if path.suffix == ".safetensors":
            return SafetensorsWeights([path])
        raise InvalidModelError(f"model file {path} is neither a .gguf nor a .safetensors file")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return SafetensorsWeights.from_index(index)
    files = sorted(path.glob("*.safetensors"))
    if files:
        return SafetensorsWeights(files)
    ggufs = sorted(path.glob("*.gguf"))
    hint = f"; to load a GGUF, pass the file itself (e.g. {ggufs[0]})" if ggufs else ""
    raise ModelNotFoundError(f"model directory {path} holds no *.safetensors weights{hint}")


# The concrete sources import WeightSource from here, so they are re-exported lazily (PEP
# 562): `from kiln.models.weights import GGUFWeights` works whichever module loads first,
# and safetensors-only users never import gguf.
_EXPORTS = {
    "SafetensorsWeights": "kiln.models.safetensors_weights",
    "GGUFWeights": "kiln.models.gguf_weights",
    "gguf_to_hf_config": "kiln.models.gguf_config",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FLOAT_DTYPES", "GGUFWeights", "SafetensorsWeights", "WeightSource", "gguf_to_hf_config", "open_weights"]
