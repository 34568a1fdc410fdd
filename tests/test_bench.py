"""The benchmark harness (`build.py bench`, bench/) scaled down on CPU: every workload on a tiny
random checkpoint written by bench/make_random_model.py, the JSON it records, and that the engine
made exactly the tokens asked for; the transformers peer on CPU; the plot and the table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kiln.bench.make_random_model import make_random_model
from kiln.build import main

REPO = Path(__file__).resolve().parents[1]
SCHEMA = ["workload", "commit", "gpu", "metric", "value", "roofline", "peers", "command"]
SMALL = ["--num-requests", "3", "--input-len", "12", "--output-len", "5", "--min-len", "2",
         "--context", "10", "--steps", "4", "--repeats", "2", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    # shards of ~100 kB: the tiny model is written as three shards and an index, as the 8B is
    return make_random_model("tiny-llama", tmp_path_factory.mktemp("tiny_random"), shard_gb=1e-4)


def run_bench(tmp_path: Path, model: Path, workload: str, *extra: str) -> dict:
    out = tmp_path / f"{workload}.json"
    assert main(["bench", "--workload", workload, "--model", str(model), "--json", str(out), *SMALL, *extra]) == 0
    rec = json.loads(out.read_text())
    assert list(rec)[:len(SCHEMA)] == SCHEMA
    assert rec["workload"] == workload and rec["gpu"] == "cpu" and rec["value"] > 0
    assert rec["command"].startswith(f"python build.py bench --workload {workload} --model ")
    assert rec["output_tokens"] == rec["expected_output_tokens"]
    return rec


def test_random_checkpoint_loads_in_kiln(tiny_ckpt):
    from kiln.models.source import open_model
    from kiln.runtime.text.tokenizer import Tokenizer

    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    src = open_model(tiny_ckpt)
    assert src.config.vocab_size == 320 and src.config.num_hidden_layers == 2
    w = src.weights.get("model.layers.0.mlp.up_proj.weight")
    assert w.shape == (128, 64) and 0.015 < float(w.astype("f4").std()) < 0.025
    assert (src.weights.get("model.norm.weight").astype("f4") == 1).all()
    tok = Tokenizer.from_dir(tiny_ckpt)
    assert tok.vocab_size == 320 and tok.eos_token_ids == {2}
    assert tok.decode([5, 6, 2]) == "t5 t6" and tok.encode("t7 t8", add_special_tokens=False) == [7, 8]


def test_random_checkpoint_spilled_to_a_second_directory_reads_the_same(tiny_ckpt, tmp_path):
    from kiln.models.source import open_model

    out = make_random_model("tiny-llama", tmp_path / "out", shard_gb=1e-4, spill_dir=tmp_path / "spill",
                            keep_gb=1e-9)  # the first shard stays, the rest spill
    shards = sorted(out.glob("model-*.safetensors"))
    assert not shards[0].is_symlink() and all(p.is_symlink() for p in shards[1:])
    assert {p.name for p in (tmp_path / "spill").iterdir()} == {p.name for p in shards[1:]}
    a, b = open_model(tiny_ckpt).weights, open_model(out).weights
    assert a.names() == b.names()
    for n in a.names():
        assert (a.get(n, keep_dtype=True).view("u2") == b.get(n, keep_dtype=True).view("u2")).all(), n


def test_random_checkpoint_loads_in_transformers(tiny_ckpt):
    import torch
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (model.model.norm.weight == 1).all() and model.lm_head.weight.shape == (320, 64)


def test_decode(tmp_path, tiny_ckpt):
    rec = run_bench(tmp_path, tiny_ckpt, "decode")
    assert rec["metric"] == "decode_tok_s" and rec["output_tokens"] == 2 * (4 + 1)
    roof = rec["roofline"]
    # f32 on the numpy target: every weight but the embedding table's unread rows
    assert roof["weight_bytes_per_token"] == 4 * (2 * (64 + 4 * 16 * 64 * 2 + 2 * 16 * 64 * 2 + 64 + 3 * 64 * 128)
                                                  + 64 + 320 * 64 + 64)
    assert roof["state_bytes_per_token"] == 0 and roof["bytes_per_token"] == roof["weight_bytes_per_token"]
    assert roof["tok_s"] == pytest.approx(roof["copy_bandwidth_GBps"] * 1e9 / roof["bytes_per_token"])


def test_decode_roofline_of_a_moe_hybrid_counts_the_routed_experts_and_the_state(tmp_path):
    """The MoE hybrid's roofline bytes, counted independently from transformers' own parameters: all
    of them in f32 but the experts not routed to (num_experts_per_tok of num_experts are read) and the
    untied embedding's unread rows; plus each GDN layer's conv and SSM state read and written."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ckpt = make_random_model("tiny-qwen3.6-moe", tmp_path / "ckpt")
    rec = run_bench(tmp_path, ckpt, "decode")
    cfg = json.loads((ckpt / "config.json").read_text())
    text = cfg["text_config"]
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    e, k = text["num_experts"], text["num_experts_per_tok"]
    want = 0
    for name, p in model.named_parameters():
        n = 4 * p.numel()
        if ".mlp.experts." in name:
            n = n // e * k
        if name.endswith("embed_tokens.weight") and not text.get("tie_word_embeddings", False):
            n = 4 * p.shape[1]
        want += n
    gdn = sum(t == "linear_attention" for t in text["layer_types"])
    key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value_dim = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    conv = (2 * key_dim + value_dim) * (text["linear_conv_kernel_dim"] - 1)
    ssm = text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"]
    roof = rec["roofline"]
    assert roof["weight_bytes_per_token"] == want
    assert roof["state_bytes_per_token"] == 2 * 4 * gdn * (conv + ssm)
    assert roof["bytes_per_token"] == want + roof["state_bytes_per_token"]


def test_prefill(tmp_path, tiny_ckpt):
    rec = run_bench(tmp_path, tiny_ckpt, "prefill")
    assert rec["metric"] == "prefill_tok_s" and rec["input_len"] == 12 and rec["output_tokens"] == 2


def test_throughput(tmp_path, tiny_ckpt):
    rec = run_bench(tmp_path, tiny_ckpt, "throughput")
    assert rec["metric"] == "output_tok_s" and rec["num_requests"] == 3
    assert rec["output_tokens"] == 15 and rec["input_tokens"] == 36
    assert rec["async_scheduling"] is False
    _check_steps(rec)


def _check_steps(rec: dict) -> None:
    """The step log adds up: every request's tokens but its last output go through the model once,
    every output is sampled once, and the steps' time is inside the wall time."""
    steps = rec["steps"]
    assert steps["prompt"]["steps"] >= 1 and steps["decode"]["steps"] >= 1
    fed = rec["input_tokens"] + rec["output_tokens"] - rec["num_requests"]
    assert sum(k["scheduled_tokens"] for k in steps.values()) == fed
    assert sum(k["sampled_tokens"] for k in steps.values()) == rec["output_tokens"]
    assert steps["decode"]["scheduled_tokens"] == steps["decode"]["sampled_tokens"]
    assert 0 < sum(k["seconds"] for k in steps.values()) <= rec["wall_s"]


def test_throughput_with_async_scheduling(tmp_path, tiny_ckpt):
    """The flag reaches the engine (the record reads it from the engine core) and is in the command."""
    rec = run_bench(tmp_path, tiny_ckpt, "throughput", "--async-scheduling")
    assert rec["async_scheduling"] is True and " --async-scheduling" in rec["command"]
    assert rec["output_tokens"] == 15
    _check_steps(rec)


def test_throughput_with_top_k_top_p_sampling(tmp_path, tiny_ckpt):
    """--temperature, --top-k, --top-p reach the record and the command; the sampled run still
    produces exactly the tokens asked for."""
    rec = run_bench(tmp_path, tiny_ckpt, "throughput", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9")
    assert rec["sampling"] == {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
    assert " --temperature 0.8 --top-k 20 --top-p 0.9" in rec["command"] and rec["output_tokens"] == 15
    assert run_bench(tmp_path, tiny_ckpt, "throughput")["sampling"] == "greedy"


@pytest.mark.parametrize("shape", ["llama-3.1-8b", "qwen3-8b"])
def test_floor_counts_the_linears_transformers_builds(shape):
    """bench/floor.py's per-layer linear weights and LM head against the model transformers builds
    from the same config.json (on the meta device: no memory): every nn.Linear of a layer."""
    import torch
    import transformers

    from kiln.bench.floor import linear_params
    from kiln.bench.make_random_model import hf_config
    from kiln.models.config import ModelConfig

    d = hf_config(shape)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**d))
    layer = sum(m.weight.numel() for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    assert linear_params(ModelConfig.from_hf_dict(d)) == (layer, model.lm_head.weight.numel())


def test_floor_work_equals_a_token_by_token_count():
    """The closed forms of bench/floor.work against walking every token of every request: a prompt
    position p attends p + 1 keys (matmul), a fed-back output at position p reads p + 1 keys' K/V."""
    from kiln.bench.floor import floor, linear_params, work
    from kiln.bench.make_random_model import hf_config
    from kiln.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(hf_config("tiny-llama"))
    layer, head = linear_params(cfg)
    L, H, D, Hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    rng = np.random.default_rng()
    in_lens, out_lens = rng.integers(1, 40, size=7).tolist(), rng.integers(1, 30, size=7).tolist()
    flops = kv_bytes = 0
    for i, o in zip(in_lens, out_lens):
        for p in range(i):  # the prompt
            flops += 2 * layer * L + 4 * H * D * L * (p + 1)
        for p in range(i, i + o - 1):  # outputs fed back (the last one never is)
            flops += 2 * layer * L
            kv_bytes += (p + 1) * 2 * Hkv * D * 1 * L
        flops += 2 * head * o  # one LM-head row per output
    assert work(cfg, in_lens, out_lens, 1) == {"matmul_flops": flops, "kv_read_bytes": kv_bytes}
    f = floor(cfg, in_lens, out_lens, 1, 1e12, 2e12)
    assert f["floor_s"] == pytest.approx(flops / 1e12 + kv_bytes / 2e12)
    assert f["tok_s"] == pytest.approx(sum(out_lens) / f["floor_s"])
    assert "power_capped" not in f
    capped = floor(cfg, in_lens, out_lens, 1, 1e12, 2e12, capped_flops_s=0.8e12)  # the matmuls at the power limit
    assert {k: v for k, v in capped.items() if k != "power_capped"} == f
    assert capped["power_capped"]["floor_s"] == pytest.approx(flops / 0.8e12 + kv_bytes / 2e12)
    assert capped["power_capped"]["tok_s"] == pytest.approx(sum(out_lens) / capped["power_capped"]["floor_s"])


def test_power_log_summarizes_what_nvidia_smi_printed(tmp_path, monkeypatch):
    """PowerLog runs nvidia-smi from PATH for the workload's span and reads its CSV back; here a
    stand-in prints lines in the shape the H200's printed during a sustained prefill (2026-12-04):
    two idle samples, then busy ones, most held by the SW power cap (0x4)."""
    import time

    from kiln.bench.device import PowerLog, summarize_smi

    lines = ["345, 77.64, 0x0000000000000001", "345 MHz, 77.83 W, 0x0000000000000001",
             "1590, 686.88, 0x0000000000000004", "1545, 690.36, 0x0000000000000004",
             "1620, 688.80, 0x0000000000000004", "1965, 584.36, 0x0000000000000000", "[N/A], [N/A], [N/A]"]
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\ncat <<'END'\n" + "\n".join(lines) + "\nEND\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with PowerLog() as log:
        time.sleep(0.5)
    got = log.summary()
    assert got == summarize_smi(lines)
    assert got["samples"] == 6 and got["busy_samples"] == 4
    assert got["sm_clock_mhz"] == {"median": 1605.0, "min": 1545.0, "max": 1965.0}
    assert got["power_w"]["max"] == 690.36 and got["power_capped"] == 0.75
    assert summarize_smi(lines[:2]) is None  # idle all along
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    with PowerLog() as log:
        pass
    assert log.summary() is None  # no nvidia-smi: no record


def test_random_256_is_seeded(tmp_path, tiny_ckpt):
    a = run_bench(tmp_path, tiny_ckpt, "random-256", "--num-requests", "6")
    b = run_bench(tmp_path, tiny_ckpt, "random-256", "--num-requests", "6")
    assert a["num_requests"] == 6 and a["input_tokens"] == b["input_tokens"]
    assert a["expected_output_tokens"] == b["expected_output_tokens"]
    assert 6 * 2 <= a["output_tokens"] <= 6 * 5 and 6 * 2 <= a["input_tokens"] <= 6 * 12
    _check_steps(a)


def test_cold_start(tmp_path, tiny_ckpt):
    rec = run_bench(tmp_path, tiny_ckpt, "cold-start")
    assert rec["metric"] == "cold_start_s"
    assert set(rec["compile_s"]) == {"cold", "warm_kernels", "cached_bundle"}
    assert rec["value"] == pytest.approx(rec["import_s"] + rec["engine_init_s"] + rec["first_request_s"])


@pytest.mark.parametrize("extra", [(), ("--async-scheduling",)], ids=["sync", "async"])
def test_server_through_the_cli(tmp_path, tiny_ckpt, extra):
    """As a user runs it: `python build.py bench` in a process of its own, `build.py serve` under it."""
    out = tmp_path / "server.json"
    cmd = [sys.executable, str(REPO / "build.py"), "bench", "--workload", "server", "--model", str(tiny_ckpt),
           "--concurrency", "1", "2", "--json", str(out), *SMALL, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert list(rec)[:len(SCHEMA)] == SCHEMA and rec["metric"] == "output_tok_s"
    assert [lv["concurrency"] for lv in rec["levels"]] == [1, 2]
    for lv in rec["levels"]:
        for side in ("server", "offline"):
            s = lv[side]
            assert s["num_requests"] == 3 and s["output_tokens"] == 15
            # TPOT is measured (every request streamed more than one token), but may be 0: a DELTA
            # stream merges the tokens a slow reader has not taken yet (output_collector.py), so on
            # a loaded 2-core machine a 5-token request of the tiny model can arrive in one chunk
            assert s["ttft_ms"]["median"] > 0 and s["tpot_ms"]["median"] >= 0 and s["output_tok_s"] > 0
    assert rec["value"] == rec["levels"][-1]["server"]["output_tok_s"]
    assert "[kiln] server: output_tok_s" in proc.stdout


def test_peer_in_the_same_run(tmp_path, tiny_ckpt, monkeypatch):
    monkeypatch.setenv("KILN_COMMIT", "0123456789ab")  # a shipped tree's commit: kiln and its peers both report it
    rec = run_bench(tmp_path, tiny_ckpt, "decode", "--peers", "hf-eager", "--repeats", "1")
    peer = rec["peers"]["hf-eager"]
    assert peer["engine"] == "transformers-eager" and peer["metric"] == "decode_tok_s" and peer["value"] > 0
    assert "--context 10 --steps 4" in peer["command"]
    assert rec["commit"] == peer["commit"] == "0123456789ab"


def test_peer_static_cache_compiled_step(tmp_path, tiny_ckpt):
    """The gpt-fast recipe traces as one graph (backend eager: inductor's compile is minutes on CPU)."""
    out = tmp_path / "peer.json"
    cmd = [sys.executable, str(REPO / "bench" / "peers" / "hf_gpu.py"), "--model", str(tiny_ckpt), "--device", "cpu",
           "--workload", "decode", "--compile", "--compile-backend", "eager", "--context", "10", "--steps", "4",
           "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert list(rec)[:len(SCHEMA)] == SCHEMA
    assert rec["engine"] == "transformers-compile" and rec["compile"]["fullgraph"] and rec["value"] > 0
    # read back by build.py bench as a peer of the same workload, ignored by another
    from kiln.bench.peer_runner import read_peer_json

    assert read_peer_json([str(out)], "decode")["transformers-compile"]["value"] == rec["value"]
    assert read_peer_json([str(out)], "prefill") == {}


def test_lengths_past_the_context_are_one_sentence(tmp_path, tiny_ckpt, capsys):
    assert main(["bench", "--workload", "throughput", "--model", str(tiny_ckpt), "--input-len", "4000",
                 "--output-len", "200", "--num-requests", "1"]) == 1
    assert "exceed --max-model-len 4096" in capsys.readouterr().err


def test_plot_and_table(tmp_path):
    from kiln.bench.plot import main as plot_main

    level = {"ttft_ms": {"median": 20.0}, "tpot_ms": {"median": 9.0}, "output_tok_s": 100.0}
    rec = {"workload": "server", "commit": "abc", "gpu": "cpu", "metric": "output_tok_s", "value": 100.0,
           "roofline": None, "peers": {}, "command": "x", "input_len": 8, "output_len": 4,
           "levels": [{"concurrency": c, "server": {**level, "concurrency": c},
                       "offline": {**level, "concurrency": c}} for c in (1, 8)]}
    f = tmp_path / "server.json"
    f.write_text(json.dumps(rec))
    assert plot_main([str(f), "--markdown"]) == 0
    pytest.importorskip("matplotlib")
    assert plot_main([str(f), "--out", str(tmp_path / "server.png")]) == 0
    assert (tmp_path / "server.png").stat().st_size > 1000


@pytest.mark.parametrize("fold", ["auto", "off"])
def test_gpu_shape_decode_gemm_fold_flag_reaches_the_configs(fold):
    """bench/gpu_shape_decode.py --gemm-fold compiles the model in-process with a Configs whose
    gemm_tile lookup carries the flag: `off` keeps every split-K GEMM's partials, `auto` folds
    those of the Llama-3.1-8B prefill where the tuned schedule or Configs.gemm_fold's rule says so
    (o_proj's tuned split-K 2 on 128x128 tiles at 2,048 tokens by the rule; down's tuned 128x256
    tile by the schedule, through memory), never a decode step's. The TMA flag still reaches the same tiles."""
    from argparse import Namespace

    from kiln.bench.gpu_shape_decode import _lookup
    from kiln.codegen.triton.configs import Configs
    from kiln.schedules import Schedules

    args = Namespace(untuned=False, attn_block_q=None, attn_warps=None, attn_stages=None, attn_maxnreg=None,
                     gemm_tma="off", gemm_fold=fold)
    configs = Configs(lookup=_lookup(args))
    tuned = Configs(lookup=Schedules.read("sm_90").lookup)
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):  # q/k/v, o_proj, down
        red = configs.gemm_reduction(n, k)
        prefill, decode = configs.gemm_tile(2048, n, k), configs.gemm_tile(1, n, k)
        # off: never; auto: the schedule's word (down's at 2,048 rows), else the rule's
        assert prefill.fold is (False if fold == "off" else tuned.gemm_tile(2048, n, k).fold)
        as_tuned = tuned.gemm_fold(2048, n, k, tuned.gemm_tile(2048, n, k), red)  # the bundle's own choice
        assert configs.gemm_fold(2048, n, k, prefill, red) is (fold == "auto" and as_tuned)
        # down's tuned prefill tile folds (through memory); o_proj's split-K 2 on 128x128 tiles by the rule
        assert as_tuned is ((n, k) in ((4096, 14336), (4096, 4096)))
        assert not configs.gemm_fold(1, n, k, decode, red)
        assert prefill.tma is False
    n, k = 4096, 14336  # a tile the rule folds: down's split-K 2 on 128x128 tiles, which fill the GPU twice
    folding = replace(configs.gemm_tile(2048, n, k), block_m=128, block_n=128, num_warps=8)
    assert configs.gemm_reduction(n, k).split_k == 2
    assert configs.gemm_fold(2048, n, k, folding, configs.gemm_reduction(n, k)) is (fold == "auto")


def test_gpu_shape_decode_attention_flags_sit_on_the_tuned_entry():
    """bench/gpu_shape_decode.py --attn-*: the prefill knobs given replace the tuned entry's, and
    the entry's other knobs (the decode size classes') stay as tuned."""
    from argparse import Namespace

    from kiln.bench.gpu_shape_decode import _lookup
    from kiln.codegen.triton.configs import Configs
    from kiln.schedules import Schedules

    tuned = Configs(lookup=Schedules.read("sm_90").lookup).attention(32, 8, 128, 4096)
    args = Namespace(untuned=False, attn_block_q=None, attn_warps=None, attn_stages=1, attn_maxnreg=168,
                     gemm_tma="auto", gemm_fold="auto")
    got = Configs(lookup=_lookup(args)).attention(32, 8, 128, 4096)
    assert (got.prefill_num_stages, got.prefill_maxnreg) == (1, 168)
    assert replace(got, prefill_num_stages=tuned.prefill_num_stages, prefill_maxnreg=tuned.prefill_maxnreg) == tuned
    assert tuned.split_maxnreg is not None  # the committed entry tunes the split class: kept above


def test_gpu_shape_decode_fuse_silu_flag_picks_the_graph():
    """bench/gpu_shape_decode.py --fuse-silu: `auto` compiles the Llama-3.1-8B graph with the
    MLP's silu_mul in the gate/up GEMM's epilogue (interleaved weight), `off` the old graph with
    a silu_mul launch per layer (an in-process A/B; the JSON records which)."""
    from kiln.bench.gpu_shape_decode import SHAPES, step_graph
    from kiln.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(SHAPES["llama-3.1-8b"])
    for flag, fused in (("auto", 32), ("off", 0)):
        ops = [n.op for n in step_graph(cfg, flag).nodes.values()]
        assert ops.count("linear_silu_mul") == fused and ops.count("silu_mul") == 32 - fused


def test_gpu_shape_decode_fuse_rope_flag_picks_the_graph():
    """--fuse-rope: `auto` puts Llama-3.1-8B's attention preamble in the q/k/v GEMM's epilogue
    (linear_rope, one per layer), `off` keeps the preamble a launch of its own."""
    from kiln.bench.gpu_shape_decode import SHAPES, step_graph
    from kiln.models.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(SHAPES["llama-3.1-8b"])
    for flag, fused in (("auto", 32), ("off", 0)):
        ops = [n.op for n in step_graph(cfg, fuse_rope=flag).nodes.values()]
        assert ops.count("linear_rope") == fused and ops.count("attention_preamble") == 32 - fused


def test_decode_timeline_reads_a_kernel_trace(tmp_path):
    """bench/decode_timeline.py's account of a chrome trace: kernels in start order, cut into
    steps of the plan's launches, each launch's duration, gap after the one before (negative:
    started early, as under PDL) and exposed time (its end minus the one before's end)."""
    from kiln.bench.decode_timeline import kernel_records, middle_steps, summarise

    # per step: a [0, 3), b [2, 7) (starts 1 us early), a [8, 9) (1 us idle before it); steps 20 us apart
    events = [{"cat": "cpu_op", "name": "cudaGraphLaunch", "ts": 0, "dur": 50}]
    for i in range(8):
        t = 20.0 * i
        events += [{"cat": "kernel", "name": n, "ts": t + s, "dur": d} for n, s, d in (("b", 2, 5), ("a", 0, 3),
                                                                                      ("a", 8, 1))]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    ks = kernel_records(str(path))
    assert [k[0] for k in ks[:3]] == ["a", "b", "a"] and len(ks) == 24
    steps = middle_steps(ks, 3, 8)
    assert len(steps) == 4  # the middle half
    res = summarise(steps, ["a[1]", "b[2]", "a[1]"])
    assert res["step_us"] == 9.0
    per = res["per_launch"]
    assert [r["dur_us"] for r in per] == [3.0, 5.0, 1.0]
    assert [r["start_gap_us"] for r in per] == [0.0, -1.0, 1.0]
    assert [r["exposed_us"] for r in per] == [3.0, 4.0, 2.0]
    assert res["by_kernel"]["a[1]"] == {"count": 2, "dur_us": 4.0, "exposed_us": 5.0, "start_gap_us": 1.0}
    with pytest.raises(SystemExit):
        middle_steps(ks, 3, 9)


def test_engine_timeline_names_what_runs_between_graphs(tmp_path):
    """bench/engine_timeline.py's account of an engine's trace: graph replays found as runs of
    the plan's kernels in order (a lone plan kernel outside a run is not one), and per middle
    step the graph's span, the period, and each copy/kernel between two graphs with the idle
    time before it."""
    from kiln.bench.engine_timeline import between, gpu_records, split_graphs

    # per step (100 us apart): graph kernels a [0, 10), b [10, 40); then a copy [42, 44), a
    # sampler kernel [45, 48) and an upload [50, 51); a stray "a" (not followed by b) at 60
    events = [{"cat": "cpu_op", "name": "cudaGraphLaunch", "ts": 0, "dur": 5}]
    for i in range(8):
        t = 100.0 * i
        events += [{"cat": c, "name": n, "ts": t + s, "dur": d} for c, n, s, d in (
            ("kernel", "a", 0, 10), ("kernel", "b", 10, 30), ("gpu_memcpy", "Memcpy DtoH", 42, 2),
            ("kernel", "sample", 45, 3), ("gpu_memcpy", "Memcpy HtoD", 50, 1), ("kernel", "a", 60, 1))]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    rs = gpu_records(str(path))
    assert len(rs) == 48 and rs[0][1] == "a"
    spans, rs = split_graphs(rs, ["a", "b"])
    assert len(spans) == 8 and all(rs[i][1] == "a" and rs[j][1] == "b" for i, j in spans)
    res = between(rs, spans)
    assert res["steps"] == 3  # the middle half: 4 graphs, 3 periods
    assert (res["graph_us"], res["period_us"], res["between_us"]) == (40.0, 100.0, 60.0)
    items = list(res["items"].items())
    assert [k for k, _ in items] == ["00 gpu_memcpy:Memcpy DtoH", "01 kernel:sample", "02 gpu_memcpy:Memcpy HtoD",
                                     "03 kernel:a", "zz idle before the next graph"]
    assert [(v["dur_us"], v["idle_before_us"]) for _, v in items] == [(2.0, 2.0), (3.0, 1.0), (1.0, 2.0),
                                                                      (1.0, 9.0), (0.0, 39.0)]
