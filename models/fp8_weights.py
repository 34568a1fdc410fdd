"""FP8 checkpoints' weights as the graph reads them, and the check that the tensors agree with
the config before anything runs.

Per-tensor scales come as scalars (ModelOpt writes shape []) or as [1] (compressed-tensors);
Fp8Weights shows every one-element scale as [1], the shape the graph declares for it
(models/fp8_linear.py). Everything else passes through with its stored dtype, so the e4m3
weights reach the graph as e4m3 (widened to f32 by `get`, which e4m3 -> f32 -> e4m3 undoes
exactly).

`check_weight_dtypes` is where a checkpoint that disagrees with its config is refused by name:
an FP8 weight the graph reads as plain (an unquantised-looking checkpoint with e4m3 tensors, a
module the config leaves unquantised stored in FP8: the issue's garbage), or a weight the config
says is FP8 stored in another dtype. Missing tensors (a scale the format needs) are named by the
weight source when the executor asks for them.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from kiln.errors import InvalidModelError
from kiln.graph import DType, Graph
from kiln.models.weights import WeightSource

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".weight_scale_2", ".input_scale")
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_FP8 = frozenset((_E4M3, np.dtype(ml_dtypes.float8_e5m2)))
_U8 = np.dtype(np.uint8)


class Fp8Weights(WeightSource):
    """The checkpoint's tensors, one-element scales seen as shape [1]."""

    def __init__(self, inner: WeightSource):
        shapes = {}
        for name in inner.names():
            shape = inner.shape(name)
            shapes[name] = (1,) if name.endswith(SCALE_SUFFIXES) and math.prod(shape) == 1 else shape
        super().__init__(inner.path, shapes)
        self.inner = inner
        self.metadata = getattr(inner, "metadata", None)

    def dtype(self, name: str) -> np.dtype | None:
        self._check(name)
        dtype = getattr(self.inner, "dtype", None)
        return dtype(name) if dtype is not None else None

    def _load(self, name: str, keep_dtype: bool) -> np.ndarray:
        return self.inner.get(name, keep_dtype=keep_dtype).reshape(self._shapes[name])


def check_weight_dtypes(graph: Graph, weights: WeightSource) -> None:
    """Every weight the graph reads in FP8 is stored as e4m3, and no weight it reads as plain
    floats is stored in FP8; InvalidModelError naming the first that is not."""
    stored_dtype = getattr(weights, "dtype", None)
    if stored_dtype is None:  # GGUF and adapted layouts: no FP8 tensors there
        return
    for t in graph.weights:
        for name, _ in t.parts or ((t.name, 0),):
            if name not in weights:
                continue  # named when loaded (the weight source's own sentence)
            stored = stored_dtype(name)
            if stored is None:  # a tensor whose source keeps no dtype (GGUF blocks, derived): its loader checks it
                continue
            if t.dtype == DType.fp8e4m3 and stored != _E4M3:
                raise InvalidModelError(
                    f"weight {name!r} is stored as {stored}, but the checkpoint's quantization_config "
                    f"says it is float8_e4m3fn")
            if t.dtype != DType.fp8e4m3 and stored in _FP8:
                why = ("the checkpoint's quantization_config leaves it unquantized"
                       if graph.attrs.get("quantization") else "config.json has no quantization_config")
                raise InvalidModelError(
                    f"weight {name!r} is stored as {stored}, but {why}, so kiln has no scale to read it with")
            # NVFP4 (models/nvfp4_linear.py): packed e2m1 pairs are uint8, and uint8 is nothing else
            if t.dtype == DType.u8 and stored != _U8:
                raise InvalidModelError(
                    f"weight {name!r} is stored as {stored}, but the checkpoint's quantization_config says it "
                    f"is NVFP4 (uint8, two e2m1 values a byte)")
            if t.dtype != DType.u8 and t.dtype.is_float and stored == _U8:
                why = ("the checkpoint's quantization_config leaves it unquantized"
                       if graph.attrs.get("quantization") else "config.json has no quantization_config")
                raise InvalidModelError(
                    f"weight {name!r} is stored as packed uint8, but {why}, so kiln has no format to unpack it with")
