"""Expert weights in every layout users have, as the two stacked graph weights of each MoE layer
(models/moe.py): `{p}.mlp.experts.gate_up_proj` [E, 2I, H] and `{p}.mlp.experts.down_proj` [E, H, I].

  stacked (transformers' in-memory layout, which save_pretrained(save_original_format=False)
      writes): experts.gate_up_proj [E, 2I, H] (gate rows, then up rows), experts.down_proj
      [E, H, I]; read as they are.
  per expert (the official checkpoints, and what save_pretrained writes by default):
      experts.{e}.gate_proj.weight [I, H], up_proj [I, H], down_proj [H, I]; stacked at load.
  GGUF (llama.cpp's ffn_{gate,up,down}_exps, named by models/gguf_weights.py):
      experts.gate_proj.weight [E, I, H], experts.up_proj.weight [E, I, H],
      experts.down_proj.weight [E, H, I]; gate and up concatenated along the rows at load
      (ffn_gate_up_exps, already [E, 2I, H], comes as experts.gate_up_proj.weight and is renamed).

The result is one array per weight, so an executor uploads one buffer per layer and never E.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from kiln.errors import InvalidModelError
from kiln.models.config import ModelConfig
from kiln.models.gguf_quant import expert_blocks
from kiln.models.moe import DOWN, GATE_UP, SCALE
from kiln.models.mapped_weights import MappedWeights
from kiln.models.weights import WeightSource


def expert_weights(cfg: ModelConfig, rename: dict[str, str], prefix: str = "model.layers",
                   dtype=None) -> dict[str, tuple]:
    """Derived weights (graph name -> (shape, fn(get) -> array), as models/qwen3_5.py's
    MappedWeights takes them) for the stacked expert weights the file does not hold as such.
    rename maps graph names to file names; the per-expert and GGUF names it consumes are
    removed from it, so only the stacked weights are visible. dtype: the file's stored dtype of
    a tensor (by file name), to check block-wise FP8 experts (fp8_experts) are e4m3."""
    derived: dict[str, tuple] = {}
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_is_moe(i):
            # the quantised experts' scales before _layer pops the weights (whose dtypes they check)
            derived.update(fp8_experts(cfg, f"{prefix}.{i}", rename, dtype))
            nv = nvfp4_experts(cfg, f"{prefix}.{i}", rename, dtype)
            derived.update(nv)
            derived.update(_layer(cfg, f"{prefix}.{i}", rename, pack=2 if nv else 1))
    return derived


def nvfp4_experts(cfg: ModelConfig, p: str, rename: dict[str, str], dtype=None) -> dict[str, tuple]:
    """A ModelOpt NVFP4 checkpoint's per-expert block scales `experts.{e}.{w}_proj.weight_scale` (e4m3
    [rows, K/16]) and per-tensor scales `.weight_scale_2` stacked as the weights are (models/moe.py
    _nvfp4_experts): `{GATE_UP}.weight_scale` [E, 2I, H/16], `{GATE_UP}.weight_scale_2` [E, 2] (the
    gate's, the up's), `{DOWN}.weight_scale` [E, H, I/16], `{DOWN}.weight_scale_2` [E, 1]; their
    `input_scale`s are not read (W4A16). {} where the config does not quantise this layer's experts
    in NVFP4. A missing scale, one of the wrong shape or an expert weight not stored as packed uint8
    is one sentence."""
    q = cfg.quantization
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if getattr(q, "weight", None) != "nvfp4" or not q.quantizes(f"{p}.mlp.experts.0.gate_proj"):
        return {}
    group = q.group_size
    names = {}
    for suffix in (".weight_scale", ".weight_scale_2"):
        for w in ("gate", "up", "down"):
            per = [rename.pop(f"{p}.mlp.experts.{e}.{w}_proj{suffix}", None) for e in range(E)]
            if not all(per):
                e = per.index(None)
                raise InvalidModelError(f"weight {p}.mlp.experts.{e}.{w}_proj{suffix} is missing from the model "
                                        f"files (the checkpoint's quantization_config says the experts are NVFP4)")
            names[w, suffix] = per
    for w in ("gate", "up", "down"):
        for e in range(E):
            rename.pop(f"{p}.mlp.experts.{e}.{w}_proj.input_scale", None)  # W4A16: not read
    for e in range(E):
        for w in ("gate", "up", "down"):
            f = rename.get(f"{p}.mlp.experts.{e}.{w}_proj.weight")
            stored = dtype(f) if dtype is not None and f is not None else None
            if stored is not None and stored != np.dtype(np.uint8):
                raise InvalidModelError(f"weight {f!r} is stored as {stored}, but the checkpoint's "
                                        f"quantization_config says it is NVFP4 (uint8, two e2m1 values a byte)")
    sg, sd = (I, H // group), (H, I // group)

    def scalar(get, name):
        v = np.asarray(get(name), np.float32)
        if v.size != 1:
            raise InvalidModelError(f"weight {name!r} has shape {list(v.shape)}, NVFP4's per-tensor scale is a scalar")
        return v.reshape(1)

    g, u, d = (names[w, ".weight_scale"] for w in ("gate", "up", "down"))
    g2, u2, d2 = (names[w, ".weight_scale_2"] for w in ("gate", "up", "down"))
    return {f"{p}.{GATE_UP}.weight_scale": ((E, 2 * I, H // group), lambda get: np.stack(
                [np.concatenate([_check(get, a, sg), _check(get, b, sg)]) for a, b in zip(g, u)])),
            f"{p}.{GATE_UP}.weight_scale_2": ((E, 2), lambda get: np.stack(
                [np.concatenate([scalar(get, a), scalar(get, b)]) for a, b in zip(g2, u2)])),
            f"{p}.{DOWN}.weight_scale": ((E, H, I // group), lambda get: np.stack([_check(get, a, sd) for a in d])),
            f"{p}.{DOWN}.weight_scale_2": ((E, 1), lambda get: np.stack([scalar(get, a) for a in d2]))}


def fp8_experts(cfg: ModelConfig, p: str, rename: dict[str, str], dtype=None) -> dict[str, tuple]:
    """A block-wise FP8 checkpoint's per-expert `experts.{e}.{gate,up,down}_proj.weight_scale_inv`
    (the Qwen3-*-FP8 and Qwen3.5/3.6-*-FP8 layout) stacked as the weights are: `{GATE_UP}{SCALE}`
    [E, 2I/bn, H/bk] (expert e's gate scale rows, then its up ones: the rows of its gate_up block
    rows, as I is whole bn blocks) and `{DOWN}{SCALE}` [E, H/bn, I/bk]. {} where the config does
    not quantise this layer's experts. An expert that lacks a scale, a scale of the wrong shape or
    an expert weight stored in another dtype than e4m3 is one sentence."""
    q = cfg.quantization
    E = cfg.num_experts
    names = [[rename.pop(f"{p}.mlp.experts.{e}.{w}_proj{SCALE}", None) for e in range(E)]
             for w in ("gate", "up", "down")]
    if getattr(q, "weight", None) != "block" or not q.quantizes(f"{p}.mlp.experts.0.gate_proj"):
        # (another FP8 layout's MoE layers are refused by name when the graph is built: models/moe.py)
        if any(any(n) for n in names) and getattr(q, "weight", None) not in ("channel", "tensor"):
            raise InvalidModelError(f"{p}.mlp.experts hold block-wise FP8 scales ({SCALE}), but the checkpoint's "
                                    f"quantization_config does not quantise them block-wise")
        return {}
    for w, per in zip(("gate", "up", "down"), names):
        if not all(per):
            e = per.index(None)
            raise InvalidModelError(f"weight {p}.mlp.experts.{e}.{w}_proj{SCALE} is missing from the model files "
                                    f"(the checkpoint's quantization_config says the experts are block-wise FP8)")
    for e in range(E):
        for w in ("gate", "up", "down"):
            f = rename.get(f"{p}.mlp.experts.{e}.{w}_proj.weight")
            stored = dtype(f) if dtype is not None and f is not None else None
            if stored is not None and stored != _E4M3:
                raise InvalidModelError(f"weight {f!r} is stored as {stored}, but the checkpoint's "
                                        f"quantization_config says it is float8_e4m3fn")
    (bn, bk), I, H = q.block, cfg.moe_intermediate_size, cfg.hidden_size
    sg, sd = (-(-I // bn), -(-H // bk)), (-(-H // bn), -(-I // bk))
    return {f"{p}.{GATE_UP}{SCALE}": ((E, 2 * sg[0], sg[1]), lambda get, g=names[0], u=names[1]: np.stack(
                [np.concatenate([_check(get, a, sg), _check(get, b, sg)]) for a, b in zip(g, u)])),
            f"{p}.{DOWN}{SCALE}": ((E, *sd), lambda get, d=names[2]: np.stack([_check(get, a, sd) for a in d]))}


_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _layer(cfg: ModelConfig, p: str, rename: dict[str, str], pack: int = 1) -> dict[str, tuple]:
    """pack: values a stored element holds along a row (2: NVFP4's two e2m1 a byte), so that an
    expert's stored rows are [I, H / pack] and [H, I / pack]."""
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate_up, down = f"{p}.{GATE_UP}", f"{p}.{DOWN}"
    Hs, Is = H // pack, I // pack  # the stored rows' lengths
    out: dict[str, tuple] = {}
    if f"{gate_up}.weight" in rename:  # GGUF ffn_gate_up_exps: the stacked layout under a .weight name
        rename[gate_up] = rename.pop(f"{gate_up}.weight")
    per = [[rename.pop(f"{p}.mlp.experts.{e}.{w}_proj.weight", None) for e in range(E)]
           for w in ("gate", "up", "down")]
    exps = [rename.pop(f"{p}.mlp.experts.{w}_proj.weight", None) for w in ("gate", "up", "down")]
    for w, names in zip(("gate", "up", "down"), per):
        if any(names) and not all(names):
            e = names.index(None)
            raise InvalidModelError(f"weight {p}.mlp.experts.{e}.{w}_proj.weight is missing from the model files")
    if gate_up not in rename:
        if all(per[0]) and all(per[1]):
            # [E, 2I, H]: expert e's rows are its gate [I, H] then its up [I, H]
            out[gate_up] = ((E, 2 * I, Hs), lambda get, g=per[0], u=per[1]: np.stack(
                [np.concatenate([_check(get, a, (I, Hs)), _check(get, b, (I, Hs))]) for a, b in zip(g, u)]))
        elif exps[0] and exps[1]:
            out[gate_up] = ((E, 2 * I, H), lambda get, g=exps[0], u=exps[1]: np.concatenate(
                [_check(get, g, (E, I, H)), _check(get, u, (E, I, H))], axis=1))
        else:
            raise InvalidModelError(f"the model files hold no experts for {p}.mlp (neither {gate_up!r}, nor "
                                    f"per-expert {p}.mlp.experts.{{e}}.gate_proj/up_proj, nor GGUF ffn_gate_exps)")
    if down not in rename:
        if all(per[2]):
            out[down] = ((E, H, Is), lambda get, d=per[2]: np.stack([_check(get, a, (H, Is)) for a in d]))
        elif exps[2]:
            rename[down] = exps[2]
        else:
            raise InvalidModelError(f"the model files hold no expert down projections for {p}.mlp "
                                    f"(neither {down!r} nor per-expert down_proj nor GGUF ffn_down_exps)")
    return out


def adapt_weights(cfg: ModelConfig, weights: WeightSource) -> WeightSource:
    """Qwen3MoeForCausalLM: the checkpoint's names are the graph's, but for the experts."""
    rename = {nm: nm for nm in weights.names()}
    derived = expert_weights(cfg, rename, dtype=getattr(weights, "dtype", None))
    derived.update(expert_blocks(cfg, rename, weights))  # GGUF experts kept in their blocks (models/gguf_quant.py)
    return MappedWeights(weights, rename, derived)


def _check(get, name: str, shape: tuple[int, ...]) -> np.ndarray:
    w = get(name)
    if tuple(w.shape) != shape:
        raise InvalidModelError(f"weight {name!r} has shape {list(w.shape)}, the config implies {list(shape)}")
    return w
