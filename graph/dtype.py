"""Element types of the IR and their numpy equivalents.

bf16 and fp8 come from ml_dtypes so that numpy can hold them; the numpy backend
computes in f32 and only stores in these types.
"""
from __future__ import annotations

from enum import Enum

import ml_dtypes
import numpy as np


class DType(str, Enum):
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    fp8e4m3 = "fp8e4m3"
    i32 = "i32"
    i64 = "i64"
    u8 = "u8"
    bool = "bool"

    @property
    def is_float(self) -> bool:
        return self in (DType.f32, DType.f16, DType.bf16, DType.fp8e4m3)

    @property
    def itemsize(self) -> int:
        return to_numpy(self).itemsize

    def __str__(self) -> str:  # keeps dumps short: "bf16", not "DType.bf16"
        return self.value


_NUMPY = {
    DType.f32: np.dtype(np.float32),
    DType.f16: np.dtype(np.float16),
    DType.bf16: np.dtype(ml_dtypes.bfloat16),
    DType.fp8e4m3: np.dtype(ml_dtypes.float8_e4m3fn),
    DType.i32: np.dtype(np.int32),
    DType.i64: np.dtype(np.int64),
    DType.u8: np.dtype(np.uint8),
    DType.bool: np.dtype(np.bool_),
}


def to_numpy(dtype: DType) -> np.dtype:
    return _NUMPY[DType(dtype)]


def from_numpy(dtype) -> DType:
    dtype = np.dtype(dtype)
    for k, v in _NUMPY.items():
        if v == dtype:
            return k
    raise TypeError(f"no kiln dtype for numpy dtype {dtype}")


# vLLM's --kv-cache-dtype names -> the KV cache's element type (None: the model's dtype).
# fp8 is e4m3 with scale 1.0 (vLLM's default when a checkpoint carries no k/v scales).
KV_CACHE_DTYPES: dict[str, DType | None] = {"auto": None, "fp8": DType.fp8e4m3, "fp8_e4m3": DType.fp8e4m3}


def kv_cache_dtype(name: str | None) -> DType | None:
    """A --kv-cache-dtype value -> DType or None; an unknown name is a ValueError naming the choices."""
    if name is None:
        return None
    try:
        return KV_CACHE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown kv cache dtype {name!r} (choices: {', '.join(KV_CACHE_DTYPES)})") from None
