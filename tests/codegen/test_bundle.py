"""Every bucket of the tiny models compiles to sm_90 and sm_121a cubins on this CPU
machine; a bundle round-trips through disk; a bundle for another target or another
model, or a corrupted one, is refused with one sentence."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kiln.codegen.compile import compile_bundle
from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.worker.bundle import Bundle, BundleError
from tests.tiny_models import BASE


def _bundle(arch: str, target: str) -> tuple[Bundle, ModelConfig]:
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch]})
    graph = run_pipeline(get_graph_builder(arch)(cfg, dtype=DType.bf16))
    b = compile_bundle(graph, target=target, model_config=dataclasses.asdict(cfg), config_hash=cfg.compute_hash(),
                       max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16)
    return b, cfg


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("target", ["sm_90", "sm_121"])
def test_every_bucket_compiles_and_round_trips(arch, target, tmp_path):
    b, cfg = _bundle(arch, target)
    plans = b.manifest["plans"]
    assert set(plans) == {"d1x1", "d2x2", "d4x4", "d8x8", "m16x8", "m32x8", "m64x8"}
    used = {key for p in plans.values() for key, _, _ in p["launches"]}
    sampler = {s["kernel"] for s in b.manifest["sampler"].values()}  # launched by the runtime's GpuSampler
    assert set(b.manifest["sampler"]) == {"processors", "sample", "logprobs", "copy_rows", "stage", "bitmask"}
    assert used | sampler == set(b.kernels)  # every launched kernel has its cubin, nothing extra
    assert all(blob[:4] == b"\x7fELF" for blob in b.kernels.values())
    # every plan kernel overlaps its predecessor's tail (codegen/triton/pdl.py) but a GEMM right
    # behind a GEMM (the down projection behind gate/up with the SiLU epilogue) or behind the
    # decode attention that merges its segments (o_proj); the sampler's kernels run after the
    # step's graph and are launched plainly
    assert b.manifest["pdl"] is True
    meta = b.manifest["kernels"]
    plain_launches = 0
    for p in plans.values():
        names = [meta[key]["name"] for key, _, _ in p["launches"]]
        decode = p["bucket"][3]
        for i, key in enumerate(k for k, _, _ in p["launches"]):
            plain = i > 0 and names[i] == "gemm_kernel" and (
                names[i - 1] == "gemm_kernel" or (decode and names[i - 1] == "paged_attention_kernel"))
            plain_launches += plain
            assert meta[key]["pdl"] is not plain, f"{p['bucket']} launch {i} ({names[i]})"
    decode_plans = sum(p["bucket"][3] for p in plans.values())
    # tiny models have 2 layers: one down GEMM each, and one o_proj per decode layer
    assert plain_launches == 2 * len(plans) + 2 * decode_plans
    assert not any(meta[k]["pdl"] for k in sampler)
    # split-KV decode buckets merge in the attention kernel: no merge launch, and counters for the
    # largest decode bucket's (sequence, KV head) pairs, zeroed by the runtime at load
    for p in plans.values():
        names = [meta[key]["name"] for key, _, _ in p["launches"]]
        assert "attention_merge_kernel" not in names, p["bucket"]
        assert names.count("paged_attention_kernel") == cfg.num_hidden_layers
    assert b.manifest["region_bytes"]["attn_merge_counter"] == 4 * 8 * cfg.num_key_value_heads
    b.write(tmp_path / "b")
    back = Bundle.read(tmp_path / "b", expect_target=target, expect_config_hash=cfg.compute_hash())
    assert back.manifest["plans"] == plans and back.kernels == b.kernels
    assert back.consts.keys() == b.consts.keys()
    for k in b.consts:
        np.testing.assert_array_equal(back.consts[k], b.consts[k])


def test_pdl_plain_rules_pick_the_gemms_that_launch_without_pdl():
    """codegen/compile.py pdl_launches on a decode layer's launch order: which GEMMs go out plainly."""
    from types import SimpleNamespace

    from kiln.codegen.compile import pdl_launches

    def spec(kernel, grid, **const):
        s = SimpleNamespace(kernel=kernel, grid=grid, constexprs=const)
        s.with_pdl = lambda: SimpleNamespace(kernel=kernel, grid=grid, constexprs={**const, "PDL": True})
        return s

    layer = [spec("rms_norm_kernel", (1,)), spec("gemm_kernel", (96, 1, 1)),  # qkv
             spec("attention_preamble_kernel", (1, 5, 1)), spec("paged_attention_kernel", (1, 8, 64), MERGE=True),
             spec("gemm_kernel", (128, 1, 1)), spec("rms_norm_kernel", (1,)),  # o_proj, add + norm
             spec("gemm_kernel", (896, 1, 1)), spec("gemm_kernel", (64, 1, 2))]  # gate/up with SiLU, down

    def plain(rule):
        return [i for i, (s, _) in enumerate(pdl_launches([(s, None) for s in layer], rule))
                if not s.constexprs.get("PDL")]
    assert plain("named") == [4, 7]  # (the first launch is compiled for PDL; the executor launches it plainly)
    assert plain("none") == []
    assert plain("wide:132") == [4, 7]  # behind 512 and 896 programs
    assert plain("wide:1000") == []
    with pytest.raises(ValueError, match="pdl plain rule"):
        pdl_launches([(layer[0], None)], "sometimes")


def test_foreign_or_corrupt_bundles_are_refused(tmp_path):
    b, cfg = _bundle("Qwen3ForCausalLM", "sm_90")
    b.write(tmp_path / "b")
    with pytest.raises(BundleError, match="compiled for sm_90, not for this device"):
        Bundle.read(tmp_path / "b", expect_target="sm_121")
    with pytest.raises(BundleError, match="another model"):
        Bundle.read(tmp_path / "b", expect_config_hash="0" * 16)
    cubin = next((tmp_path / "b" / "kernels").iterdir())
    cubin.write_bytes(cubin.read_bytes()[:-8])
    with pytest.raises(BundleError, match="checksum"):
        Bundle.read(tmp_path / "b")
    with pytest.raises(BundleError, match="not a kiln bundle"):
        Bundle.read(tmp_path / "nothing")


@pytest.mark.parametrize("target", ["sm_90", "sm_121"])
def test_every_bucket_of_a_hybrid_compiles(target):
    """A tiny Qwen3.5 hybrid (3 Gated DeltaNet layers, 1 gated attention): every bucket's plan
    has the conv and delta-rule kernels per GDN layer (the chunked one only where prefills run),
    the step inputs carry the state slots, the GDN states are per slot (NS)."""
    from tests.tiny_models import HYBRID_BASE

    cfg = ModelConfig.from_hf_dict({**HYBRID_BASE, "architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 4})
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))
    b = compile_bundle(graph, target=target, model_config=dataclasses.asdict(cfg), config_hash=cfg.compute_hash(),
                       max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16)
    meta, plans = b.manifest["kernels"], b.manifest["plans"]
    assert all(blob[:4] == b"\x7fELF" for blob in b.kernels.values())
    for p in plans.values():
        names = [meta[key]["name"] for key, _, _ in p["launches"]]
        decode = p["bucket"][3]
        assert names.count("causal_conv1d_kernel") == names.count("gdn_recurrent_kernel") == 3
        assert names.count("gdn_chunked_kernel") == (0 if decode else 3)
        # decode: the gated norm inside the recurrent kernel (fold_gdn_norm); mixed: a launch of its own
        assert names.count("gated_rms_norm_kernel") == (0 if decode else 3)
        assert names.count("sigmoid_mul_kernel") == 1
        assert "state_slots" in p["inputs"] and list(p["inputs"])[-1] == "num_logits"
    states = b.manifest["states"]
    assert states["gdn_ssm.0"] == ["f32", ["NS", 4, 16, 16]] and states["kv_cache.3"][1][0] == "NB"


@pytest.mark.parametrize("target", ["sm_90", "sm_121"])
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_every_bucket_of_a_moe_model_compiles(target, arch):
    """Tiny MoE models (Qwen3-MoE with dense layers between, the Qwen3.5-MoE hybrid with a shared
    expert): every bucket has a router and the experts' launches per MoE layer, the decode path
    (no align step) where a bucket has few assignments, the grouped path elsewhere."""
    from kiln.codegen.triton.moe import moe_path
    from tests.tiny_models import BASE, HYBRID_BASE

    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "Qwen3MoeForCausalLM":
        d = {**BASE, **moe, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
        layers, sums = 1, 0  # layer 1 (every 2nd, less mlp_only_layers); its sum in layer 2's add_rms_norm
    else:
        d = {k: v for k, v in HYBRID_BASE.items() if k != "intermediate_size"}
        d.update(moe, num_hidden_layers=4, shared_expert_intermediate_size=48)
        layers, sums = 4, 1  # the last layer's output goes through the logits' gather_rows before its norm
    cfg = ModelConfig.from_hf_dict({**d, "architectures": [arch]})
    graph = run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))
    b = compile_bundle(graph, target=target, model_config=dataclasses.asdict(cfg), config_hash=cfg.compute_hash(),
                       max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, block_size=16)
    meta, plans = b.manifest["kernels"], b.manifest["plans"]
    assert all(blob[:4] == b"\x7fELF" for blob in b.kernels.values())
    paths = set()
    for p in plans.values():
        names = [meta[key]["name"] for key, _, _ in p["launches"]]
        path = moe_path(p["bucket"][0], 2)
        paths.add(path)
        assert names.count("moe_router_kernel") == names.count("moe_down_kernel") == layers
        assert names.count("moe_align_kernel") == (layers if path == "grouped" else 0)
        # both paths end in the rank-order sum (issue 37: the decode path's down runs per assignment),
        # run by the next layer's add_rms_norm where that reads the layer's output (lower.py
        # _norm_takes_moe_sum), else by moe_sum
        assert names.count("moe_sum_kernel") == sums
    assert paths == {"decode", "grouped"}
