"""ModelOpt NVFP4 MoE checkpoints on the cpu target (W4A16: graph/nvfp4_ops.py moe_experts_nvfp4) against
transformers.

The tiny MoE checkpoints of tests/tiny_moe.py (per-expert layout) quantised by the test as ModelOpt's
NVFP4 export writes them (tests/nvfp4_checkpoints.py quantize_nvfp4: `weight` uint8 two e2m1 a byte,
`weight_scale` e4m3 per 16 columns, scalar `weight_scale_2` and `input_scale`), for every expert's
gate/up/down_proj, the shared expert's, the attention and GDN projections and the dense MLPs;
hf_quant_config.json's exclude_modules (ModelOpt's wildcards) keeps lm_head, the router (*mlp.gate),
the shared expert's gate and the GDN in_proj_a/in_proj_b bf16. Oracle: transformers in f32 on the
numpy-dequantised weights (W4A16 has no activation rounding): kiln's logits within 1e-3 relative and
32 greedy steps equal."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from kiln.errors import InvalidModelError
from kiln.loader import load
from kiln.runtime.worker.input_batch import SeqChunk, prepare_step
from tests.moe_checkpoints import dequantised_oracle, quantised_state
from tests.nvfp4_checkpoints import HF_QUANT_CONFIG, quantize_nvfp4
from tests.test_fp8_models import _prompts, _rel
from tests.tiny_moe import make_tiny_moe

EXCLUDE = ["lm_head", "*mlp.gate", "*mlp.shared_expert_gate", "*linear_attn.in_proj_a", "*linear_attn.in_proj_b",
           "*visual*"]


def make_nvfp4_moe_checkpoint(out_dir: Path, variant: str, seed: int = 0):
    """-> the f32 transformers model on the dequantised weights (the W4A16 oracle)."""
    src = out_dir / "bf16"
    model = make_tiny_moe(src, variant, seed=seed)

    def quantise(module, w):
        packed, s, s2, d = quantize_nvfp4(w)
        return {f"{module}.weight": packed, f"{module}.weight_scale": s,
                f"{module}.weight_scale_2": np.array(s2, np.float32),  # scalars, as ModelOpt saves them
                f"{module}.input_scale": np.array(1.0 / 448, np.float32)}, d.astype(np.float32)  # (W4A4's)
    out, deq = quantised_state(model, src, quantise)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    hq = json.loads(json.dumps(HF_QUANT_CONFIG))
    hq["quantization"]["exclude_modules"] = EXCLUDE
    (out_dir / "hf_quant_config.json").write_text(json.dumps(hq, indent=2))
    return dequantised_oracle(model, src, deq)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def moe(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"{request.param}_nvfp4")
    oracle = make_nvfp4_moe_checkpoint(d, request.param)
    return request.param, d, load(d, kv_cache_tokens=2048, tokenizer=False), oracle


def _logits(lm, chunk):
    inputs = prepare_step([chunk], lm.block_size)
    inputs["logits_indices"] = np.arange(len(chunk.token_ids), dtype=np.int32)
    return lm.executor.execute(inputs)[lm.graph.outputs[0]]


def test_experts_stay_packed(moe):
    variant, _, lm, _ = moe
    c = lm.source.config
    ops = [n.op for n in lm.graph.nodes.values()]
    layers = [i for i in range(c.num_hidden_layers) if c.layer_is_moe(i)]
    assert ops.count("moe_experts_nvfp4") == len(layers) and "moe_experts" not in ops
    w = lm.executor.weights
    x = f"model.layers.{layers[0]}.mlp.experts"
    E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
    assert w[f"{x}.gate_up_proj"].dtype == np.uint8 and w[f"{x}.gate_up_proj"].shape == (E, 2 * I, H // 2)
    assert w[f"{x}.gate_up_proj.weight_scale"].shape == (E, 2 * I, H // 16)
    assert w[f"{x}.gate_up_proj.weight_scale_2"].shape == (E, 2)
    assert w[f"{x}.down_proj.weight_scale_2"].shape == (E, 1)


def test_logits_and_greedy_match_the_w4a16_oracle(moe):
    variant, _, lm, oracle = moe
    for p in _prompts(256, seed=1):
        got = _logits(lm, SeqChunk(p, 0, list(range(-(-len(p) // lm.block_size))), state_slot=0))
        with torch.no_grad():
            ref = oracle(torch.tensor([p])).logits[0].numpy()
        assert _rel(got, ref) <= 1e-3, f"{variant}: {len(p)}-token prompt {_rel(got, ref):.2e} from the W4A16 oracle"
    (prompt,) = _prompts(256, seed=2, lens=(16,))
    blocks = list(range(-(-(len(prompt) + 32) // lm.block_size)))
    seq, ours = list(prompt), []
    chunk = SeqChunk(seq, 0, blocks, state_slot=0)
    while len(ours) < 32:
        ours.append(int(_logits(lm, chunk)[-1].argmax()))
        seq.append(ours[-1])
        chunk = SeqChunk([ours[-1]], len(seq) - 1, blocks, state_slot=0)
    with torch.no_grad():
        ref = oracle(torch.tensor([seq[:-1]])).logits[0].numpy()[len(prompt) - 1:]
    assert ref.argmax(-1).tolist() == ours, variant


def test_a_missing_expert_scale_is_one_sentence(tmp_path):
    make_nvfp4_moe_checkpoint(tmp_path, "qwen3_moe")
    from safetensors.torch import load_file as load_pt, save_file as save_pt
    sd = load_pt(str(tmp_path / "model.safetensors"))
    sd.pop("model.layers.1.mlp.experts.6.down_proj.weight_scale_2")
    save_pt(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InvalidModelError, match=r"^weight model\.layers\.1\.mlp\.experts\.6\.down_proj\.weight_scale_2 "
                                                r"is missing from the model files"):
        load(tmp_path, kv_cache_tokens=256, tokenizer=False)
