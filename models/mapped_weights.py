"""A weight source under a graph's tensor names over a checkpoint with other names or layouts
(models/qwen3_5.py's text tower under model.language_model., Qwen3-Next's interleaved GDN
projections, models/moe_weights.py's stacked experts)."""
from __future__ import annotations

import numpy as np

from kiln.models.weights import WeightSource


class MappedWeights(WeightSource):
    """A weight source under the graph's names over another checkpoint layout: names are
    renamed (`rename`: graph name -> file name) or derived from several file tensors (`derived`:
    graph name -> (shape, fn(get) -> array)). Everything else of the file is not visible."""

    def __init__(self, inner: WeightSource, rename: dict[str, str], derived: dict[str, tuple]):
        shapes = {name: inner.shape(src) for name, src in rename.items()}
        shapes.update({name: shape for name, (shape, _) in derived.items()})
        super().__init__(inner.path, shapes)
        self.inner, self._rename, self._derived = inner, rename, derived
        self.metadata = getattr(inner, "metadata", None)

    def dtype(self, name: str) -> np.dtype | None:
        """A renamed tensor's stored dtype (models/fp8_weights.py checks quantised ones); None for
        a derived one or an inner source that keeps none."""
        self._check(name)
        inner = getattr(self.inner, "dtype", None)
        return inner(self._rename[name]) if inner is not None and name in self._rename else None

    def _load(self, name: str, keep_dtype: bool) -> np.ndarray:
        if name in self._derived:
            return self._derived[name][1](lambda src: self.inner.get(src, keep_dtype=keep_dtype))
        return self.inner.get(self._rename[name], keep_dtype=keep_dtype)
