"""graph/paged_attention_ref.py: the tiled numpy reference equals dense causal attention (GQA,
sliding window, several sequences, chunks longer than a tile, a partial last block), and a long
prefill's attention never holds an [H, n, L] score tensor (issue 42 #3: the untiled reference
built one, plus a mask and a softmax copy of it, and a 2,048-token prefill took ~30 s)."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from kiln.graph import paged_attention_ref as ref
from kiln.graph.ops import paged_attention


def _dense(q, k, v, start, scale, window):
    """q: [n, H, D] at positions start.., k, v: [L, Hkv, D] -> [n, H, D], one row at a time."""
    n, H, D = q.shape
    g = H // k.shape[1]
    out = np.zeros_like(q)
    for i in range(n):
        pos = start + i
        lo = max(0, pos - window + 1) if window else 0
        for h in range(H):
            s = k[lo:pos + 1, h // g] @ q[i, h] * scale
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[lo:pos + 1, h // g]
    return out


def _paged(rng, lens, hkv, d, bs):
    """A cache holding each sequence's keys and values in shuffled blocks."""
    nblocks = [-(-n // bs) for n in lens]
    cache = np.zeros((sum(nblocks) + 2, 2, bs, hkv, d), np.float32)
    free = list(rng.permutation(len(cache)))
    table = np.zeros((len(lens), max(nblocks)), np.int32)
    kv = []
    for s, n in enumerate(lens):
        k, v = rng.standard_normal((2, n, hkv, d)).astype(np.float32)
        for b in range(nblocks[s]):
            table[s, b] = blk = free.pop()
            cache[blk, 0, : len(k[b * bs:(b + 1) * bs])] = k[b * bs:(b + 1) * bs]
            cache[blk, 1, : len(v[b * bs:(b + 1) * bs])] = v[b * bs:(b + 1) * bs]
        kv.append((k, v))
    return cache, table, kv


@pytest.mark.parametrize("window", [0, 7])
def test_tiled_reference_equals_dense_causal_attention(monkeypatch, window):
    monkeypatch.setattr(ref, "QUERY_TILE", 16)  # several tiles per sequence, cheaply
    rng = np.random.default_rng(4)
    H, hkv, D, bs = 6, 2, 8, 4
    lens, qlens = [1, 45, 70, 9], [1, 45, 20, 1]  # a lone token, a prefill, a chunk, a decode
    cache, table, kv = _paged(rng, lens, hkv, D, bs)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]), H, D)).astype(np.float32)
    got = paged_attention(q, cache, table, np.array(lens, np.int32), qsl, scale=D ** -0.5, sliding_window=window)
    for s, (k, v) in enumerate(kv):
        want = _dense(q[qsl[s]:qsl[s + 1]], k, v, lens[s] - qlens[s], D ** -0.5, window)
        np.testing.assert_allclose(got[qsl[s]:qsl[s + 1]], want, rtol=2e-5, atol=2e-6)


def test_a_long_prefill_never_holds_a_full_score_tensor():
    rng = np.random.default_rng(0)
    n, H, hkv, D, bs = 2048, 9, 3, 64, 16  # SmolLM2-135M's attention shape
    cache = rng.standard_normal((n // bs, 2, bs, hkv, D)).astype(np.float32)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    table = np.arange(n // bs, dtype=np.int32)[None]
    tracemalloc.start()
    try:
        paged_attention(q, cache, table, np.array([n], np.int32), np.array([0, n], np.int32), scale=0.125)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    full = H * n * n * 4  # one f32 [H, n, L] score tensor: 151 MB
    # the output (4.7 MB), the context's K and V (3.1 MB) and one tile's scores (9.4 MB)
    assert peak < full / 6, f"peak {peak / 2**20:.0f} MiB"
