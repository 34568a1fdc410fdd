"""A real checkpoint directory with random bf16 weights at a public model's shape, which kiln
and transformers both load: config.json, safetensors shards (+ index), a synthetic tokenizer.

    python bench/make_random_model.py --shape llama-3.1-8b --out DIR [--shard-gb 4] [--seed 0]
    python bench/make_random_model.py --shape qwen3.6-27b --dry-run   # the size it would write, per format
    python bench/make_random_model.py --shape llama-3.1-8b --format fp8 --out DIR   # or nvfp4, q4k

Weights come from a tiled pool of N(0, 0.02) bf16 values (norms are 1), so writing the 16 GB of
an 8B model runs at disk speed: right bytes and shapes for timing, not a model. The safetensors
files are written here by hand (an 8-byte little-endian header length, the JSON header padded
to 8 bytes, then the raw tensor bytes), so no torch is needed. The tokenizer is a WordLevel
vocabulary of exactly vocab_size entries ("<unk>", "<s>", "</s>", then "t3", "t4", ...): every
id decodes to text, and benchmarks send token ids, never text.

The Qwen3.5/3.6 hybrids (qwen3.6-27b, qwen3.6-35b-a3b, tiny-qwen3.6, tiny-qwen3.6-moe) are written
as the published checkpoints ship them (../shared/specs/qwen3_5.md sections 1 and 8.2):
Qwen3_5(Moe)ForConditionalGeneration, the text fields nested under `text_config`, the text tower
under `model.language_model.`, `lm_head.weight` at top level; no vision tower and no MTP head (both
loaders skip them; transformers' ConditionalGeneration class reports model.visual.* missing). Their
zero-centred RMSNorms, which apply (1 + w), are written as 0 (scale 1), the Gated DeltaNet's gated
norm (plain w) as 1, A_log as log(uniform(1, 16)) and dt_bias as 1 (transformers' _init_weights), so
the GDN decays stay in (0, 1). MoE experts are per-expert tensors (mlp.experts.{e}.{gate,up,down}_proj),
the layout the official checkpoints have, which transformers' qwen3_5_moe_text conversion (qwen2_moe's
MergeModulelist + Concatenate) fuses into experts.gate_up_proj / experts.down_proj at load.

--format writes the quantised tensors straight from random codes and random scales (no bf16 pass,
so an 8B model is written at disk speed as bf16 is), in the layouts kiln reads:

  fp8    block-wise FP8 as Qwen's *-FP8 checkpoints ship it: every decoder Linear `weight` e4m3 and
         `weight_scale_inv` f32 per [128, 128] block (a multiplier), config.json's quantization_config
         {quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size [128, 128]}; the
         embeddings, norms and lm_head stay bf16; a hybrid also leaves each GDN layer's conv1d,
         in_proj_a and in_proj_b bf16 and lists them (and lm_head, the embeddings) in
         modules_to_not_convert by the file's names, as Qwen3.5/3.6-*-FP8 do (tests/fp8_checkpoints.py
         hybrid_not_converted). A MoE shape (qwen3-30b-a3b, qwen3.6-35b-a3b) quantises every expert's
         gate/up/down_proj per expert (mlp.experts.{e}.*.weight + weight_scale_inv, tests/test_fp8_moe.py's
         layout) and the shared expert; its router mlp.gate and mlp.shared_expert_gate stay bf16 and are
         listed. A shape whose linears are not whole 128-blocks (the tiny ones) gets the
         largest power-of-two block that divides them.
  nvfp4  ModelOpt NVFP4 (models/nvfp4_config.py): every decoder Linear `weight` u8 [N, K/2] (two e2m1
         codes a byte), `weight_scale` e4m3 [N, K/16], `weight_scale_2` and `input_scale` f32 scalars;
         hf_quant_config.json and config.json's converted quantization_config, as NVIDIA's checkpoints
         carry both (exclude_modules / ignore: lm_head, and a MoE layer's router gates); a MoE shape's
         experts are per expert, each with its own four tensors (tests/test_nvfp4_moe.py's layout).
  q4k    one GGUF file (gguf-py's GGUFWriter, llama architecture) mixed as llama.cpp's Q4_K_M
         (src/llama-quant.cpp llama_tensor_get_type_impl): Q4_K everywhere, Q6_K for output.weight and
         for attn_v / ffn_down in the layers use_more_bits picks (the first and last eighth and every
         third between; --pure: all Q4_K, the issue's "all linears Q4_K"), norms F32; k-quant blocks written byte by byte from random codes and random
         positive f16 d / dmin (graph/gguf_blocks.py's layouts); plain RoPE (no rope_freqs tensor, so
         llama.cpp and kiln run the same model), and a byte-level BPE vocabulary ("<unk>", "<s>", "</s>",
         the 256 byte symbols, two spaces, then "t260", ...) that kiln's GGUF tokenizer reads.

Scales are drawn at random (never all ones) so that dequantised weights have about the bf16 pool's
spread (std ~0.02, mean ~0) and logits stay finite. A (shape, format) kiln does not run is refused
in one sentence (models/quant_config.py's FP8 / NVFP4 architectures; q4k is written for Llama shapes).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from kiln.models.reference_shapes import HYBRID_SHAPES, SHAPES, TEST_SHAPES

ALL_SHAPES = {**SHAPES, **HYBRID_SHAPES, **TEST_SHAPES}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
# architecture -> (config.json model_type, text_config model_type)
HYBRID_MODEL_TYPES = {"Qwen3_5ForConditionalGeneration": ("qwen3_5", "qwen3_5_text"),
                      "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "qwen3_5_moe_text")}
TEXT_PREFIX = "model.language_model."  # the hybrids' text tower (ConditionalGeneration)
UNK, BOS, EOS = "<unk>", "<s>", "</s>"  # ids 0, 1, 2
POOL_ELEMS = 1 << 24  # 32 MB of bf16 values, tiled into every weight
CHUNK_ELEMS = 1 << 23  # elements per write call
FORMATS = ("bf16", "fp8", "nvfp4", "q4k")
ITEMSIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}  # safetensors dtype -> bytes
WEIGHT_STD = 0.02  # the bf16 pool's spread, which the quantised formats' dequantised weights keep
FP8_BLOCK = 128  # Qwen's *-FP8 weight_block_size [128, 128]
FP8_CODE_STD = 64.0  # e4m3 codes drawn from N(0, 64^2) (clipped to +-448): most of e4m3's exponent range
NVFP4_GROUP = 16
E2M1_RMS = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of uniformly random e2m1 codes
NVFP4_SCALE_RANGE = (32.0, 448.0)  # block scales uniform here (ModelOpt's are amax / (6 * weight_scale_2) <= 448)
GGUF_FILE_TYPE_Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M (general.file_type)
# k-quant super-block scales: Q4_K w = d * sc * q - dmin * m (q 0..15, sc, m 0..63 from random bytes)
# has mean 0 where E[dmin] * 31.5 = E[d] * 32 * 7.5 and std ~259 d; Q6_K w = d * scale * (q - 32) with
# random int8 scales has std ~1362 d. Both come out near WEIGHT_STD.
Q4K_D, Q4K_DMIN, Q6K_D = 7.7e-5, 5.9e-4, 1.47e-5


class FormatRefused(ValueError):
    """A (shape, format) kiln does not run: one sentence."""


def hf_config(shape: str) -> dict:
    """The config.json of a shape: flat for llama / qwen3; for the hybrids the ConditionalGeneration
    form, the text tower's fields under text_config (the ids are the synthetic tokenizer's)."""
    cfg = copy.deepcopy(ALL_SHAPES[shape])
    arch = cfg["architectures"][0]
    common = dict(bos_token_id=1, eos_token_id=2, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
                  initializer_range=0.02, use_cache=True)
    if arch in HYBRID_MODEL_TYPES:
        outer_type, text_type = HYBRID_MODEL_TYPES[arch]
        del cfg["architectures"]
        cfg.update(common, model_type=text_type, dtype="bfloat16")
        return {"architectures": [arch], "model_type": outer_type, "text_config": dict(sorted(cfg.items())),
                "tie_word_embeddings": cfg["tie_word_embeddings"], "torch_dtype": "bfloat16"}
    cfg.update(model_type=MODEL_TYPES[arch], torch_dtype="bfloat16", **common)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and [out, in] shapes of a checkpoint of hf_config's, in file order."""
    if "text_config" in cfg:
        return _hybrid_weight_shapes(cfg)
    h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (nq * d, h)
        out[p + "self_attn.k_proj.weight"] = (nkv * d, h)
        out[p + "self_attn.v_proj.weight"] = (nkv * d, h)
        out[p + "self_attn.o_proj.weight"] = (h, nq * d)
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers", [])
        if cfg.get("num_experts") and layer not in dense and (layer + 1) % step == 0:
            # Qwen3-MoE: the router and per-expert tensors (transformers' save format)
            e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = (e, h)
            for x in range(e):
                out[p + f"mlp.experts.{x}.gate_proj.weight"] = (mi, h)
                out[p + f"mlp.experts.{x}.up_proj.weight"] = (mi, h)
                out[p + f"mlp.experts.{x}.down_proj.weight"] = (h, mi)
            continue
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    return out


def _hybrid_weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """A Qwen3.5/3.6 ConditionalGeneration checkpoint's text tower and head (spec 8.2): per layer the
    gated attention (q_proj 2x wide: per head [query | gate]) or the Gated DeltaNet, then a dense MLP
    or a MoE block with per-expert tensors and a shared expert."""
    t = cfg["text_config"]
    h, v = t["hidden_size"], t["vocab_size"]
    d, nq, nkv = t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"]
    hk, hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv, kc = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
    conv_dim = 2 * hk * dk + hv * dv  # the conv's channels: q | k | v
    out: dict[str, tuple[int, ...]] = {TEXT_PREFIX + "embed_tokens.weight": (v, h)}
    for layer, kind in enumerate(t["layer_types"]):
        p = f"{TEXT_PREFIX}layers.{layer}."
        out[p + "input_layernorm.weight"] = (h,)
        if kind == "full_attention":
            a = p + "self_attn."
            out[a + "q_proj.weight"] = (2 * nq * d, h)
            out[a + "k_proj.weight"] = (nkv * d, h)
            out[a + "v_proj.weight"] = (nkv * d, h)
            out[a + "o_proj.weight"] = (h, nq * d)
            out[a + "q_norm.weight"] = (d,)
            out[a + "k_norm.weight"] = (d,)
        else:
            la = p + "linear_attn."
            out[la + "in_proj_qkv.weight"] = (conv_dim, h)
            out[la + "in_proj_z.weight"] = (hv * dv, h)
            out[la + "in_proj_b.weight"] = (hv, h)
            out[la + "in_proj_a.weight"] = (hv, h)
            out[la + "conv1d.weight"] = (conv_dim, 1, kc)
            out[la + "A_log"] = (hv,)
            out[la + "dt_bias"] = (hv,)
            out[la + "norm.weight"] = (dv,)
            out[la + "out_proj.weight"] = (h, hv * dv)
        out[p + "post_attention_layernorm.weight"] = (h,)
        m = p + "mlp."
        if t.get("num_experts"):
            ie, ish = t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
            out[m + "gate.weight"] = (t["num_experts"], h)
            for e in range(t["num_experts"]):
                out[f"{m}experts.{e}.gate_proj.weight"] = (ie, h)
                out[f"{m}experts.{e}.up_proj.weight"] = (ie, h)
                out[f"{m}experts.{e}.down_proj.weight"] = (h, ie)
            out[m + "shared_expert.gate_proj.weight"] = (ish, h)
            out[m + "shared_expert.up_proj.weight"] = (ish, h)
            out[m + "shared_expert.down_proj.weight"] = (h, ish)
            out[m + "shared_expert_gate.weight"] = (1, h)
        else:
            i = t["intermediate_size"]
            out[m + "gate_proj.weight"] = (i, h)
            out[m + "up_proj.weight"] = (i, h)
            out[m + "down_proj.weight"] = (h, i)
    out[TEXT_PREFIX + "norm.weight"] = (h,)
    if not t.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    return out


def fixed_values(cfg: dict, shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """The tensors not drawn from the pool, as bf16 arrays: llama / qwen3 norms are 1; a hybrid's
    (1 + w) norms 0 and its GDN gated norm 1, A_log log(uniform(1, 16)), dt_bias 1."""
    rng = np.random.default_rng([seed, 1])  # apart from the pool's phases: llama / qwen3 files stay the same
    hybrid = "text_config" in cfg
    out: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        if name.endswith(".A_log") and hybrid:
            out[name] = np.log(rng.uniform(1.0, 16.0, n))
        elif name.endswith(".dt_bias") and hybrid:
            out[name] = np.ones(n)
        elif name.endswith("linear_attn.norm.weight") or (name.endswith("norm.weight") and not hybrid):
            out[name] = np.ones(n)
        elif name.endswith("norm.weight"):
            out[name] = np.zeros(n)
    return {k: a.astype(ml_dtypes.bfloat16) for k, a in out.items()}


# -- what each format stores ---------------------------------------------------------------------------

def _text(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def _is_router(name: str) -> bool:
    return name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight"))


def _decoder_linear(name: str, shape: tuple[int, ...]) -> bool:
    """A decoder layer's Linear weight (the modules the quantisers quantise): 2-D, in a layer, no norm."""
    return (name.endswith(".weight") and len(shape) == 2 and ".layers." in name and not name.endswith("norm.weight")
            and "_layernorm." not in name)


def fp8_not_converted(cfg: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """modules_to_not_convert as Qwen's FP8 files write it: none for the plain decoders (their lm_head and
    embeddings are no Linear the quantiser touches); for a hybrid lm_head, the embeddings and each GDN
    layer's conv1d, in_proj_a and in_proj_b, by the file's module names; a MoE layer's router gates."""
    out = []
    if "text_config" in cfg:
        out += ["lm_head", TEXT_PREFIX + "embed_tokens"]
        out += [n.rsplit(".", 1)[0] for n in shapes
                if n.endswith(("linear_attn.conv1d.weight", "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"))]
    out += [n.rsplit(".", 1)[0] for n in shapes if _is_router(n)]
    return out


def nvfp4_excluded(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """ModelOpt's exclude_modules: lm_head, and a MoE layer's router gates."""
    return ["lm_head"] + [n.rsplit(".", 1)[0] for n in shapes if _is_router(n)]


def quantised_linears(cfg: dict, fmt: str, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The `.weight` names a format stores quantised."""
    skip = set(fp8_not_converted(cfg, shapes) if fmt == "fp8" else nvfp4_excluded(shapes) if fmt == "nvfp4" else ())
    return [n for n, s in shapes.items() if _decoder_linear(n, s) and n.rsplit(".", 1)[0] not in skip]


def fp8_block(cfg: dict, shapes: dict[str, tuple[int, ...]]) -> int:
    """128, or for a shape whose FP8 linears are not whole 128 x 128 blocks the largest power of two that
    divides every one's rows and columns (kiln's block-wise FP8 needs whole blocks along K and, to
    stack q/k/v and gate/up, along N)."""
    dims = [d for n in quantised_linears(cfg, "fp8", shapes) for d in shapes[n]]
    b = FP8_BLOCK
    while b > 1 and any(d % b for d in dims):
        b //= 2
    return b


def check_format(shape: str, fmt: str) -> None:
    """FormatRefused, one sentence, for a (shape, format) kiln does not run."""
    if fmt not in FORMATS:
        raise FormatRefused(f"format {fmt!r} is not one make_random_model writes ({', '.join(FORMATS)})")
    if fmt == "bf16":
        return
    cfg = hf_config(shape)
    arch = cfg["architectures"][0]
    shapes = weight_shapes(cfg)
    if fmt in ("fp8", "nvfp4"):
        from kiln.models.quant_config import FP8_ARCHITECTURES, NVFP4_ARCHITECTURES

        archs = FP8_ARCHITECTURES if fmt == "fp8" else NVFP4_ARCHITECTURES
        if arch not in archs:
            raise FormatRefused(f"{shape} in {fmt} is not written: this writer makes {fmt} checkpoints of "
                                f"{', '.join(archs)} only, not {arch} (models/quant_config.py)")
        if fmt == "fp8" and fp8_block(cfg, shapes) < 16:
            raise FormatRefused(f"{shape} in fp8 is not written: its linears share no block of 16 or more")
        if fmt == "nvfp4":
            bad = [n for n in quantised_linears(cfg, fmt, shapes) if shapes[n][1] % NVFP4_GROUP]
            if bad:
                raise FormatRefused(f"{shape} in nvfp4 is not written: {bad[0]} has {shapes[bad[0]][1]} input "
                                    f"features, not whole groups of {NVFP4_GROUP}")
        return
    if arch != "LlamaForCausalLM":  # q4k
        raise FormatRefused(f"{shape} in q4k is not written: the GGUF writer writes the llama architecture only "
                            f"(kiln's GGUF loader reads no {arch})")
    widths = {"hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"],
              "num_attention_heads x head_dim": cfg["num_attention_heads"] * cfg["head_dim"]}
    for what, k in widths.items():
        if k % 256:
            raise FormatRefused(f"{shape} in q4k is not written: its {what} {k} is not whole 256-weight k-quant blocks")


def tensor_plan(cfg: dict, fmt: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors checkpoint's tensors in file order: name -> (safetensors dtype, shape)."""
    shapes = weight_shapes(cfg)
    quant = set(quantised_linears(cfg, fmt, shapes)) if fmt in ("fp8", "nvfp4") else set()
    block = fp8_block(cfg, shapes) if fmt == "fp8" else 0
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if name not in quant:
            out[name] = ("BF16", shape)
            continue
        module, (n, k) = name.rsplit(".", 1)[0], shape
        if fmt == "fp8":
            out[name] = ("F8_E4M3", shape)
            out[module + ".weight_scale_inv"] = ("F32", (-(-n // block), -(-k // block)))
        else:
            out[name] = ("U8", (n, k // 2))
            out[module + ".weight_scale"] = ("F8_E4M3", (n, k // NVFP4_GROUP))
            out[module + ".weight_scale_2"] = ("F32", ())
            out[module + ".input_scale"] = ("F32", ())
    return out


def _nbytes(spec: tuple[str, tuple[int, ...]]) -> int:
    return ITEMSIZE[spec[0]] * math.prod(spec[1])


def checkpoint_bytes(shape: str, fmt: str = "bf16", pure: bool = False) -> int:
    """The bytes of a shape's tensor data in a format (safetensors headers or GGUF metadata aside):
    what --dry-run reports. pure: q4k without the Q4_K_M mix (all Q4_K)."""
    cfg = hf_config(shape)
    if fmt == "q4k":
        return sum(nbytes for _, _, _, nbytes in gguf_plan(cfg, pure))
    return sum(_nbytes(s) for s in tensor_plan(cfg, fmt).values())


def decode_bytes(shape: str, fmt: str = "bf16", pure: bool = False) -> int:
    """The weight bytes one batch-1 decode token reads, from the plan alone (what bench/workloads.py
    decode_weight_bytes counts on the loaded GPU graph): every tensor as stored (e4m3 weights, f32 / e4m3
    scales, u8 pairs, GGUF blocks; a GGUF's F32 norms in the graph's bf16), but NVFP4's input_scale (W4A16
    does not read it), one row of an untied embedding, f32 for a hybrid's A_log / dt_bias (the graph keeps
    the GDN decay parameters in f32), and of a MoE layer's experts the num_experts_per_tok the router
    picks: their quantised weights and their scales."""
    cfg = hf_config(shape)
    t = _text(cfg)
    if fmt == "q4k":
        total = 0
        for name, qtype, hf_shape, nbytes in gguf_plan(cfg, pure):
            if name == "token_embd.weight" and not t.get("tie_word_embeddings", False):
                total += 2 * hf_shape[1]  # one bf16 row
            else:
                total += 2 * math.prod(hf_shape) if qtype == "F32" else nbytes
        return total
    total = experts = 0
    for name, spec in tensor_plan(cfg, fmt).items():
        n = _nbytes(spec)
        if name.endswith(".input_scale"):
            continue
        if name.endswith("embed_tokens.weight") and not t.get("tie_word_embeddings", False):
            n //= spec[1][0]
        elif name.endswith((".A_log", ".dt_bias")):
            n = 4 * math.prod(spec[1])
        if ".mlp.experts." in name:
            experts += n
        else:
            total += n
    # every expert of every MoE layer has the same tensors: the picked ones are k / E of them
    return total + experts * t.get("num_experts_per_tok", 0) // max(t.get("num_experts") or 1, 1)


def quantization_config(cfg: dict, fmt: str) -> tuple[dict | None, dict | None]:
    """(config.json's quantization_config, hf_quant_config.json's content) of a format."""
    shapes = weight_shapes(cfg)
    if fmt == "fp8":
        qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [fp8_block(cfg, shapes)] * 2}
        skip = fp8_not_converted(cfg, shapes)
        return ({**qc, "modules_to_not_convert": skip} if skip else qc), None
    if fmt == "nvfp4":  # NVIDIA's layout: hf_quant_config.json and its converted form in config.json
        producer = {"name": "modelopt", "version": "0.37.0"}
        exclude = nvfp4_excluded(shapes)
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
        qc = {"config_groups": {"group_0": {"input_activations": dict(fp4), "weights": dict(fp4), "targets": ["Linear"]}},
              "ignore": exclude, "quant_algo": "NVFP4", "producer": producer, "quant_method": "modelopt"}
        hq = {"producer": producer, "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                                     "group_size": NVFP4_GROUP, "exclude_modules": exclude}}
        return qc, hq
    return None, None


def plan_shards(plan: dict[str, tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[str]]:
    """Tensors in file order, cut into shards of at most shard_bytes (a larger tensor gets its own).
    plan: tensor_plan's, or bare shapes (bf16)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in plan.items():
        n = _nbytes(spec) if isinstance(spec[0], str) else 2 * math.prod(spec)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


# -- random data -----------------------------------------------------------------------------------------

class Pools:
    """Tiled pools of random values, one per kind of tensor data, each drawn once (at most 32 MB):
    bf16 N(0, 0.02) weights (the pool bf16 checkpoints have always had), e4m3 FP8 codes, random
    bytes (NVFP4's e2m1 pairs: every nibble is a finite e2m1) and e4m3 NVFP4 block scales."""

    def __init__(self, plan: dict[str, tuple[str, tuple[int, ...]]], seed: int):
        need: dict[str, int] = {}
        for name, spec in plan.items():
            kind = self.kind(name, spec[0])
            if kind:
                need[kind] = need.get(kind, 0) + math.prod(spec[1])
        rng = np.random.default_rng(seed)  # the bf16 pool first, from the seed's own stream: bf16 files stay the same
        total_bf16 = need.get("bf16", 0)
        self.pools: dict[str, np.ndarray] = {"bf16": (rng.standard_normal(
            min(POOL_ELEMS, max(total_bf16, 1)), dtype=np.float32) * WEIGHT_STD).astype(ml_dtypes.bfloat16)}
        self.rng = rng  # the per-tensor phases
        q = np.random.default_rng([seed, 2])
        size = {k: min(2 * POOL_ELEMS, max(n, 1)) for k, n in need.items()}
        if "fp8" in need:
            self.pools["fp8"] = np.clip(q.standard_normal(size["fp8"], dtype=np.float32) * FP8_CODE_STD,
                                        -448, 448).astype(ml_dtypes.float8_e4m3fn)
        if "bytes" in need:
            self.pools["bytes"] = q.integers(0, 256, size["bytes"], dtype=np.uint8)
        if "nvfp4_scale" in need:
            self.pools["nvfp4_scale"] = q.uniform(*NVFP4_SCALE_RANGE, size["nvfp4_scale"]).astype(
                ml_dtypes.float8_e4m3fn)
        self.scales = np.random.default_rng([seed, 3])  # the small f32 scale tensors, drawn whole

    @staticmethod
    def kind(name: str, dtype: str) -> str | None:
        if dtype == "BF16":
            return "bf16"
        if dtype == "F8_E4M3":
            return "nvfp4_scale" if name.endswith(".weight_scale") else "fp8"
        if dtype == "U8":
            return "bytes"
        return None  # f32 scales: scale_tensor

    def scale_tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The f32 scales, random: block-wise FP8's weight_scale_inv (dequantised std ~WEIGHT_STD over the
        e4m3 codes), NVFP4's weight_scale_2 (the same over e2m1 codes x block scales) and input_scale
        (an activation amax of 1-10 over 6 x 448; W4A16 does not read it)."""
        r = self.scales.uniform(0.5, 1.5, shape).astype(np.float32)
        if name.endswith(".weight_scale_inv"):
            return r * np.float32(WEIGHT_STD / FP8_CODE_STD)
        if name.endswith(".weight_scale_2"):
            lo, hi = NVFP4_SCALE_RANGE
            rms = math.sqrt((hi ** 3 - lo ** 3) / (3 * (hi - lo)))
            return r * np.float32(WEIGHT_STD / (E2M1_RMS * rms))
        if name.endswith(".input_scale"):
            return (self.scales.uniform(1.0, 10.0, shape) / (6 * 448)).astype(np.float32)
        raise ValueError(f"no random rule for the f32 tensor {name}")


def write_safetensors(path: Path, names: list[str], plan: dict[str, tuple[str, tuple[int, ...]]],
                      pools: Pools, progress=lambda n: None, fixed: dict[str, np.ndarray] | None = None) -> None:
    """One shard: `fixed` tensors as given (None: the ones of every *norm.weight, llama's rule), f32
    scales drawn whole, every other a run of its pool from a random phase."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        dtype, shape = plan[name]
        n = _nbytes(plan[name])
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer keeps it
    if fixed is None:
        fixed = {n: np.ones(math.prod(plan[n][1]), dtype=ml_dtypes.bfloat16) for n in names
                 if n.endswith("norm.weight")}
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            dtype, shape = plan[name]
            elems = math.prod(shape)
            kind = pools.kind(name, dtype)
            if name in fixed or kind is None:
                arr = fixed[name].astype(ml_dtypes.bfloat16) if name in fixed else pools.scale_tensor(name, shape)
                f.write(np.ascontiguousarray(arr).tobytes())
                progress(_nbytes(plan[name]))
                continue
            pool = pools.pools[kind]
            size = pool.dtype.itemsize
            pool_bytes = pool.view(np.uint8)
            start = int(pools.rng.integers(0, len(pool)))  # a different phase per tensor
            done = 0
            while done < elems:
                k = min(elems - done, len(pool) - start, CHUNK_ELEMS)
                f.write(memoryview(pool_bytes[size * start: size * (start + k)]))
                done += k
                start = (start + k) % len(pool)
                progress(size * k)


# -- GGUF (q4k) ------------------------------------------------------------------------------------------

def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp llama_tensor_get_type_impl) for the attn_v / ffn_down layers
    Q4_K_M gives Q6_K: the first and last eighth, and every third layer between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def gguf_plan(cfg: dict, pure: bool = False) -> list[tuple[str, str, tuple[int, ...], int]]:
    """A llama Q4_K_M GGUF's tensors in file order: (llama.cpp name, ggml type, HF [out, in] shape, bytes);
    pure: every quantised tensor Q4_K, the output too (llama-quantize --pure)."""
    from kiln.graph.gguf_blocks import row_bytes

    h, v, i, n = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = []

    def add(name: str, qtype: str, shape: tuple[int, ...]) -> None:
        nbytes = 4 * math.prod(shape) if qtype == "F32" else shape[0] * row_bytes(qtype, shape[1])
        out.append((name, qtype, shape, nbytes))

    add("token_embd.weight", "Q4_K", (v, h))
    for layer in range(n):
        more = "Q6_K" if use_more_bits(layer, n) and not pure else "Q4_K"
        p = f"blk.{layer}."
        add(p + "attn_norm.weight", "F32", (h,))
        add(p + "attn_q.weight", "Q4_K", (nq * d, h))
        add(p + "attn_k.weight", "Q4_K", (nkv * d, h))
        add(p + "attn_v.weight", more, (nkv * d, h))
        add(p + "attn_output.weight", "Q4_K", (h, nq * d))
        add(p + "ffn_norm.weight", "F32", (h,))
        add(p + "ffn_gate.weight", "Q4_K", (i, h))
        add(p + "ffn_up.weight", "Q4_K", (i, h))
        add(p + "ffn_down.weight", more, (h, i))
    add("output_norm.weight", "F32", (h,))
    if not cfg.get("tie_word_embeddings", False):
        add("output.weight", "Q4_K" if pure else "Q6_K", (v, h))
    return out


def random_k_blocks(qtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """u8 [n, TS]: Q4_K or Q6_K blocks of random codes (every quant and packed-scale byte random) and
    random positive f16 super-block scales near Q4K_D / Q4K_DMIN / Q6K_D (graph/gguf_blocks.py's layouts)."""
    from kiln.graph.gguf_blocks import BLOCKS

    blocks = rng.integers(0, 256, (n, BLOCKS[qtype][1]), dtype=np.uint8)

    def f16(at: int, base: float) -> None:
        blocks[:, at:at + 2] = (rng.uniform(0.5, 1.5, n) * base).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == "Q4_K":  # d f16 | dmin f16 | scales x12 | qs x128
        f16(0, Q4K_D)
        f16(2, Q4K_DMIN)
    elif qtype == "Q6_K":  # ql x128 | qh x64 | scales int8 x16 | d f16
        f16(208, Q6K_D)
    else:
        raise ValueError(qtype)
    return blocks


def write_gguf_tokenizer(w, vocab_size: int) -> None:
    """A byte-level BPE vocabulary kiln's GGUF tokenizer (runtime/text/gguf_tokenizer.py) reads: the
    specials at 0-2 (CONTROL), the 256 byte symbols in GPT-2's spelling, two spaces ("ĠĠ", the one
    merge: a GGUF array may not be empty), then "t260", "t261", ... up to vocab_size."""
    from kiln.runtime.text.gguf_tokenizer import bytes_to_unicode

    space = bytes_to_unicode()[ord(" ")]
    tokens = [UNK, BOS, EOS, *bytes_to_unicode().values(), space * 2]
    tokens += [f"t{i}" for i in range(len(tokens), vocab_size)]
    if len(tokens) != vocab_size:
        raise FormatRefused(f"a GGUF vocabulary of {vocab_size} tokens cannot hold the 3 specials, 256 byte symbols "
                            f"and a merge")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab_size - 3))
    w.add_token_merges([f"{space} {space}"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)


def write_q4k_gguf(shape: str, path: Path, seed: int = 0, progress=lambda n: None, pure: bool = False) -> Path:
    """The shape as a llama Q4_K_M GGUF at `path` (pure: all Q4_K), streamed tensor by tensor
    (GGUFWriter's tensor infos first, then each tensor's data as it is made)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    cfg = hf_config(shape)
    plan = gguf_plan(cfg, pure)
    rng = np.random.default_rng([seed, 4])
    pool_blocks = {}
    for qtype, ts in (("Q4_K", 144), ("Q6_K", 210)):
        need = sum(nbytes for _, q, _, nbytes in plan if q == qtype) // ts
        if need:
            pool_blocks[qtype] = random_k_blocks(qtype, min(need, (2 * POOL_ELEMS) // ts), rng)
    w = GGUFWriter(str(path), "llama")
    w.add_name(f"random {shape}")
    w.add_file_type(GGUF_FILE_TYPE_Q4_K_M)
    for key, value in (("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("block_count", cfg["num_hidden_layers"]), ("attention.head_count", cfg["num_attention_heads"]),
                       ("attention.head_count_kv", cfg["num_key_value_heads"]),
                       ("rope.dimension_count", cfg["head_dim"]), ("context_length", cfg["max_position_embeddings"]),
                       ("vocab_size", cfg["vocab_size"])):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32("llama.rope.freq_base", cfg["rope_theta"])
    write_gguf_tokenizer(w, cfg["vocab_size"])
    for name, qtype, hf_shape, nbytes in plan:
        if qtype == "F32":
            w.add_tensor_info(name, hf_shape, np.dtype(np.float32), nbytes)
        else:
            w.add_tensor_info(name, (hf_shape[0], nbytes // hf_shape[0]), np.dtype(np.uint8), nbytes,
                              raw_dtype=GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, qtype, hf_shape, nbytes in plan:
        if qtype == "F32":  # norms: 1, as the bf16 checkpoints' llama norms
            w.write_tensor_data(np.ones(hf_shape, np.float32))
        else:
            pool = pool_blocks[qtype]
            n = nbytes // pool.shape[1]
            start = int(rng.integers(0, len(pool)))  # whole blocks from a random phase
            idx = (start + np.arange(n)) % len(pool)
            w.write_tensor_data(pool[idx].reshape(hf_shape[0], -1))
        progress(nbytes)
    w.close()
    return path


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {UNK: 0, BOS: 1, EOS: 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([UNK, BOS, EOS])  # already in the vocabulary: marks them special, adds no ids
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
        "model_max_length": 1 << 30}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=1))


def make_random_model(shape: str, out: str | Path, *, shard_gb: float = 4.0, seed: int = 0,
                      show_progress: bool = False, spill_dir: str | Path | None = None,
                      keep_gb: float = 0.0, fmt: str = "bf16", pure: bool = False) -> Path:
    """Write the checkpoint into `out` (created; existing files of the same names are replaced); -> out,
    or for q4k the GGUF file written in it (`<shape>-Q4_K_M.gguf`; pure: `<shape>-Q4_K.gguf`, every
    quantised tensor Q4_K as llama-quantize --pure writes it). fmt: bf16 | fp8 | nvfp4 | q4k (the
    module docstring); FormatRefused for a (shape, format) kiln does not run, before anything is written.
    spill_dir: once `keep_gb` GB of shards are in `out`, the rest are written there and symlinked into
    `out` (a checkpoint larger than one filesystem: the 35B-A3B shape is 69 GB, the H200 machine's disk
    64 GiB, so part of it goes to /dev/shm)."""
    check_format(shape, fmt)
    if pure and fmt != "q4k":
        raise FormatRefused(f"--pure is a q4k option (all Q4_K, no Q4_K_M mix), not one of {fmt}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape)
    bar = None
    total = checkpoint_bytes(shape, fmt, pure)
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {shape} {fmt}", file=sys.stderr)
    if fmt == "q4k":
        path = write_q4k_gguf(shape, out / f"{shape}-{'Q4_K' if pure else 'Q4_K_M'}.gguf", seed,
                              bar.update if bar else lambda n: None, pure)
        if bar:
            bar.close()
        return path
    plan = tensor_plan(cfg, fmt)
    fixed = fixed_values(cfg, weight_shapes(cfg), seed)
    shards = plan_shards(plan, int(shard_gb * 1e9))
    pools = Pools(plan, seed)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for stale in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json",
                                                         out / "hf_quant_config.json"]:
        if stale.exists() and stale.name not in files:
            stale.unlink()  # a leftover shard of another layout (or format) would confuse loaders
    kept = 0
    for fname, names in zip(files, shards):
        path = out / fname
        if spill_dir is not None and kept >= keep_gb * 1e9:
            Path(spill_dir).mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            path.symlink_to(Path(spill_dir).resolve() / fname)
        write_safetensors(path, names, plan, pools, bar.update if bar else lambda n: None, fixed)
        kept += sum(_nbytes(plan[n]) for n in names)
    if bar:
        bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    qc, hq = quantization_config(cfg, fmt)
    if qc is not None:
        cfg["quantization_config"] = qc
    if hq is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(hq, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(out, cfg.get("text_config", cfg)["vocab_size"])
    return out


def _size(b: int) -> str:
    return f"{b / 1e9:8.2f} GB" if b >= 1e8 else f"{b / 1e6:8.2f} MB"


def _shape_list() -> str:
    lines = ["shapes (bf16 size):"]
    for name in sorted(ALL_SHAPES):
        arch = ALL_SHAPES[name]["architectures"][0]
        lines.append(f"  {name:18s} {arch:36s} {_size(checkpoint_bytes(name))}")
    return "\n".join(lines)


def dry_run_lines(shape: str, shard_gb: float) -> list[str]:
    """--dry-run's report: per format the tensor count, the bytes, the shards and the weight bytes a
    batch-1 decode token reads (decode_bytes: a MoE's routed experts only), or why it is not written."""
    cfg = hf_config(shape)
    lines = []
    for fmt in FORMATS:
        try:
            check_format(shape, fmt)
        except FormatRefused as e:
            lines.append(str(e))
            continue
        total = checkpoint_bytes(shape, fmt)
        if fmt == "q4k":
            n = len(gguf_plan(cfg))
            files = f"one GGUF file (Q4_K_M mix; {checkpoint_bytes(shape, fmt, pure=True)} bytes with --pure)"
        else:
            plan = tensor_plan(cfg, fmt)
            n = len(plan)
            files = f"{len(plan_shards(plan, int(shard_gb * 1e9)))} shard(s) of at most {shard_gb:g} GB"
        read = decode_bytes(shape, fmt)
        t = _text(cfg)
        picked = f" ({t['num_experts_per_tok']} of {t['num_experts']} experts)" if t.get("num_experts") else ""
        lines.append(f"{shape} {fmt}: {n} tensors, {total} bytes ({total / 1e9:.2f} GB, {total / 2**30:.2f} GiB), "
                     f"{files}; a decode token reads {read} bytes ({read / 1e9:.2f} GB){picked}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=_shape_list(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(ALL_SHAPES))
    ap.add_argument("--format", default="bf16", choices=FORMATS, dest="fmt",
                    help="bf16; fp8 (block-wise, Qwen's *-FP8 layout); nvfp4 (ModelOpt); q4k (a llama.cpp Q4_K_M GGUF)")
    ap.add_argument("--pure", action="store_true",
                    help="q4k: every quantised tensor Q4_K, no Q4_K_M mix (llama-quantize --pure)")
    ap.add_argument("--out", help="checkpoint directory to write (required unless --dry-run)")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="largest shard size in GB (1e9 bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spill-dir", help="write the shards past --keep-gb here and symlink them into --out "
                    "(a checkpoint larger than --out's filesystem; e.g. /dev/shm)")
    ap.add_argument("--keep-gb", type=float, default=0.0, help="with --spill-dir: GB of shards kept in --out")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the tensor count, bytes and shards the shape would write in each format; write nothing")
    a = ap.parse_args(argv)
    if a.dry_run:
        print("\n".join(dry_run_lines(a.shape, a.shard_gb)))
        return 0
    if not a.out:
        ap.error("--out is required (or pass --dry-run)")
    t0 = time.perf_counter()
    try:
        out = make_random_model(a.shape, a.out, shard_gb=a.shard_gb, seed=a.seed, show_progress=True,
                                spill_dir=a.spill_dir, keep_gb=a.keep_gb, fmt=a.fmt, pure=a.pure)
    except FormatRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.shape} ({a.fmt}) to {out} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
