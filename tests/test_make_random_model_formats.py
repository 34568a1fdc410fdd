"""bench/make_random_model.py --format fp8 | nvfp4 | q4k (issue 40's benchmark checkpoints), on tiny shapes:

- each loads in kiln on the numpy target with finite logits;
- fp8 (block-wise, Qwen's layout): kiln's logits against transformers on the weights dequantised here in
  torch from the file (W = e4m3 * weight_scale_inv per block), with every FP8 linear's input rounded as
  vLLM's references round it (tests/fp8_checkpoints.py quantize_activations, tests/test_fp8_models.py's
  bounds); and transformers' own loader of the file (FineGrainedFP8) gives the W8A16 logits;
- nvfp4 (ModelOpt): kiln's logits within 1e-3 of transformers on the weights dequantised here from the
  file (ml_dtypes' e2m1 / e4m3, low nibble first), the bound of tests/test_nvfp4_models.py;
- q4k (a Q4_K_M GGUF): gguf-py's reader reads it, kiln's block dequantisation of every tensor equals
  gguf-py's `dequantize` bit for bit (q/k rows in llama.cpp's order), and kiln computing in the blocks
  gives transformers' logits on gguf-py's dequantised weights within 1e-4 (tests/test_gguf_blocks_models.py);
- the decode roofline's byte count (bench/workloads.py decode_weight_bytes) of the sm_90 graph equals
  the bytes a decode step reads, counted here from the files: every stored tensor's bytes (e4m3 weights,
  f32 / e4m3 scales, u8 pairs, GGUF blocks), bf16 for the plain tensors, but NVFP4's input_scale (W4A16
  does not read it), one row of the untied embedding, and f32 for a hybrid's A_log / dt_bias (the graph
  keeps the GDN decay parameters in f32);
- --dry-run prints every format's bytes, and a (shape, format) kiln does not run is one sentence.
"""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kiln.bench.make_random_model import (FORMATS, FormatRefused, checkpoint_bytes, fp8_block, hf_config,
                                          make_random_model, quantization_config, weight_shapes)
from kiln.bench.workloads import decode_weight_bytes
from kiln.loader import build_graph, load
from kiln.models.source import open_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tests.fp8_checkpoints import quantize_activations  # noqa: E402
from tests.test_fp8_models import _kiln_logits, _prompts, _rel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(shape, format) -> the path kiln loads."""
    root = tmp_path_factory.mktemp("formats")
    cases = [("tiny-llama", "fp8"), ("tiny-llama", "nvfp4"), ("tiny-llama-k", "q4k"), ("tiny-qwen3.6", "fp8")]
    return {(s, f): make_random_model(s, root / f"{s}_{f}", fmt=f, shard_gb=1e-4 if f == "fp8" else 4.0)
            for s, f in cases}


def _tensors(path: Path) -> dict:
    """The checkpoint's tensors through safetensors' torch reader (not kiln's)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _oracle(path: Path, weights: dict):
    """transformers in f32 from the checkpoint's config (without its quantization) holding `weights`."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config", None)
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def _dequantised_fp8(t: dict, block: int) -> dict:
    out = {}
    for name, w in t.items():
        if name.endswith(".weight_scale_inv"):
            continue
        if w.dtype == torch.float8_e4m3fn:
            s = t[name.removesuffix("weight") + "weight_scale_inv"]
            full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:w.shape[0], :w.shape[1]]
            out[name] = w.float() * full
        else:
            out[name] = w.float()
    return out


def test_fp8_is_qwens_layout_with_random_scales(ckpts):
    """config.json's quantization_config is the one Qwen's *-FP8 checkpoints carry (128 x 128 blocks at
    the 8B shape; the tiny shape's largest common block), the linears are e4m3 with f32 block scales that
    are random, and the dequantised weights keep the bf16 pool's spread."""
    assert quantization_config(hf_config("llama-3.1-8b"), "fp8")[0] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    path = ckpts["tiny-llama", "fp8"]
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [32, 32]}
    t = _tensors(path)
    w, s = t["model.layers.1.mlp.down_proj.weight"], t["model.layers.1.mlp.down_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (64, 128) and s.dtype == torch.float32 and s.shape == (2, 4)
    assert t["lm_head.weight"].dtype == torch.bfloat16 and t["model.embed_tokens.weight"].dtype == torch.bfloat16
    scales = torch.cat([v.flatten() for k, v in t.items() if k.endswith("weight_scale_inv")])
    assert len(torch.unique(scales)) == len(scales) and not (scales == 1).any()
    deq = _dequantised_fp8(t, 32)["model.layers.0.mlp.up_proj.weight"]
    assert 0.01 < float(deq.std()) < 0.04 and abs(float(deq.mean())) < 0.005


def test_fp8_hybrid_leaves_qwens_modules_bf16(ckpts):
    """The hybrid's modules_to_not_convert names what Qwen3.5/3.6-*-FP8 leave bf16 (the file's names):
    lm_head, the embeddings, each GDN layer's conv1d, in_proj_a and in_proj_b; and the 27B shape is
    128 x 128 blocks."""
    cfg = hf_config("qwen3.6-27b")
    assert fp8_block(cfg, weight_shapes(cfg)) == 128
    path = ckpts["tiny-qwen3.6", "fp8"]
    skip = set(json.loads((path / "config.json").read_text())["quantization_config"]["modules_to_not_convert"])
    gdn = [i for i, k in enumerate(hf_config("tiny-qwen3.6")["text_config"]["layer_types"]) if k == "linear_attention"]
    want = {"lm_head", "model.language_model.embed_tokens"} | {
        f"model.language_model.layers.{i}.linear_attn.{m}" for i in gdn for m in ("conv1d", "in_proj_a", "in_proj_b")}
    assert skip == want
    t = _tensors(path)
    assert t[f"model.language_model.layers.{gdn[0]}.linear_attn.in_proj_a.weight"].dtype == torch.bfloat16
    assert t[f"model.language_model.layers.{gdn[0]}.linear_attn.in_proj_qkv.weight"].dtype == torch.float8_e4m3fn


def test_fp8_logits_match_the_w8a8_oracle(ckpts):
    """tests/test_fp8_models.py's bounds: most prompts within 1e-2 of the W8A8 oracle, none past half of
    what the activation rounding itself does; and transformers' own FP8 loader gives the W8A16 oracle."""
    path = ckpts["tiny-llama", "fp8"]
    w8a16 = _oracle(path, _dequantised_fp8(_tensors(path), 32))
    w8a16.fp8_layout, w8a16.fp8_block, w8a16.fp8_input_scales, w8a16.fp8_skip = "block", (32, 32), {}, ()
    w8a16.fp8_linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    w8a8 = quantize_activations(copy.deepcopy(w8a16))
    lm = load(path, kv_cache_tokens=1024, tokenizer=False)
    assert [n.op for n in lm.graph.nodes.values()].count("linear_fp8") == 2 * 7
    prompts = _prompts(320, seed=1)
    close = 0
    for s, (p, got) in enumerate(zip(prompts, _kiln_logits(lm, prompts))):
        assert np.isfinite(got).all()
        with torch.no_grad():
            ref = w8a8(torch.tensor([p])).logits[0].numpy()
            rounding = _rel(ref, w8a16(torch.tensor([p])).logits[0].numpy())
        err = _rel(got, ref)
        assert err < 0.5 * rounding, f"prompt {s}: {err:.2e} from the W8A8 oracle, the rounding moves {rounding:.2e}"
        close += err < 1e-2
    assert close >= 0.75 * len(prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    p = torch.tensor([prompts[2]])
    with torch.no_grad():
        assert _rel(hf(p).logits[0].numpy(), w8a16(p).logits[0].numpy()) < 1e-5


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_hybrid_formats_load_with_finite_logits(ckpts, tmp_path, fmt):
    """The Qwen3.6 hybrid shape in fp8 and nvfp4 (issue 40 benchmarks the 27B in FP8) loads in kiln on the
    numpy target with its linears quantised and finite logits."""
    path = ckpts["tiny-qwen3.6", "fp8"] if fmt == "fp8" else make_random_model("tiny-qwen3.6", tmp_path, fmt=fmt)
    lm = load(path, kv_cache_tokens=1024, tokenizer=True)
    ops = [n.op for n in lm.graph.nodes.values()]
    assert ops.count(f"linear_{fmt}") >= 4 * 3  # every layer's MLP and attention or GDN projections
    out = _kiln_logits(lm, _prompts(320, seed=6, lens=(1, 9, 40)))
    assert all(np.isfinite(x).all() and np.abs(x).max() > 0 for x in out)


def _e2m1(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def test_nvfp4_is_modelopts_layout_and_matches_the_oracle(ckpts):
    """hf_quant_config.json and config.json's quantization_config as NVIDIA's checkpoints carry them
    (tests/nvfp4_checkpoints.py's copies of ModelOpt's), random e4m3 block scales and f32 tensor
    scales; kiln's logits within 1e-3 of transformers on the weights dequantised here."""
    from tests.nvfp4_checkpoints import CONFIG_JSON_QC, HF_QUANT_CONFIG

    path = ckpts["tiny-llama", "nvfp4"]
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    hq = json.loads((path / "hf_quant_config.json").read_text())
    assert {k: v for k, v in qc.items() if k != "producer"} == {k: v for k, v in CONFIG_JSON_QC.items() if k != "producer"}
    assert hq["quantization"] == HF_QUANT_CONFIG["quantization"] and hq["producer"]["name"] == "modelopt"
    t = {k: v.float().numpy() if v.dtype != torch.uint8 else v.numpy() for k, v in _tensors(path).items()}
    weights = {}
    for name, w in t.items():
        if name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if w.dtype == np.uint8:
            m = name.removesuffix(".weight")
            s, s2 = t[m + ".weight_scale"], t[m + ".weight_scale_2"]
            assert s.shape == (w.shape[0], w.shape[1] // 8) and s2.shape == ()
            assert len(np.unique(s)) > 10 and (s > 0).all()
            vals = np.stack([_e2m1(w & 15), _e2m1(w >> 4)], axis=-1).reshape(w.shape[0], -1)  # low nibble first
            w = vals * np.repeat(s, 16, axis=1) * s2
            assert 0.01 < float(w.std()) < 0.04
        weights[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    oracle = _oracle(path, weights)
    lm = load(path, kv_cache_tokens=1024, tokenizer=False)
    assert [n.op for n in lm.graph.nodes.values()].count("linear_nvfp4") == 2 * 7
    prompts = _prompts(320, seed=1)
    for p, got in zip(prompts, _kiln_logits(lm, prompts)):
        assert np.isfinite(got).all()
        with torch.no_grad():
            ref = oracle(torch.tensor([p])).logits[0].numpy()
        assert _rel(got, ref) <= 1e-3


def test_q4k_gguf_blocks_equal_gguf_py_and_logits_match(ckpts):
    """Q4_K_M's mix (Q6_K for output and for attn_v / ffn_down in use_more_bits' layers), every block
    tensor dequantised by kiln equal to gguf-py's dequantize, values of the bf16 pool's spread, and kiln
    in the blocks within 1e-4 of transformers on gguf-py's weights."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    from kiln.graph.gguf_blocks import dequantize as kiln_dequantize
    from kiln.models.gguf_weights import hf_name, unpermute_qk
    from tests.test_weights import llama_cpp_permute

    path = ckpts["tiny-llama-k", "q4k"]
    reader = GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    # 2 layers: use_more_bits(1, 2) (the last eighth) and not use_more_bits(0, 2)
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == types["blk.1.ffn_up.weight"] == "Q4_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    lm = load(path, kv_cache_tokens=256, tokenizer=True, gguf_blocks=True)
    src, cfg = lm.source.weights, lm.source.config
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    held = {}
    for t in reader.tensors:
        want = np.asarray(gguf_dequantize(t.data, t.tensor_type), np.float32).reshape(tuple(reversed(t.shape.tolist())))
        name = hf_name(t.name)
        h = next((n for k, n in heads.items() if f".{k}." in t.name), 0)
        if t.tensor_type.name in ("Q4_K", "Q6_K"):
            got = kiln_dequantize(src.inner.raw_blocks(name), t.tensor_type.name)
            assert np.array_equal(llama_cpp_permute(got, h) if h else got, want), t.name
            assert 0.01 < float(want.std()) < 0.04 and abs(float(want.mean())) < 0.005, t.name
        held[name] = torch.from_numpy(np.array(unpermute_qk(want, h) if h else want))
    hf_cfg = {k: v for k, v in hf_config("tiny-llama-k").items() if k != "rope_scaling"}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg)).eval()
    missing, unexpected = hf.load_state_dict(held, strict=False)
    assert not unexpected and not missing
    # every linear in its blocks: per layer q/k/v (one type) merged, o, gate/up merged, down; layer 1's
    # Q6_K v apart from its Q4_K q/k; and the head
    assert [n.op for n in lm.graph.nodes.values()].count("linear_gguf") == 4 * 2 + 1 + 1
    prompts = _prompts(320, seed=1)
    for p, got in zip(prompts, _kiln_logits(lm, prompts)):
        assert np.isfinite(got).all()
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        assert _rel(got, ref) <= 1e-4
    assert lm.tokenizer.decode(lm.tokenizer.encode("hi there", add_special_tokens=False)) == "hi there"


def _expected_decode_bytes(path: Path) -> int:
    """The bytes one decode step on a GPU reads, from the files alone (the module docstring's rule)."""
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        total = 0
        for t in GGUFReader(path).tensors:
            if t.name == "token_embd.weight":
                total += 2 * int(t.shape[0])  # one bf16 row (ne[0] = hidden)
            elif t.tensor_type.name in ("F32", "F16", "BF16"):
                total += 2 * int(t.n_elements)  # plain tensors in the GPU graph's bf16
            else:
                total += int(t.n_bytes)  # the blocks as stored
        return total
    total = 0
    for f in path.glob("*.safetensors"):
        raw = f.read_bytes()
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        for name, info in header.items():
            if name == "__metadata__" or name.endswith(".input_scale"):
                continue
            n = info["data_offsets"][1] - info["data_offsets"][0]
            if name.endswith("embed_tokens.weight"):
                n //= info["shape"][0]
            elif name.endswith((".A_log", ".dt_bias")):
                n = 4 * math.prod(info["shape"])
            total += n
    return total


@pytest.mark.parametrize("case", [("tiny-llama", "fp8"), ("tiny-llama", "nvfp4"), ("tiny-llama-k", "q4k"),
                                  ("tiny-qwen3.6", "fp8")], ids="-".join)
def test_decode_roofline_counts_the_quantised_bytes(ckpts, case):
    path = ckpts[case]
    cfg = open_model(path).config
    graph = build_graph(cfg, target="sm_90")
    got = decode_weight_bytes(graph, cfg)
    assert got == _expected_decode_bytes(path)
    plain = checkpoint_bytes(case[0])  # the same model in bf16, embeddings whole
    assert got < 0.75 * plain


def test_q4k_pure_is_all_q4_k(tmp_path):
    """--pure (llama-quantize's): every quantised tensor Q4_K, the output too; it runs in kiln's blocks
    with finite logits, and the roofline counts its blocks."""
    from gguf import GGUFReader

    path = make_random_model("tiny-llama-k", tmp_path, fmt="q4k", pure=True)
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert {q for n, q in types.items() if not n.endswith("norm.weight")} == {"Q4_K"}
    lm = load(path, kv_cache_tokens=256, tokenizer=False, gguf_blocks=True)
    assert [n.op for n in lm.graph.nodes.values()].count("linear_gguf") == 4 * 2 + 1
    assert all(np.isfinite(x).all() for x in _kiln_logits(lm, _prompts(320, seed=4)))
    cfg = lm.source.config
    assert decode_weight_bytes(build_graph(cfg, target="sm_90"), cfg) == _expected_decode_bytes(path)
    assert checkpoint_bytes("tiny-llama-k", "q4k", pure=True) == path.stat().st_size - _data_offset(path)


def _data_offset(path: Path) -> int:
    """Where a GGUF's tensor data starts (its size minus the data is the header and metadata)."""
    from gguf import GGUFReader

    return GGUFReader(path).data_offset


def test_dry_run_prints_each_format_and_refusals_are_one_sentence(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "bench" / "make_random_model.py"), "--shape", "llama-3.1-8b",
                          "--dry-run"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == len(FORMATS)
    for line, fmt in zip(out, FORMATS):
        assert line.startswith(f"llama-3.1-8b {fmt}: ") and f" {checkpoint_bytes('llama-3.1-8b', fmt)} bytes " in line
    # llama.cpp's Llama-3.1-8B Q4_K_M is 4.92 GB: the mix writes the same bytes (4.91 GB of tensors)
    assert 4.85e9 < checkpoint_bytes("llama-3.1-8b", "q4k") < 4.95e9
    moe = subprocess.run([sys.executable, str(REPO / "bench" / "make_random_model.py"), "--shape", "qwen3.6-35b-a3b",
                          "--dry-run"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert moe[0].startswith("qwen3.6-35b-a3b bf16: ")
    assert any(line.startswith("qwen3.6-35b-a3b in q4k is not written: ") for line in moe)
    with pytest.raises(FormatRefused, match=r"^tiny-llama in q4k is not written: .*256-weight k-quant blocks$"):
        make_random_model("tiny-llama", tmp_path / "x", fmt="q4k")
    assert not (tmp_path / "x").exists()  # refused before anything is written
    r = subprocess.run([sys.executable, str(REPO / "bench" / "make_random_model.py"), "--shape", "tiny-qwen3.6",
                        "--format", "q4k", "--out", str(tmp_path / "y")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "q4k is not written" in r.stderr
