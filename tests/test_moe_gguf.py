"""A tiny Qwen3-MoE GGUF written here with gguf-py's GGUFWriter from a tiny transformers checkpoint,
under llama.cpp's names (blk.N.ffn_gate_inp, ffn_{gate,up,down}_exps [E, I, H] / [E, H, I]) and
qwen3moe metadata: kiln gives that checkpoint's logits (f32 experts), and with Q8_0 experts
(dequantised at load) the logits of the same checkpoint holding the dequantised experts."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from kiln.loader import load
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.tiny_moe import make_tiny_moe

ARCH = "qwen3moe"
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """llama.cpp's tensors of a Qwen3MoeForCausalLM (qwen3: no q/k permutation)."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, cpp in LAYER.items():
            out[f"blk.{i}.{cpp}.weight"] = sd[p + hf + ".weight"]
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
        inter = gate_up.shape[1] // 2
        out[f"blk.{i}.ffn_gate_exps.weight"] = np.ascontiguousarray(gate_up[:, :inter])
        out[f"blk.{i}.ffn_up_exps.weight"] = np.ascontiguousarray(gate_up[:, inter:])
        out[f"blk.{i}.ffn_down_exps.weight"] = sd[p + "mlp.experts.down_proj"]
    return out


def write_moe_gguf(path, model, quant=None) -> None:
    c = model.config
    w = GGUFWriter(str(path), ARCH)
    for key, value in (("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("block_count", c.num_hidden_layers), ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("attention.key_length", c.head_dim),
                       ("context_length", c.max_position_embeddings), ("vocab_size", c.vocab_size),
                       ("expert_count", c.num_experts), ("expert_used_count", c.num_experts_per_tok),
                       ("expert_feed_forward_length", c.moe_intermediate_size)):
        w.add_uint32(f"{ARCH}.{key}", value)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{ARCH}.rope.freq_base", c.rope_parameters["rope_theta"])
    for name, arr in gguf_tensors(model).items():
        if quant is not None and "_exps" in name:
            w.add_tensor(name, quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """All layers MoE and renormalised top-k, as llama.cpp's qwen3moe runs them."""
    d = tmp_path_factory.mktemp("qwen3_moe_gguf")
    return d, make_tiny_moe(d / "hf", "qwen3_moe", decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                            num_hidden_layers=3)


def _logits(path, prompt) -> np.ndarray:
    lm = load(path, tokenizer=False)
    chunk = SeqChunk(prompt, 0, list(range(-(-len(prompt) // lm.block_size))), all_logits=True)
    return next(iter(lm.executor.execute(prepare_step([chunk], lm.block_size)).values()))


PROMPT = np.random.default_rng(5).integers(3, 256, 45).tolist()


def test_an_f32_moe_gguf_gives_the_checkpoints_logits(hf_moe):
    d, model = hf_moe
    write_moe_gguf(d / "m.gguf", model)
    lm = load(d / "m.gguf", tokenizer=False)
    cfg = lm.source.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == \
        ("Qwen3MoeForCausalLM", 8, 2, True)
    got = _logits(d / "m.gguf", PROMPT)
    np.testing.assert_allclose(got, _logits(d / "hf", PROMPT), rtol=0, atol=1e-5)
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_q8_0_experts_are_dequantised_at_load(hf_moe):
    d, model = hf_moe
    model = copy.deepcopy(model)  # its experts are replaced below
    q8 = GGMLQuantizationType.Q8_0
    write_moe_gguf(d / "q8.gguf", model, quant=q8)
    deq = {}  # the checkpoint with each expert tensor replaced by its dequantised Q8_0 form
    for name, arr in gguf_tensors(model).items():
        if "_exps" in name:
            deq[name] = dequantize(quantize(arr, q8), q8).reshape(arr.shape)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate_up = np.concatenate([deq[f"blk.{i}.ffn_gate_exps.weight"], deq[f"blk.{i}.ffn_up_exps.weight"]], 1)
            assert not np.array_equal(gate_up, layer.mlp.experts.gate_up_proj.numpy())  # really quantised
            layer.mlp.experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(deq[f"blk.{i}.ffn_down_exps.weight"]))
        want = model(torch.tensor([PROMPT])).logits[0].numpy()
    got = _logits(d / "q8.gguf", PROMPT)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_llama_cpp_moe_names_and_the_1d_shared_expert_gate(tmp_path):
    from kiln.models.gguf_weights import hf_name
    from kiln.models.weights import open_weights

    assert hf_name("blk.2.ffn_gate_exps.weight") == "model.layers.2.mlp.experts.gate_proj.weight"
    assert hf_name("blk.2.ffn_gate_inp.weight") == "model.layers.2.mlp.gate.weight"
    assert hf_name("blk.0.ffn_down_shexp.weight") == "model.layers.0.mlp.shared_expert.down_proj.weight"
    gate = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    w = GGUFWriter(str(tmp_path / "s.gguf"), ARCH)
    w.add_tensor("blk.0.ffn_gate_inp_shexp.weight", gate)  # llama.cpp keeps it as [H]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = open_weights(tmp_path / "s.gguf")
    name = "model.layers.0.mlp.shared_expert_gate.weight"
    assert src.shape(name) == (1, 16)
    np.testing.assert_array_equal(src.get(name), gate[None])
