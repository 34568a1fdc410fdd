"""Safetensors checkpoints, one file or shards, read through a memory map.

We parse the header ourselves (8-byte little-endian length, then JSON) instead of going
through `safetensors.safe_open`: numpy has no bf16 or fp8, and with our own parser every
dtype is one `view` of the mapped bytes, and every byte range can be checked against the
file size when the checkpoint is opened. A shard cut short by an interrupted download
then fails at open time with the file's name, not halfway through a build.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from kiln.errors import InvalidModelError, ModelNotFoundError
from kiln.models.weights import WeightSource

# The safetensors dtype strings, as numpy dtypes (explicitly little-endian: the format is).
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# A header larger than this is not a safetensors header (the reference reader uses 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


class _Entry:
    """Where one tensor lives: its file, dtype, shape and absolute byte range."""

    __slots__ = ("file", "dtype", "shape", "start", "end")

    def __init__(self, file: Path, dtype: np.dtype, shape: tuple[int, ...], start: int, end: int):
        self.file, self.dtype, self.shape, self.start, self.end = file, dtype, shape, start, end


def read_header(file: Path) -> dict[str, _Entry]:
    """The tensor table of one safetensors file, validated against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidModelError(f"model file {file} is truncated or corrupt: it is only {size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise InvalidModelError(
                f"model file {file} is truncated or corrupt: its header claims {n} bytes, "
                f"the file has {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidModelError(f"model file {file} is corrupt: its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise InvalidModelError(f"model file {file} is corrupt: its header is not a JSON object")

    base = 8 + n  # data offsets in the header count from the end of the header
    entries = {name: _entry(file, name, info, base)
               for name, info in header.items() if name != "__metadata__"}
    need = max((e.end for e in entries.values()), default=base) - base
    if base + need > size:
        raise InvalidModelError(
            f"model file {file} is truncated or corrupt: expected {need} bytes of tensor data, "
            f"found {size - base}")
    _check_overlaps(file, entries)
    return entries


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(file: Path, name: str, info, base: int) -> _Entry:
    """One header entry, every field checked before anything is sized by it (issue 42 #12:
    string shapes, negative shapes and offsets past the end gave tracebacks, not a sentence)."""
    bad = f"model file {file} is corrupt: the header entry of tensor {name!r}"
    if not isinstance(info, dict):
        raise InvalidModelError(f"{bad} is not an object")
    dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype_name, str):
        raise InvalidModelError(f"{bad} has no dtype string")
    if dtype_name not in DTYPES:
        raise InvalidModelError(
            f"model file {file} holds tensor {name!r} of dtype {dtype_name}, which kiln cannot read")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise InvalidModelError(f"{bad} has shape {shape!r}, not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise InvalidModelError(f"{bad} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    dtype = DTYPES[dtype_name]
    if end - begin != math.prod(shape) * dtype.itemsize:  # exact ints: no overflow, no float
        raise InvalidModelError(
            f"model file {file} is corrupt: tensor {name!r} declares {end - begin} bytes "
            f"for shape {list(shape)} of {dtype_name}")
    return _Entry(file, dtype, tuple(shape), base + begin, base + end)


def _check_overlaps(file: Path, entries: dict[str, _Entry]) -> None:
    """Two tensors sharing bytes is a corrupt (or crafted) file: the reference reader refuses it."""
    spans = sorted((e.start, e.end, name) for name, e in entries.items() if e.end > e.start)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise InvalidModelError(f"model file {file} is corrupt: tensors {a!r} and {b!r} overlap")


class SafetensorsWeights(WeightSource):
    """Tensors of one or more safetensors files; names are already Hugging Face names."""

    def __init__(self, files: list[Path], path: Path | None = None):
        files = [Path(f) for f in files]
        entries: dict[str, _Entry] = {}
        for file in files:
            if not file.is_file():
                raise ModelNotFoundError(f"model file {file} does not exist")
            for name, entry in read_header(file).items():
                if name in entries:
                    raise InvalidModelError(
                        f"tensor {name!r} appears in both {entries[name].file} and {file}")
                entries[name] = entry
        self._entries = entries
        self._maps: dict[Path, np.memmap] = {}  # opened on first use, one per file
        super().__init__(path or (files[0].parent if len(files) > 1 else files[0]),
                         {name: e.shape for name, e in entries.items()})

    @classmethod
    def from_index(cls, index: Path) -> SafetensorsWeights:
        """Sharded checkpoint: model.safetensors.index.json names each tensor's shard."""
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shard_names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise InvalidModelError(f"{index} is not a valid safetensors index (no weight_map)") from None
        missing = [s for s in shard_names if not (index.parent / s).is_file()]
        if missing:
            raise InvalidModelError(f"{index} lists shard {missing[0]}, which is missing from {index.parent}")
        source = cls([index.parent / s for s in shard_names], path=index.parent)
        # The index and the shards must agree, or a tensor would silently come from nowhere.
        for name, shard in weight_map.items():
            entry = source._entries.get(name)
            if entry is None or entry.file.name != Path(shard).name:
                raise InvalidModelError(f"{index} puts tensor {name!r} in {shard}, but that shard lacks it")
        return source

    def dtype(self, name: str) -> np.dtype:
        self._check(name)
        return self._entries[name].dtype

    def _load(self, name: str, keep_dtype: bool) -> np.ndarray:
        e = self._entries[name]
        mm = self._maps.get(e.file)
        if mm is None:
            mm = self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        # A read-only view into the map: no copy until someone converts or writes it.
        return np.asarray(mm[e.start:e.end]).view(e.dtype).reshape(e.shape)
