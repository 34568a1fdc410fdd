"""Tiny FP8 checkpoints, quantised in numpy from a tiny HF model (tests/tiny_models.py) into the
layouts the real producers write, with their quantization_config field by field:

  block    HF/vLLM block-wise FP8 (Qwen3-*-FP8): `weight` e4m3, `weight_scale_inv` f32 per
           [bn, bk] block = amax / 448 (a multiplier), as transformers' Fp8Quantize writes it
  channel  compressed-tensors FP8_DYNAMIC (llm-compressor): `weight_scale` [N, 1] per row, stored
           bf16 as llm-compressor stores it for a bf16 model
  modelopt ModelOpt FP8 (hf_quant_config.json): scalar `weight_scale` and a static scalar
           `input_scale` = the calibrated input amax / 448 (q/k/v and gate/up see the same input,
           so their input scales come out equal, as ModelOpt's export makes them)

The non-quantised tensors (embeddings, norms, lm_head) stay bf16, as in the real checkpoints.
`make_fp8_checkpoint` returns the f32 transformers model whose linears hold the dequantised
weights W = e4m3 * scale: the oracle without activation rounding.

The Qwen3.5 hybrids (tests/tiny_models.py HYBRID_VARIANTS) are quantised block-wise as Qwen's own
Qwen3.5/3.6-*-FP8 checkpoints are: every Linear of the text tower in FP8 (gated attention q/k/v/o,
the Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj, the MLP) but those modules_to_not_convert
lists, which for Qwen's files (read in copies of Qwen3.5-27B-FP8's config.json: ms-swift's
quant_args.py modules_to_not_convert list, and a test's copy of Qwen3.6-35B-A3B-FP8's) names, by
the file's module names, lm_head, the embeddings, every GDN layer's conv1d, in_proj_a and in_proj_b
(hv rows: vLLM's gdn_linear_attn.py "ba_proj doesn't support blockwise fp8 quantization"), the
vision tower's linears and the MTP head (none here): hybrid_not_converted writes that list.
"""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.numpy import save_file

from tests.tiny_models import HYBRID_VARIANTS, make_tiny_hybrid, make_tiny_model

E4M3 = ml_dtypes.float8_e4m3fn
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# the Gated DeltaNet projections of a Qwen3.5 hybrid: Linear modules too
GDN_LINEARS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
               "linear_attn.in_proj_a", "linear_attn.out_proj")

BLOCK_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [16, 16]}
_ARGS = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8, "observer_kwargs": {},
         "symmetric": True, "type": "float"}
CHANNEL_CONFIG = {  # llm-compressor's FP8_DYNAMIC preset as it lands in config.json
    "config_groups": {"group_0": {
        "input_activations": {**_ARGS, "dynamic": True, "observer": None, "strategy": "token"},
        "output_activations": None,
        "targets": ["Linear"],
        "weights": {**_ARGS, "dynamic": False, "observer": "minmax", "strategy": "channel"},
    }},
    "format": "float-quantized", "global_compression_ratio": None, "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
MODELOPT_CONFIG = {"producer": {"name": "modelopt", "version": "0.29.0"},
                   "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}


def quantize_block(w: np.ndarray, bn: int, bk: int) -> tuple[np.ndarray, np.ndarray]:
    """w: f32 [N, K] -> (e4m3 [N, K], scale f32 [ceil(N/bn), ceil(K/bk)]), scale = block amax / 448."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    pad = np.zeros((nb * bn, kb * bk), np.float32)
    pad[:n, :k] = np.abs(w)
    amax = pad.reshape(nb, bn, kb, bk).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k]
    return np.clip(w / full, -448, 448).astype(E4M3), scale


def dequantize_block(q: np.ndarray, scale: np.ndarray, bn: int, bk: int) -> np.ndarray:
    n, k = q.shape
    return q.astype(np.float32) * np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k]


def _leaf(module: str) -> str:
    """model.layers.3.mlp.up_proj (or model.language_model.layers.3...) -> mlp.up_proj"""
    parts = module.split(".")
    return ".".join(parts[parts.index("layers") + 2:]) if "layers" in parts else module


def hybrid_not_converted(model) -> list[str]:
    """modules_to_not_convert as Qwen's Qwen3.5/3.6-*-FP8 files write it (see the module docstring),
    for the tiny hybrid `model`: lm_head, the embeddings, each GDN layer's conv1d, in_proj_a and
    in_proj_b, and the vision tower's Linear modules, by the file's module names."""
    names = ["lm_head"]
    for name, mod in model.named_modules():
        leaf = _leaf(name)
        if name.endswith("embed_tokens") and "visual" not in name:
            names.append(name)
        elif leaf in ("linear_attn.conv1d", "linear_attn.in_proj_a", "linear_attn.in_proj_b"):
            names.append(name)
        elif ".visual." in f".{name}." and isinstance(mod, torch.nn.Linear):
            names.append(name)
    return names


def make_fp8_checkpoint(out_dir: Path, variant: str, layout: str, *, block=(16, 16), not_converted=(),
                        seed: int = 0, calib_prompts=(), hybrid_overrides=None):
    """Write variant's tiny model quantised into `layout` under out_dir; return the f32
    transformers model holding the dequantised weights (the W8A16 oracle). not_converted:
    modules left bf16 and listed in the config's skip list (a hybrid's always has
    hybrid_not_converted's too). calib_prompts: token lists whose per-linear input amax gives
    ModelOpt's static input scales. hybrid_overrides: text-config fields of a hybrid variant."""
    hybrid = variant in HYBRID_VARIANTS
    if hybrid:
        model = make_tiny_hybrid(out_dir, variant, seed=seed, **(hybrid_overrides or {}))
        not_converted = (*hybrid_not_converted(model), *not_converted)
    else:
        model = make_tiny_model(out_dir, variant, seed=seed, dtype=torch.float32)
    linears = LINEARS + GDN_LINEARS if hybrid else LINEARS
    cfg = json.loads((out_dir / "config.json").read_text())
    amax = _calibrate(model, calib_prompts, linears) if layout == "modelopt" else {}
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and _leaf(module) in linears) or module in not_converted:
            out[name] = w.astype(ml_dtypes.bfloat16)  # stays bf16, as the real checkpoints keep it
            deq[name] = torch.from_numpy(out[name].astype(np.float32))
            continue
        if layout == "block":
            q, s = quantize_block(w, *block)
            out[f"{module}.weight_scale_inv"], d = s, dequantize_block(q, s, *block)
        elif layout == "channel":
            s = (np.abs(w).max(axis=1, keepdims=True) / 448.0).astype(ml_dtypes.bfloat16)  # [N, 1]
            q = np.clip(w / s.astype(np.float32), -448, 448).astype(E4M3)
            out[f"{module}.weight_scale"], d = s, q.astype(np.float32) * s.astype(np.float32)
        elif layout == "modelopt":
            s = np.float32(np.abs(w).max() / 448.0)
            q = np.clip(w / s, -448, 448).astype(E4M3)
            out[f"{module}.weight_scale"], d = np.array(s, np.float32), q.astype(np.float32) * s
            out[f"{module}.input_scale"] = np.array(amax[module] / 448.0, np.float32)
        else:
            raise ValueError(layout)
        out[name] = q
        deq[name] = torch.from_numpy(d.astype(np.float32))
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg["dtype"] = "bfloat16"
    if layout == "block":
        cfg["quantization_config"] = {**BLOCK_CONFIG, "weight_block_size": list(block),
                                      **({"modules_to_not_convert": list(not_converted)} if not_converted else {})}
    elif layout == "channel":
        cfg["quantization_config"] = {**CHANNEL_CONFIG, "ignore": ["lm_head", *not_converted]}
    else:
        hq = json.loads(json.dumps(MODELOPT_CONFIG))
        hq["quantization"]["exclude_modules"] += list(not_converted)
        (out_dir / "hf_quant_config.json").write_text(json.dumps(hq, indent=2))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    model.load_state_dict(deq, strict=False)
    # what quantize_activations needs to round the activations as the checkpoint says
    model.fp8_layout, model.fp8_block, model.fp8_skip = layout, tuple(block), tuple(not_converted)
    model.fp8_linears = linears
    model.fp8_input_scales = {k.rsplit(".", 1)[0]: float(v) for k, v in out.items() if k.endswith(".input_scale")}
    return model


def _calibrate(model, prompts, linears=LINEARS) -> dict[str, float]:
    """Max |input| of every decoder linear over the calibration prompts (ModelOpt's max calibrator)."""
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in model.named_modules():
        parts = name.split(".")
        if ".".join(parts[parts.index("layers") + 2:] if "layers" in parts else parts) in linears:
            def hook(m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return amax


def quantize_activations(model):
    """Make `model` (from make_fp8_checkpoint) the W8A8 oracle: every FP8 linear's input rounded
    to e4m3 first, by torch's own float8_e4m3fn cast, as vLLM's references define it
    (tests/kernels/quant_utils.py): block-wise per token per bk columns, scale = max(amax, 1e-10)
    / 448 (native_per_token_group_quant_fp8); FP8_DYNAMIC per token, scale clamped at
    1 / (448 * 512) (ref_dynamic_per_token_quant); ModelOpt by its static input_scale.
    The linear then multiplies the rounded activation by the dequantised weight."""
    layout, block, input_scales = model.fp8_layout, model.fp8_block, model.fp8_input_scales

    def hook_for(module_name):
        def hook(mod, args):
            x = args[0]
            k = x.shape[-1]
            group = block[1] if layout == "block" else k
            t = x.reshape(-1, k // group, group)
            if layout == "modelopt":
                s = torch.tensor(input_scales[module_name], dtype=torch.float32)
            elif layout == "block":
                s = t.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
            else:
                s = (t.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
            q = (t / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
            return ((q * s).reshape(x.shape),)
        return hook
    for name, mod in model.named_modules():
        if "layers" in name.split(".") and _leaf(name) in model.fp8_linears and name not in model.fp8_skip:
            mod.register_forward_pre_hook(hook_for(name))
    return model


# -- the W8A8-oracle checks tests/test_fp8_hybrid.py, tests/test_fp8_moe.py and
# tests/test_make_random_model_moe.py share: each passes its own probe (kiln's logits and quantised
# activations of a step) and its own oracle (the W8A16 model told kiln's rounding) ----------------------

def hooked_logits(model, prompt, handles) -> np.ndarray:
    """The f32 logits [T, V] of `model` on one prompt with the forward hooks `handles` (a told oracle's),
    which are removed afterwards."""
    try:
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0].numpy()
    finally:
        for h in handles:
            h.remove()


def check_w8a8_logits(probe, oracle_logits, w8a16, prompts, variant: str) -> None:
    """Each prompt's logits (probe.run(prompt) -> (logits, acts)) within 1e-3 of the W8A8 oracle
    (oracle_logits(w8a16, prompt, acts, stats)), where the unrounded W8A16 model is more than 2e-2 off
    (else the test could not tell W8A8 from W8A16); ties at most 1e-4 of the rounded elements."""
    from tests.test_fp8_models import _rel

    stats = {"elements": 0, "ties": 0}
    for p in prompts:
        got, acts = probe.run(p)
        ref = oracle_logits(w8a16, p, acts, stats)
        with torch.no_grad():
            unrounded = w8a16(torch.tensor([p])).logits[0].numpy()
        assert _rel(got, ref) <= 1e-3, f"{variant}: {len(p)}-token prompt {_rel(got, ref):.2e} from the W8A8 oracle"
        assert _rel(unrounded, ref) > 2e-2, f"{variant}: the activation rounding moves logits only " \
                                            f"{_rel(unrounded, ref):.2e}: the test cannot tell W8A8 from W8A16"
    assert stats["ties"] <= 1e-4 * stats["elements"], stats


def check_w8a8_greedy(lm, probe, oracle_logits, w8a16, prompt, variant: str, steps: int = 32) -> None:
    """`steps` greedy steps of kiln (the prompt's prefill, then one decode step a token, as
    runtime/worker/generate.py greedy_generate steps; probe.run_chunk) equal the oracle's argmax at every
    generated position and are within 1e-3 of its logits, the oracle told the rounding kiln's steps
    made of each token."""
    from kiln.runtime.worker.input_batch import SeqChunk
    from tests.test_fp8_models import _rel

    stats = {"elements": 0, "ties": 0}
    blocks = list(range(-(-(len(prompt) + steps) // lm.block_size)))
    seq, ours, acts_of, rows = list(prompt), [], [], []
    chunk = SeqChunk(seq, 0, blocks, state_slot=0)
    while len(ours) < steps:
        logits, acts = probe.run_chunk(chunk)
        acts_of.append(acts)
        rows.append(logits[-1])
        ours.append(int(logits[-1].argmax()))
        seq.append(ours[-1])
        chunk = SeqChunk([ours[-1]], len(seq) - 1, blocks, state_slot=0)
    acts = {k: tuple(np.concatenate([a[k][i] for a in acts_of]) for i in (0, 1)) for k in acts_of[0]}
    ref = oracle_logits(w8a16, seq[:-1], acts, stats)[len(prompt) - 1:]
    assert ref.argmax(axis=-1).tolist() == ours, variant
    assert _rel(np.stack(rows), ref) <= 1e-3, variant
