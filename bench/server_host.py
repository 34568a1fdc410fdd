"""The serving path's host cost with the model's forward pass replaced by a no-op: `build.py
serve`'s processes (API server + engine core process) on a model whose executor returns fixed
logits after sleeping --gpu-ms (the GPU's share of a step), driven by closed-loop streaming
clients. What is left is the Python of the engine core, the IPC, the front's output processing,
AsyncLLM, the handlers, JSON/SSE and Tornado, and the client's own parsing.

    python bench/make_random_model.py --shape tiny-llama --out /tmp/tinyllama
    python bench/server_host.py --model /tmp/tinyllama --concurrency 32 128 --client openai lean \\
        [--gpu-ms 10] [--offline] [--py-spy DIR]

Clients (each in this process, one asyncio loop, C workers, keep-alive connections):
  openai  the official async `openai` client, as bench/server_workload.py runs it
  lean    bench/server_workload.py's SSEConnection: raw HTTP/1.1 over asyncio streams, chunked
          framing, SSE split, json.loads per event; about the least a Python client can pay
Per level: output tok/s, TTFT/TPOT medians, and CPU seconds per 1,000 output tokens of the
client (this process), the API server process and the engine core process.

The no-op executor is bench-only: `serve` below swaps runtime/engine/core_client.py's _core_main
for a wrapper that builds the real engine in the child and then replaces its executor's `execute`
(as bench/host_overhead.py does for the offline engine); nothing in kiln's own code paths knows
about it. The sampled tokens cycle through ordinary vocabulary ids so the detokenizer and the
JSON carry text as a real model's would.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kiln.bench.server_workload import SERVED_NAME, SSEConnection, lean_request, one_request

# ---------------------------------------------------------------- the no-op model (server side)


def patch_executor(executor, vocab: int, gpu_ms: float) -> None:
    """executor.execute -> fixed logits after sleeping gpu_ms: token 3 + (step + row) % (vocab - 3)."""
    step = [0]

    def execute(inputs):
        t0 = time.perf_counter()
        n = len(inputs["logits_indices"])
        logits = np.zeros((n, vocab), np.float32)
        logits[np.arange(n), 3 + (step[0] + np.arange(n)) % (vocab - 3)] = 1.0
        step[0] += 1
        if gpu_ms > 0:
            rest = gpu_ms / 1e3 - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        return {"logits": logits}
    executor.execute = execute


def _noop_core_main(gpu_ms: float, build, conn) -> None:
    """The engine core process's main with the executor patched after the real engine is built."""
    from kiln.runtime.engine import core_client

    def build_noop():
        engine, lm = build()
        patch_executor(lm.executor, engine.vocab_size, gpu_ms)
        return engine, lm
    core_client._core_main(build_noop, conn)


def serve_main(argv: list[str]) -> int:
    """`server_host.py serve --gpu-ms X [build.py serve flags]`: build.py serve with the no-op model."""
    from kiln.runtime.engine import core_client
    from kiln.server import cli_args

    ap = argparse.ArgumentParser(prog="server_host.py serve")
    cli_args.add_serve_arguments(ap)
    ap.add_argument("--gpu-ms", type=float, default=0.0)
    a = ap.parse_args(argv)
    if not a.engine_process:
        raise SystemExit("server_host.py serves with the engine core process only")
    # EngineCoreClient looks _core_main up when it starts the child: the child runs the wrapper
    # (pickled by reference to this module) instead.
    core_client._core_main = functools.partial(_noop_core_main, a.gpu_ms)
    return cli_args.cmd_serve(a)


# ---------------------------------------------------------------- clients

def proc_cpu(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return t.user + t.system


async def run_level(kind: str, url: str, conc: int, prompts: list[list[int]], output_len: int,
                    pids: dict[str, int], on_start=None) -> dict:
    results: list = []  # (TTFT, TPOT or None, tokens) per request, as server_workload.py measures them
    todo = list(reversed(prompts))
    if kind == "openai":
        import openai

        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600)
        await one_request(client, prompts[0][:16], 4)  # warm-up

        async def worker() -> None:
            while todo:
                results.append(await one_request(client, todo.pop(), output_len))
    else:
        conns = [SSEConnection(url) for _ in range(conc)]
        await lean_request(conns[0], prompts[0][:16], 4)

        async def worker_for(c: SSEConnection) -> None:
            while todo:
                results.append(await lean_request(c, todo.pop(), output_len))
    cpu0 = {k: proc_cpu(p) for k, p in pids.items()}
    me0 = time.process_time()
    if on_start is not None:
        on_start()
    t0 = time.perf_counter()
    if kind == "openai":
        await asyncio.gather(*[worker() for _ in range(conc)])
        await client.close()
    else:
        await asyncio.gather(*[worker_for(c) for c in conns])
        for c in conns:
            c.close()
    wall = time.perf_counter() - t0
    cpu = {"client": time.process_time() - me0, **{k: proc_cpu(p) - cpu0[k] for k, p in pids.items()}}
    tokens = sum(r[2] for r in results)
    if tokens != output_len * len(prompts):
        raise RuntimeError(f"{tokens} tokens instead of {output_len * len(prompts)}")
    ttft = [r[0] for r in results]
    tpot = [r[1] for r in results if r[1] is not None]
    return {"client": kind, "concurrency": conc, "output_tok_s": tokens / wall, "wall_s": wall,
            "ttft_ms": 1e3 * statistics.median(ttft), "tpot_ms": 1e3 * statistics.median(tpot),
            "cpu_ms_per_1k_tokens": {k: 1e6 * v / tokens for k, v in cpu.items()}}


def start_server(a) -> tuple[subprocess.Popen, str, dict[str, int]]:
    import psutil

    cmd = [sys.executable, "-m", "kiln.bench.server_host", "serve", "--model", a.model, "--port", "0",
           "--served-model-name", SERVED_NAME, "--max-model-len", str(a.input_len + a.output_len + 16),
           "--max-num-seqs", str(max(a.concurrency)), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
           "--kv-cache-tokens", str(max(a.concurrency) * (a.input_len + a.output_len + 32)),
           "--gpu-ms", str(a.gpu_ms)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
            if a.verbose:
                print(line, end="", file=sys.stderr)
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    log = []
    while True:
        line = lines.get(timeout=300)
        if line is None:
            raise SystemExit(f"the server exited ({proc.wait()}): {''.join(log[-20:])}")
        log.append(line)
        if m := re.search(r"on (http://\S+) ", line):
            break
    pids = {"api_server": proc.pid}
    for child in psutil.Process(proc.pid).children():  # the core, and multiprocessing's resource tracker
        if "resource_tracker" not in " ".join(child.cmdline()):
            pids["engine_core"] = child.pid
    return proc, m.group(1), pids


def offline_level(a, conc: int, prompts: list[list[int]]) -> dict:
    """LLM.generate on the same requests in waves of C, with the same no-op executor."""
    from kiln import LLM, SamplingParams

    llm = LLM(a.model, max_model_len=a.input_len + a.output_len + 16, max_num_seqs=max(a.concurrency),
              max_num_batched_tokens=a.max_num_batched_tokens,
              kv_cache_tokens=max(a.concurrency) * (a.input_len + a.output_len + 32))
    patch_executor(llm.model.executor, llm.engine.vocab_size, a.gpu_ms)
    sp = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    outs = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    for k in range(0, len(prompts), conc):
        outs += llm.generate(prompts[k:k + conc], sp)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"client": "offline", "concurrency": conc, "output_tok_s": tokens / wall, "wall_s": wall,
            "ttft_ms": 1e3 * statistics.median(o.metrics.ttft for o in outs),
            "tpot_ms": 1e3 * statistics.median(o.metrics.tpot for o in outs),
            "cpu_ms_per_1k_tokens": {"offline": 1e6 * cpu / tokens}}


def start_spies(spies: list, pids: dict[str, int], outs: list[Path] | None) -> None:
    """py-spy on each server process from now on (GIL-holding samples only: where CPU goes)."""
    for pid, out in zip(pids.values(), outs or []):
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--threads", "--gil", "--nonblocking",
               "--rate", "200", "--output", str(out)]
        spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--client", nargs="+", default=["openai", "lean"], choices=("openai", "lean"))
    ap.add_argument("--num-requests", type=int, help="per level (default 2 x concurrency)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-ms", type=float, default=0.0, help="sleep in each execute: the GPU's share of a step")
    ap.add_argument("--offline", action="store_true", help="also LLM.generate with the same no-op executor")
    ap.add_argument("--repeats", type=int, default=1, help="alternate the clients this many times per level")
    ap.add_argument("--py-spy", type=Path, help="record py-spy raw profiles of both server processes here")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    from kiln.loader import load_frontend

    cfg, _ = load_frontend(a.model, tokenizer=False)
    rng = np.random.default_rng(0)
    reqs = {c: [rng.integers(3, cfg.vocab_size, a.input_len).tolist() for _ in range(a.num_requests or 2 * c)]
            for c in a.concurrency}
    rows = []
    if a.offline:
        for c in a.concurrency:
            rows.append(offline_level(a, c, reqs[c]))
            print(json.dumps(rows[-1]), flush=True)
    proc, url, pids = start_server(a)
    try:
        for c in a.concurrency:
            for rep in range(a.repeats):
                for kind in a.client:
                    profile = None if a.py_spy is None else [a.py_spy / f"{n}_{kind}_c{c}_r{rep}.txt" for n in pids]
                    spies: list[subprocess.Popen] = []
                    row = asyncio.run(run_level(kind, url, c, reqs[c], a.output_len, pids,
                                                functools.partial(start_spies, spies, pids, profile)))
                    for s in spies:
                        s.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
                        s.wait()
                    row["repeat"] = rep
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
