"""TPOT through the OpenAI server vs the offline LLM API, at 1 and 32 concurrent streams.

    python bench/server_vs_offline.py [--model PATH] [--concurrency 1 32] [--prompt-tokens 16]
                                      [--gen-tokens 32] [--json OUT]

Offline: LLM.generate on C prompts at once; TPOT is each request's engine-side
(last token time - first token time) / (tokens - 1), then the median over requests.
Server: `build.py serve` in a subprocess (its own GIL, as deployed), C streaming
/v1/completions clients on the openai AsyncOpenAI client in this process; TPOT is each
stream's (last chunk arrival - first chunk arrival) / (tokens - 1), counting tokens with
return_token_ids, then the median. Prompts are random token ids of exactly
--prompt-tokens; greedy, EOS ignored, so every request makes --gen-tokens tokens.
The difference is the server's cost per token: HTTP, JSON, SSE, the event loop.
Not a dependency of any test; timings on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

BUILD = Path(__file__).resolve().parents[1] / "build.py"


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, min(vocab, 30000), size=length).tolist() for _ in range(n)]


def offline_tpot(llm, conc: int, args) -> float:
    from kiln import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    llm.generate(prompts(1, args.prompt_tokens, llm.engine.vocab_size, 0), params)  # warm-up
    outs = llm.generate(prompts(conc, args.prompt_tokens, llm.engine.vocab_size, conc), params)
    return statistics.median(o.metrics.tpot for o in outs)


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, str(BUILD), "serve", "--port", "0", "--served-model-name", "bench",
           "--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    if args.no_engine_process:
        cmd += ["--no-engine-process"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    while True:
        line = lines.get(timeout=600)
        if line is None:
            raise SystemExit(f"the server exited with {proc.wait()}")
        if m := re.search(r"on (http://\S+) ", line):
            return proc, m.group(1)


async def one_stream(client, prompt: list[int], gen: int) -> float:
    stream = await client.completions.create(model="bench", prompt=prompt, max_tokens=gen, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    first = last = None
    tokens = 0
    async for chunk in stream:
        n = len(chunk.choices[0].model_extra.get("token_ids") or []) if chunk.choices else 0
        if not n:
            continue
        now = time.perf_counter()
        if first is None:
            first, tokens = now, n - 1  # tokens after the first chunk's last token
        else:
            tokens += n
        last = now
    return (last - first) / tokens if tokens else float("nan")


async def server_tpot(url: str, conc: int, vocab: int, args) -> float:
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600) as client:
        await one_stream(client, prompts(1, args.prompt_tokens, vocab, 0)[0], args.gen_tokens)  # warm-up
        tpots = await asyncio.gather(*[one_stream(client, p, args.gen_tokens)
                                       for p in prompts(conc, args.prompt_tokens, vocab, conc)])
    return statistics.median(tpots)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="default: SmolLM2-135M-Instruct (the server's default)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-tokens", type=int, default=8192)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--no-engine-process", action="store_true",
                    help="serve with the engine core in the server's process (to measure what the split buys)")
    args = ap.parse_args()

    from kiln import LLM

    llm = LLM(args.model, kv_cache_tokens=args.kv_cache_tokens)
    vocab = llm.engine.vocab_size
    results = {"offline": {c: offline_tpot(llm, c, args) for c in args.concurrency}}
    del llm
    proc, url = start_server(args)
    try:
        results["server"] = {c: asyncio.run(server_tpot(url, c, vocab, args)) for c in args.concurrency}
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"TPOT (median ms/token), {args.prompt_tokens} prompt + {args.gen_tokens} generated tokens, greedy")
    print(f"{'streams':>8} {'offline':>10} {'server':>10} {'overhead':>9}")
    for c in args.concurrency:
        off, srv = results["offline"][c] * 1e3, results["server"][c] * 1e3
        print(f"{c:>8} {off:>10.2f} {srv:>10.2f} {100 * (srv / off - 1):>8.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
