"""`build.py tune --kernels moe` on the GPU, on a small Qwen3-MoE: the sweep runs, finds no
candidate whose bits differ from the default's (the path and tiles are schedule knobs only:
moe_gemm.py), writes an entry per bucket size, and Configs (what compile asks) reads them back.

    pytest -m gpu tests/gpu/test_gpu_tune_moe.py
"""
from __future__ import annotations

import json

import pytest

from kiln.codegen.triton.configs import Configs
from kiln.codegen.triton.moe_config import MoeConfig
from kiln.schedules import Schedules

pytestmark = pytest.mark.gpu

# 16 experts, 4 a token: 1 to 256 tokens cross the default threshold (64 assignments) at 16 tokens
CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 512, "intermediate_size": 1536,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
          "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "num_experts": 16, "num_experts_per_tok": 4,
          "moe_intermediate_size": 256}
SEQS, TOKENS = 16, 256
SHAPE = {"e": 16, "h": 512, "i": 256, "top_k": 4, "dtype": "bfloat16"}


def test_tune_moe_writes_winners_with_the_default_bits(gpu_target, tmp_path):
    from kiln.build import main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIG))
    rc = main(["tune", "--model", str(tmp_path / "model"), "--target", gpu_target, "--kernels", "moe",
               "--out", str(tmp_path / "schedules"), "--max-num-seqs", str(SEQS),
               "--max-num-batched-tokens", str(TOKENS)])
    assert rc == 0  # 1: a path or tile changed a token's bits (the tuner refused it, and says which)
    assert sorted(f.name for f in (tmp_path / "schedules" / gpu_target).iterdir()) == ["moe.yaml"]
    sched = Schedules.read(gpu_target, tmp_path / "schedules")
    entries = sched.entries["moe_experts"]
    assert [e["t"] for e in entries] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    configs = Configs(sched.lookup)
    for e in entries:
        assert {k: e[k] for k in SHAPE} == SHAPE and e["us"] > 0
        want = MoeConfig(**{k: v for k, v in e.items() if k not in {*SHAPE, "t", "us"}})
        assert configs.moe(e["t"], 4, 16, 512, 256, "bfloat16", gpu_target) == want
    assert configs.fallbacks == []
    print("\n".join(f"T={e['t']}: {e['path']} block_m {e['block_m']} {e['us']} us" for e in entries))
