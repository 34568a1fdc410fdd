"""graph/gguf_blocks.py's numpy dequantisation, written from the block layouts, against gguf-py's
`dequantize` (the oracle): bit for bit on fresh random blocks of every format kiln computes in
(every byte random but the f16 fields: finite random values of either sign), on blocks gguf-py
itself quantised (Q8_0, Q4_0, Q4_1), and on k-quant blocks written by tests/gguf_blocks.py's
layout-wise quantiser, whose dequantised weights must also be close to the floats it was given
(so those blocks mean what the layout says they mean)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kiln.graph.gguf_blocks import BLOCKS, dequantize, k_of, row_bytes
from tests.gguf_blocks import quantize_k, random_matrix

QTYPES = list(BLOCKS)


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("qtype", QTYPES)
def test_random_blocks_dequantise_as_gguf_py(qtype):
    rng = np.random.default_rng(QTYPES.index(qtype))
    for scale in (0.05, 3e-5, 40.0):  # f16 scales near normal, subnormal-adjacent and large
        raw = random_matrix(qtype, 33, 768, rng, scale=scale)
        want = gguf_dequantize(raw, GGMLQuantizationType[qtype])
        assert _same_bits(dequantize(raw, qtype), want)
        assert np.isfinite(want).all() and (want != 0).mean() > 0.9
    assert row_bytes(qtype, 768) == raw.shape[1] and k_of(qtype, raw.shape[1]) == 768


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_gguf_py_quantised(qtype):
    w = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    raw = gguf_quantize(w, GGMLQuantizationType[qtype])
    assert _same_bits(dequantize(raw, qtype), gguf_dequantize(raw, GGMLQuantizationType[qtype]))


@pytest.mark.parametrize("qtype,tol", [("Q4_K", 0.12), ("Q5_K", 0.06), ("Q6_K", 0.03)])
def test_k_quant_blocks_written_by_the_layout(qtype, tol):
    w = np.random.default_rng(2).standard_normal((3, 8, 512)).astype(np.float32)  # a 3-D (expert) stack too
    raw = quantize_k(w, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (3, 8, row_bytes(qtype, 512))
    deq = dequantize(raw, qtype)
    assert _same_bits(deq, gguf_dequantize(raw, GGMLQuantizationType[qtype]))
    assert np.abs(deq - w).max() < tol * np.abs(w).max()


def test_unknown_type_and_ragged_rows_are_refused():
    with pytest.raises(KeyError):
        dequantize(np.zeros((1, 34), np.uint8), "Q5_0")
    with pytest.raises(ValueError, match="whole 34-byte blocks"):
        dequantize(np.zeros((1, 35), np.uint8), "Q8_0")
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes("Q4_K", 300)
