"""The compiled CPU target's step kernels (runtime/cpu/op_kernels.py) against the numpy references
of their ops (graph/ops.py) on fresh random inputs. Buffers are larger than the step (T rows of
an arena of more), as the plan passes them."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.graph import ops
from kiln.graph.rope import rope_tables
from kiln.runtime.cpu import op_kernels as K

rng = np.random.default_rng(0)
F32 = np.float32


def arena(rows: int, *shape) -> np.ndarray:
    return np.full((rows, *shape), np.nan, F32)  # rows past T must stay untouched garbage


def close(a, b, tol=2e-6):
    assert not np.isnan(a).any()
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
    assert err < tol, err


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norms(offset):
    T, H = 5, 96
    x, res = rng.standard_normal((2, 8, H), dtype=F32) * 3
    w = rng.standard_normal(H).astype(F32)
    out, res_out = arena(8, H), arena(8, H)
    K.rms_norm(x, w, 1e-5, offset, out, T)
    close(out[:T], ops.rms_norm(x[:T], w, eps=1e-5, offset=offset))
    K.add_rms_norm(x, res, w, 1e-5, offset, out, res_out, T)
    want, want_res = ops.add_rms_norm(x[:T], res[:T], w, eps=1e-5, offset=offset)
    close(out[:T], want)
    assert np.array_equal(res_out[:T], want_res)
    assert np.isnan(out[T:]).all()


def test_silu_mul_grouped_and_add_rows():
    T, I, g = 3, 64, 16
    y = rng.standard_normal((6, 2 * I), dtype=F32) * 4
    out = arena(6, I)
    K.silu_mul_grouped(y, g, out, T)
    gate = y[:T].reshape(T, -1, 2, g)[:, :, 0].reshape(T, I)
    up = y[:T].reshape(T, -1, 2, g)[:, :, 1].reshape(T, I)
    close(out[:T], ops.silu_mul(gate, up))
    a, b = y[:, :I].copy(), y[:, I:].copy()
    K.add_rows(a, b, T)
    assert np.array_equal(a[:T], ops.add(y[:T, :I], y[:T, I:]))


@pytest.mark.parametrize("neox,norm,rd", [(True, False, 32), (False, False, 32), (True, True, 32), (True, False, 16)])
def test_rope_and_kv_write(neox, norm, rd):
    """q rotated and k rotated + v written to their slots equal attention_preamble's (bits, where
    there is no q/k norm), padding slots (-1) write nothing."""
    T, H, Hkv, D, NB, BS = 6, 4, 2, 32, 4, 8
    qkv = rng.standard_normal((8, (H + 2 * Hkv) * D), dtype=F32)
    q = qkv[:, :H * D].reshape(8, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].reshape(8, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].reshape(8, Hkv, D)
    pos = rng.integers(0, 500, T).astype(np.int32)
    slots = rng.permutation(NB * BS)[:T].astype(np.int32)
    slots[2] = -1
    qn, kn = (rng.standard_normal((2, D), dtype=F32) if norm else (np.zeros(0, F32),) * 2)
    cache = rng.standard_normal((NB, 2, BS, Hkv, D), dtype=F32)
    ref_cache = cache.copy()
    scaling = ()
    cos, sin = rope_tables(rd, 10000.0, scaling, 512)
    q_out = arena(8, H, D)
    K.rope_kv(q, k, v, cache, pos, slots, cos, sin, rd, neox, qn, kn, 1e-6, 0.0, q_out, T)
    args = dict(theta=10000.0, rotary_dim=rd, is_neox=neox, scaling=scaling, max_position=512)
    norms = (qn, kn) if norm else ()
    want_q, _ = ops.attention_preamble(np.ascontiguousarray(q[:T]), np.ascontiguousarray(k[:T]),
                                       np.ascontiguousarray(v[:T]), ref_cache, pos, slots, *norms, eps=1e-6, **args)
    if norm:
        close(q_out[:T], want_q)
        close(cache, ref_cache)
    else:
        assert np.array_equal(q_out[:T], want_q)
        assert np.array_equal(cache, ref_cache)


@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention(window):
    """Three sequences (a prefill chunk behind cached context, a decode, a fresh prompt) with
    scattered blocks, GQA."""
    H, Hkv, D, BS, NB = 6, 2, 16, 4, 40
    cache = rng.standard_normal((NB, 2, BS, Hkv, D), dtype=F32)
    seq_lens = np.array([13, 9, 7], np.int32)
    n_new = np.array([5, 1, 7], np.int32)
    qsl = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    T = int(qsl[-1])
    blocks = rng.permutation(NB)[:12].astype(np.int32)
    block_table = blocks.reshape(3, 4)
    q = rng.standard_normal((T + 3, H, D), dtype=F32)
    out = arena(T + 3, H, D)
    seq_of = np.repeat(np.arange(3, dtype=np.int32), n_new)
    K.paged_attention(q, cache, block_table, seq_lens, qsl, 0.25, window, out, seq_of)
    want = ops.paged_attention(q[:T], cache, block_table, seq_lens, qsl, scale=0.25, sliding_window=window)
    close(out[:T], want, 1e-5)
    # rows of sequence 0 marked -1 are left alone (plan.py attends them through BLAS)
    out2 = np.full_like(out, 7.0)
    K.paged_attention(q, cache, block_table, seq_lens, qsl, 0.25, window, out2,
                      np.where(seq_of == 0, -1, seq_of).astype(np.int32))
    assert (out2[:5] == 7.0).all()
    assert np.array_equal(out2[5:T], out[5:T])
