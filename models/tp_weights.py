"""One tensor-parallel rank's view of a checkpoint: each sharded tensor cut to the slices the
rank's graph asks for (graph.attrs["tp_slices"], passes/shard_tensor_parallel.py).

A safetensors tensor is a read-only memory map (models/safetensors_weights.py): the cut is
taken before any conversion, so a rank reads only its slices' pages, never the whole tensor.
Tensors made at load (a GGUF's dequantised ones, stacked experts, Qwen3-Next's de-interleaved
projections: models/mapped_weights.py) are made whole and then cut; the rank keeps only its cut.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from kiln.models.weights import FLOAT_DTYPES, WeightSource


def cut(arr: np.ndarray, spec) -> np.ndarray:
    """arr's ranges along spec's axis, one after another, zero rows padded up to spec's length."""
    axis, ranges, pad = spec
    pieces = [arr[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges]
    out = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis)
    if pad and out.shape[axis] < pad:
        widths = [(0, 0)] * out.ndim
        widths[axis] = (0, pad - out.shape[axis])
        out = np.pad(out, widths)
    return out


class ShardedWeights(WeightSource):
    """`inner` with the sharded tensors cut (shapes as the rank's graph declares them)."""

    def __init__(self, inner: WeightSource, slices: Mapping[str, tuple]):
        shapes = {}
        for name in inner.names():
            shape = list(inner.shape(name))
            if name in slices:
                axis, ranges, pad = slices[name]
                shape[axis] = pad or sum(b - a for a, b in ranges)
            shapes[name] = tuple(shape)
        super().__init__(inner.path, shapes)
        self.inner, self.slices = inner, dict(slices)
        # (no ggml_type: a GGUF's raw blocks are not cut, so a rank computes on the dequantised cut)
        self.metadata = getattr(inner, "metadata", None)

    def _load(self, name: str, keep_dtype: bool) -> np.ndarray:
        spec = self.slices.get(name)
        if spec is None:
            return self.inner.get(name, keep_dtype=keep_dtype)
        arr = np.ascontiguousarray(cut(self.inner.get(name, keep_dtype=True), spec))
        if not keep_dtype and arr.dtype in FLOAT_DTYPES and arr.dtype != np.float32:
            arr = arr.astype(np.float32)
        return arr
