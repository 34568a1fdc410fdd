"""The numpy reference of paged attention, tiled over queries (graph/ops.py registers it).

Why tiled (issue 42 #3): the first reference built the whole [Hkv, g, n, L] score tensor of a
prefill in one `np.einsum` (numpy's C loops, no BLAS), then a full [n, L] mask, then softmax
over it. A 2,048-token prefill spent ~30 s there on two cores and an 8k one ran out of cache
and bandwidth (529 s). Here every query tile of at most QUERY_TILE rows
- runs its two products as BLAS matmuls ([Hkv, g*m, D] @ [Hkv, D, Lt]), not einsum loops;
- reads only the keys its rows can see: up to its last row's position (causal), and from its
  first row's window start (sliding window), so causally dead upper-right blocks are never
  computed (half the work of a long prefill) and a tile's scores stay a few MB;
- masks in place, on the tile only.
Attention stays quadratic in FLOPs (n x L dot products is what attention is), but at a cost
per score near the BLAS peak, so a prefill of a few thousand tokens is dominated by its
linear layers (docs/BENCHMARKS.md has the numbers).

Numbers: float32 throughout; the softmax's normaliser divides the [m, D] output instead of
the [m, Lt] probabilities (the same value up to rounding; the GPU kernels compare to this
within their dtype's tolerance).
"""
from __future__ import annotations

import numpy as np

_f32 = np.float32

# Query rows per tile: 9 heads x 128 rows x 8k keys of f32 scores is 38 MB at the longest
# context the CPU target serves, a few MB at 2k; smaller tiles pay Python overhead per tile.
QUERY_TILE = 128


def _gather_kv(cache: np.ndarray, blocks: np.ndarray, L: int):
    """The sequence's first L keys and values out of its pages, as [Hkv, D, L] (keys,
    transposed for q @ k) and [Hkv, L, D] (values), float32 and contiguous."""
    hkv, d = cache.shape[3], cache.shape[4]
    k = cache[blocks, 0].reshape(-1, hkv, d)[:L]  # [L, Hkv, D]
    v = cache[blocks, 1].reshape(-1, hkv, d)[:L]
    kt = k.transpose(1, 2, 0).astype(_f32, order="C")  # a copy: also casts a bf16/fp8 cache
    vt = v.transpose(1, 0, 2).astype(_f32, order="C")
    return kt, vt


def _attend_tile(q: np.ndarray, kt: np.ndarray, vt: np.ndarray, p0: int, scale: float,
                 sliding_window: int) -> np.ndarray:
    """q: [m, Hkv, g, D] f32, the rows at absolute positions p0 .. p0+m-1; kt: [Hkv, D, L],
    vt: [Hkv, L, D] the whole context. -> [m, Hkv, g, D]."""
    m, hkv, g, d = q.shape
    hi = p0 + m  # keys past the last row's position are masked for every row: never read
    lo = max(0, p0 - sliding_window + 1) if sliding_window else 0
    qg = np.ascontiguousarray(q.transpose(1, 2, 0, 3)).reshape(hkv, g * m, d)
    scores = (qg @ kt[:, :, lo:hi]).reshape(hkv, g, m, hi - lo)  # [Hkv, g, m, Lt]
    scores *= _f32(scale)
    qpos = np.arange(p0, hi)[:, None]
    kpos = np.arange(lo, hi)[None, :]
    mask = kpos > qpos
    if sliding_window:
        mask |= kpos <= qpos - sliding_window
    if mask.any():
        np.copyto(scores, -np.inf, where=mask)  # mask: [m, Lt], broadcast over heads
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denom = scores.sum(axis=-1, keepdims=True)  # [Hkv, g, m, 1]
    out = (scores.reshape(hkv, g * m, hi - lo) @ vt[:, lo:hi]).reshape(hkv, g, m, d)
    out /= denom
    return out.transpose(2, 0, 1, 3)


def paged_attention_ref(q, cache, block_table, seq_lens, query_start_loc, *, scale: float,
                        sliding_window: int = 0) -> np.ndarray:
    """q: [T, H, D]; cache: [NB, 2, BS, Hkv, D]; block_table: i32[S, MB]; seq_lens: i32[S];
    query_start_loc: i32[S+1] -> f32 [T, H, D]. See ops.paged_attention for the contract."""
    T, H, D = q.shape
    bs, hkv = cache.shape[2], cache.shape[3]
    g = H // hkv
    out = np.zeros((T, H, D), dtype=_f32)
    for s in range(len(seq_lens)):
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        n, L = q1 - q0, int(seq_lens[s])
        if n == 0:
            continue
        kt, vt = _gather_kv(cache, block_table[s, : (L + bs - 1) // bs], L)
        qs = q[q0:q1].astype(_f32, copy=False).reshape(n, hkv, g, D)
        for i in range(0, n, QUERY_TILE):
            m = min(QUERY_TILE, n - i)
            # row i of this sequence's queries sits at absolute position L - n + i
            tile = _attend_tile(qs[i:i + m], kt, vt, L - n + i, scale, sliding_window)
            out[q0 + i:q0 + i + m] = tile.reshape(m, H, D)
    return out
