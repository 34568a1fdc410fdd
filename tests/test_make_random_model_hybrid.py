"""bench/make_random_model.py's Qwen3.5/3.6 hybrid shapes: the tiny dense hybrid written by hand
loads in transformers (text-only CausalLM and the ConditionalGeneration class the config names)
with no missing or unexpected text weights and runs, and kiln runs it on CPU with the same greedy
tokens; the tiny MoE hybrid loads in transformers (per-expert tensors fused at load) and kiln
runs it with transformers' greedy tokens; the full-size shapes' tensor names and shapes are the ones
transformers builds (on the meta device); --help lists the shapes and --dry-run writes nothing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.bench.make_random_model import (TEXT_PREFIX, checkpoint_bytes, hf_config, make_random_model,
                                          weight_shapes)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
HYBRIDS = ("qwen3.6-27b", "qwen3.6-35b-a3b")
# a one-block vision tower: ConditionalGeneration always builds one, and the default is 27 blocks
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    # shards of ~100 kB: written as several shards and an index, as the 27B is
    return make_random_model("tiny-qwen3.6", tmp_path_factory.mktemp("tiny_qwen36"), shard_gb=1e-4)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return make_random_model("tiny-qwen3.6-moe", tmp_path_factory.mktemp("tiny_qwen36_moe"), shard_gb=1e-4)


def _no_loading_problems(info: dict, allow_missing: str | None = None) -> None:
    missing = [k for k in info["missing_keys"] if not (allow_missing and k.startswith(allow_missing))]
    assert not missing and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info.get("error_msgs"), info


def _hf_causal(path: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    attn_implementation="eager",
                                                                    output_loading_info=True)
    _no_loading_problems(info)
    return model.eval()


def _hf_conditional(path: Path):
    """The class config.json names, with a one-block vision tower: only model.visual.* may be missing."""
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg.vision_config = type(cfg.vision_config)(**TINY_VISION)
    cls = getattr(transformers, cfg.architectures[0])
    model, info = cls.from_pretrained(path, config=cfg, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True)
    assert info["missing_keys"] and all(k.startswith("model.visual.") for k in info["missing_keys"])
    _no_loading_problems(info, allow_missing="model.visual.")
    return model.eval()


def _file_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.astype(np.float32) for k, v in load_file(f).items()})  # bf16 -> f32 via ml_dtypes
    return out


def test_dense_config_is_the_conditional_generation_layout(dense):
    cfg = json.loads((dense / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cfg["model_type"] == "qwen3_5"
    t = cfg["text_config"]
    assert t["model_type"] == "qwen3_5_text" and "vision_config" not in cfg
    assert t["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert t["rope_parameters"]["partial_rotary_factor"] == 0.25 and t["rope_parameters"]["mrope_interleaved"]
    index = json.loads((dense / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    names = set(index["weight_map"])
    assert "lm_head.weight" in names and all(n.startswith(TEXT_PREFIX) or n == "lm_head.weight" for n in names)


def test_dense_loads_in_transformers_and_runs(dense):
    model = _hf_causal(dense)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    files = _file_tensors(dense)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    # every text tensor arrived under its name (the PrefixChange of model.language_model. -> model.)
    assert set(sd) == {("model." + k[len(TEXT_PREFIX):]) if k.startswith(TEXT_PREFIX) else k for k in files}
    for k, v in files.items():
        assert np.array_equal(sd[("model." + k[len(TEXT_PREFIX):]) if k.startswith(TEXT_PREFIX) else k], v), k
    la, attn = model.model.layers[0].linear_attn, model.model.layers[3].self_attn
    assert (model.model.layers[0].input_layernorm.weight == 0).all() and (attn.q_norm.weight == 0).all()
    assert (la.norm.weight == 1).all() and (la.dt_bias == 1).all()
    a = la.A_log.exp()
    assert ((a >= 0.99) & (a <= 16.1)).all() and a.std() > 0
    w = files[TEXT_PREFIX + "layers.0.mlp.up_proj.weight"]
    assert w.shape == (160, 64) and 0.015 < float(w.std()) < 0.025
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8, 9, 10, 11]])).logits
    assert logits.shape == (1, 7, 320) and torch.isfinite(logits).all() and logits.abs().max() > 0
    cond = _hf_conditional(dense)
    with torch.no_grad():
        cond_logits = cond(torch.tensor([[5, 6, 7, 8, 9, 10, 11]])).logits
    assert torch.equal(cond_logits, logits)


def test_dense_runs_in_kiln_with_transformers_greedy_tokens(dense):
    from kiln.loader import load
    from kiln.runtime.worker.generate import greedy_generate

    lm = load(dense)
    cfg = lm.source.config
    assert cfg.architecture == "Qwen3_5ForConditionalGeneration" and cfg.is_hybrid and cfg.rotary_dim == 8
    assert lm.tokenizer.vocab_size == 320 and lm.tokenizer.eos_token_ids == {2}
    prompts = [[5, 6, 7, 8, 9], [11, 12], list(range(3, 40))]
    steps: list[np.ndarray] = []
    ours = greedy_generate(lm.executor, lm.block_size, prompts, max_tokens=6, logits_out=steps)
    assert [len(o) for o in ours] == [6, 6, 6]
    model = _hf_causal(dense)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        assert ours[i] == ref.sequences[0, len(p):].tolist(), f"greedy tokens differ ({len(p)}-token prompt)"
        for t, want in enumerate(ref.logits):
            want = want[0].numpy()
            assert np.abs(steps[t][i] - want).max() / np.abs(want).max() < 1e-4, (i, t)


def test_moe_loads_in_transformers_with_the_experts_fused(moe):
    cfg = json.loads((moe / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and cfg["model_type"] == "qwen3_5_moe"
    t = cfg["text_config"]
    assert t["model_type"] == "qwen3_5_moe_text" and "intermediate_size" not in t
    model = _hf_causal(moe)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    files = _file_tensors(moe)
    p = TEXT_PREFIX + "layers.1.mlp."
    assert p + "experts.7.down_proj.weight" in files and not any("gate_up_proj" in k for k in files)
    experts = model.model.layers[1].mlp.experts
    for e in (0, 5):  # the per-expert tensors merged: gate rows, then up rows
        want = np.concatenate([files[f"{p}experts.{e}.gate_proj.weight"], files[f"{p}experts.{e}.up_proj.weight"]])
        assert np.array_equal(experts.gate_up_proj[e].detach().float().numpy(), want)
        assert np.array_equal(experts.down_proj[e].detach().float().numpy(), files[f"{p}experts.{e}.down_proj.weight"])
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8, 9, 10, 11]])).logits
    assert logits.shape == (1, 7, 320) and torch.isfinite(logits).all()
    cond = _hf_conditional(moe)
    with torch.no_grad():
        assert torch.equal(cond(torch.tensor([[5, 6, 7, 8, 9, 10, 11]])).logits, logits)


def test_moe_runs_in_kiln_with_transformers_greedy_tokens(moe):
    """The per-expert tensors stacked at load (models/moe_weights.py), the experts and the shared
    expert in every layer (the config parses although a qwen3_5_moe text_config has no
    intermediate_size)."""
    from kiln.loader import load
    from kiln.runtime.worker.generate import greedy_generate

    lm = load(moe, tokenizer=False)
    cfg = lm.source.config
    assert cfg.architecture == "Qwen3_5MoeForConditionalGeneration" and cfg.num_experts == 8
    assert all(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers)) and cfg.intermediate_size == 0
    prompts = [[5, 6, 7, 8, 9], list(range(3, 40))]
    steps: list[np.ndarray] = []
    ours = greedy_generate(lm.executor, lm.block_size, prompts, max_tokens=6, logits_out=steps)
    model = _hf_causal(moe)
    model.config._experts_implementation = "eager"
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        assert ours[i] == ref.sequences[0, len(p):].tolist(), f"greedy tokens differ ({len(p)}-token prompt)"
        for t, want in enumerate(ref.logits):
            want = want[0].numpy()
            assert np.abs(steps[t][i] - want).max() / np.abs(want).max() < 1e-4, (i, t)


@pytest.mark.parametrize("shape", HYBRIDS)
def test_full_size_names_and_shapes_are_what_transformers_builds(shape):
    """The 27B's and the 35B-A3B's tensors against the ConditionalGeneration model transformers
    builds from the same config.json (meta device: no memory), vision tower aside; per-expert
    tensors against the fused experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I]."""
    d = hf_config(shape)
    cfg = transformers.AutoConfig.for_model(**d)
    with torch.device("meta"):
        model = getattr(transformers, d["architectures"][0])(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith("model.visual.")}
    ours = weight_shapes(d)
    fused: dict[str, tuple[int, ...]] = {}
    for name, s in ours.items():
        if ".mlp.experts." not in name:
            fused[name] = s
            continue
        layer, rest = name.split(".mlp.experts.")
        e, proj = rest.split(".")[:2]
        n_exp = d["text_config"]["num_experts"]
        if proj == "down_proj":
            fused[f"{layer}.mlp.experts.down_proj"] = (n_exp, *s)
        else:
            key = f"{layer}.mlp.experts.gate_up_proj"
            fused[key] = (n_exp, 2 * s[0], s[1])
    assert fused == want
    t = d["text_config"]
    assert t["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"] and len(t["layer_types"]) == \
        t["num_hidden_layers"]
    # bf16 bytes: the weights transformers counts (no vision tower, no MTP head)
    assert checkpoint_bytes(shape) == 2 * sum(np.prod(s) for s in want.values())


def test_qwen3_30b_a3b_names_and_shapes_are_what_transformers_builds():
    """The flat Qwen3-MoE shape: per-expert tensors against transformers' stacked experts (meta
    device), and a config kiln reads as 48 MoE layers of 8 of 128 experts."""
    from kiln.models.config import ModelConfig

    d = hf_config("qwen3-30b-a3b")
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(transformers.AutoConfig.for_model(**d))
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fused: dict[str, tuple[int, ...]] = {}
    for name, s in weight_shapes(d).items():
        if ".mlp.experts." not in name:
            fused[name] = s
            continue
        layer, rest = name.split(".mlp.experts.")
        proj = rest.split(".")[1]
        key = f"{layer}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        fused[key] = (128, *s) if proj == "down_proj" else (128, 2 * s[0], s[1])
    assert fused == want
    cfg = ModelConfig.from_hf_dict(d)
    assert all(cfg.layer_is_moe(i) for i in range(48)) and (cfg.num_experts, cfg.num_experts_per_tok) == (128, 8)
    assert checkpoint_bytes("qwen3-30b-a3b") == 2 * sum(np.prod(s) for s in want.values())


def test_kiln_reads_the_27b_config():
    from kiln.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(hf_config("qwen3.6-27b"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (5120, 64, 24, 4, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_conv_dim) == (16, 48, 10240)
    assert cfg.rope_theta == 1e7 and cfg.rotary_dim == 64 and cfg.intermediate_size == 17408
    assert cfg.layer_types.count("full_attention") == 16 and cfg.vocab_size == 248320


def test_help_lists_the_shapes_and_dry_run_writes_nothing(tmp_path):
    script = str(REPO / "bench" / "make_random_model.py")
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for shape in (*HYBRIDS, "tiny-qwen3.6", "tiny-qwen3.6-moe", "llama-3.1-8b"):
        assert shape in proc.stdout
    out = tmp_path / "none"
    proc = subprocess.run([sys.executable, script, "--shape", "qwen3.6-27b", "--out", str(out), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"{checkpoint_bytes('qwen3.6-27b')} bytes" in proc.stdout and not out.exists()
