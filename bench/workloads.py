"""The performance issue's workloads, run through kiln's public APIs (`kiln.LLM`, `build.py
serve`) with token-id prompts, greedy sampling (decode, throughput and random-256: or --temperature with
--top-k and --top-p), EOS ignored and fixed lengths:

    decode       batch-1 decode at --context 512 for --steps 128 (tok/s; the weight-bytes roofline at
                 the copy bandwidth measured in the same run; on a GPU also the bare graph-replay time)
    prefill      one --input-len 2048 prompt (tok/s, from the engine's time to first token)
    throughput   --num-requests 1000 of --input-len 1000 and --output-len 1000 at once (output tok/s)
    random-256   256 requests, input and output lengths uniform in [--min-len 100, 1024] (seeded)
                 (both offline workloads: on a GPU with torch beside, the workload's floor as the
                 roofline: its matmul FLOPs and decode K/V bytes at rates measured in the run, bench/floor.py,
                 and under power_capped the same at the matmul rate with the board at its power limit;
                 everywhere the engine steps split into decode-only and prompt-carrying ones, StepLog)
    server       `build.py serve` at each --concurrency 1 8 32 128, max(4, 2C) requests of --input-len 512
                 and --output-len 256 per level: TTFT, TPOT, output tok/s, next to the offline engine on
                 the same requests (bench/server_workload.py); its value is the top level's output tok/s
    cold-start   `build.py compile` cold and cached, then engine init + first request in a fresh
                 process (bench/cold_start.py)

Each workload returns its fields; run_bench adds {workload, commit, gpu, command, peers}, prints a
line and writes --json. Every workload checks that each request produced exactly the tokens asked
for: a benchmark that generated less would report a speed it never ran at.
"""
from __future__ import annotations

import argparse
import os
import datetime
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build.py"

DEFAULTS = {
    "decode": dict(context=512, steps=128, repeats=3),
    "prefill": dict(input_len=2048, repeats=3),
    "throughput": dict(num_requests=1000, input_len=1000, output_len=1000),
    "random-256": dict(num_requests=256, min_len=100, input_len=1024, output_len=1024),
    "server": dict(concurrency=[1, 8, 32, 128], input_len=512, output_len=256),
    "cold-start": dict(input_len=16, output_len=2),
}
SIZE_FLAGS = ("num_requests", "input_len", "output_len", "min_len", "concurrency", "context", "steps", "repeats")
BANDWIDTH_DEFINITION = ("read + write: 2 x bytes copied / time (as nvidia's bandwidthTest counts a device copy; "
                        "the issue's 4.27 TB/s for the H200 is this count, under its 4.8 TB/s HBM peak)")


def with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    a = argparse.Namespace(**vars(args))
    for k, v in DEFAULTS[a.workload].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    for k in SIZE_FLAGS:
        v = getattr(a, k, None)
        if v is not None and any(x < 1 for x in (v if isinstance(v, list) else [v])):
            raise KilnError(f"--{k.replace('_', '-')} must be at least 1")
    return a


# -- helpers shared by the workloads ---------------------------------------------------------------

def sampling(max_tokens: int, a=None):
    """The workloads' sampling: greedy, or with `a` (the bench flags) at --temperature with
    --top-k and --top-p."""
    from kiln import SamplingParams

    if a is None or not a.temperature:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=a.temperature, top_k=a.top_k,
                          top_p=a.top_p)


def random_prompts(rng: np.random.Generator, lengths, vocab: int) -> list[list[int]]:
    """Token ids past the three specials of make_random_model's vocabulary (<unk>, <s>, </s>)."""
    return [rng.integers(min(3, vocab - 1), vocab, size=int(n)).tolist() for n in lengths]


def check_lengths(outs, expected) -> int:
    """-> tokens produced; a request that made a different number is an error of the run."""
    got = [len(o.outputs[0].token_ids) for o in outs]
    bad = [(g, e) for g, e in zip(got, expected) if g != e]
    if bad:
        raise KilnError(f"{len(bad)} of {len(got)} requests produced the wrong number of tokens "
                        f"(first: {bad[0][0]} instead of {bad[0][1]})")
    return sum(got)


def check_fits(a, input_len: int, output_len: int) -> None:
    if input_len + output_len > a.max_model_len:
        raise KilnError(f"{input_len} prompt + {output_len} output tokens exceed --max-model-len {a.max_model_len}")


def summary_ms(seconds: list[float]) -> dict:
    xs = [s * 1e3 for s in seconds if s is not None]
    if not xs:
        return {"median": None, "mean": None, "p99": None}
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "p99": float(np.percentile(xs, 99))}


@contextmanager
def engine(a):
    from kiln import LLM

    llm = LLM(a.model, target=a.target, bundle_dir=a.bundle, max_model_len=a.max_model_len,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              kv_cache_tokens=a.kv_cache_tokens, async_scheduling=a.async_scheduling,
              kv_cache_dtype=a.kv_cache_dtype, quantization=getattr(a, "quantization", None))
    try:
        yield llm
    finally:
        if a.target != "cpu":
            llm.model.executor.close()  # give the GPU memory back before the next engine or server


class _TokenBar:
    """A stat logger (runtime/engine/stats.py) that moves a tqdm bar by the tokens sampled each step."""

    def __init__(self, bar):
        self.bar = bar

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.bar.update(iteration_stats.num_generation_tokens)


class StepLog:
    """A stat logger that keeps each engine step's scheduled and sampled token counts and the wall
    time since the step before (under async scheduling a step is logged when its outputs are
    read, so in a steady run the gaps are the GPU's step periods)."""

    def __init__(self):
        self.t = time.perf_counter()
        self.steps: list[tuple[int, int, float]] = []  # (scheduled tokens, sampled tokens, seconds)

    def record(self, scheduler_stats, iteration_stats) -> None:
        now = time.perf_counter()
        self.steps.append((iteration_stats.num_scheduled_tokens, iteration_stats.num_generation_tokens, now - self.t))
        self.t = now

    def summary(self) -> dict:
        """Steps split by kind: "decode" steps sample a token for every token they schedule (each
        running request one token); "prompt" steps carry prompt tokens (chunked prefill, decode rows
        riding along). -> per kind: steps, seconds, median ms a step, scheduled and sampled tokens."""
        out = {}
        for kind, pick in (("decode", lambda n, g: n == g), ("prompt", lambda n, g: n > g)):
            rows = [r for r in self.steps if r[0] and pick(r[0], r[1])]
            out[kind] = {"steps": len(rows), "seconds": sum(r[2] for r in rows),
                         "median_ms": 1e3 * statistics.median(r[2] for r in rows) if rows else None,
                         "scheduled_tokens": sum(r[0] for r in rows), "sampled_tokens": sum(r[1] for r in rows)}
        return out


@contextmanager
def progress(llm, a, total: int, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="tok", disable=a.no_progress, file=sys.stderr, dynamic_ncols=True)
    logger = _TokenBar(bar)
    llm.engine.stat_loggers.append(logger)
    try:
        yield bar
    finally:
        llm.engine.stat_loggers.remove(logger)
        bar.close()


def weight_bytes_per_token(llm) -> int:
    """Bytes of weights one batch-1 decode token reads (decode_weight_bytes of the loaded graph)."""
    return decode_weight_bytes(llm.model.graph, llm.model.source.config)


def decode_weight_bytes(graph, cfg) -> int:
    """Bytes of weights one batch-1 decode token reads from `graph`: every weight at the dtype the graph
    holds it in (so a quantised checkpoint's weights and scales as stored: FP8 e4m3 weights and their
    f32 scales, NVFP4's packed u8 pairs, e4m3 block scales and f32 tensor scales, a GGUF linear's raw
    u8 blocks; the plain tensors in the graph's dtype), except that an untied embedding table gives one
    row (a tied one is read whole by the LM head) and a stacked expert tensor ([num_experts, ...]: the
    weights and every scale of FP8 / NVFP4 experts, NVFP4's [num_experts, 2] tensor scales too) gives
    the num_experts_per_tok experts the router picks. An untied head may be `lm_head.weight` or a
    GGUF's `lm_head.gguf_weight`: the embedding is one row either way."""
    from kiln.graph import to_numpy

    total = 0
    for t in graph.weights:
        n = to_numpy(t.dtype).itemsize * int(np.prod(t.shape))
        if cfg.num_experts and len(t.shape) >= 2 and t.shape[0] == cfg.num_experts and ".experts." in t.name:
            n = n // cfg.num_experts * cfg.num_experts_per_tok
        if t.name == "model.embed_tokens.weight" and not cfg.tie_word_embeddings:
            n //= t.shape[0]
        total += n
    return total


def state_bytes_per_token(llm) -> int:
    """Bytes of per-request recurrent state (GDN conv and SSM state: the graph's states sized per
    slot, 'NS') one decode token reads and writes back: 2 x one slot of each."""
    from kiln.graph import to_numpy

    return sum(2 * to_numpy(s.dtype).itemsize * int(np.prod(s.shape[1:]))
               for s in llm.model.graph.states if s.shape and s.shape[0] == "NS")


# -- the workloads ---------------------------------------------------------------------------------

def decode(a) -> dict:
    from kiln.bench.device import copy_bandwidth

    check_fits(a, a.context, a.steps + 1)
    bandwidth = copy_bandwidth(a.target)  # before the engine takes the memory
    rng = np.random.default_rng(a.seed)
    with engine(a) as llm:
        vocab = llm.engine.vocab_size
        llm.generate(random_prompts(rng, [8], vocab), sampling(4))  # warm-up: the batch-1 graph is captured
        tpots, produced = [], 0
        with progress(llm, a, a.repeats * (a.steps + 1), "decode"):
            for _ in range(a.repeats):
                out = llm.generate(random_prompts(rng, [a.context], vocab), sampling(a.steps + 1, a))
                produced += check_lengths(out, [a.steps + 1])
                tpots.append(out[0].metrics.tpot)  # (last token - first token) / steps: decode steps only
        res = {"metric": "decode_tok_s", "value": 1 / statistics.median(tpots)}
        wbytes, sbytes = weight_bytes_per_token(llm), state_bytes_per_token(llm)
        nbytes = wbytes + sbytes
        res["roofline"] = {"tok_s": bandwidth / nbytes, "bytes_per_token": nbytes, "weight_bytes_per_token": wbytes,
                           "state_bytes_per_token": sbytes,
                           "copy_bandwidth_GBps": bandwidth / 1e9, "bandwidth_counts": BANDWIDTH_DEFINITION}
        if a.target != "cpu":
            from kiln.bench.device import gpu_only_decode_ms

            ms = gpu_only_decode_ms(llm.model.executor)  # the graph replays the last step's inputs
            res.update(gpu_decode_ms=ms, gpu_decode_tok_s=1e3 / ms if ms else None)
            if getattr(a, "profile", False):
                res["profile"] = decode_profile(llm, a.context)
    res.update(decode_ms=1e3 * statistics.median(tpots), runs_tok_s=[1 / t for t in tpots], context=a.context,
               steps=a.steps, repeats=a.repeats, output_tokens=produced,
               expected_output_tokens=a.repeats * (a.steps + 1))
    return res


def decode_profile(llm, context: int) -> dict:
    """Per-kernel GPU time of one batch-1 decode step at `context` tokens (bench/gpu_shape_decode.py's
    profile: the step's launches with events between them, and the bucket as one plain graph). The
    step reads the first blocks of the KV cache and state slot 1 as they are: timing only."""
    from kiln.bench.gpu_shape_decode import profile
    from kiln.runtime.worker.input_batch import SeqChunk, prepare_step

    bs = llm.model.block_size
    step = prepare_step([SeqChunk([1], context, list(range(context // bs + 1)), state_slot=1)], bs)
    return profile(llm.model.executor, step)


def prefill(a) -> dict:
    check_fits(a, a.input_len, 1)
    rng = np.random.default_rng(a.seed)
    with engine(a) as llm:
        vocab = llm.engine.vocab_size
        llm.generate(random_prompts(rng, [a.input_len], vocab), sampling(1))  # warm-up at the same size
        ttfts, produced = [], 0
        with progress(llm, a, a.repeats, "prefill"):
            for _ in range(a.repeats):  # fresh random prompts: no prefix-cache hits
                out = llm.generate(random_prompts(rng, [a.input_len], vocab), sampling(1))
                produced += check_lengths(out, [1])
                ttfts.append(out[0].metrics.ttft)
    ttft = statistics.median(ttfts)
    return {"metric": "prefill_tok_s", "value": a.input_len / ttft, "roofline": None, "ttft_ms": ttft * 1e3,
            "runs_tok_s": [a.input_len / t for t in ttfts], "input_len": a.input_len, "repeats": a.repeats,
            "output_tokens": produced, "expected_output_tokens": a.repeats}


def offline(a, in_lens: list[int], out_lens: list[int], desc: str) -> dict:
    rates = None
    if a.target != "cpu":  # the floor's two ceilings, measured before the engine takes the memory
        from kiln.bench.device import copy_bandwidth
        from kiln.bench.floor import gpu_matmul_rate

        # the matmul rate at the boost clock (the floor's), then held at the power limit (power_capped)
        rates = (gpu_matmul_rate(), copy_bandwidth(a.target), gpu_matmul_rate(warm_s=1.0))
    rng = np.random.default_rng(a.seed)
    with engine(a) as llm:
        vocab = llm.engine.vocab_size
        prompts = random_prompts(rng, in_lens, vocab)
        llm.generate(random_prompts(rng, [8], vocab), sampling(4))  # warm-up
        with progress(llm, a, sum(out_lens), desc):
            steps = StepLog()
            llm.engine.stat_loggers.append(steps)
            t0 = steps.t = time.perf_counter()
            outs = llm.generate(prompts, [sampling(n, a) for n in out_lens])
            wall = time.perf_counter() - t0
            llm.engine.stat_loggers.remove(steps)
        ahead = llm.engine.core.async_scheduling  # as the engine ran, not as asked
        roofline = None
        if rates and rates[0]:  # torch with CUDA beside the engine: the workload's floor (bench/floor.py)
            from kiln.bench.floor import floor
            from kiln.graph import DType, to_numpy

            kv = to_numpy(DType(llm.model.graph.attrs["kv_cache_dtype"])).itemsize
            roofline = floor(llm.model.source.config, in_lens, out_lens, kv, *rates)
    produced = check_lengths(outs, out_lens)
    return {"metric": "output_tok_s", "value": produced / wall, "roofline": roofline,
            "total_tok_s": (sum(in_lens) + produced) / wall, "requests_per_s": len(outs) / wall, "wall_s": wall,
            "ttft_ms": summary_ms([o.metrics.ttft for o in outs]),
            "tpot_ms": summary_ms([o.metrics.tpot for o in outs]),
            "num_requests": len(outs), "input_tokens": sum(in_lens), "output_tokens": produced,
            "expected_output_tokens": sum(out_lens), "async_scheduling": ahead, "steps": steps.summary()}


def throughput(a) -> dict:
    check_fits(a, a.input_len, a.output_len)
    res = offline(a, [a.input_len] * a.num_requests, [a.output_len] * a.num_requests, "throughput")
    return {**res, "input_len": a.input_len, "output_len": a.output_len}


def random_256(a) -> dict:
    if a.min_len > min(a.input_len, a.output_len):
        raise KilnError("--min-len must not exceed --input-len and --output-len (the upper bounds)")
    check_fits(a, a.input_len, a.output_len)
    rng = np.random.default_rng(a.seed + 1)  # the lengths; the prompts' ids come from a.seed
    in_lens = rng.integers(a.min_len, a.input_len + 1, size=a.num_requests).tolist()
    out_lens = rng.integers(a.min_len, a.output_len + 1, size=a.num_requests).tolist()
    res = offline(a, in_lens, out_lens, "random")
    return {**res, "min_len": a.min_len, "max_input_len": a.input_len, "max_output_len": a.output_len,
            "seed": a.seed}


def server(a) -> dict:
    from kiln.bench.server_workload import run_server_workload

    check_fits(a, a.input_len, a.output_len)
    return run_server_workload(a)


def cold_start(a) -> dict:
    from kiln.bench.cold_start import run_cold_start

    return run_cold_start(a)


WORKLOADS = {"decode": decode, "prefill": prefill, "throughput": throughput, "random-256": random_256,
             "server": server, "cold-start": cold_start}


# -- the common fields, peers, output ---------------------------------------------------------------

def git_commit() -> str:
    """HEAD of this checkout, or KILN_COMMIT when set (a copy of the tree shipped to another
    machine may carry a stale .git: the sender knows the commit)."""
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _bundle_stamp(bundle_dir: str | None):
    m = Path(bundle_dir or "", "manifest.yaml")
    return m.stat().st_mtime_ns if bundle_dir and m.is_file() else None


def run_bench(args: argparse.Namespace) -> int:
    from kiln.bench.cli import command_line
    from kiln.bench.device import PowerLog, device_name
    from kiln.bench.peer_runner import read_peer_json, run_peers

    a = with_defaults(args)
    peers = {**run_peers(a), **read_peer_json(a.peer_json, a.workload)}
    before = _bundle_stamp(a.bundle)
    with PowerLog() if a.target != "cpu" else nullcontext() as power:
        res = WORKLOADS[a.workload](a)
    if power is not None and (gpu_power := power.summary()):  # clocks and power over the whole workload
        res["gpu_power"] = gpu_power
    if a.bundle:  # did the run time the bundle it was given, or one compiled over it (build.py warns)?
        res["bundle"] = {"dir": a.bundle, "reused": before is not None and _bundle_stamp(a.bundle) == before}
    record = {"workload": a.workload, "commit": git_commit(), "gpu": device_name(a.target),
              "metric": res.pop("metric"), "value": res.pop("value"), "roofline": res.pop("roofline", None),
              "peers": peers, "command": command_line(args), "model": a.model, "target": a.target,
              "kv_cache_dtype": a.kv_cache_dtype, "quantization": getattr(a, "quantization", None),
              "sampling": ({"temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p}
                           if a.temperature and a.workload in ("decode", "throughput", "random-256", "server") else "greedy"),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **res}
    line = f"[kiln] {a.workload}: {record['metric']} = {record['value']:.2f}"
    if record["roofline"]:
        line += f" (roofline {record['roofline']['tok_s']:.1f} at {record['roofline']['copy_bandwidth_GBps']:.0f} GB/s"
        capped = record["roofline"].get("power_capped")
        line += f"; {capped['tok_s']:.1f} at the power-capped matmul rate)" if capped else ")"
    for name, p in peers.items():
        line += f"; {name}: {p['value']:.2f}"
    print(line, flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0
