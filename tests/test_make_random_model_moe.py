"""bench/make_random_model.py --format fp8 | nvfp4 for the MoE shapes (issue 40's qwen3.6-35b-a3b and
qwen3-30b-a3b), on their tiny counterparts tiny-qwen3.6-moe (Qwen3_5MoeForConditionalGeneration: shared
expert, GDN layers) and tiny-qwen3-moe (Qwen3MoeForCausalLM):

- the layout kiln's FP8 / NVFP4 MoE readers take (tests/test_fp8_moe.py, tests/test_nvfp4_moe.py): every
  expert's gate/up/down_proj per expert, e4m3 + f32 weight_scale_inv (fp8) or u8 pairs + e4m3
  weight_scale + scalar weight_scale_2 / input_scale (nvfp4); the shared expert quantised like the other
  linears; the router mlp.gate and mlp.shared_expert_gate bf16 and named in modules_to_not_convert /
  exclude_modules; in fp8 a hybrid's embeddings, lm_head and GDN conv1d / in_proj_a / in_proj_b bf16;
- kiln (numpy target) against transformers in f32 on the weights dequantised here from the files:
  nvfp4 (W4A16) within 1e-3 (tests/test_nvfp4_moe.py's bound); fp8 against the W8A8 oracle of
  tests/test_fp8_moe.py (every FP8 linear's and expert's input and the experts' intermediate rounded to
  e4m3 per token per block) within 1e-3, where the unrounded model is more than 2e-2 off;
- the decode roofline (bench/workloads.py decode_weight_bytes on the sm_90 graph) and --dry-run's
  figure (make_random_model.decode_bytes) both equal the bytes a decode token reads counted from the
  files: of the experts only num_experts_per_tok / num_experts of their weights and scales.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kiln.bench.make_random_model import checkpoint_bytes, decode_bytes, hf_config, make_random_model
from kiln.bench.workloads import decode_weight_bytes
from kiln.loader import build_graph, load
from kiln.models.source import open_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.fp8_checkpoints import check_w8a8_logits  # noqa: E402
from tests.test_fp8_models import _prompts, _rel  # noqa: E402
from tests.test_fp8_moe import _oracle_logits, _Probe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHAPES = ("tiny-qwen3.6-moe", "tiny-qwen3-moe")
CASES = [(s, f) for s in SHAPES for f in ("fp8", "nvfp4")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_formats")
    # one of them sharded: the per-expert scales may sit in another shard than their weights
    return {(s, f): make_random_model(s, root / f"{s}_{f}", fmt=f, shard_gb=1e-4 if s == SHAPES[0] else 4.0)
            for s, f in CASES}


def _header_tensors(path: Path) -> dict[str, tuple[str, list[int], int]]:
    """name -> (safetensors dtype, shape, bytes), from the shards' headers."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        raw = f.read_bytes()
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        out.update({k: (v["dtype"], v["shape"], v["data_offsets"][1] - v["data_offsets"][0])
                    for k, v in header.items() if k != "__metadata__"})
    return out


def _file_tensors(path: Path) -> dict[str, np.ndarray]:
    """Through safetensors' torch reader (its numpy one has no e4m3), e4m3 and bf16 as ml_dtypes arrays."""
    from safetensors.torch import load_file

    as_np = {torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
             torch.bfloat16: (torch.int16, ml_dtypes.bfloat16)}
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if v.dtype in as_np:
                raw, dt = as_np[v.dtype]
                out[k] = v.view(raw).numpy().view(dt)
            else:
                out[k] = v.numpy()
    return out


def _e2m1(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _dequantised(path: Path, fmt: str, block: int) -> dict[str, np.ndarray]:
    """The checkpoint's weights in f32: fp8 e4m3 * weight_scale_inv per [block, block]; nvfp4 e2m1 (low
    nibble first) * weight_scale per 16 columns * weight_scale_2."""
    t = _file_tensors(path)
    out = {}
    for name, w in t.items():
        if name.endswith((".weight_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        m = name.removesuffix(".weight")
        if fmt == "fp8" and w.dtype == ml_dtypes.float8_e4m3fn:
            s = t[m + ".weight_scale_inv"].astype(np.float32)
            full = np.repeat(np.repeat(s, block, 0), block, 1)[:w.shape[0], :w.shape[1]]
            out[name] = w.astype(np.float32) * full
        elif fmt == "nvfp4" and w.dtype == np.uint8:
            vals = np.stack([_e2m1(w & 15), _e2m1(w >> 4)], axis=-1).reshape(w.shape[0], -1)
            out[name] = vals * np.repeat(t[m + ".weight_scale"].astype(np.float32), 16, axis=1) \
                * np.float32(t[m + ".weight_scale_2"])
        else:
            out[name] = w.astype(np.float32)
    return out


def _oracle(path: Path, fmt: str, tmp: Path):
    """transformers' causal LM in f32 on the dequantised weights (the checkpoint's config without its
    quantization), the experts eager."""
    from safetensors.numpy import save_file

    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    block = qc.get("weight_block_size", [0])[0]
    tmp.mkdir()
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_file(_dequantised(path, fmt, block), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval().config._experts_implementation = "eager"
    model.block = (block, block)
    return model


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_layout_is_the_one_kilns_moe_readers_take(ckpts, case):
    shape, fmt = case
    path = ckpts[case]
    cfg = json.loads((path / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    hybrid = "text_config" in cfg
    p = "model.language_model.layers.3.mlp." if hybrid else "model.layers.1.mlp."
    tensors = _header_tensors(path)
    E, H, I = t["num_experts"], t["hidden_size"], t["moe_intermediate_size"]
    qc = cfg["quantization_config"]
    if fmt == "fp8":
        b = qc["weight_block_size"][0]
        for e in range(E):
            for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                assert tensors[f"{p}experts.{e}.{proj}.weight"][:2] == ("F8_E4M3", [n, k])
                assert tensors[f"{p}experts.{e}.{proj}.weight_scale_inv"][:2] == ("F32", [n // b, k // b])
        plain = {f"{p}gate"} | ({f"{p}shared_expert_gate"} if hybrid else set())
        assert plain <= set(qc["modules_to_not_convert"])
        if hybrid:
            assert {"lm_head", "model.language_model.embed_tokens",
                    "model.language_model.layers.0.linear_attn.conv1d",
                    "model.language_model.layers.0.linear_attn.in_proj_a",
                    "model.language_model.layers.0.linear_attn.in_proj_b"} <= set(qc["modules_to_not_convert"])
            assert tensors[f"{p}shared_expert.down_proj.weight"][0] == "F8_E4M3"
            assert tensors["model.language_model.layers.0.linear_attn.in_proj_a.weight"][0] == "BF16"
            assert tensors["model.language_model.layers.0.linear_attn.conv1d.weight"][0] == "BF16"
    else:
        for e in range(E):
            for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                x = f"{p}experts.{e}.{proj}"
                assert tensors[x + ".weight"][:2] == ("U8", [n, k // 2])
                assert tensors[x + ".weight_scale"][:2] == ("F8_E4M3", [n, k // 16])
                assert tensors[x + ".weight_scale_2"][:2] == tensors[x + ".input_scale"][:2] == ("F32", [])
        hq = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
        plain = {f"{p}gate"} | ({f"{p}shared_expert_gate"} if hybrid else set())
        assert plain <= set(hq["exclude_modules"]) and plain <= set(qc["ignore"])
        if hybrid:
            assert tensors[f"{p}shared_expert.down_proj.weight"][0] == "U8"
    assert tensors[p + "gate.weight"][:2] == ("BF16", [E, H])
    if hybrid:
        assert tensors[p + "shared_expert_gate.weight"][:2] == ("BF16", [1, H])
    embed = "model.language_model.embed_tokens.weight" if hybrid else "model.embed_tokens.weight"
    assert tensors[embed][0] == tensors["lm_head.weight"][0] == "BF16"


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_logits_match_the_dequantised_oracle(ckpts, case, tmp_path):
    shape, fmt = case
    path = ckpts[case]
    lm = load(path, kv_cache_tokens=2048, tokenizer=False)
    c = lm.source.config
    ops = [n.op for n in lm.graph.nodes.values()]
    assert ops.count(f"moe_experts_{fmt}") == c.num_hidden_layers and "moe_experts" not in ops
    oracle = _oracle(path, fmt, tmp_path / "oracle")
    prompts = _prompts(320, seed=1)
    if fmt == "nvfp4":
        from tests.test_nvfp4_moe import _logits
        from kiln.runtime.worker.input_batch import SeqChunk

        for p in prompts:
            got = _logits(lm, SeqChunk(p, 0, list(range(-(-len(p) // lm.block_size))), state_slot=0))
            with torch.no_grad():
                ref = oracle(torch.tensor([p])).logits[0].numpy()
            assert np.isfinite(got).all() and _rel(got, ref) <= 1e-3, f"{shape}: {_rel(got, ref):.2e} from W4A16"
        return
    check_w8a8_logits(_Probe(lm), _oracle_logits, oracle, prompts, shape)


def _expected_decode_bytes(path: Path) -> int:
    """A decode token's weight bytes from the files: every tensor as stored but NVFP4's input_scale, one
    embedding row, f32 A_log / dt_bias; of each MoE layer's experts, k of E (all experts alike)."""
    cfg = json.loads((path / "config.json").read_text())
    t = cfg.get("text_config", cfg)
    total = experts = 0
    for name, (_, shape, n) in _header_tensors(path).items():
        if name.endswith(".input_scale"):
            continue
        if name.endswith("embed_tokens.weight"):
            n //= shape[0]
        elif name.endswith((".A_log", ".dt_bias")):
            n = 4 * math.prod(shape)
        if ".experts." in name:
            experts += n
        else:
            total += n
    assert experts % t["num_experts"] == 0
    return total + experts // t["num_experts"] * t["num_experts_per_tok"]


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_decode_roofline_counts_the_routed_experts(ckpts, case):
    path = ckpts[case]
    cfg = open_model(path).config
    want = _expected_decode_bytes(path)
    assert decode_weight_bytes(build_graph(cfg, target="sm_90"), cfg) == want
    assert decode_bytes(*case) == want
    assert want < checkpoint_bytes(*case)  # the other experts are not read


def test_dry_run_writes_the_full_size_moe_shapes_in_fp8_and_nvfp4():
    for shape in ("qwen3.6-35b-a3b", "qwen3-30b-a3b"):
        out = subprocess.run([sys.executable, str(REPO / "bench" / "make_random_model.py"), "--shape", shape,
                              "--dry-run"], capture_output=True, text=True, check=True).stdout.splitlines()
        t = hf_config(shape).get("text_config", hf_config(shape))
        for fmt in ("fp8", "nvfp4"):
            (line,) = [x for x in out if x.startswith(f"{shape} {fmt}: ")]
            assert f" {checkpoint_bytes(shape, fmt)} bytes " in line
            assert f"a decode token reads {decode_bytes(shape, fmt)} bytes" in line
            assert f"({t['num_experts_per_tok']} of {t['num_experts']} experts)" in line
        # the routed experts are a small part of what a token reads next to the whole checkpoint
        assert decode_bytes(shape, "nvfp4") < decode_bytes(shape, "fp8") < decode_bytes(shape, "bf16")
