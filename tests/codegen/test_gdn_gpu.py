"""The Gated DeltaNet recurrent kernel on a real GPU at the Qwen3.6 shapes (dk = dv = 128; 16 key
heads, 32 or 48 value heads): its default launch splits a head's value columns over programs, and
the last program of a (token, head) norms the row (the fused gated RMSNorm). Against the numpy
reference (the default split, [128, 8] tiles on 1 warp, and a head in one program, the old
launch); state and normed rows bit for bit the unfused launches' (the rule without the norm, then
gated_rms_norm); a decode token's row and state the same bits in a mixed bucket (chunked kernel,
the norm in place, the recurrent kernel for one-token sequences) and alone; the counters left zero
for the next launch. Whether the split and the one-program launch agree bit for bit is printed
(-s), not asserted: on a GPU their sums over dk may reduce in another order.

    TRITON_INTERPRET=0 pytest -m gpu tests/codegen/test_gdn_gpu.py
torch (a test dependency) only holds device memory here.
"""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton import gdn
from kiln.graph import gdn_ops
from tests.codegen.helpers import BF16, assert_close, f32, rand, same_bits

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
from tests.codegen.gpu_torch import cuda, dev, host  # noqa: E402,F401 (cuda: the autouse skip)

HK, DK, DV = 16, 128, 128




def _batch(new, ctx, slots):
    seq_lens = np.array([n + c for n, c in zip(new, ctx)], np.int32)
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    return seq_lens, qsl, np.array(slots, np.int32)


def _inputs(rng, hv, t):
    """Host q, k, v (column views of one conv output row, as the model lays them out), a, b,
    A_log, dt_bias, z, w."""
    conv = 2 * HK * DK + hv * DV
    mixed = rand(rng, (t, conv))
    q = mixed[:, :HK * DK].reshape(t, HK, DK)
    k = mixed[:, HK * DK:2 * HK * DK].reshape(t, HK, DK)
    v = mixed[:, 2 * HK * DK:].reshape(t, hv, DV)
    ab = rand(rng, (t, 2 * hv))
    a_log = np.log(rng.uniform(1, 16, hv)).astype(np.float32)
    dt_bias = rng.uniform(-1, 1, hv).astype(np.float32)
    z, w = rand(rng, (t, hv * DV)), rand(rng, (DV,))
    return mixed, (q, k, v, ab[:, :hv], ab[:, hv:], a_log, dt_bias), z, w


def _dev_inputs(mixed, ab_host, a_log, dt_bias, hv):
    """The same views over device copies."""
    t = mixed.shape[0]
    m, ab = dev(mixed), dev(ab_host)
    q = m[:, :HK * DK].view(t, HK, DK)
    k = m[:, HK * DK:2 * HK * DK].view(t, HK, DK)
    v = m[:, 2 * HK * DK:].view(t, hv, DV)
    return q, k, v, ab[:, :hv], ab[:, hv:], dev(a_log), dev(dt_bias)


def _reference(ins, z, w, state, seq_lens, qsl, slots):
    q, k, v, a, b, a_log, dt_bias = ins
    o, _ = gdn_ops.fused_gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state, seq_lens, qsl, slots,
                                          q_scale=DK ** -0.5)
    return gdn_ops.gated_rms_norm(o, z.reshape(o.shape), w, eps=1e-6)


@pytest.mark.parametrize("hv", [32, 48])
def test_split_heads_with_the_fused_norm_give_the_unfused_bits(hv):
    rng = np.random.default_rng(38)
    seq_lens, qsl, slots = _batch([1] * 6, [5, 64, 130, 1, 0, 300], [1, 0, 2, 5, 4, 3])
    t = int(qsl[-1])
    mixed, ins, z, w = _inputs(rng, hv, t)
    state0 = (rng.standard_normal((6, hv, DK, DV)) * 0.3).astype(np.float32)
    ref = _reference(ins, z, w, state0.copy(), seq_lens, qsl, slots)
    d_ins = _dev_inputs(mixed, np.concatenate([ins[3], ins[4]], 1), ins[5], ins[6], hv)
    meta = [dev(x) for x in (seq_lens, qsl, slots)]
    zd, wd = dev(z), dev(w)
    outs, states = {}, {}
    for name, kw in {"split": {}, "split8": dict(block_v=8, num_warps=1), "whole": dict(block_v=DV)}.items():
        st = dev(state0)
        out = torch.empty((t, hv, DV), dtype=torch.bfloat16, device="cuda")
        cnt = torch.zeros((t, hv), dtype=torch.int32, device="cuda")
        gdn.gdn_recurrent(*d_ins, st, *meta, out, norm=(zd, wd, 1e-6), counter=cnt, **kw)
        outs[name], states[name] = host(out), host(st)
        assert not host(cnt).any(), f"{name}: counters not left zero"
        assert_close(outs[name], ref, rtol=3e-2, what=f"gdn recurrent + norm ({name})")
    st = dev(state0)
    o = torch.empty((t, hv, DV), dtype=torch.bfloat16, device="cuda")
    gdn.gdn_recurrent(*d_ins, st, *meta, o)  # the same column split, no norm
    unfused = torch.empty_like(o)
    gdn.gated_rms_norm(o, zd, wd, unfused, eps=1e-6, n_rows=dev(np.array([t], np.int32)))
    assert same_bits(states["split"], host(st))
    assert same_bits(outs["split"], host(unfused)), "fused norm != rule then gated_rms_norm"
    print(f"\n[gdn hv={hv}] split vs whole-head program: state same bits "
          f"{same_bits(states['split'], states['whole'])}, rows same bits {same_bits(outs['split'], outs['whole'])}")


def test_a_decode_token_has_the_same_bits_in_a_mixed_bucket():
    hv = 32
    rng = np.random.default_rng(39)
    seq_lens, qsl, slots = _batch([150, 1, 70, 1], [0, 10, 37, 200], [2, 3, 0, 1])
    t = int(qsl[-1])
    mixed, ins, z, w = _inputs(rng, hv, t)
    state0 = (rng.standard_normal((4, hv, DK, DV)) * 0.3).astype(np.float32)
    d_ins = _dev_inputs(mixed, np.concatenate([ins[3], ins[4]], 1), ins[5], ins[6], hv)
    zd, wd = dev(z), dev(w)
    st = dev(state0)
    out = torch.full((t, hv, DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    cnt = torch.zeros((t, hv), dtype=torch.int32, device="cuda")
    meta = [dev(x) for x in (seq_lens, qsl, slots)]
    gdn.gdn_chunked(*d_ins, st, *meta, out, mixed=True)
    gdn.gated_rms_norm(out, zd, wd, out, eps=1e-6, n_rows=dev(np.array([t], np.int32)))
    gdn.gdn_recurrent(*d_ins, st, *meta, out, mixed=True, norm=(zd, wd, 1e-6), counter=cnt)
    mixed_out, mixed_state = host(out), host(st)
    assert not host(cnt).any()
    ref = _reference(ins, z, w, state0.copy(), seq_lens, qsl, slots)
    assert_close(mixed_out, ref, rtol=3e-2, what="mixed bucket, normed")
    for d in (1, 3):  # the decode tokens, alone in a decode launch
        t0 = int(qsl[d])
        one = _dev_inputs(mixed[t0:t0 + 1], np.concatenate([ins[3], ins[4]], 1)[t0:t0 + 1], ins[5], ins[6], hv)
        st1 = dev(state0)
        o1 = torch.empty((1, hv, DV), dtype=torch.bfloat16, device="cuda")
        gdn.gdn_recurrent(*one, st1, dev(seq_lens[d:d + 1]), dev(np.array([0, 1], np.int32)), dev(slots[d:d + 1]),
                          o1, norm=(zd[t0:t0 + 1], wd, 1e-6),
                          counter=torch.zeros((1, hv), dtype=torch.int32, device="cuda"))
        assert same_bits(host(o1), mixed_out[t0:t0 + 1]), f"decode token {d}: row bits differ"
        assert same_bits(host(st1)[slots[d]], mixed_state[slots[d]]), f"decode token {d}: state bits differ"
