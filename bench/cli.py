"""`build.py bench`: its flags. Argparse only, so that building build.py's parser stays fast;
the workloads (bench/workloads.py) load when `bench` runs.

bench/ lives in the repository checkout beside build.py, not in the installed package: it
reaches the engine through the public APIs (kiln.LLM, `build.py serve`) like any user.
"""
from __future__ import annotations

import argparse
import shlex

from kiln.graph.dtype import KV_CACHE_DTYPES

WORKLOADS = ("decode", "prefill", "throughput", "random-256", "server", "cold-start")
PEERS = ("hf-eager", "hf-compile")

# (flag, add_argument keywords). Size flags default to None: each workload fills in the
# performance issue's value (bench/workloads.py DEFAULTS), so tests pass small ones.
FLAGS: list[tuple[str, dict]] = [
    ("--workload", dict(required=True, choices=WORKLOADS, help="the workload to run (required; docs/BENCHMARKS.md "
                                                              "says what each measures)")),
    ("--model", dict(help="HF model directory or GGUF file (default: SmolLM2-135M-Instruct)")),
    ("--target", dict(default="cpu", choices=("cpu", "sm_90", "sm_121"),
                      help="cpu (numba kernels compiled for this CPU; KILN_CPU_BACKEND=numpy for the reference), "
                      "or the GPU to compile for and run on: sm_90 (H100/H200), sm_121 (GB10)")),
    ("--bundle", dict(help="GPU bundle directory, compiled there when missing or stale (default: none; compiled "
                           "or read from the compile cache at every start)")),
    ("--json", dict(metavar="OUT", help="write the result here ({workload, commit, gpu, metric, value, ...}; "
                                        "default: print it only)")),
    ("--num-requests", dict(type=int, help="requests (default: throughput 1000; random-256 256; server, per "
                                           "concurrency level, max(4, 2 x concurrency))")),
    ("--input-len", dict(type=int, help="prompt tokens (default: throughput 1000, prefill 2048, server 512; "
                                        "random-256: the upper bound, 1024)")),
    ("--output-len", dict(type=int, help="output tokens (default: throughput 1000, server 256; random-256: the "
                                         "upper bound, 1024)")),
    ("--min-len", dict(type=int, help="random-256: lower bound of input and output lengths (default: 100)")),
    ("--concurrency", dict(type=int, nargs="+", help="server: concurrent streams per level (default: 1 8 32 128)")),
    ("--context", dict(type=int, help="decode: prompt tokens before the timed steps (default: 512)")),
    ("--steps", dict(type=int, help="decode: timed batch-1 decode steps (default: 128)")),
    ("--repeats", dict(type=int, help="decode, prefill: timed runs, the median is reported (default: 3)")),
    ("--profile", dict(action="store_true", help="decode on a GPU: also time every kernel of one batch-1 decode "
                                                 "step at --context (events between launches) into the record")),
    ("--seed", dict(type=int, default=0, help="seed of the random prompts and lengths")),
    ("--temperature", dict(type=float, default=0.0, help="decode, throughput, random-256, server: sample at this "
                                                         "temperature instead of greedily (0: greedy)")),
    ("--top-k", dict(type=int, default=0, help="with --temperature: top-k (0: off)")),
    ("--top-p", dict(type=float, default=1.0, help="with --temperature: top-p (1: off)")),
    ("--max-model-len", dict(type=int, default=4096, help="as `build.py compile` (a bundle is keyed by it)")),
    ("--max-num-seqs", dict(type=int, default=256, help="most sequences in one step")),
    ("--max-num-batched-tokens", dict(type=int, default=2048, help="token budget of one step")),
    ("--kv-cache-tokens", dict(type=int, help="KV cache size (default: 65536 on CPU, at most 4 GiB; free memory on a GPU)")),
    ("--kv-cache-dtype", dict(default="auto", choices=list(KV_CACHE_DTYPES),
                              help="as `build.py serve` (fp8: e4m3, scale 1.0)")),
    ("--quantization", dict(help="as `build.py serve` (vLLM's names; fp8 on a bf16 checkpoint: online FP8; "
                                 "default: the checkpoint's own)")),
    ("--peers", dict(nargs="+", choices=PEERS, default=[],
                     help="run these peers (bench/peers/hf_gpu.py, a subprocess) first, in the same run")),
    ("--peer-json", dict(nargs="+", default=[], metavar="FILE",
                         help="peer results of this run to record next to kiln's (same workload only)")),
    ("--client", dict(choices=("lean", "openai"), default="lean",
                      help="server: the streaming client (lean: raw HTTP/SSE; openai: the official client, "
                           "whose own parsing is the bottleneck at 128 streams)")),
    ("--no-offline", dict(action="store_true", help="server: skip the offline numbers at each concurrency")),
    ("--async-scheduling", dict(action=argparse.BooleanOptionalAction, default=None,
                                help="schedule the next step while one executes (vLLM's flag; default: on for a "
                                "GPU target, off on CPU)")),
    ("--no-progress", dict(action="store_true", help="no progress bars")),
]


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    for flag, kw in FLAGS:
        p.add_argument(flag, **kw)
    p.set_defaults(func=cmd_bench)


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (flags left at their defaults are left out)."""
    parts = ["python", "build.py", "bench"]
    for flag, kw in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is None or value is False or value == [] or ("default" in kw and value == kw["default"]):
            continue
        parts.append(flag)
        if value is not True:
            parts += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return shlex.join(parts)


def cmd_bench(args: argparse.Namespace) -> int:
    from kiln.bench.workloads import run_bench

    return run_bench(args)
