"""GGUF models computed in their block formats on the cpu target (load(gguf_blocks=True): linear_gguf,
graph/gguf_ops.py) against

- the same file dequantised at load (today's path): the same logits, bit for bit, where both graphs
  go through the same passes (the passes that know only `linear` — SwiGLU, residual and RoPE
  epilogues — off), and within f32 summation order through the default ones (they fuse the
  dequantised graph's GEMMs into other shapes, whose BLAS sums round differently);
- transformers on the dequantised weights (gguf-py's `dequantize`), within 1e-4 of the largest logit.

Files: a tiny Llama written by gguf-py's GGUFWriter from a transformers checkpoint (q/k rows permuted
as llama.cpp's converter does), its linears in Q8_0/Q4_0/Q4_1 (gguf-py's quantiser) or in
Q4_K/Q5_K/Q6_K (blocks written by the layout, tests/gguf_blocks.py), mixed within a layer as
llama.cpp's Q4_K_M mixes do, the untied LM head quantised too; and the README's SmolLM2 Q4_1.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kiln.loader import load
from kiln.models.gguf_quant import without_blocks
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import default_passes, run_pipeline
from kiln.runtime.worker.cpu_executor import CpuExecutor
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from kiln.graph import DType
from tests.gguf_blocks import quantize_k
from tests.test_weights import llama_cpp_permute
from tests.tiny_models import randomize

DIMS = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=False)
CPP = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
       "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
       "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
MIXES = {  # per module: its type (None: f32); "embed" and "head" the token embedding and the LM head
    "legacy": {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q4_1",
               "up_proj": "Q4_1", "down_proj": "Q4_0", "embed": "Q8_0", "head": "Q8_0"},
    "k-quants": {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q4_K", "o_proj": "Q5_K", "gate_proj": "Q4_K",
                 "up_proj": "Q4_K", "down_proj": "Q6_K", "embed": None, "head": "Q6_K"},
}
PROMPT = np.random.default_rng(5).integers(3, 256, 21).tolist()


def _quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    if qtype.endswith("_K"):
        return quantize_k(w, qtype)
    return gguf_quantize(w, GGMLQuantizationType[qtype])


def write_llama_gguf(path, model, mix: dict) -> dict[str, np.ndarray]:
    """The model as a llama GGUF with `mix`'s types -> {HF name: the weight the file holds, dequantised}."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = GGUFWriter(str(path), "llama")
    for key, value in (("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("block_count", c.num_hidden_layers), ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("rope.dimension_count", c.head_dim),
                       ("context_length", c.max_position_embeddings), ("vocab_size", c.vocab_size)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32("llama.rope.freq_base", 10000.0)
    held = {}

    def add(cpp: str, hf: str, qtype: str | None, heads: int = 0):
        arr = sd[hf]
        stored = llama_cpp_permute(arr, heads) if heads else arr
        if qtype is None:
            w.add_tensor(cpp, stored)
            held[hf] = arr
            return
        raw = _quantize(stored, qtype)
        w.add_tensor(cpp, raw, raw_dtype=GGMLQuantizationType[qtype])
        deq = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(arr.shape)
        held[hf] = llama_cpp_permute_inverse(deq, heads) if heads else deq

    add("token_embd.weight", "model.embed_tokens.weight", mix["embed"])
    add("output_norm.weight", "model.norm.weight", None)
    add("output.weight", "lm_head.weight", mix["head"])
    for i in range(c.num_hidden_layers):
        for hf, cpp in CPP.items():
            leaf = hf.split(".")[-1]
            heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(leaf, 0)
            add(f"blk.{i}.{cpp}.weight", f"model.layers.{i}.{hf}.weight", mix.get(leaf), heads)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def llama_cpp_permute_inverse(w: np.ndarray, heads: int) -> np.ndarray:
    from kiln.models.gguf_weights import unpermute_qk

    return unpermute_qk(w, heads)


@pytest.fixture(scope="module")
def hf_llama():
    cfg = transformers.LlamaConfig(**DIMS, architectures=["LlamaForCausalLM"])
    return randomize(transformers.LlamaForCausalLM(cfg).eval(), seed=3)


def _step(executor, block_size=16):
    chunk = SeqChunk(PROMPT, 0, list(range(-(-len(PROMPT) // block_size))), all_logits=True)
    return next(iter(executor.execute(prepare_step([chunk], block_size)).values()))


def _unfused(source, blocks: bool):
    """The cpu executor over the graph without the passes that know only `linear`."""
    cfg = source.config if blocks else without_blocks(source.config)
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.f32, block_size=16),
                         default_passes(fuse_silu=False, fuse_residual=False, fuse_rope=False))
    return graph, CpuExecutor(graph, source.weights.get, num_blocks=8)


def _transformers_logits(model, held: dict) -> np.ndarray:
    model = type(model)(model.config).eval()
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in held.items()}, strict=False)
    model.tie_weights()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


@pytest.mark.parametrize("mix", list(MIXES))
def test_gguf_blocks_on_cpu(tmp_path, hf_llama, mix, caplog):
    held = write_llama_gguf(tmp_path / "m.gguf", hf_llama, MIXES[mix])
    with caplog.at_level(logging.INFO, logger="kiln.loader"):
        lm = load(tmp_path / "m.gguf", tokenizer=False, gguf_blocks=True, kv_cache_tokens=256)
    ops = [n.op for n in lm.graph.nodes.values()]
    # per layer: q/k/v (one type) merged, o, gate/up merged, down; and the head: all in their blocks
    assert ops.count("linear_gguf") == 4 * DIMS["num_hidden_layers"] + 1 and ops.count("linear") == 0
    log = caplog.text
    assert f"GGUF: {7 * DIMS['num_hidden_layers'] + 1} tensors stay in their block format" in log
    assert "model.layers.*.self_attn.q_proj" in log and "lm_head" in log
    assert ("dequantised at load: model.embed_tokens.weight (Q8_0)" in log) == (mix == "legacy")
    got = _step(lm.executor)
    # the dequantise-at-load path: through the default passes, within f32 summation order
    at_load = _step(load(tmp_path / "m.gguf", tokenizer=False, kv_cache_tokens=256).executor)
    assert np.abs(got - at_load).max() <= 1e-5 * np.abs(at_load).max()
    # and through the same passes, the same bits
    (g_blocks, ex_blocks), (g_load, ex_load) = _unfused(lm.source, True), _unfused(lm.source, False)
    assert [n.op for n in g_blocks.nodes.values()] == [n.op.replace("linear", "linear_gguf") if n.op == "linear"
                                                       else n.op for n in g_load.nodes.values()]
    a, b = _step(ex_blocks), _step(ex_load)
    assert a.tobytes() == b.tobytes()
    want = _transformers_logits(hf_llama, held)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


@pytest.mark.slow
def test_smollm2_q4_1_in_its_blocks(smollm2_gguf, hf_smollm2_model):
    """The README's model, its 210 Q4_1 linears in their blocks (the Q8_0 embedding, tied to the LM
    head, dequantised at load): transformers' prefill logits. (The bits of the dequantise-at-load
    path are test_gguf_blocks_on_cpu's check: loading SmolLM2 twice more costs half a minute.)"""
    lm = load(smollm2_gguf, tokenizer=False, gguf_blocks=True, kv_cache_tokens=256)
    assert sum(n.op == "linear_gguf" for n in lm.graph.nodes.values()) == 30 * 4
    got = _step(lm.executor)
    with torch.no_grad():
        want = hf_smollm2_model(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_moe_experts_in_their_blocks(tmp_path, caplog):
    """A tiny Qwen3-MoE GGUF with Q8_0 experts (tests/test_moe_gguf.py's file): the experts stay in
    their blocks (moe_experts_gguf over gate/up blocks stacked per layer), the log says so, and the
    logits are the dequantise-at-load path's bit for bit (test_moe_gguf.py checks that path against
    transformers)."""
    from tests.test_moe_gguf import write_moe_gguf
    from tests.tiny_moe import make_tiny_moe

    model = make_tiny_moe(tmp_path / "hf", "qwen3_moe", decoder_sparse_step=1, mlp_only_layers=[],
                          norm_topk_prob=True, num_hidden_layers=2)
    write_moe_gguf(tmp_path / "q8.gguf", model, quant=GGMLQuantizationType.Q8_0)
    with caplog.at_level(logging.INFO, logger="kiln.loader"):
        lm = load(tmp_path / "q8.gguf", tokenizer=False, gguf_blocks=True, kv_cache_tokens=256)
    assert [n.op for n in lm.graph.nodes.values()].count("moe_experts_gguf") == 2
    assert "GGUF: 6 tensors stay in their block format" in caplog.text
    assert "model.layers.*.mlp.experts.gate_proj, model.layers.*.mlp.experts.up_proj" in caplog.text
    at_load = load(tmp_path / "q8.gguf", tokenizer=False, kv_cache_tokens=256)
    assert "moe_experts_gguf" not in [n.op for n in at_load.graph.nodes.values()]
    assert _step(lm.executor).tobytes() == _step(at_load.executor).tobytes()


def test_other_types_keep_dequantise_at_load(tmp_path, hf_llama, caplog):
    """A type kiln has no block kernel for (Q5_0 here) keeps today's path: its linear reads the
    weight dequantised at load, beside the others' blocks, and the log names it."""
    mix = dict(MIXES["legacy"], v_proj="Q5_0", embed=None)
    held = write_llama_gguf(tmp_path / "m.gguf", hf_llama, mix)
    with caplog.at_level(logging.INFO, logger="kiln.loader"):
        lm = load(tmp_path / "m.gguf", tokenizer=False, gguf_blocks=True, kv_cache_tokens=256)
    linears = {n.name: n.op for n in lm.graph.nodes.values() if n.op.startswith("linear")}
    assert linears["layers.0.v_proj"] == "linear" and linears["layers.0.q_proj+k_proj"] == "linear_gguf"
    assert "dequantised at load: model.layers.*.self_attn.v_proj.weight (Q5_0)" in caplog.text
    want = _transformers_logits(hf_llama, held)
    got = _step(lm.executor)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
