"""The hybrid models' ops (graph/gdn_ops.py) against transformers' own torch code for
Qwen3.5 (the pure-torch path: no fla, no causal_conv1d), on fresh random inputs; and the
spec's pitfalls (../shared/specs/qwen3_5.md section 11), one test each."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

from kiln.graph.gdn_ops import (causal_conv1d, gated_delta_rule, gated_rms_norm, gdn_gates,  # noqa: E402
                                gdr_chunked, gdr_recurrent, l2norm, sigmoid_mul)
from kiln.graph.ops import rms_norm  # noqa: E402

RTOL = 1e-4


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def close(a, b, rtol=RTOL):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
    assert err < rtol, f"relative error {err:.2e}"


def gdr_inputs(rng, n, hk=2, hv=4, dk=16, dv=8):
    q, k = rand(rng, n, hk, dk), rand(rng, n, hk, dk)
    v = rand(rng, n, hv, dv)
    a, b = rand(rng, n, hv), rand(rng, n, hv)
    a_log, dt_bias = rand(rng, hv, scale=0.5), rand(rng, hv, scale=0.5)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    return q, k, v, g, beta


def hf_chunk(q, k, v, g, beta, state=None):
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))[None]  # noqa: E731
    r = v.shape[1] // q.shape[1]
    qe, ke = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)  # HF expands GQA before the kernel
    o, s = hf.torch_chunk_gated_delta_rule(
        t(qe), t(ke), t(v), g=t(g), beta=t(beta),
        initial_state=None if state is None else torch.from_numpy(state)[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0].numpy(), s[0].numpy()


def ours(q, k, v, g, beta, seqs, state=None, slots=None):
    """gated_delta_rule over one step of sequences given as (context, n) pairs."""
    dk = q.shape[-1]
    qn, kn = l2norm(q, scale=dk ** -0.5), l2norm(k)
    lens = np.array([c + n for c, n in seqs], np.int32)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    slots = np.arange(len(seqs), dtype=np.int32) if slots is None else slots
    st = np.zeros((len(seqs), v.shape[1], dk, v.shape[2]), np.float32) if state is None else state
    o, st = gated_delta_rule(qn, kn, v, g, beta, st, lens, qsl, slots)
    return o, st


@pytest.mark.parametrize("n", [1, 5, 64, 65, 137])
def test_chunked_rule_matches_transformers(n):
    """The chunked form over three 64-token chunks (and short ones) against HF's torch chunk kernel."""
    rng = np.random.default_rng(n)
    q, k, v, g, beta = gdr_inputs(rng, n)
    want_o, want_s = hf_chunk(q, k, v, g, beta)
    o, st = ours(q, k, v, g, beta, [(0, n)])
    close(o, want_o)
    close(st[0], want_s)


def test_decode_continues_from_the_state_as_transformers_recurrent():
    rng = np.random.default_rng(7)
    q, k, v, g, beta = gdr_inputs(rng, 71)
    o_all, s_all = hf_chunk(q, k, v, g, beta)
    _, st = ours(q[:70], k[:70], v[:70], g[:70], beta[:70], [(0, 70)])
    o, st = ours(q[70:], k[70:], v[70:], g[70:], beta[70:], [(70, 1)], state=st)  # recurrent form
    close(o, o_all[70:])
    close(st[0], s_all)
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))[None]  # noqa: E731
    _, s70 = hf_chunk(q[:70], k[:70], v[:70], g[:70], beta[:70])
    qe, ke = np.repeat(q[70:], 2, axis=1), np.repeat(k[70:], 2, axis=1)
    o_rec, _ = hf.torch_recurrent_gated_delta_rule(t(qe), t(ke), t(v[70:]), g=t(g[70:]), beta=t(beta[70:]),
                                                   initial_state=torch.from_numpy(s70)[None],
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    close(o, o_rec[0].numpy())


@pytest.mark.parametrize("cuts", [(40,), (64,), (10, 64, 100), (1, 2, 3)])
def test_a_prompt_split_over_steps_sees_the_same_chunks(cuts):
    """Chunked prefill: the state carried between steps, the chunks at absolute multiples of 64."""
    rng = np.random.default_rng(sum(cuts))
    n = 150
    q, k, v, g, beta = gdr_inputs(rng, n)
    whole, s_whole = ours(q, k, v, g, beta, [(0, n)])
    st, outs, prev = None, [], 0
    for c in list(cuts) + [n]:
        o, st = ours(q[prev:c], k[prev:c], v[prev:c], g[prev:c], beta[prev:c], [(prev, c - prev)], state=st)
        outs.append(o)
        prev = c
    close(np.concatenate(outs), whole, rtol=1e-5)
    close(st[0], s_whole[0], rtol=1e-5)


def test_recurrent_and_chunked_forms_agree():
    rng = np.random.default_rng(3)
    q, k, v, g, beta = gdr_inputs(rng, 90)
    qe = l2norm(np.repeat(q, 2, axis=1), scale=16 ** -0.5)
    ke = l2norm(np.repeat(k, 2, axis=1))
    s0 = rand(rng, 4, 16, 8)
    o1, s1 = gdr_recurrent(qe, ke, v, g, beta, s0)
    o2, s2 = gdr_chunked(qe, ke, v, g, beta, s0, start=30)
    close(o2, o1)
    close(s2, s1)


def test_batched_sequences_keep_their_own_slots():
    rng = np.random.default_rng(11)
    q, k, v, g, beta = gdr_inputs(rng, 30)
    o_a, s_a = ours(q[:12], k[:12], v[:12], g[:12], beta[:12], [(0, 12)])
    o_b, s_b = ours(q[12:], k[12:], v[12:], g[12:], beta[12:], [(0, 18)])
    state = np.full((3, 4, 16, 8), 7.0, np.float32)  # stale slots: a fresh sequence ignores them
    o, st = ours(q, k, v, g, beta, [(0, 12), (0, 18)], state=state, slots=np.array([2, 0], np.int32))
    np.testing.assert_array_equal(o[:12], o_a)
    np.testing.assert_array_equal(o[12:], o_b)
    np.testing.assert_array_equal(st[2], s_a[0])
    np.testing.assert_array_equal(st[0], s_b[0])
    assert (st[1] == 7.0).all()  # an unused slot is untouched


def conv_inputs(rng, n, c=12, kw=4):
    return rand(rng, n, c), rand(rng, c, 1, kw, scale=0.5)


def test_causal_conv1d_matches_torch_and_carries_its_state():
    rng = np.random.default_rng(5)
    x, w = conv_inputs(rng, 23)
    want = torch.nn.functional.conv1d(torch.from_numpy(x.T)[None], torch.from_numpy(w), padding=3,
                                      groups=x.shape[1])[0, :, :23].numpy().T
    state = np.zeros((2, 12, 3), np.float32)
    y, state = causal_conv1d(x, state, w, np.array([23], np.int32), np.array([0, 23], np.int32),
                             np.array([1], np.int32))
    close(y, want)
    np.testing.assert_array_equal(state[1], x[-3:].T)
    # the same sequence in three steps (7 tokens, 1 decode token, the rest)
    st = np.zeros((2, 12, 3), np.float32)
    parts, prev = [], 0
    for c in (7, 8, 23):
        yp, st = causal_conv1d(x[prev:c], st, w, np.array([c], np.int32), np.array([0, c - prev], np.int32),
                               np.array([0], np.int32))
        parts.append(yp)
        prev = c
    close(np.concatenate(parts), want)


def test_gates_match_the_formula():
    """Pitfall 5: beta is a sigmoid on b's dtype, g = -exp(A_log) * softplus(a + dt_bias) in f32
    (softplus's threshold of 20 included)."""
    rng = np.random.default_rng(2)
    a, b = rand(rng, 9, 4, scale=10.0), rand(rng, 9, 4)
    a[0, 0] = 25.0
    a_log, dt_bias = rand(rng, 4), rand(rng, 4)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    ta = torch.from_numpy(a)
    want_g = -torch.from_numpy(a_log).exp() * torch.nn.functional.softplus(ta + torch.from_numpy(dt_bias))
    close(g, want_g.numpy())
    close(beta, torch.from_numpy(b).sigmoid().numpy())
    import ml_dtypes

    bb = torch.from_numpy(b).to(torch.bfloat16)
    _, beta16 = gdn_gates(a, b.astype(ml_dtypes.bfloat16), a_log, dt_bias)
    np.testing.assert_array_equal(beta16, bb.sigmoid().float().numpy())


def test_gated_norm_uses_plain_w_and_the_silu_gate():
    """Pitfalls 2 and 3: the GDN's gated norm applies w (stored near 1), then silu(z)."""
    rng = np.random.default_rng(4)
    x, z = rand(rng, 6, 4, 8), rand(rng, 6, 4, 8)
    w = (1.0 + rand(rng, 8, scale=0.1)).astype(np.float32)
    m = hf.Qwen3_5RMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(w))
        want = m(torch.from_numpy(x), torch.from_numpy(z)).numpy()
    close(gated_rms_norm(x, z, w, eps=1e-6), want)


def test_zero_centred_norm_is_one_plus_w():
    """Pitfall 2: the layer, final and q/k norms apply (1 + w), w stored near 0."""
    rng = np.random.default_rng(6)
    x, w = rand(rng, 5, 32), rand(rng, 32, scale=0.1)
    m = hf.Qwen3_5RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(w))
        want = m(torch.from_numpy(x)).numpy()
    close(rms_norm(x, w, eps=1e-6, offset=1.0), want)
    assert np.abs(rms_norm(x, w, eps=1e-6) - want).max() > 0.5  # plain w is far off


def test_l2norm_eps_sits_in_the_sum():
    """Pitfall 4: x / sqrt(sum(x^2) + 1e-6), then the dk^-0.5 scale."""
    rng = np.random.default_rng(8)
    x = rand(rng, 3, 2, 16, scale=1e-3)
    want = hf.l2norm(torch.from_numpy(x), dim=-1, eps=1e-6).numpy() * 0.25
    close(l2norm(x, scale=0.25), want)


def test_value_heads_read_key_heads_by_repeat_interleave():
    """Pitfall 7: value head j reads key head j // r; tiling the key heads gives other outputs."""
    rng = np.random.default_rng(9)
    q, k, v, g, beta = gdr_inputs(rng, 20)
    o, _ = ours(q, k, v, g, beta, [(0, 20)])
    want, _ = hf_chunk(q, k, v, g, beta)  # hf_chunk expands by repeat (interleave)
    close(o, want)
    tiled = np.tile(l2norm(q, scale=0.25), (1, 2, 1)), np.tile(l2norm(k), (1, 2, 1))
    o_tile, _ = gdr_chunked(*tiled, v, g, beta, np.zeros((4, 16, 8), np.float32))
    assert np.abs(o_tile - o).max() > 1e-3


def test_attention_gate_is_a_sigmoid_on_the_output():
    rng = np.random.default_rng(10)
    x, gate = rand(rng, 4, 8), rand(rng, 4, 8)
    close(sigmoid_mul(x, gate), (torch.from_numpy(x) * torch.from_numpy(gate).sigmoid()).numpy())
