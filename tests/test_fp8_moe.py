"""Block-wise FP8 MoE checkpoints on the cpu target (W8A8: graph/fp8_ops.py moe_experts_fp8) against
transformers.

The tiny MoE checkpoints of tests/tiny_moe.py (transformers' own, eager experts, the per-expert layout)
quantised by the test as Qwen's Qwen3-30B-A3B-FP8 and Qwen3.6-35B-A3B-FP8 are: quant_method "fp8",
fmt "e4m3", activation_scheme "dynamic", weight_block_size, e4m3 `weight` + f32 `weight_scale_inv`
per [bn, bk] block for every expert's gate/up/down_proj, the shared expert's, the attention and GDN
projections and the dense MLPs; the router (mlp.gate), the shared expert's gate (mlp.shared_expert_gate),
the embeddings, lm_head, the GDN conv1d / in_proj_a / in_proj_b and the vision tower stay bf16 and are
listed in modules_to_not_convert (tests/fp8_checkpoints.py hybrid_not_converted, plus the gates). Two
cases: Qwen3MoeForCausalLM with [128, 128] blocks on a tiny model widened so that every expert
dimension is whole blocks, and Qwen3_5MoeForConditionalGeneration (shared expert, GDN layers) with
[16, 16] blocks (several activation groups a token) and its scales stored in bf16.

Oracle (W8A8), as tests/test_fp8_hybrid.py builds it: transformers in f32 on the numpy-dequantised
weights, every FP8 linear's input rounded to e4m3 per token per bk columns (scale max(amax, 1e-10) /
448, vLLM's per_token_group_quant_fp8), told kiln's rounding where the two disagree by one e4m3 step
at a rounding boundary; the experts' forward replaced by the same W8A8 computation in torch (the
token's quantised row through the dequantised gate/up, SiLU-and-mul, that intermediate quantised per
token per bk columns by torch's float8 cast, the dequantised down). kiln's logits are within 1e-3 of
the oracle's and 32 greedy steps equal its argmax; the unrounded (W8A16) model differs by far more,
so a path that skips the activation rounding fails.
"""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from kiln.errors import InvalidModelError, UnsupportedQuantizationError
from kiln.graph.fp8_ops import moe_fp8_act
from kiln.loader import load
from kiln.runtime.worker.cpu_executor import CpuExecutor
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.fp8_checkpoints import (BLOCK_CONFIG, CHANNEL_CONFIG, check_w8a8_greedy, check_w8a8_logits, hooked_logits,
                                  dequantize_block, hybrid_not_converted, quantize_block)
from tests.moe_checkpoints import QUANTISED, _leaf, dequantised_oracle, quantised_state
from tests.test_fp8_hybrid import TIE, _ordinal
from tests.test_fp8_models import _prompts
from tests.tiny_moe import make_tiny_moe

# every dimension an expert reads or writes whole [128, 128] blocks: hidden 256, experts 128 wide;
# the dense layer (mlp_only_layers) 256 wide
WIDE = dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256, head_dim=32)
# (variant, weight_block_size, config overrides); the Qwen3.5-MoE case stores its weight_scale_inv in
# bf16, as some Qwen3.5/3.6 FP8 exports do (the format's scales are read in whatever float dtype they come)
CASES = [("qwen3_moe", (128, 128), WIDE), ("qwen3_5_moe", (16, 16), {})]
SCALE_DTYPE = {"qwen3_moe": np.float32, "qwen3_5_moe": ml_dtypes.bfloat16}


def make_fp8_moe_checkpoint(out_dir: Path, variant: str, block=(128, 128), seed: int = 0, **overrides):
    """Write the tiny MoE `variant` under out_dir quantised block-wise (see the module docstring);
    return the f32 transformers model holding the dequantised weights (the W8A16 oracle), with
    .deq: the dequantised per-expert weights by file name."""
    src = out_dir / "bf16"
    model = make_tiny_moe(src, variant, seed=seed, **overrides)

    def quantise(module, w):
        q, s = quantize_block(w, *block)
        s = s.astype(SCALE_DTYPE[variant])
        deq = dequantize_block(q, s.astype(np.float32), *block)
        return {f"{module}.weight": q, f"{module}.weight_scale_inv": s}, deq
    out, deq = quantised_state(model, src, quantise)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    layers = model.config.get_text_config().num_hidden_layers
    text = "model.language_model" if variant == "qwen3_5_moe" else "model"
    gates = [f"{text}.layers.{i}.mlp.{g}" for i in range(layers) for g in ("gate", "shared_expert_gate")]
    not_converted = [*(hybrid_not_converted(model) if variant == "qwen3_5_moe" else
                       ["lm_head", "model.embed_tokens"]), *gates]
    cfg["quantization_config"] = {**BLOCK_CONFIG, "weight_block_size": list(block),
                                  "modules_to_not_convert": not_converted}
    cfg["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("generation_config.json",):
        if (src / f).exists():
            (out_dir / f).write_text((src / f).read_text())
    w8a16 = dequantised_oracle(model, src, deq)
    w8a16.deq = deq
    w8a16.block = block
    return w8a16


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c[0])
def moe(request, tmp_path_factory):
    variant, block, overrides = request.param
    d = tmp_path_factory.mktemp(f"{variant}_fp8")
    w8a16 = make_fp8_moe_checkpoint(d, variant, block, **overrides)
    lm = load(d, kv_cache_tokens=2048, tokenizer=False)
    return request.param, d, lm, w8a16


class _Probe:
    """kiln's quantised inputs (e4m3 values, f32 scales) of every linear_fp8 and moe_experts_fp8, by
    node name, for one step; the executor keeps them as extra outputs."""

    def __init__(self, lm):
        assert isinstance(lm.executor, CpuExecutor), type(lm.executor)
        self.lm, g = lm, lm.graph
        self.fp8 = {n.name: n for n in g.nodes.values() if n.op in ("linear_fp8", "moe_experts_fp8")}
        keep = {t for n in self.fp8.values() for t in n.inputs[:3 if n.op == "moe_experts_fp8" else 2]}
        for t in sorted(keep):
            if t not in g.outputs:
                g.outputs.append(t)
        lm.executor._last_use = lm.executor._compute_last_use()

    def run(self, prompt):
        return self.run_chunk(SeqChunk(prompt, 0, list(range(-(-len(prompt) // self.lm.block_size))), state_slot=0))

    def run_chunk(self, chunk: SeqChunk):
        inputs = prepare_step([chunk], self.lm.block_size)
        inputs["logits_indices"] = np.arange(len(chunk.token_ids), dtype=np.int32)
        out = self.lm.executor.execute(inputs)
        acts = {name: (out[n.inputs[0]].astype(np.float32), out[n.inputs[1]]) for name, n in self.fp8.items()}
        for name, n in self.fp8.items():
            if n.op == "moe_experts_fp8":  # kiln's quantised intermediate, by its own reference
                w = self.lm.executor.weights
                xq, xs, ids = (out[t] for t in n.inputs[:3])
                aq, as_ = moe_fp8_act(xq, xs, ids, w[n.inputs[4]], w[n.inputs[5]], **{
                    a: n.attrs[a] for a in ("block", "out_dtype", "min_scale")})
                acts[f"{name}.act"] = (aq.astype(np.float32), as_)
        return out[self.lm.graph.outputs[0]], acts


def _round_told(x: torch.Tensor, groups: int, told, stats, what: str) -> torch.Tensor:
    """x [T, K] rounded to e4m3 per token per K / groups columns (scale max(amax, 1e-10) / 448) and
    dequantised; told: kiln's (e4m3 values as f32, scales) of the same rows, taken where the two
    disagree by one step at a rounding boundary (tests/test_fp8_hybrid.py says why), None: torch's."""
    t = x.reshape(x.shape[0], groups, x.shape[-1] // groups)
    s = t.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    y = (t / s).clamp(-448.0, 448.0)
    q = y.to(torch.float8_e4m3fn).to(torch.float32)
    stats["elements"] += q.numel()
    if told is not None:
        theirs = torch.from_numpy(told).reshape(q.shape)
        differ = q != theirs
        if differ.any():
            lo, hi = torch.minimum(q, theirs)[differ], torch.maximum(q, theirs)[differ]
            assert bool((_ordinal(hi) - _ordinal(lo) == 1).all()), f"{what}: kiln's e4m3 activation is not one " \
                                                                    f"step from torch's"
            dist = float(((y[differ] - (lo + hi) / 2).abs() / 448.0).max())
            assert dist <= TIE, f"{what}: kiln rounds an activation {dist:.1e} from the boundary otherwise than torch"
            stats["ties"] += int(differ.sum())
            q = torch.where(differ, theirs, q)
    return (q * s).reshape(x.shape)


def _node(module: str) -> str:
    """transformers' module name -> kiln's node name (model.layers.1.mlp.shared_expert.up_proj ->
    layers.1.shared_expert.up_proj, ...self_attn.q_proj -> layers.1.q_proj)."""
    parts = module.split(".")
    i = parts.index("layers")
    return ".".join(["layers", parts[i + 1], *parts[i + 3:]])


def _oracle(model, acts, stats):
    """Hooks making the W8A16 `model` the W8A8 oracle (module docstring); -> the hook handles."""
    bn, bk = model.block
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "layers" in name.split(".") and _leaf(name) in QUANTISED:
            key = _node(name)

            def hook(m, args, key=key):
                x = args[0]
                kq, ks = acts[key]
                flat = x.reshape(-1, x.shape[-1])
                return (_round_told(flat, ks.shape[1], kq, stats, key).reshape(x.shape),)
            handles.append(mod.register_forward_pre_hook(hook))
        elif name.endswith("mlp.experts"):
            key = _node(name)  # layers.{i}.experts
            handles.append(_patch_experts(mod, acts[key], acts[f"{key}.act"], stats, key, bk))
    return handles


class _Restore:
    def __init__(self, mod):
        self.mod = mod

    def remove(self):
        del self.mod.forward


def _patch_experts(mod, told, told_act, stats, key, bk):
    """The experts' forward as W8A8 (module docstring); the weights are mod's (dequantised). told,
    told_act: kiln's quantised x [T, H] and intermediate [T*k, I] (rows t * k + j)."""
    xq, _ = told
    aq = told_act[0]

    def forward(hidden, top_k_index, top_k_weights):
        x = _round_told(hidden.float(), hidden.shape[-1] // bk, xq, stats, key)
        out = torch.zeros_like(x)
        inter = mod.gate_up_proj.shape[1] // 2
        for t in range(x.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                h = x[t:t + 1] @ mod.gate_up_proj[e].T
                a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
                r = t * top_k_index.shape[1] + j
                a = _round_told(a, inter // bk, aq[r:r + 1], stats, f"{key} intermediate")
                out[t] += top_k_weights[t, j] * (a @ mod.down_proj[e].T)[0]
        return out
    mod.forward = forward
    return _Restore(mod)


def _oracle_logits(model, prompt, acts, stats):
    return hooked_logits(model, prompt, _oracle(model, acts, stats))


def test_graph_keeps_the_experts_in_fp8(moe):
    """One moe_experts_fp8 a MoE layer over e4m3 experts stacked per layer with their stacked block
    scales; router and shared-expert gate plain; the shared expert and attention FP8 linears."""
    (variant, (bn, bk), _), _, lm, _ = moe
    c = lm.source.config
    ops = [n.op for n in lm.graph.nodes.values()]
    moe_layers = [i for i in range(c.num_hidden_layers) if c.layer_is_moe(i)]
    assert ops.count("moe_experts_fp8") == len(moe_layers) and "moe_experts" not in ops
    w = lm.executor.weights
    E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
    p = f"model.layers.{moe_layers[0]}.mlp"
    assert w[f"{p}.experts.gate_up_proj"].dtype.name == "float8_e4m3fn"
    assert w[f"{p}.experts.gate_up_proj"].shape == (E, 2 * I, H)
    assert w[f"{p}.experts.gate_up_proj.weight_scale_inv"].shape == (E, 2 * I // bn, H // bk)
    assert w[f"{p}.experts.down_proj.weight_scale_inv"].shape == (E, -(-H // bn), I // bk)
    # the router and the shared expert's gate (stacked into one GEMM with the shared expert's linears
    # where they are plain: passes/merge_parallel_linears.py) read f32; the shared expert e4m3
    dtypes = {name: str(t.dtype) for t in lm.graph.weights for name, _ in (t.parts or ((t.name, 0),))}
    assert dtypes[f"{p}.gate.weight"] == "f32"
    if c.shared_expert_intermediate_size:
        assert dtypes[f"{p}.shared_expert.up_proj.weight"] == "fp8e4m3"
        assert dtypes[f"{p}.shared_expert_gate.weight"] == "f32"


def test_logits_match_w8a8_oracle(moe):
    (variant, *_), _, lm, w8a16 = moe
    check_w8a8_logits(_Probe(lm), _oracle_logits, w8a16, _prompts(256, seed=1), variant)


def test_greedy_tokens_match_w8a8_oracle(moe):
    """32 greedy steps of kiln (prefill, then a decode step a token) equal the oracle's argmax at
    every generated position, the oracle told the rounding kiln's steps made of each token."""
    (variant, *_), _, lm, w8a16 = moe
    (prompt,) = _prompts(256, seed=2, lens=(16,))
    check_w8a8_greedy(lm, _Probe(lm), _oracle_logits, w8a16, prompt, variant)


def _rewrite(path: Path, fn):
    """Edit the checkpoint's tensors (torch's: safetensors.numpy reads no e4m3)."""
    from safetensors.torch import load_file as load_pt, save_file as save_pt
    sd = load_pt(str(path / "model.safetensors"))
    fn(sd)
    save_pt(sd, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_a_checkpoint_that_disagrees_with_its_config_is_one_sentence(tmp_path):
    """A missing expert scale, a scale of the wrong shape and an expert stored in bf16 are each
    refused naming the tensor; per-channel FP8 (compressed-tensors) experts are refused naming the format."""
    d = tmp_path / "ok"
    d.mkdir()
    make_fp8_moe_checkpoint(d, "qwen3_moe", (16, 16))
    x = "model.layers.1.mlp.experts"
    cases = [
        (lambda sd: sd.pop(f"{x}.3.up_proj.weight_scale_inv"),
         rf"^weight {x}\.3\.up_proj\.weight_scale_inv is missing from the model files"),
        (lambda sd: sd.update({f"{x}.2.down_proj.weight_scale_inv": torch.ones((4, 4))}),
         rf"^weight '{x}\.2\.down_proj\.weight_scale_inv' has shape \[4, 4\], the config implies \[4, 2\]$"),
        (lambda sd: sd.update({f"{x}.5.gate_proj.weight": sd[f"{x}.5.gate_proj.weight"].to(torch.bfloat16)}),
         rf"^weight '{x}\.5\.gate_proj\.weight' is stored as bfloat16, but the checkpoint's quantization_config "
         rf"says it is float8_e4m3fn$"),
    ]
    for i, (edit, msg) in enumerate(cases):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        for f in ("config.json", "model.safetensors"):
            (bad / f).write_bytes((d / f).read_bytes())
        _rewrite(bad, edit)
        with pytest.raises(InvalidModelError, match=msg):
            lm = load(bad, kv_cache_tokens=256, tokenizer=False)
            lm.executor.execute  # the weights are read at load
    ch = tmp_path / "channel"
    ch.mkdir()
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = CHANNEL_CONFIG
    (ch / "config.json").write_text(json.dumps(cfg))
    (ch / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    with pytest.raises(UnsupportedQuantizationError, match=r"^compressed-tensors FP8 with channel-wise weight scales "
                                                           r"MoE layers \(model\.layers\.1\.mlp\) are not supported"):
        load(ch, kv_cache_tokens=256, tokenizer=False)


@pytest.mark.parametrize("qc", [{**BLOCK_CONFIG, "modules_to_not_convert": ["lm_head", "*self_attn*", "*mlp.gate"]},
                                {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                 "exclude_modules": ["lm_head", "*self_attn*", "*mlp.gate"]}], ids=["fp8", "nvfp4"])
def test_tensor_parallel_quantised_experts_are_refused_by_name(qc):
    """Quantised experts are not sharded yet (their scales would be sliced with the rows): even where
    every other linear is plain, tensor parallelism refuses the expert op by name."""
    from kiln.loader import build_graph
    from kiln.models.config import ModelConfig
    from kiln.errors import ConfigError
    from tests.tiny_models import BASE
    from tests.tiny_moe import EXPERTS

    cfg = ModelConfig.from_hf_dict({**BASE, **EXPERTS, "architectures": ["Qwen3MoeForCausalLM"],
                                    "quantization_config": qc})
    with pytest.raises(ConfigError, match=r"does not split moe_experts_(fp8|nvfp4) layers"):
        build_graph(cfg, target="cpu", tensor_parallel=(2, 0))
