"""Tuned schedules: YAML round trip, lookup rules, and that a compile picks them up
(and says which kernels fell back to defaults)."""
from __future__ import annotations

import logging

import pytest
import yaml

from kiln.codegen.autotune import TUNED_MS, gemm_problems, reductions, tiles
from kiln.codegen.buckets import Bucket, make_buckets
from kiln.codegen.compile import compile_bundle
from kiln.codegen.triton.configs import DEFAULT, Configs, GemmTile
from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import run_pipeline
from kiln.schedules import Schedules, compiler_version
from tests.tiny_models import BASE


def _tiny_graph():
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2})
    return cfg, run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16))


def _sched(arch="sm_90"):
    return Schedules(arch, {
        "gemm_reduction": [{"n": 96, "k": 64, "block_k": 32, "split_k": 2, "us": 1.0}],
        "gemm_tile": [{"m": 4, "n": 96, "k": 64, "block_m": 16, "block_n": 16, "num_warps": 2, "num_stages": 5},
                      {"m": 64, "n": 96, "k": 64, "block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 2}]})


def test_round_trip_merge_and_lookup(tmp_path):
    s = _sched()
    s.write("gemm", tmp_path)
    back = Schedules.read("sm_90", tmp_path)
    assert back.entries == s.entries and back.digest() == s.digest()
    # a tile tuned for M serves every bucket up to M; past the largest tuned M, the largest
    assert back.lookup("gemm_tile", (1, 96, 64, "sm_90"))["block_n"] == 16
    assert back.lookup("gemm_tile", (4, 96, 64, "sm_90"))["num_stages"] == 5
    assert back.lookup("gemm_tile", (5, 96, 64, "sm_90"))["block_m"] == 32
    assert back.lookup("gemm_tile", (4096, 96, 64, "sm_90"))["block_m"] == 32
    assert back.lookup("gemm_tile", (1, 96, 64, "sm_121")) is None  # another arch's entry never applies
    assert back.lookup("gemm_tile", (1, 128, 64, "sm_90")) is None
    assert back.lookup("gemm_reduction", (96, 64)) == {"block_k": 32, "split_k": 2}
    newer = Schedules("sm_90", {"gemm_reduction": [{"n": 96, "k": 64, "block_k": 64, "split_k": 1}]})
    back.merge(newer)
    assert back.entries["gemm_reduction"] == newer.entries["gemm_reduction"]
    assert back.digest() != s.digest()


def test_other_compiler_versions_are_ignored(tmp_path, caplog):
    _sched().write("gemm", tmp_path)
    f = tmp_path / "sm_90" / "gemm.yaml"
    doc = yaml.safe_load(f.read_text())
    doc["compiler"] = "triton 0.0.1"
    f.write_text(yaml.safe_dump(doc))
    with caplog.at_level(logging.WARNING):
        s = Schedules.read("sm_90", tmp_path)
    assert s.entries == {} and "triton 0.0.1" in caplog.text
    assert compiler_version() in caplog.text


def test_compile_uses_tuned_entries_and_lists_fallbacks():
    cfg, graph = _tiny_graph()
    problems = {(p.n, p.k): p for p in gemm_problems(graph, make_buckets(4, 64))}
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert (qkv, cfg.hidden_size) in problems and (2 * cfg.intermediate_size, cfg.hidden_size) in problems
    n, k = qkv, cfg.hidden_size
    sched = Schedules("sm_90", {
        "gemm_reduction": [{"n": n, "k": k, "block_k": 32, "split_k": 2}],
        "gemm_tile": [{"m": 4, "n": n, "k": k, "block_m": 16, "block_n": 16, "num_warps": 2, "num_stages": 5}]})
    configs = Configs(lookup=sched.lookup)
    bundle = compile_bundle(graph, target="sm_90", model_config={}, config_hash="x", max_model_len=128,
                            max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                            buckets=[Bucket(4, 4, 4, True), Bucket(64, 4, 4, False)], configs=configs)
    metas = [m for m in bundle.manifest["kernels"].values() if m["name"] == "gemm_kernel"]
    assert any(m["num_warps"] == 2 for m in metas)  # the tuned decode tile was compiled
    ops = {op for op, _ in configs.fallbacks}
    assert "gemm_tile" in ops and "gemm_reduction" in ops  # o_proj, down and lm_head are untuned
    assert ("gemm_reduction", (n, k)) not in configs.fallbacks
    assert ("gemm_tile", (4, n, k, "sm_90")) not in configs.fallbacks


def test_tuner_candidates_keep_the_reduction_per_weight():
    for k in (64, 4096, 14336):
        for r in reductions(k):
            assert k % r.block_k == 0
    # every M class has candidates, and decode tiles are one row block
    for m in TUNED_MS:
        cands = tiles(m, wide=True)
        assert cands and all(isinstance(t, GemmTile) for t in cands)
        if m <= 16:
            assert {t.block_m for t in cands} == {16}
    assert DEFAULT.gemm_tile(1, 6144, 4096).block_m == 16


@pytest.mark.parametrize("lead_m", [1, 3, 200])
def test_problems_cover_every_bucket(lead_m):
    _, graph = _tiny_graph()
    buckets = [Bucket(lead_m, lead_m, lead_m, True), Bucket(2048, 16, 16, False)]
    for p in gemm_problems(graph, buckets):
        for b in buckets:
            m = b.logits if p.out_dtype == "f32" else b.tokens  # the LM head runs on the logits rows
            assert any(t >= m for t in p.ms)


def test_an_unchanged_compile_comes_from_the_bundle_cache(tmp_path):
    from kiln.codegen.compile import compile_bundle_cached

    _, graph = _tiny_graph()
    kw = dict(target="sm_90", model_config={}, config_hash="x", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, block_size=16, buckets=[Bucket(4, 4, 4, True), Bucket(64, 4, 4, False)])
    said = []
    first = compile_bundle_cached(graph, cache_tag="a", cache_dir=tmp_path, progress=said.append, **kw)
    assert not any("unchanged" in s for s in said)
    again = compile_bundle_cached(graph, cache_tag="a", cache_dir=tmp_path, progress=said.append, **kw)
    assert any("unchanged" in s for s in said)
    assert again.manifest["plans"] == first.manifest["plans"] and again.kernels == first.kernels
    said.clear()
    compile_bundle_cached(graph, cache_tag="b", cache_dir=tmp_path, progress=said.append, **kw)  # a retune
    assert not any("unchanged" in s for s in said)
    assert len(list(tmp_path.iterdir())) == 2


def test_a_broken_schedules_file_is_one_clear_error(tmp_path, monkeypatch):
    import kiln.schedules as sch
    from kiln.build import compile_model
    from kiln.errors import ConfigError

    cfg, graph = _tiny_graph()

    class Source:
        config = cfg
    (tmp_path / "sm_90").mkdir()
    bad = tmp_path / "sm_90" / "gemm.yaml"
    monkeypatch.setattr(sch, "ROOT", tmp_path)
    kw = dict(target="sm_90", block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
    bad.write_text("compiler: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        compile_model(Source(), graph, **kw)
    n, k = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, cfg.hidden_size
    bad.write_text(yaml.safe_dump({"compiler": compiler_version(),
                                   "gemm_reduction": [{"n": n, "k": k, "block_k": 32, "splitk": 2}]}))
    with pytest.raises(ConfigError, match="unknown fields.*splitk"):
        compile_model(Source(), graph, **kw)
