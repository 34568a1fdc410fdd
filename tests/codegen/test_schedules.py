"""Tuned schedules: YAML round trip, lookup rules, and that a compile picks them up
(and says which kernels fell back to defaults)."""
from __future__ import annotations

import logging

import pytest
import yaml

from kiln.codegen.autotune import TUNED_MS, gemm_problems, reductions, tiles
from kiln.codegen.buckets import Bucket, make_buckets
from kiln.codegen.compile import compile_bundle
from kiln.codegen.triton.configs import DEFAULT, Configs, ElementwiseConfig, GemmTile
from kiln.graph import DType
from kiln.models.config import ModelConfig
from kiln.models.registry import get_graph_builder
from kiln.passes.pipeline import default_passes, run_pipeline
from kiln.schedules import Schedules, compiler_version
from tests.tiny_models import BASE


def _tiny_graph(fuse_silu=True):
    cfg = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2})
    return cfg, run_pipeline(get_graph_builder(cfg.architecture)(cfg, dtype=DType.bf16),
                             default_passes(fuse_silu=fuse_silu))


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
    # the tuned decode tile was compiled (q/k/v: the GEMM with the attention preamble in its epilogue)
    metas = [m for m in bundle.manifest["kernels"].values() if m["name"] == "gemm_rope_kernel"]
    assert any(m["num_warps"] == 2 for m in metas)
    ops = {op for op, _ in configs.fallbacks}
    assert "gemm_tile" in ops and "gemm_reduction" in ops  # o_proj, down and lm_head are untuned
    assert ("gemm_reduction", (n, k)) not in configs.fallbacks
    assert ("gemm_tile", (4, n, k, "sm_90")) not in configs.fallbacks


def test_wgmma_tiles_load_through_tma_on_sm_90_and_a_schedule_may_say_otherwise():
    assert DEFAULT.gemm_tile(2048, 4096, 4096, "sm_90").tma is True
    assert DEFAULT.gemm_tile(64, 4096, 4096, "sm_90").tma is True
    assert DEFAULT.gemm_tile(1, 4096, 4096, "sm_90").tma is False  # mma.sync decode tiles keep pointer loads
    assert DEFAULT.gemm_tile(2048, 4096, 4096, "sm_121").tma is False  # not measured there
    sched = _sched()
    sched.entries["gemm_tile"].append({"m": 256, "n": 96, "k": 64, "block_m": 128, "block_n": 64, "num_warps": 8,
                                       "num_stages": 3, "tma": False})
    configs = Configs(lookup=sched.lookup)
    assert configs.gemm_tile(64, 96, 64, "sm_90").tma is False  # tuned to block_m 32: the rule says no
    assert configs.gemm_tile(256, 96, 64, "sm_90").tma is False  # the schedule's word wins
    assert configs.gemm_tile(1024, 96, 64, "sm_90") == GemmTile(128, 64, 8, 3, tma=False)


def test_a_tma_gemm_gets_global_scratch_in_the_bundle():
    """The prefill bucket's GEMMs build 2 TMA descriptors per program on the device: the
    bundle says so (global_scratch_size), so the runtime hands them a scratch buffer; the
    decode bucket's GEMMs need none."""
    cfg, graph = _tiny_graph()
    bundle = compile_bundle(graph, target="sm_90", model_config={}, config_hash="x", max_model_len=128,
                            max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                            buckets=[Bucket(4, 4, 4, True), Bucket(64, 4, 4, False)])
    man = bundle.manifest

    def scratch(plan):
        return {man["kernels"][key]["global_scratch_size"] for key, _, _ in man["plans"][plan]["launches"]
                if man["kernels"][key]["name"] == "gemm_kernel"}

    assert scratch("d4x4") == {0}
    assert scratch("m64x4") == {0, 256}  # 256: the 64-row GEMMs; 0: the lm_head over the 4 logits rows


def test_tuner_candidates_keep_the_reduction_per_weight():
    for k in (64, 4096, 14336):
        for r in reductions(k):
            assert k % r.block_k == 0
    # every M class has candidates, and decode tiles are one row block
    for m in TUNED_MS:
        cands = tiles(m)
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
    from kiln.loader import compile_model
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


ATTN = {"h": 32, "hkv": 8, "d": 128, "block_q": 8, "num_warps": 4, "num_stages": 3, "prefill_block_q": 32,
        "prefill_num_warps": 8, "prefill_num_stages": 3, "us": 410.5, "prefill_us": 170.25}


def _families():
    return Schedules("sm_90", {**_sched().entries, "paged_attention": [dict(ATTN)],
                               "rms_norm": [{"width": 4096, "num_warps": 16, "us": 30.0}],
                               "silu_mul": [{"width": 14336, "block": 2048, "num_warps": 8, "us": 20.0}]})


def test_each_family_has_its_file_and_all_of_them_are_read(tmp_path):
    s = _families()
    for fam in ("gemm", "attention", "rows"):
        s.write(fam, tmp_path)
    ops = {f.stem: set(yaml.safe_load(f.read_text())) - {"compiler"} for f in (tmp_path / "sm_90").iterdir()}
    assert ops == {"gemm": {"gemm_reduction", "gemm_tile"}, "attention": {"paged_attention"},
                   "rows": {"rms_norm", "silu_mul"}}
    back = Schedules.read("sm_90", tmp_path)
    assert back.entries == s.entries and back.digest() == s.digest()
    # an attention entry serves its head shape at any max_model_len, and holds schedule knobs only
    want = {k: v for k, v in ATTN.items() if k not in ("h", "hkv", "d", "us", "prefill_us")}
    assert back.lookup("paged_attention", (32, 8, 128, None, 4096)) == want
    assert back.lookup("paged_attention", (32, 8, 128, None, 131072)) == want
    assert back.lookup("paged_attention", (32, 4, 128, None, 4096)) is None
    assert back.lookup("paged_attention", (32, 8, 128, "float8_e4m3fn", 4096)) is None  # an e4m3 cache's own
    assert back.lookup("rms_norm", (4096,)) == {"num_warps": 16}
    assert back.lookup("rms_norm", (2048,)) is None
    assert back.lookup("silu_mul", (14336,)) == {"block": 2048, "num_warps": 8}
    assert back.lookup("gather_rows", (4096,)) is None
    with pytest.raises(ValueError, match="unknown schedules family"):
        s.write("norms", tmp_path)


def test_a_retuned_family_changes_the_digest_and_leaves_the_others_alone(tmp_path):
    s = _families()
    for fam in ("gemm", "attention", "rows"):
        s.write(fam, tmp_path)
    before = {f.name: f.read_text() for f in (tmp_path / "sm_90").iterdir()}
    back = Schedules.read("sm_90", tmp_path)
    back.merge(Schedules("sm_90", {"rms_norm": [{"width": 4096, "num_warps": 8, "us": 29.0}]}))
    back.merge(Schedules("sm_90", {"rms_norm": [{"width": 2048, "num_warps": 4, "us": 9.0}]}))
    assert sorted(e["width"] for e in back.entries["rms_norm"]) == [2048, 4096]  # keyed by width
    back.write("rows", tmp_path)
    after = {f.name: f.read_text() for f in (tmp_path / "sm_90").iterdir()}
    assert after["gemm.yaml"] == before["gemm.yaml"] and after["attention.yaml"] == before["attention.yaml"]
    assert after["rows.yaml"] != before["rows.yaml"]
    again = Schedules.read("sm_90", tmp_path)
    assert again.lookup("rms_norm", (4096,)) == {"num_warps": 8}
    assert again.digest() != s.digest()


def test_an_e4m3_cache_has_attention_schedules_of_its_own(tmp_path):
    """A `cache: float8_e4m3fn` entry serves attention over an e4m3 KV cache only; bf16 (and f16)
    caches keep the entry without the field, and an e4m3 cache without its own entry takes the
    defaults (listed as a fallback), not the bf16 cache's knobs. Both survive a write and read."""
    fp8 = {**ATTN, "cache": "float8_e4m3fn", "block_q": 4, "num_warps": 2, "num_stages": 2, "us": 555.4}
    s = Schedules("sm_90", {"paged_attention": [dict(fp8), dict(ATTN)]})
    s.write("attention", tmp_path)
    back = Schedules.read("sm_90", tmp_path)
    assert [e.get("cache") for e in back.entries["paged_attention"]] == [None, "float8_e4m3fn"]  # file order
    configs = Configs(lookup=back.lookup)
    bf16, f16 = configs.attention(32, 8, 128, 4096, "bfloat16"), configs.attention(32, 8, 128, 4096, "float16")
    e4m3 = configs.attention(32, 8, 128, 4096, "float8_e4m3fn")
    assert (bf16.block_q, bf16.num_warps, bf16.num_stages) == (8, 4, 3) and f16 == bf16
    assert configs.attention(32, 8, 128, 4096) == bf16
    assert (e4m3.block_q, e4m3.num_warps, e4m3.num_stages) == (4, 2, 2)
    assert (e4m3.tile, e4m3.seg) == (bf16.tile, bf16.seg)  # the prefill's reduction knobs never depend on it
    # the decode variant's tile does (configs.AttentionConfig.decode_tile): an e4m3 cache's decode bits are its own
    assert (e4m3.tile_of_decode, bf16.tile_of_decode, bf16.decode_tile) == (32, bf16.tile, None)
    # re-tuning one cache's entry leaves the other's
    back.merge(Schedules("sm_90", {"paged_attention": [{**fp8, "num_stages": 3}]}))
    assert len(back.entries["paged_attention"]) == 2
    assert Configs(lookup=back.lookup).attention(32, 8, 128, 4096, "float8_e4m3fn").num_stages == 3
    only_bf16 = Configs(lookup=Schedules("sm_90", {"paged_attention": [dict(ATTN)]}).lookup)
    fallback = only_bf16.attention(32, 8, 128, 4096, "float8_e4m3fn")
    assert fallback == DEFAULT.attention(32, 8, 128, 4096, "float8_e4m3fn") != DEFAULT.attention(32, 8, 128, 4096)
    assert fallback.route_mixed and fallback.num_warps == 1  # the e4m3 defaults, not the bf16 cache's
    assert only_bf16.fallbacks == [("paged_attention", (32, 8, 128, "float8_e4m3fn", 4096))]


def test_configs_take_tuned_attention_and_row_entries_and_list_the_rest(caplog):
    configs = Configs(lookup=_families().lookup)
    with caplog.at_level(logging.INFO, logger="kiln.codegen.triton.configs"):
        att = configs.attention(32, 8, 128, 131072)
        assert (att.block_q, att.num_warps, att.num_stages) == (8, 4, 3)
        assert (att.prefill_block_q, att.prefill_num_warps, att.prefill_num_stages) == (32, 8, 3)
        default = DEFAULT.attention(32, 8, 128, 131072)
        assert (att.tile, att.seg) == (default.tile, default.seg)  # reduction knobs: the default's
        assert configs.attention(32, 8, 128, 128).seg == DEFAULT.attention(32, 8, 128, 128).seg
        assert configs.row("rms_norm", 4096).num_warps == 16
        assert configs.elementwise("silu_mul", 14336) == ElementwiseConfig(block=2048, num_warps=8)
        assert configs.attention(16, 8, 128, 4096) == DEFAULT.attention(16, 8, 128, 4096)
        assert configs.row("attention_preamble", 4096) == DEFAULT.row("attention_preamble", 4096)
        assert configs.elementwise("gather_rows", 4096) == ElementwiseConfig()
    assert configs.fallbacks == [("paged_attention", (16, 8, 128, None, 4096)), ("attention_preamble", (4096,)),
                                 ("gather_rows", (4096,))]
    assert "no tuned schedule for gather_rows (4096,)" in caplog.text
    assert "no tuned schedule for rms_norm" not in caplog.text


def test_compile_uses_tuned_attention_and_row_entries(tmp_path):
    """A schedules folder with attention and row entries: the bundle's kernels carry their knobs."""
    from kiln.codegen.triton.paged_attention_launch import attention_block_q

    cfg, graph = _tiny_graph(fuse_silu=False)  # silu_mul a launch of its own, to carry its row entry
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    tuned = Schedules("sm_90", {
        "paged_attention": [{"h": h, "hkv": hkv, "d": d, "block_q": 16, "num_warps": 8, "num_stages": 3,
                             "prefill_block_q": 32, "prefill_num_warps": 2, "prefill_num_stages": 3}],
        "rms_norm": [{"width": hidden, "num_warps": 2}],
        "silu_mul": [{"width": inter, "block": inter // 2, "num_warps": 2}]})
    tuned.write("attention", tmp_path)
    tuned.write("rows", tmp_path)
    sched = Schedules.read("sm_90", tmp_path)
    configs = Configs(lookup=sched.lookup)
    buckets = [Bucket(4, 4, 4, True), Bucket(64, 4, 4, False)]
    bundle = compile_bundle(graph, target="sm_90", model_config={}, config_hash="x", max_model_len=128,
                            max_num_seqs=4, max_num_batched_tokens=64, block_size=16, buckets=buckets,
                            configs=configs)
    meta = bundle.manifest["kernels"]

    def launches(plan: str, kernel: str):
        return [(meta[key], grid) for key, grid, _ in bundle.manifest["plans"][plan]["launches"]
                if meta[key]["name"] == kernel]
    dec, pre = launches("d4x4", "paged_attention_kernel"), launches("m64x4", "paged_attention_kernel")
    assert dec and {m["num_warps"] for m, _ in dec} == {8}
    assert pre and {m["num_warps"] for m, _ in pre} == {2}
    tuned = configs.attention(h, hkv, d, 128)
    bq = attention_block_q(h, hkv, tuned)  # prefill programs: (T + S (2 BLOCK_Q - 2)) // BLOCK_Q
    assert {g[0] for _, g in pre} == {(64 + 4 * (2 * bq - 2)) // bq} != {(64 + 4 * 30) // 16}
    assert {g[2] for _, g in dec} == {-(-128 // DEFAULT.attention(h, hkv, d, 128).seg)}  # seg: the default's
    assert {m["num_warps"] for m, _ in launches("m64x4", "rms_norm_kernel")} == {2}
    silu = launches("m64x4", "silu_mul_kernel")
    assert {m["num_warps"] for m, _ in silu} == {2} and {g[1] for _, g in silu} == {2}
    fell_back = {op for op, _ in configs.fallbacks}
    assert not fell_back & {"paged_attention", "rms_norm", "silu_mul"}
    assert "gather_rows" in fell_back  # (no attention_preamble launch: it is in the q/k/v GEMM's epilogue)
