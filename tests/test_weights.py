"""Weight sources against transformers: GGUF (SmolLM2, and small written files) and safetensors."""
from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from kiln.errors import InvalidModelError, ModelNotFoundError, UnsupportedArchitectureError
from kiln.models.gguf_weights import hf_name, unpermute_qk
from kiln.models.weights import GGUFWeights, SafetensorsWeights, gguf_to_hf_config, open_weights


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, the transform GGUF llama files carry."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- SmolLM2 GGUF against transformers -------------------------------------------------

def test_smollm2_tensors_equal_transformers(smollm2_weights, hf_smollm2_model):
    state = hf_smollm2_model.state_dict()
    ours = smollm2_weights
    assert isinstance(ours, GGUFWeights) and ours.tied_embeddings
    # Tied: transformers' lm_head.weight is the embedding itself, and we do not duplicate it.
    assert set(state) - set(ours.names()) == {"lm_head.weight"}
    assert set(ours.names()) <= set(state)
    for name in ours.names():
        got, want = ours.get(name), state[name].numpy()
        assert got.dtype == np.float32 and got.shape == want.shape == ours.shape(name), name
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(state["lm_head.weight"].numpy(), ours.get("model.embed_tokens.weight"))


def test_smollm2_config_equals_transformers(smollm2_gguf, smollm2_weights, hf_smollm2_model):
    ours = gguf_to_hf_config(smollm2_weights.metadata)
    hf = transformers.AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "model_type"):
        assert ours[key] == getattr(hf, key), key
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert ours["rope_theta"] == rope["rope_theta"] == 100000.0
    assert ours["rope_scaling"] is None and rope.get("rope_type", "default") == "default"
    assert ours["architectures"] == [type(hf_smollm2_model).__name__] == ["LlamaForCausalLM"]


def test_truncated_gguf_is_invalid(smollm2_gguf, tmp_path):
    half = tmp_path / "half.gguf"
    with open(smollm2_gguf, "rb") as src, open(half, "wb") as dst:
        dst.write(src.read(smollm2_gguf.stat().st_size // 2))
    with pytest.raises(InvalidModelError, match=r"half\.gguf is truncated or corrupt: expected \d+ bytes"):
        open_weights(half)


def test_not_a_gguf_is_invalid(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(InvalidModelError, match="bad.gguf"):
        open_weights(bad)


# --- small GGUF files written here -------------------------------------------------------

def write_gguf(path, arch, tensors: dict, n_head=4, n_kv=2):
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", n_kv)
    for name, (arr, qtype) in tensors.items():
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_written_gguf_names_dtypes_and_permutation(tmp_path, arch):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((32, 16)).astype(np.float32)  # 4 heads of 8
    k = rng.standard_normal((16, 16)).astype(np.float32)  # 2 kv heads of 8
    permuted = arch == "llama"  # llama.cpp permutes q/k only for its llama architecture
    F32, F16, BF16, Q8 = (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                          GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0)
    emb = rng.standard_normal((10, 32)).astype(np.float32)
    write_gguf(tmp_path / "m.gguf", arch, {
        "token_embd.weight": (emb, Q8),
        "blk.0.attn_q.weight": (llama_cpp_permute(q, 4) if permuted else q, F32),
        "blk.0.attn_k.weight": (llama_cpp_permute(k, 2) if permuted else k, BF16),
        "blk.0.attn_v.weight": (k.astype(np.float16), F16),
        "blk.0.attn_k_norm.weight": (np.ones(8, np.float32), F32),
        "output_norm.weight": (np.ones(16, np.float32), F32),
    })
    src = open_weights(tmp_path / "m.gguf")
    assert src.names() == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                           "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                           "model.layers.0.self_attn.k_norm.weight", "model.norm.weight"]
    assert src.shape("model.embed_tokens.weight") == (10, 32) and src.tied_embeddings
    np.testing.assert_array_equal(src.get("model.layers.0.self_attn.q_proj.weight"), q)
    k_bf16 = src.get("model.layers.0.self_attn.k_proj.weight", keep_dtype=True)
    assert k_bf16.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(k_bf16, k.astype(ml_dtypes.bfloat16))
    v = src.get("model.layers.0.self_attn.v_proj.weight", keep_dtype=True)
    assert v.dtype == np.float16 and src.get("model.layers.0.self_attn.v_proj.weight").dtype == np.float32
    # Quantized tensors always come back as float32, keep_dtype or not.
    e = src.get("model.embed_tokens.weight", keep_dtype=True)
    assert e.dtype == np.float32 and np.abs(e - emb).max() < 0.05


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(1)
    for rows, heads in ((48, 6), (24, 2)):
        w = rng.standard_normal((rows, 5))
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, heads), heads), w)
        b = rng.standard_normal(rows)
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(b, heads), heads), b)


def test_hf_names():
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") == "rope_freqs.weight"


def gguf_metadata(arch="qwen3", **extra):
    md = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 128,
          f"{arch}.block_count": 2, f"{arch}.attention.head_count": 4, f"{arch}.context_length": 4096,
          "tokenizer.ggml.tokens": ["a"] * 100}
    return {**md, **{k.replace("ARCH", arch): v for k, v in extra.items()}}


def test_gguf_config_qwen3_head_dim_and_yarn():
    md = gguf_metadata(**{"ARCH.attention.key_length": 32, "ARCH.rope.scaling.type": "yarn",
                          "ARCH.rope.scaling.factor": 4.0, "ARCH.rope.scaling.original_context_length": 1024})
    config = gguf_to_hf_config(md, ["token_embd.weight", "output.weight", "blk.0.attn_q_norm.weight"])
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    assert config["vocab_size"] == 100 and config["num_key_value_heads"] == 4
    assert config["rope_theta"] == 10000.0 and config["tie_word_embeddings"] is False
    assert config["rope_scaling"] == {"rope_type": "yarn", "type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": 1024}


def test_gguf_config_unknown_architecture():
    with pytest.raises(UnsupportedArchitectureError, match="mamba"):
        gguf_to_hf_config(gguf_metadata("mamba"), [])


# --- safetensors ----------------------------------------------------------------------

def save_tiny_llama(path, dtype, **save_kw):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path, **save_kw)
    return model.state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_llama_safetensors_round_trip(tmp_path, dtype):
    state = save_tiny_llama(tmp_path, dtype)
    src = open_weights(tmp_path)
    assert isinstance(src, SafetensorsWeights) and set(src.names()) == set(state)
    for name, tensor in state.items():
        assert src.shape(name) == tuple(tensor.shape) and name in src
        np.testing.assert_array_equal(src.get(name), tensor.float().numpy())
        native = src.get(name, keep_dtype=True)
        assert native.dtype == (ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float32)
        assert native.tobytes() == tensor.contiguous().view(torch.uint8).numpy().tobytes()


def test_sharded_safetensors(tmp_path):
    state = save_tiny_llama(tmp_path, torch.float32, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    src = open_weights(tmp_path)
    assert set(src.names()) == set(state)
    for name, tensor in state.items():
        np.testing.assert_array_equal(src.get(name), tensor.numpy())
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(InvalidModelError, match=shard.name):
        open_weights(tmp_path)


def test_truncated_safetensors_fails_at_open(tmp_path):
    save_tiny_llama(tmp_path, torch.float32)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(InvalidModelError, match=r"model\.safetensors is truncated or corrupt: expected \d+ bytes"):
        open_weights(tmp_path)
    file.write_bytes(data[:20])  # cut inside the header
    with pytest.raises(InvalidModelError, match="model.safetensors"):
        open_weights(tmp_path)


def write_safetensors(path, tensors: dict[str, tuple[str, tuple, bytes]]):
    """A safetensors file by hand, for dtypes torch's writer would need a GPU build for."""
    header, blob = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + blob)


def test_fp8_and_int_safetensors(tmp_path):
    x = np.array([[0.5, -1.0, 2.0], [448.0, 0.0, -0.125]], dtype=ml_dtypes.float8_e4m3fn)
    ids = np.arange(4, dtype=np.int64)
    write_safetensors(tmp_path / "model.safetensors", {
        "w": ("F8_E4M3", x.shape, x.tobytes()), "ids": ("I64", ids.shape, ids.tobytes())})
    src = open_weights(tmp_path / "model.safetensors")
    assert src.get("w", keep_dtype=True).dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(src.get("w"), x.astype(np.float32))
    assert src.get("ids").dtype == np.int64 and src.get("ids").tolist() == [0, 1, 2, 3]
    with pytest.raises(InvalidModelError, match="no tensor named 'nope'"):
        src.get("nope")


def test_bad_safetensors_headers(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"w": ("F4", (2,), b"\0")})
    with pytest.raises(InvalidModelError, match="dtype F4"):
        open_weights(tmp_path / "a.safetensors")
    write_safetensors(tmp_path / "a.safetensors", {"w": ("F32", (3,), bytes(8))})
    with pytest.raises(InvalidModelError, match="declares 8 bytes"):
        open_weights(tmp_path / "a.safetensors")
    (tmp_path / "a.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(InvalidModelError, match="not valid JSON"):
        open_weights(tmp_path / "a.safetensors")


def test_missing_paths(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        open_weights(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="holds no"):
        open_weights(tmp_path)
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(InvalidModelError, match="neither"):
        open_weights(tmp_path / "x.bin")
