"""The IR: shape inference, the verifier, topological order, state updates."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.graph import OPS, DType, Graph, GraphError
from kiln.graph.ops import paged_attention, rope
from kiln.models.config import ModelConfig
from kiln.models.llama import build_graph


def tiny_config(**kw) -> ModelConfig:
    d = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=16, intermediate_size=24,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    d.update(kw)
    return ModelConfig.from_hf_dict(d)


def test_llama_graph_shapes_and_order():
    g = build_graph(tiny_config())
    g.verify()
    order = [n.name for n in g.topo_order()]
    assert order[0] == "embed" and order[-1] == "lm_head"
    # the cache write of a layer runs before that layer's attention reads the cache
    assert order.index("layers.0.cache_write") < order.index("layers.0.attn")
    assert g.tensors["lm_head"].shape == ("L", 32)
    assert g.tensors["layers.1.q_rope"].shape == ("T", 4, 4)
    assert [t.name for t in g.states] == ["kv_cache.0", "kv_cache.1"]
    assert "layers.0.q_rope" in g.dump()


def test_verifier_rejects_bad_graphs():
    g = Graph(OPS)
    x = g.input("x", DType.f32, ("T", 8))
    w = g.weight("w", DType.f32, (4, 8))
    y = g.call1("linear", x, w)
    with pytest.raises(ValueError, match="K="):
        g.call1("linear", y, w)  # K mismatch caught by inference
    g.tensors[y.name].shape = ("T", 5)  # a pass that corrupts a shape
    with pytest.raises(GraphError, match="inference says"):
        g.verify()
    with pytest.raises(GraphError, match="defined twice"):
        g.input("x", DType.f32, ("T",))
    with pytest.raises(KeyError, match="unknown op"):
        g.call1("conv3d", x)


def test_cache_write_must_target_state():
    g = Graph(OPS)
    k = g.input("k", DType.f32, ("T", 2, 4))
    not_state = g.input("c", DType.f32, ("NB", 2, 16, 2, 4))
    slots = g.input("s", DType.i32, ("T",))
    g.call1("cache_write", k, k, not_state, slots)
    with pytest.raises(GraphError, match="non-state"):
        g.verify()


def test_rope_layouts_agree_up_to_permutation():
    """gpt-j (interleaved) rope on x equals neox rope on x with pairs de-interleaved."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    pos = rng.integers(0, 100, size=5).astype(np.int32)
    perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    a = rope(x, pos, theta=10000.0, rotary_dim=8, is_neox=False)
    b = rope(x[..., perm], pos, theta=10000.0, rotary_dim=8, is_neox=True)
    np.testing.assert_allclose(a[..., perm], b, rtol=1e-6, atol=1e-6)
    # rotation preserves the norm of each pair
    np.testing.assert_allclose(np.linalg.norm(a, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_paged_attention_matches_dense_causal_attention():
    rng = np.random.default_rng(1)
    H, Hkv, D, BS, L = 4, 2, 8, 4, 11
    k = rng.standard_normal((L, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((L, Hkv, D)).astype(np.float32)
    cache = np.zeros((8, 2, BS, Hkv, D), np.float32)
    blocks = np.array([5, 2, 7])  # scattered, out of order
    for p in range(L):
        cache[blocks[p // BS], 0, p % BS] = k[p]
        cache[blocks[p // BS], 1, p % BS] = v[p]
    n = 3  # the last 3 positions are this step's queries
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    out = paged_attention(q, cache, blocks[None].astype(np.int32), np.array([L], np.int32),
                          np.array([0, n], np.int32), scale=D ** -0.5)
    for i in range(n):
        pos = L - n + i
        for h in range(H):
            kk, vv = k[: pos + 1, h // 2], v[: pos + 1, h // 2]
            s = kk @ q[i, h] * D ** -0.5
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[i, h], (p / p.sum()) @ vv, rtol=1e-5, atol=1e-6)
