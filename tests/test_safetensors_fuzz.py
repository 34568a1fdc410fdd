"""Safetensors headers that lie (issue 42 #12), fuzzed with hypothesis (derandomized, bounded):
string, float and negative shapes, offsets past the end or backwards, overlapping tensors, a
header length that is not the header's. Opening the file and loading every tensor either works,
each tensor exactly its declared bytes, or raises InvalidModelError: never another exception, and
never an allocation sized by a header field (traced peak memory stays small)."""
from __future__ import annotations

import json
import math
import struct
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.errors import InvalidModelError
from kiln.models.safetensors_weights import DTYPES, SafetensorsWeights

FUZZ = settings(max_examples=150, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

HOSTILE = st.one_of(
    st.integers(-(1 << 64), 1 << 64), st.floats(allow_nan=True), st.text(max_size=4), st.none(), st.booleans(),
    st.lists(st.one_of(st.integers(-(1 << 63), 1 << 63), st.text(max_size=2), st.floats()), max_size=4),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))


def _valid_header(n: int) -> tuple[dict, int]:
    """n f32 tensors of 2x3, packed back to back; -> (header, data bytes)."""
    header, off = {}, 0
    for i in range(n):
        header[f"t{i}"] = {"dtype": "F32", "shape": [2, 3], "data_offsets": [off, off + 24]}
        off += 24
    return header, off


def _write(path, header, data_len: int, header_len: int | None = None) -> None:
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n % (1 << 64)) + raw + bytes(range(256)) * (data_len // 256 + 1))
    with open(path, "r+b") as f:  # cut the data to data_len exactly
        f.truncate(8 + len(raw) + data_len)


def _open_and_load(path) -> None:
    """Open and read every tensor; what a header promises must hold for each one."""
    tracemalloc.start()
    try:
        try:
            w = SafetensorsWeights([path])
            for name in w.names():
                arr = w.get(name, keep_dtype=True)
                assert arr.shape == w.shape(name) and all(d >= 0 for d in arr.shape)
                assert arr.nbytes == math.prod(arr.shape) * arr.dtype.itemsize
        except InvalidModelError as e:
            assert "\n" not in str(e) and str(path) in str(e)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes traced for a {path.stat().st_size}-byte file"


@FUZZ
@given(n=st.integers(1, 4), which=st.integers(0, 3), field=st.sampled_from(["dtype", "shape", "data_offsets", None]),
       value=HOSTILE, extra=st.integers(-64, 64))
def test_one_lying_field(tmp_path_factory, n, which, field, value, extra):
    header, data = _valid_header(n)
    entry = header[f"t{which % n}"]
    if field is None:
        header[f"t{which % n}"] = value  # the whole entry
    else:
        entry[field] = value
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    _write(path, header, max(0, data + extra))
    _open_and_load(path)


@FUZZ
@given(shape=st.lists(st.integers(-4, 1 << 62), max_size=4), begin=st.integers(-8, 1 << 62),
       size=st.integers(-8, 1 << 62), dtype=st.sampled_from(sorted(DTYPES)), data=st.integers(0, 512),
       header_len=st.one_of(st.none(), st.integers(0, (1 << 64) - 1)))
def test_numbers_that_lie(tmp_path_factory, shape, begin, size, dtype, data, header_len):
    header = {"__metadata__": {"format": "pt"}, "a": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
              "b": {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + size]}}
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    _write(path, header, data, header_len)
    _open_and_load(path)


@pytest.mark.parametrize("entry, says", [
    ({"dtype": "F32", "shape": ["2", "3"], "data_offsets": [0, 24]}, "not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [-2, -3], "data_offsets": [0, 24]}, "not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [2.0, 3], "data_offsets": [0, 24]}, "not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [1 << 38], "data_offsets": [0, 1 << 40]}, "truncated or corrupt: expected"),
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 1 << 40]}, "declares 1099511627776 bytes"),
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [24, 0]}, "0 <= begin <= end"),
    ({"dtype": ["F32"], "shape": [2, 3], "data_offsets": [0, 24]}, "no dtype string"),
])
def test_each_lie_is_one_sentence(tmp_path, entry, says):
    path = tmp_path / "model.safetensors"
    _write(path, {"x": entry}, 64)
    with pytest.raises(InvalidModelError, match=says):
        SafetensorsWeights([path])


def test_overlapping_tensors_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    _write(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                  "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, 24)
    with pytest.raises(InvalidModelError, match="'a' and 'b' overlap"):
        SafetensorsWeights([path])
