"""The CPU KV cache is resident from the start and sized by default within a byte budget (issue 42's
soak: the engine's RSS grew by one first-touched block a request, 0.70 MiB on SmolLM2, until
every block of the 3 GiB cache had been used once). Residency is what the kernel says: mincore(2)
over each cache array's pages."""
from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from kiln import loader
from kiln.loader import cpu_kv_blocks, load
from tests.tiny_models import make_tiny_model

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_fraction(arr: np.ndarray) -> float:
    """The fraction of arr's pages in RAM now (mincore(2); arr's range widened to whole pages)."""
    page = mmap.PAGESIZE
    start = arr.ctypes.data // page * page
    end = -(-(arr.ctypes.data + arr.nbytes) // page) * page
    n = (end - start) // page
    vec = (ctypes.c_ubyte * n)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) / n


@pytest.mark.parametrize("backend", ["compiled", "numpy"])
def test_cache_pages_resident_after_load(backend, monkeypatch, tmp_path):
    # one array a layer (K and V x 2 heads x 16 x f32): 2 of 128 MiB at 2^19 tokens, far past
    # malloc's mmap threshold (a fresh mapping, untouched until written: resident ~0 % with np.zeros)
    monkeypatch.setenv("KILN_CPU_BACKEND", backend)
    make_tiny_model(tmp_path, "llama_gqa_untied")
    lm = load(tmp_path, kv_cache_tokens=1 << 19, tokenizer=False)
    caches = [a for a in lm.executor.states.values() if a.nbytes >= 32 << 20]
    assert len(caches) == 2
    for a in caches:
        assert resident_fraction(a) > 0.99
        assert not a.any()  # still zeros


def test_default_size_within_byte_budget(monkeypatch, tmp_path):
    make_tiny_model(tmp_path, "llama_gqa_untied")
    lm = load(tmp_path, kv_cache_tokens=16 * 8, tokenizer=False)
    graph, ex = lm.graph, lm.executor
    # the oracle for a block's bytes: the executor's own state arrays
    per_block = sum(a.nbytes for a in ex.states.values()) // ex.num_blocks
    assert cpu_kv_blocks(graph, 100, 16) == 7  # an explicit size: whole blocks, rounded up
    assert cpu_kv_blocks(graph, None, 16) == 65536 // 16  # 32 MiB: under the 4 GiB budget
    monkeypatch.setattr(loader, "CPU_KV_CACHE_BYTES", 1000 * per_block + per_block // 2)
    assert cpu_kv_blocks(graph, None, 16) == 1000  # the budget binds: what it holds, whole blocks
