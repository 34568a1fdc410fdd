"""The fused MoE kernels (codegen/triton/moe*.py) under the interpreter against a numpy reference
written here from the graph ops' semantics (moe_router, moe_experts), on fresh random inputs:
steps where some experts get no token, where one expert gets every token, top-k ties; both
expert paths (decode, grouped); a token's bits alone and in a batch; every kernel's cubins."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.codegen.triton.aot import compile_specs
from kiln.codegen.triton.moe import moe_experts, moe_experts_specs, moe_path, moe_sum
from kiln.codegen.triton.moe_align import moe_align, moe_align_capacity
from kiln.codegen.triton.moe_gemm import MoeTile, moe_sum_spec
from kiln.codegen.triton.moe_router import moe_router, moe_router_spec
from kiln.graph import moe_ops
from tests.codegen.helpers import BF16, assert_close, f32, rand, require_interpreter, same_bits

pytestmark = pytest.mark.usefixtures("interpreter")

E, K, H, I = 8, 2, 64, 32


@pytest.fixture
def interpreter():
    require_interpreter()


@pytest.fixture
def rng():
    return np.random.default_rng(37)


# -- the reference: the graph ops' semantics, one token and rank at a time ----------------------

def ref_router(logits, top_k, renormalize):
    x = f32(logits)
    p = np.exp(x - x.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]  # stable: a tie goes to the lower id
    w = np.take_along_axis(p, ids, -1)
    if renormalize:
        w = w / w.sum(-1, keepdims=True)
    return ids.astype(np.int32), w.astype(np.float32)


def ref_experts(x, ids, w, w13, w2):
    dt, i = x.dtype, w2.shape[2]
    rnd = lambda v: v.astype(dt).astype(np.float32)  # noqa: E731  (a store in the activation dtype)
    y = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):  # rank order
            e = ids[t, j]
            h = rnd(f32(w13[e]) @ f32(x[t]))  # every GEMM output rounded, as a linear's store
            g, u = h[:i], h[i:]
            a = rnd(g / (1.0 + np.exp(-g)) * u)
            y[t] += np.float32(w[t, j]) * rnd(f32(w2[e]) @ a)
    return y.astype(dt)


def _weights(rng, dtype, e=E):
    return rand(rng, (e, 2 * I, H), dtype, 0.2), rand(rng, (e, H, I), dtype, 0.2)


def _routing(rng, t, case, e=E, k=K):
    """topk_ids [T, k] (distinct per token) and renormalised f32 weights."""
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    if case == "some_experts_idle":  # experts 0, 3, 6, 7 get nothing
        pool = np.array([1, 2, 4, 5])
        ids = np.stack([rng.permutation(pool)[:K] for _ in range(t)]).astype(np.int32)
    elif case == "one_expert_takes_all":  # expert 5 is every token's first choice
        ids[:, 0] = 5
        ids[:, 1] = (5 + rng.integers(1, e, t)) % e
    w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    return ids, w / w.sum(-1, keepdims=True)


# -- router ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,e,renorm", [(BF16, 8, True), (np.float32, 12, False), (BF16, 12, True)])
def test_router_matches_reference_with_ties(rng, dtype, e, renorm):
    t = 11
    logits = rand(rng, (t, e), dtype, 2.0)
    logits[0] = logits[0, 0]  # every expert tied: ids 0, 1
    logits[1, [6, 2]] = logits[1].max() + 1.0  # a tie at the top: 2 before 6
    logits[2, [7, 4, 1]] = logits[2].max() + 1.0  # three tied: the lowest two, 1 and 4
    logits[3, 3] = logits[3].max() + 4.0
    logits[3, [5, 0]] = logits[3, 3] - 1.0  # a tie for second place: 0
    for top_k in (1, K, 4):
        ids, w = moe_router(logits, top_k=top_k, renormalize=renorm)
        want_ids, want_w = ref_router(logits, top_k, renorm)
        np.testing.assert_array_equal(ids, want_ids)
        assert_close(w, want_w, rtol=1e-6, what=f"router weights, k={top_k}")
    ids, _ = moe_router(logits, top_k=K, renormalize=renorm)
    assert ids[0].tolist() == [0, 1] and ids[1].tolist() == [2, 6] and ids[2].tolist() == [1, 4]
    assert ids[3].tolist() == [3, 0]


def test_router_leaves_padded_rows_alone(rng):
    logits = rand(rng, (6, E))
    ids, w = np.full((6, K), -7, np.int32), np.full((6, K), np.nan, np.float32)
    moe_router(logits, top_k=K, renormalize=True, ids=ids, weights=w, n_rows=np.array([4], np.int32))
    want_ids, want_w = ref_router(logits[:4], K, True)
    np.testing.assert_array_equal(ids[:4], want_ids)
    assert_close(w[:4], want_w, rtol=1e-6, what="router weights")
    assert (ids[4:] == -7).all() and np.isnan(w[4:]).all()


def test_router_with_the_shared_experts_silu_gives_the_two_launches_bits(rng):
    """moe_router_silu_mul (passes/fuse_router_silu.py): the router's launch also writes the shared
    expert's silu(gate) * up from the merged GEMM's columns (strided slices of one [T, E + 2I + 1]
    matrix, as the model lays them out): ids, weights and act equal the router alone and
    silu_mul_kernel alone bit for bit; padded rows are left alone."""
    from kiln.codegen.triton.silu_mul import silu_mul

    t, i = 9, 40  # 40 columns: a partial block
    merged = rand(rng, (t, E + 2 * i + 1), BF16, 2.0)
    logits, gate, up = merged[:, :E], merged[:, E:E + i], merged[:, E + i:E + 2 * i]
    ids, w = np.full((t, K), -7, np.int32), np.full((t, K), np.nan, np.float32)
    act = np.full((t, i), np.nan, BF16)
    n = np.array([7], np.int32)
    moe_router(logits, top_k=K, renormalize=True, ids=ids, weights=w, n_rows=n, silu=(gate, up, act))
    ids1, w1 = np.full((t, K), -7, np.int32), np.full((t, K), np.nan, np.float32)
    moe_router(logits, top_k=K, renormalize=True, ids=ids1, weights=w1, n_rows=n)
    act1 = np.full((t, i), np.nan, BF16)
    silu_mul(gate, up, act1, n_rows=n)
    np.testing.assert_array_equal(ids, ids1)
    assert np.array_equal(w[:7], w1[:7]) and np.isnan(w[7:]).all()
    assert np.array_equal(act[:7].view(np.uint16), act1[:7].view(np.uint16)) and np.isnan(act[7:].astype(np.float32)).all()
    g, u = gate.astype(np.float32), up.astype(np.float32)
    assert_close(act[:7], (g / (1 + np.exp(-g)) * u)[:7], rtol=1e-2, what="shared expert act")


# -- align ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["random", "some_experts_idle", "one_expert_takes_all"])
@pytest.mark.parametrize("block_m", [16, 32])
def test_align_sorts_assignments_by_expert_into_padded_blocks(rng, case, block_m):
    t, live = 40, 37  # the last 3 tokens are padding: never sorted
    ids, _ = _routing(rng, t, case)
    sorted_ids, block_expert, n_post = moe_align(ids, num_experts=E, block_m=block_m,
                                                 n_rows=np.array([live], np.int32))
    assert sorted_ids.shape == (moe_align_capacity(t, K, E, block_m),)
    flat = ids[:live].reshape(-1)
    counts = np.bincount(flat, minlength=E)
    padded = -(-counts // block_m) * block_m
    assert n_post[0] == padded.sum()
    at = 0
    for e in range(E):  # expert e's run: its assignments in increasing order, then the sentinel
        run = sorted_ids[at:at + padded[e]]
        np.testing.assert_array_equal(run[:counts[e]], np.flatnonzero(flat == e))
        assert (run[counts[e]:] == t * K).all()
        assert (block_expert[at // block_m:(at + padded[e]) // block_m] == e).all()
        at += padded[e]
    if case == "some_experts_idle":
        assert set(block_expert[:at // block_m]) == {1, 2, 4, 5}


# -- experts --------------------------------------------------------------------------------------

PATHS = ("decode", "decode_token", "grouped")


@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["random", "some_experts_idle", "one_expert_takes_all"])
def test_experts_match_reference(rng, dtype, path, case):
    t = 40 if path == "grouped" else 5
    x = rand(rng, (t, H), dtype)
    w13, w2 = _weights(rng, dtype)
    ids, w = _routing(rng, t, case)
    y = moe_experts(x, ids, w, w13, w2, path=path)
    assert_close(y, ref_experts(x, ids, w, w13, w2), rtol=1e-2 if dtype == BF16 else 1e-4,
                 what=f"moe_experts {path} {case}")


def test_router_then_experts_matches_reference(rng):
    """The layer as the graph runs it: router logits -> ids, weights -> experts (bf16)."""
    t = 24
    x, logits = rand(rng, (t, H)), rand(rng, (t, E), BF16, 2.0)
    w13, w2 = _weights(rng, BF16)
    ids, w = moe_router(logits, top_k=K, renormalize=True)
    want_ids, want_w = ref_router(logits, K, True)
    np.testing.assert_array_equal(ids, want_ids)
    assert_close(moe_experts(x, ids, w, w13, w2), ref_experts(x, want_ids, want_w, w13, w2), what="moe layer")


def test_kernels_match_the_graph_ops(rng):
    """The same layer against graph/moe_ops.py, the CPU target's definition (the plans will be
    held to it), with one expert taking every token and some idle."""
    t = 33
    x, logits = rand(rng, (t, H)), rand(rng, (t, E), BF16, 2.0)
    logits[:, 6] = logits.max() + 1.0
    logits[:, [0, 7]] = logits.min() - 8.0
    w13, w2 = _weights(rng, BF16)
    ids, w = moe_router(logits, top_k=K, renormalize=True)
    want_ids, want_w = moe_ops.moe_router(logits, top_k=K, renormalize=True)
    np.testing.assert_array_equal(ids, want_ids)
    assert (ids[:, 0] == 6).all()
    assert_close(w, want_w, rtol=1e-6, what="router weights")
    want = moe_ops.moe_experts(x, want_ids, want_w, w13, w2)
    for path in PATHS:
        assert_close(moe_experts(x, ids, w, w13, w2, path=path), want, what=f"moe_experts {path}")


TILES = [MoeTile(block_m=16, block_n=32, block_k=64), MoeTile(block_m=32, block_n=16, block_k=32, group_m=2),
         MoeTile(block_m=64, block_n=64, block_k=128)]


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_a_tokens_bits_do_not_depend_on_its_batch_path_or_tiles(rng, dtype):
    """Token t's output: in a 40-token step (grouped, several tiles), alone (decode, and grouped),
    and with only 3 others: the same bits. f32 activations first, where no bf16 rounding can hide
    a reordered sum; top-3, so that the order of the rank sum shows (two terms commute)."""
    t = 40
    x = rand(rng, (t, H), dtype)
    w13, w2 = _weights(rng, dtype)
    ids, w = _routing(rng, t, "random", k=3)
    assert moe_path(t, 3) == "grouped" and moe_path(1, 3) == "decode"
    full = moe_experts(x, ids, w, w13, w2)
    for tile in TILES:
        assert same_bits(moe_experts(x, ids, w, w13, w2, path="grouped", tiles=(tile, tile)), full), tile
    for path in ("decode", "decode_token"):
        assert same_bits(moe_experts(x, ids, w, w13, w2, path=path), full), path
    # decode tiles: narrow and wide columns, K in one step or several (the 16-step chain either way)
    for gu, dn in ((MoeTile(16, 16, 32, 2, 5), MoeTile(16, 16, 16, 2, 4)), (MoeTile(16, 64, 64), MoeTile(16, 32, 32))):
        assert same_bits(moe_experts(x, ids, w, w13, w2, path="decode", tiles=(gu, dn)), full), (gu, dn)
    for i in (0, 17, 39):
        for path in PATHS:
            one = moe_experts(x[i:i + 1], ids[i:i + 1], w[i:i + 1], w13, w2, path=path)
            assert same_bits(one[0], full[i]), f"token {i} alone ({path}) differs from its row in the batch"
        few = moe_experts(x[i:i + 4], ids[i:i + 4], w[i:i + 4], w13, w2, path="grouped")
        assert same_bits(few[0], full[i])
    if dtype == np.float32:  # the test can see a change: BLAS's order of the same sums differs
        assert not same_bits(ref_experts(x, ids, w, w13, w2), full)


@pytest.mark.parametrize("path", PATHS)
def test_padded_tokens_are_skipped(rng, path):
    """n_rows < T: the live tokens get their bits, the padding rows are not written."""
    t, live = 12, 9
    x = rand(rng, (t, H))
    w13, w2 = _weights(rng, BF16)
    ids, w = _routing(rng, t, "random")
    ids[live:] = 99  # garbage ids on padded tokens must not be read
    out = np.full((t, H), 7.0, BF16)
    moe_experts(x, ids, w, w13, w2, out, path=path, n_rows=np.array([live], np.int32))
    want = moe_experts(x[:live], ids[:live], w[:live], w13, w2, path=path)
    assert same_bits(out[:live], want)
    assert (f32(out[live:]) == 7.0).all()


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_the_rank_sum_with_the_shared_expert_gives_the_three_ops_bits(rng, dtype):
    """moe_sum with shared=(x, gate) (the lowering folds the shared expert's sigmoid_mul and the
    add into the routed experts' rank-order sum: lower.py _defer_moe_sum) against moe_experts,
    then gdn.sigmoid_mul with add=, both paths that can defer: the same bits; padded rows left
    alone; and within rounding of the graph ops."""
    from kiln.codegen.triton.gdn import sigmoid_mul
    from kiln.codegen.triton.moe import moe_workspace

    t, live, k = 7, 5, 3
    x = rand(rng, (t, H), dtype)
    w13, w2 = _weights(rng, dtype)
    ids, w = _routing(rng, t, "one_expert_takes_all", k=k)
    shared = rand(rng, (t, H), dtype)
    gate_cols = rand(rng, (t, 5), dtype, 2.0)  # the [T, 1] gate: a strided column of a merged GEMM's output
    gate = gate_cols[:, 3:4]
    n = np.array([live], np.int32)
    routed = moe_experts(x, ids, w, w13, w2, n_rows=n)
    want = sigmoid_mul(shared.reshape(t, 1, H), gate[:, :, None], n_rows=n, add=routed.reshape(t, 1, H))[:, 0]
    for path in ("decode", "grouped"):
        need = moe_workspace(t, k, E, H, I, np.dtype(dtype).name, path=path, block_m=16)
        ws = {name: np.empty(shape, dtype if d == np.dtype(dtype).name else d) for name, (shape, d) in need.items()}
        out = np.full((t, H), 7.0, dtype)
        moe_experts(x, ids, w, w13, w2, out, path=path, n_rows=n, workspace=ws, defer_sum=True)
        assert (f32(out) == 7.0).all()  # nothing summed yet
        moe_sum(ws["o"], w, out, n_rows=n, shared=(shared, gate))
        assert same_bits(out[:live], want[:live]), path
        assert (f32(out[live:]) == 7.0).all()
    g = 1 / (1 + np.exp(-f32(gate)))
    ref = f32(ref_experts(x, ids, w, w13, w2)) + f32(shared) * g
    assert_close(out[:live], ref[:live].astype(dtype), rtol=2e-2 if dtype == BF16 else 1e-4, what="routed + shared")


def test_specs_cover_every_path():
    kernels = {s.kernel for p in PATHS for s in moe_experts_specs(40, K, E, H, I, path=p)}
    assert kernels == {"moe_align_kernel", "moe_gate_up_kernel", "moe_down_kernel", "moe_sum_kernel"}
    # Qwen3.6-35B-A3B at batch 1 (issue 37): both GEMMs over (column block, assignment), 16 wide,
    # then the rank-order sum; the token form's down has a program per column block only
    dec = moe_experts_specs(1, 8, 256, 2048, 512, path="decode")
    assert [s.kernel for s in dec] == ["moe_gate_up_kernel", "moe_down_kernel", "moe_sum_kernel"]
    assert [s.grid[:2] for s in dec] == [(512 // 16, 8), (2048 // 16, 8), (1, 2)]
    assert dec[1].constexprs["SPLIT"] and dec[1].constexprs["DECODE"]
    tok = moe_experts_specs(1, 8, 256, 2048, 512, path="decode_token")
    assert [s.grid for s in tok] == [(512 // 32, 8, 1), (2048 // 16, 1, 1)] and "SPLIT" not in tok[1].constexprs


def moe_specs():
    """Every MoE kernel at a Qwen3.6-35B-A3B shape (E 256, k 8, H 2048, I 512) and the tests'
    tiny one: decode (16-row mma.sync tiles), grouped with 16-row and 64-row (wgmma) blocks."""
    specs = [moe_router_spec(64, 256, 8, renormalize=True), moe_router_spec(64, E, K, "float32", renormalize=False)]
    for t in (1, 64, 4096):
        specs += moe_experts_specs(t, 8, 256, 2048, 512)
    specs += moe_experts_specs(1, 8, 256, 2048, 512, path="decode_token")
    specs += [moe_sum_spec(t, 8, 2048, shared="bfloat16") for t in (1, 64)]  # with the shared expert's add
    specs += moe_experts_specs(40, K, E, H, I, "float32", path="grouped")
    return specs


@pytest.mark.slow
def test_every_moe_kernel_compiles_for_both_archs(tmp_path):
    specs = moe_specs()
    assert {s.kernel for s in specs} == {"moe_router_kernel", "moe_align_kernel", "moe_gate_up_kernel",
                                         "moe_down_kernel", "moe_sum_kernel"}
    assert {s.constexprs.get("BLOCK_M") for s in specs if s.kernel == "moe_gate_up_kernel"} == {16, 64}
    # sm_90 also with programmatic dependent launch, as a bundle compiles them: aot checks that
    # nothing touches global memory before griddepcontrol.wait
    jobs = [(s, a) for s in specs for a in ("sm_90", "sm_121")] + [(s.with_pdl(), "sm_90") for s in specs]
    for (spec, arch), c in zip(jobs, compile_specs(jobs, cache_dir=tmp_path), strict=True):
        where = f"{spec.kernel} {spec.constexprs} @ {arch}"
        assert c.cubin[:4] == b"\x7fELF" and c.name == spec.kernel, where
        assert c.target == {"sm_90": "sm_90a", "sm_121": "sm_121a"}[arch], where
        assert c.n_hidden == 2 and c.global_scratch_size == 0, where  # Triton 3.6: two null scratch pointers
        assert c.shared <= (227 if arch == "sm_90" else 99) * 1024, where
