"""The numpy references of moe_router and moe_experts (graph/moe_ops.py) against a plain
per-token loop written here from their definition (and torch's softmax / topk for the router),
on fresh random inputs: top-k ties, an expert no token picks, one expert every token picks,
rank-order sums, batch invariance, and the shape checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.graph import OPS, DType, Graph
from kiln.graph.moe_ops import moe_experts, moe_router


def _silu(v):
    return v / (1.0 + np.exp(-v))


def per_token(x, ids, w, w13, w2):
    """The definition, one token and one rank at a time."""
    inter = w13.shape[1] // 2
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            h = w13[ids[t, j]] @ x[t]
            y[t] += w[t, j] * (w2[ids[t, j]] @ (_silu(h[:inter]) * h[inter:]))
    return y


def _weights(rng, e=6, i=8, h=16):
    return (rng.standard_normal((e, 2 * i, h)).astype(np.float32) / 4,
            rng.standard_normal((e, h, i)).astype(np.float32) / 3)


@pytest.mark.parametrize("renormalize", [False, True])
def test_router_matches_torch_softmax_topk(renormalize):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((37, 16)).astype(np.float32) * 3
    ids, w = moe_router(logits, top_k=4, renormalize=renormalize)
    p = torch.softmax(torch.from_numpy(logits), dim=-1)
    tw, ti = torch.topk(p, 4, dim=-1)
    if renormalize:
        tw = tw / tw.sum(-1, keepdim=True)
    assert ids.dtype == np.int32 and w.dtype == np.float32 and ids.shape == w.shape == (37, 4)
    np.testing.assert_array_equal(ids, ti.numpy())
    np.testing.assert_allclose(w, tw.numpy(), rtol=1e-6, atol=1e-7)
    assert (np.diff(w, axis=1) <= 0).all(), "ranked highest first"


def test_router_ties_go_to_the_lower_expert_id():
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0],    # a three-way tie for the top
                       [2.0, 2.0, 2.0, 2.0, 2.0],    # all equal
                       [0.0, 1.0, 5.0, 1.0, 1.0]], np.float32)  # a tie for second place
    ids, w = moe_router(logits, top_k=2, renormalize=True)
    np.testing.assert_array_equal(ids, [[1, 2], [0, 1], [2, 1]])
    np.testing.assert_allclose(w[:2], 0.5)
    assert w[2, 0] > w[2, 1]


def test_experts_match_the_per_token_definition_with_idle_and_busy_experts():
    """Expert 5 gets no token, expert 0 gets every token (rank 0 for some, rank 1 for others),
    and the per-token loop agrees."""
    rng = np.random.default_rng(1)
    t, h = 23, 16
    w13, w2 = _weights(rng, e=6, h=h)
    x = rng.standard_normal((t, h)).astype(np.float32)
    other = rng.integers(1, 5, t)  # experts 1..4
    ids = np.where(np.arange(t)[:, None] % 2 == 0, np.stack([np.zeros(t), other], 1),
                   np.stack([other, np.zeros(t)], 1)).astype(np.int32)
    w = rng.random((t, 2)).astype(np.float32)
    y = moe_experts(x, ids, w, w13, w2)
    assert y.shape == (t, h) and y.dtype == np.float32 and not np.isnan(y).any()
    np.testing.assert_allclose(y, per_token(x, ids, w, w13, w2), rtol=1e-5, atol=1e-5)


def test_router_then_experts_with_one_expert_for_every_token():
    """Top-1 with one expert's logit far ahead: every token on expert 3 with weight 1."""
    rng = np.random.default_rng(2)
    w13, w2 = _weights(rng)
    x = rng.standard_normal((9, 16)).astype(np.float32)
    logits = rng.standard_normal((9, 6)).astype(np.float32)
    logits[:, 3] += 100.0
    ids, w = moe_router(logits, top_k=1, renormalize=True)
    assert (ids == 3).all() and np.allclose(w, 1.0)
    np.testing.assert_allclose(moe_experts(x, ids, w, w13, w2), per_token(x, ids, w, w13, w2), rtol=1e-5, atol=1e-5)


def test_a_tokens_output_does_not_depend_on_the_others_in_the_step():
    rng = np.random.default_rng(3)
    w13, w2 = _weights(rng, e=8)
    x = rng.standard_normal((40, 16)).astype(np.float32)
    ids, w = moe_router(rng.standard_normal((40, 8)).astype(np.float32), top_k=3, renormalize=False)
    batched = moe_experts(x, ids, w, w13, w2)
    for t in (0, 17, 39):
        alone = moe_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], w13, w2)
        np.testing.assert_allclose(alone[0], batched[t], rtol=1e-6, atol=1e-6)
    # the same tokens in another order: each row follows its token
    perm = rng.permutation(40)
    np.testing.assert_allclose(moe_experts(x[perm], ids[perm], w[perm], w13, w2), batched[perm], rtol=1e-6,
                               atol=1e-6)


def test_bf16_rounds_like_the_dense_mlp():
    """In bf16 each expert's GEMMs and silu_mul round as linear / silu_mul do; the weighted sum
    over ranks is f32 and rounded once."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(4)
    w13, w2 = (a.astype(bf16) for a in _weights(rng))
    x = rng.standard_normal((5, 16)).astype(bf16)
    ids, w = moe_router(rng.standard_normal((5, 6)).astype(np.float32), top_k=2, renormalize=True)
    y = moe_experts(x, ids, w, w13, w2)
    assert y.dtype == bf16
    want = per_token(x.astype(np.float32), ids, w, w13.astype(np.float32), w2.astype(np.float32))
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=3e-2, atol=3e-2)


def test_shape_inference_and_its_errors():
    g = Graph(OPS)
    x = g.input("x", DType.bf16, ("T", 16))
    logits = g.input("logits", DType.bf16, ("T", 6))
    ids, w = g.call("moe_router", [logits], top_k=2, renormalize=True)
    assert (ids.dtype, ids.shape, w.dtype, w.shape) == (DType.i32, ("T", 2), DType.f32, ("T", 2))
    w13, w2 = g.weight("w13", DType.bf16, (6, 16, 16)), g.weight("w2", DType.bf16, (6, 16, 8))
    y = g.call1("moe_experts", x, ids, w, w13, w2)
    assert (y.dtype, y.shape) == (DType.bf16, ("T", 16))
    with pytest.raises(ValueError, match="top_k"):
        g.call("moe_router", [logits], top_k=7, renormalize=True)
    with pytest.raises(ValueError, match=r"\[E, 2I, H\] and \[E, H, I\]"):
        g.call1("moe_experts", x, ids, w, w13, g.weight("w2bad", DType.bf16, (6, 16, 4)))
