"""The Gated DeltaNet kernels (codegen/triton/gdn.py) under the interpreter against
graph/gdn_ops.py, on fresh random inputs: a batch mixing a fresh prompt longer than two
64-token chunks, a continued prefill starting mid-chunk from its state slot, a decode token,
and an empty (padding) sequence."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton import gdn
from kiln.graph import gdn_ops
from tests.codegen.helpers import BF16, assert_close, f32, rand, require_interpreter

pytestmark = pytest.mark.usefixtures("interpreter")

HK, HV, DK, DV, KW = 2, 4, 16, 32, 4
CONV = 2 * HK * DK + HV * DV


@pytest.fixture
def interpreter():
    require_interpreter()


@pytest.fixture
def rng():
    return np.random.default_rng(36)


def _batch(new, ctx, slots):
    """seq_lens, query_start_loc, state_slots of sequences with `new` tokens this step after `ctx`."""
    seq_lens = np.array([n + c for n, c in zip(new, ctx)], np.int32)
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    return seq_lens, qsl, np.array(slots, np.int32)


BATCHES = {
    # fresh 150-token prompt (chunks 64, 64, 22); 70 tokens after 37 (27, 43); a decode token;
    # an empty padding sequence without a slot
    "mixed": ([150, 70, 1, 0], [0, 37, 10, 0], [2, 0, 3, -1]),
    "decode": ([1, 1, 1], [5, 64, 130], [1, 0, 2]),
}


@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_causal_conv1d_matches_reference(rng, dtype, batch):
    seq_lens, qsl, slots = _batch(*BATCHES[batch])
    t, c = int(qsl[-1]), 80  # 80 channels: a partial second block of 64
    x, w = rand(rng, (t, c), dtype), rand(rng, (c, 1, KW), dtype, 0.5)
    state = rand(rng, (4, c, KW - 1), dtype)
    ref_state = state.copy()
    y = gdn.causal_conv1d(x, w, state, seq_lens, qsl, slots, block=64)
    ref, _ = gdn_ops.causal_conv1d(x, ref_state, w, seq_lens, qsl, slots)
    ref = f32(ref)
    ref = (ref / (1.0 + np.exp(-ref))).astype(dtype)  # SiLU fused
    tol = 1e-2 if dtype == BF16 else 1e-5
    assert_close(y, ref, rtol=tol, what="conv1d + silu")
    assert_close(state, ref_state, rtol=tol, what="conv state")


def _gdn_inputs(rng, dtype, t):
    """q, k, v as column views of one conv output [T, CONV] (as the model lays them out)."""
    mixed = rand(rng, (t, CONV), dtype)
    q = mixed[:, :HK * DK].reshape(t, HK, DK)
    k = mixed[:, HK * DK:2 * HK * DK].reshape(t, HK, DK)
    v = mixed[:, 2 * HK * DK:].reshape(t, HV, DV)
    ab = rand(rng, (t, 2 * HV), dtype)
    a, b = ab[:, :HV], ab[:, HV:]
    a_log = np.log(rng.uniform(1, 16, HV)).astype(np.float32)
    dt_bias = rng.uniform(-1, 1, HV).astype(np.float32)
    return q, k, v, a, b, a_log, dt_bias


def _reference(q, k, v, a, b, a_log, dt_bias, state, seq_lens, qsl, slots, *, recurrent: bool):
    """The composition the kernels fuse: l2 norms (q scaled by dk^-0.5), gates, the rule."""
    qn, kn = gdn_ops.l2norm(q, scale=DK ** -0.5), gdn_ops.l2norm(k)
    g, beta = gdn_ops.gdn_gates(a, b, a_log, dt_bias)
    if not recurrent:
        return gdn_ops.gated_delta_rule(qn, kn, v, g, beta, state, seq_lens, qsl, slots)[0]
    r = HV // HK
    out = np.zeros(v.shape, np.float32)
    for _, q0, q1, ctx, slot in gdn_ops._segments(seq_lens, qsl, slots):
        s0 = state[slot] if ctx > 0 and slot >= 0 else np.zeros(state.shape[1:], np.float32)
        o, s1 = gdn_ops.gdr_recurrent(np.repeat(qn[q0:q1], r, 1), np.repeat(kn[q0:q1], r, 1), f32(v[q0:q1]),
                                      g[q0:q1], beta[q0:q1], s0)
        out[q0:q1] = o
        if slot >= 0:
            state[slot] = s1
    return out.astype(v.dtype)


@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("form,batch", [("recurrent", "decode"), ("recurrent", "mixed"), ("chunked", "mixed"),
                                        ("chunked", "decode")])
def test_gated_delta_rule_matches_reference(rng, dtype, form, batch):
    seq_lens, qsl, slots = _batch(*BATCHES[batch])
    ins = _gdn_inputs(rng, dtype, int(qsl[-1]))
    state = (rng.standard_normal((4, HV, DK, DV)) * 0.3).astype(np.float32)
    ref_state = state.copy()
    kernel = gdn.gdn_recurrent if form == "recurrent" else gdn.gdn_chunked
    kw = dict(block_v=16)  # two value blocks per head
    o = kernel(*ins, state, seq_lens, qsl, slots, **kw)
    ref = _reference(*ins, ref_state, seq_lens, qsl, slots, recurrent=form == "recurrent")
    tol = 2e-2 if dtype == BF16 else 1e-4
    assert_close(o, ref, rtol=tol, what=f"gdn {form} output")
    assert_close(state, ref_state, rtol=tol, what=f"gdn {form} state")


def test_mixed_bucket_gives_decode_tokens_the_decode_kernels_bits(rng):
    """In a bucket mixing prefills and decodes the lowering launches the chunked kernel for the
    sequences of several tokens and the recurrent one for the one-token sequences (mixed=True):
    together the reference's numbers, and each decode token gets the same bits as in a decode
    bucket (the recurrent kernel alone), so its greedy token cannot depend on its batch."""
    seq_lens, qsl, slots = _batch(*BATCHES["mixed"])
    ins = _gdn_inputs(rng, BF16, int(qsl[-1]))
    state = (rng.standard_normal((4, HV, DK, DV)) * 0.3).astype(np.float32)
    ref_state, alone_state = state.copy(), state.copy()
    out = np.full((int(qsl[-1]), HV, DV), np.nan, BF16)
    gdn.gdn_chunked(*ins, state, seq_lens, qsl, slots, out, block_v=16, mixed=True)
    gdn.gdn_recurrent(*ins, state, seq_lens, qsl, slots, out, block_v=16, mixed=True)
    ref = _reference(*ins, ref_state, seq_lens, qsl, slots, recurrent=False)
    assert_close(out, ref, rtol=2e-2, what="mixed bucket output")
    assert_close(state, ref_state, rtol=2e-2, what="mixed bucket state")
    d = 2  # the decode sequence: token 220 after 10 of context, slot 3
    t0 = int(qsl[d])
    one = [x[t0:t0 + 1] for x in ins[:5]]
    alone = gdn.gdn_recurrent(*one, *ins[5:], alone_state, seq_lens[d:d + 1], np.array([0, 1], np.int32),
                              slots[d:d + 1], block_v=16)
    assert np.array_equal(alone, out[t0:t0 + 1]) and np.array_equal(alone_state[3], state[3])


def _norm_inputs(rng, t):
    z = rand(rng, (t, HV * DV), BF16)
    w = rand(rng, (DV,), BF16)
    return z, w


@pytest.mark.parametrize("block_v", [8, DV])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_recurrent_kernel_with_the_gated_norm_gives_the_unfused_bits(rng, batch, block_v):
    """fold_gdn_norm's decode launch: the recurrent kernel norming each head's output row before
    the store equals the recurrent kernel then gated_rms_norm bit for bit (state too), and the
    reference composition within bf16 tolerance. block_v 8: a head's 32 columns in 4 programs, the
    last of each (token, head) to count in on the counter norming the row (which it leaves zero);
    block_v DV: one program holds the row."""
    seq_lens, qsl, slots = _batch(*BATCHES[batch])
    t = int(qsl[-1])
    ins = _gdn_inputs(rng, BF16, t)
    z, w = _norm_inputs(rng, t)
    state = (rng.standard_normal((4, HV, DK, DV)) * 0.3).astype(np.float32)
    two, ref_state = state.copy(), state.copy()
    counter = np.zeros((t, HV), np.int32)
    fused = gdn.gdn_recurrent(*ins, state, seq_lens, qsl, slots, norm=(z, w, 1e-6), block_v=block_v, counter=counter)
    assert not counter.any()
    o = gdn.gdn_recurrent(*ins, two, seq_lens, qsl, slots, block_v=16)
    unfused = gdn.gated_rms_norm(o, z, w, eps=1e-6)
    assert np.array_equal(fused.view(np.uint16), unfused.view(np.uint16)) and np.array_equal(state, two)
    o_ref = _reference(*ins, ref_state, seq_lens, qsl, slots, recurrent=True)
    ref = gdn_ops.gated_rms_norm(o_ref, z.reshape(t, HV, DV), w, eps=1e-6)
    assert_close(fused, ref, rtol=3e-2, what="gdn recurrent + gated norm")


@pytest.mark.parametrize("block_v", [8, DV])
def test_mixed_bucket_with_the_gated_norm_gives_decode_tokens_the_decode_bits(rng, block_v):
    """The mixed bucket's launches of fused_gated_delta_rule_norm (codegen/lower.py): chunked,
    the norm over every row in place, recurrent with the norm for the one-token sequences.
    Together the reference's numbers; the decode token's row is the decode launch's bits."""
    seq_lens, qsl, slots = _batch(*BATCHES["mixed"])
    t = int(qsl[-1])
    ins = _gdn_inputs(rng, BF16, t)
    z, w = _norm_inputs(rng, t)
    state = (rng.standard_normal((4, HV, DK, DV)) * 0.3).astype(np.float32)
    ref_state, alone_state = state.copy(), state.copy()
    out = np.full((t, HV, DV), np.nan, BF16)
    gdn.gdn_chunked(*ins, state, seq_lens, qsl, slots, out, block_v=16, mixed=True)
    gdn.gated_rms_norm(out, z, w, out, eps=1e-6)
    gdn.gdn_recurrent(*ins, state, seq_lens, qsl, slots, out, mixed=True, norm=(z, w, 1e-6), block_v=block_v)
    o_ref = _reference(*ins, ref_state, seq_lens, qsl, slots, recurrent=False)
    ref = gdn_ops.gated_rms_norm(o_ref, z.reshape(t, HV, DV), w, eps=1e-6)
    assert_close(out, ref, rtol=3e-2, what="mixed bucket output, normed")
    assert_close(state, ref_state, rtol=2e-2, what="mixed bucket state")
    d = 2
    t0 = int(qsl[d])
    one = [x[t0:t0 + 1] for x in ins[:5]]
    alone = gdn.gdn_recurrent(*one, *ins[5:], alone_state, seq_lens[d:d + 1], np.array([0, 1], np.int32),
                              slots[d:d + 1], norm=(z[t0:t0 + 1], w, 1e-6), block_v=block_v)
    assert np.array_equal(alone.view(np.uint16), out[t0:t0 + 1].view(np.uint16))


def test_sigmoid_mul_reads_the_gate_columns_in_place(rng):
    """The gated attention's gate: columns D..2D of each head of q_proj's [T, H, 2D] output."""
    t, h, d = 5, 3, 32
    qg = rand(rng, (t, h, 2 * d))
    x = rand(rng, (t, h, d))
    y = gdn.sigmoid_mul(x, qg[:, :, d:])
    assert_close(y, gdn_ops.sigmoid_mul(x, qg[:, :, d:]), rtol=1e-2, what="sigmoid_mul")


def test_sigmoid_mul_with_one_gate_a_row_and_an_add(rng):
    """The shared expert's scale (one gate a token, [T, 1]) and its add to the routed experts'
    output in one launch, with the graph's roundings: sigmoid_mul, then add."""
    from kiln.graph.ops import add

    t, n = 6, 96
    x, routed = rand(rng, (t, 1, n)), rand(rng, (t, 1, n))
    gate = rand(rng, (t, 3))[:, 1:2].reshape(t, 1, 1)  # a column of a wider row (the merged GEMM's)
    y = gdn.sigmoid_mul(x, gate, add=routed)
    want = add(routed.reshape(t, n), gdn_ops.sigmoid_mul(x.reshape(t, n), gate.reshape(t, 1)))
    assert np.array_equal(f32(y).reshape(t, n), f32(want))


def test_chunked_prefill_split_at_chunk_boundaries_is_bit_identical(rng):
    """A 150-token prompt in one step, or as 64 + 86 tokens over two steps (the scheduler cuts
    hybrid prefill chunks at multiples of 64), gives the same bits: the kernel cuts chunks at
    absolute positions, so both runs compute the same chunks from the same states."""
    q, k, v, a, b, a_log, dt_bias = _gdn_inputs(rng, np.float32, 150)
    one = np.zeros((1, HV, DK, DV), np.float32)
    o1 = gdn.gdn_chunked(q, k, v, a, b, a_log, dt_bias, one, *_batch([150], [0], [0]))
    two = np.zeros((1, HV, DK, DV), np.float32)
    first = gdn.gdn_chunked(q[:64], k[:64], v[:64], a[:64], b[:64], a_log, dt_bias, two, *_batch([64], [0], [0]))
    rest = gdn.gdn_chunked(q[64:], k[64:], v[64:], a[64:], b[64:], a_log, dt_bias, two, *_batch([86], [64], [0]))
    assert np.array_equal(np.concatenate([first, rest]), o1)
    assert np.array_equal(two, one)


def test_a_token_alone_in_its_window_has_the_same_bits_however_the_prompt_was_split(rng):
    """A 129-token prompt's last token starts a new 64-token window. Prefilled in one step (a
    mixed bucket: chunked kernel, then recurrent), the chunked kernel stops at 128 and leaves
    that token to the recurrent kernel; prefilled as 128 + 1 (the scheduler may end a chunk on
    128), the lone token is a one-token sequence, which the recurrent kernel takes in any
    bucket. Both give it, and the state after it, the same bits; before this rule the chunked
    form's one-token window and the recurrent form rounded differently."""
    ins = _gdn_inputs(rng, BF16, 129)
    one = np.zeros((2, HV, DK, DV), np.float32)
    out = np.full((129, HV, DV), np.nan, BF16)
    gdn.gdn_chunked(*ins, one, *_batch([129], [0], [1]), out, mixed=True)
    gdn.gdn_recurrent(*ins, one, *_batch([129], [0], [1]), out, mixed=True)
    ref = _reference(*ins, np.zeros_like(one), *_batch([129], [0], [1]), recurrent=False)
    assert_close(out, ref, rtol=2e-2, what="129-token prompt")
    two = np.zeros((2, HV, DK, DV), np.float32)
    head = [x[:128] for x in ins[:5]]
    first = np.full((128, HV, DV), np.nan, BF16)
    gdn.gdn_chunked(*head, *ins[5:], two, *_batch([128], [0], [1]), first, mixed=True)
    gdn.gdn_recurrent(*head, *ins[5:], two, *_batch([128], [0], [1]), first, mixed=True)
    last = gdn.gdn_recurrent(*[x[128:] for x in ins[:5]], *ins[5:], two, *_batch([1], [128], [1]))
    assert np.array_equal(first, out[:128]) and np.array_equal(last, out[128:])
    assert np.array_equal(two[1], one[1])


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_gated_rms_norm_matches_reference(rng, dtype):
    t = 7
    x = rand(rng, (t, HV, DV), dtype)
    z = rand(rng, (t, HV * DV), dtype)
    w = rand(rng, (DV,), dtype)
    y = gdn.gated_rms_norm(x, z, w, eps=1e-6)
    ref = gdn_ops.gated_rms_norm(x, z.reshape(t, HV, DV), w, eps=1e-6)
    assert_close(y, ref, rtol=1e-2 if dtype == BF16 else 1e-5, what="gated rms norm")


def test_conv_refuses_a_kernel_width_it_cannot_run(rng):
    x = rand(rng, (3, 8))
    with pytest.raises(Exception, match="kernel width 5"):
        gdn.causal_conv1d(x, rand(rng, (8, 1, 5)), rand(rng, (1, 8, 4)), *_batch([3], [0], [0]))
