"""Online FP8 (`--quantization fp8` on an unquantised checkpoint, vLLM's online dynamic FP8): every
decoder linear's weight quantised to e4m3 with one f32 scale per tensor when it is loaded, its
activations quantised per token by the op that makes them (models/quant_config.py ONLINE_FP8, the
per-tensor layout of models/fp8_linear.py). The LM head and the embeddings stay as they are.

vLLM (vllm/model_executor/layers/quantization/fp8.py Fp8LinearMethod.process_weights_after_loading
for a checkpoint that is not FP8-serialized) quantises with scale = amax(W) / 448 and
W_q = e4m3(W / scale), saturating; it does so on its merged layers (q|k|v, gate|up), one scale for
the merged weight, where kiln keeps one scale for each checkpoint tensor (the finer of the two: a
shard's own amax is at most the merged one's).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from kiln.models.quant_config import Fp8Config
from kiln.models.weights import WeightSource

# the decoder linears the graph builders name (models/llama.py, models/qwen3_5.py, models/moe.py dense MLP)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = np.float32(448.0)


def quantize_per_tensor(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32 [N, K] -> (e4m3 [N, K], f32 [1]): scale = amax / 448 (1 for an all-zero weight)."""
    w = np.asarray(w, np.float32)
    amax = np.float32(np.abs(w).max()) if w.size else np.float32(0)
    scale = np.float32(amax / FP8_MAX) if amax > 0 else np.float32(1)
    return np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(_E4M3), np.array([scale], np.float32)


class OnlineFp8Weights(WeightSource):
    """The checkpoint's tensors with each linear weight the config quantises shown as e4m3 and its
    per-tensor `weight_scale` [1] beside it (computed when either is first read)."""

    def __init__(self, inner: WeightSource, quant: Fp8Config):
        shapes = dict((n, inner.shape(n)) for n in inner.names())
        self._weights: dict[str, str] = {}  # {module}.weight_scale -> {module}.weight
        for name, shape in list(shapes.items()):
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and len(shape) == 2 and module.rpartition(".")[2] in LINEARS \
                    and quant.quantizes(module):
                self._weights[f"{module}.{quant.scale_name}"] = name
                shapes[f"{module}.{quant.scale_name}"] = (1,)
        super().__init__(inner.path, shapes)
        self.inner = inner
        self.metadata = getattr(inner, "metadata", None)
        self._quantized = set(self._weights.values())
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def dtype(self, name: str) -> np.dtype | None:
        self._check(name)
        if name in self._quantized:
            return _E4M3
        if name in self._weights:
            return np.dtype(np.float32)
        dtype = getattr(self.inner, "dtype", None)
        return dtype(name) if dtype is not None else None

    def _quantize(self, weight: str) -> tuple[np.ndarray, np.ndarray]:
        if weight not in self._cache:  # a weight and its scale are read one after the other
            self._cache = {weight: quantize_per_tensor(self.inner.get(weight))}
        return self._cache[weight]

    def _load(self, name: str, keep_dtype: bool) -> np.ndarray:
        if name in self._quantized:
            return self._quantize(name)[0]
        if name in self._weights:
            return self._quantize(self._weights[name])[1]
        return self.inner.get(name, keep_dtype=keep_dtype)
