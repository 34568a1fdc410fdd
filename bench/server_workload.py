"""The server workload: `build.py serve` in a subprocess (its own processes, as deployed) and
closed-loop clients on the official async openai client, at each concurrency level, next to
the offline engine on the same requests.

Per level C: --num-requests requests (default max(4, 2C)) of exactly --input-len random token
ids, streaming /v1/completions with max_tokens --output-len, greedy, ignore_eos in extra_body;
C workers each send their next request when the last one ends. TTFT = first chunk with a token
- send time; TPOT = (last chunk - first chunk) / (tokens - 1), counting tokens from the
return_token_ids of each chunk; output tok/s = the level's tokens / its wall time.

Offline (unless --no-offline): LLM.generate on the same requests in waves of C, which is what
closed-loop clients with equal lengths amount to; TTFT and TPOT from the engine's request metrics.
It runs first and gives the GPU back before the server loads the model.
"""
from __future__ import annotations

import asyncio
import queue
import re
import subprocess
import sys
import threading
import time

import numpy as np

from kiln.errors import KilnError

SERVED_NAME = "bench"


def level_requests(a, conc: int, vocab: int) -> list[list[int]]:
    from kiln.bench.workloads import random_prompts

    n = a.num_requests or max(4, 2 * conc)
    return random_prompts(np.random.default_rng([a.seed, conc]), [a.input_len] * n, vocab)


def level_stats(conc: int, ttfts, tpots, tokens: int, wall: float, expected: int) -> dict:
    from kiln.bench.workloads import summary_ms

    if tokens != expected:
        raise KilnError(f"at concurrency {conc} the requests produced {tokens} tokens instead of {expected}")
    return {"concurrency": conc, "num_requests": len(ttfts), "output_tokens": tokens, "wall_s": wall,
            "output_tok_s": tokens / wall, "ttft_ms": summary_ms(ttfts), "tpot_ms": summary_ms(tpots)}


def offline_level(llm, a, conc: int, prompts: list[list[int]]) -> dict:
    from kiln.bench.workloads import check_lengths, greedy

    outs = []
    t0 = time.perf_counter()
    for k in range(0, len(prompts), conc):
        outs += llm.generate(prompts[k:k + conc], greedy(a.output_len))
    wall = time.perf_counter() - t0
    tokens = check_lengths(outs, [a.output_len] * len(outs))
    return level_stats(conc, [o.metrics.ttft for o in outs], [o.metrics.tpot for o in outs], tokens, wall,
                       a.output_len * len(prompts))


def start_server(a) -> tuple[subprocess.Popen, str, list[str]]:
    from kiln.bench.workloads import BUILD

    cmd = [sys.executable, str(BUILD), "serve", "--port", "0", "--served-model-name", SERVED_NAME,
           "--target", a.target, "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    for flag, value in (("--model", a.model), ("--bundle", a.bundle), ("--kv-cache-tokens", a.kv_cache_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    log: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            log.append(line)
            lines.put(line)
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 1800  # a GPU target may compile its bundle first
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            line = None
        if line is None:
            proc.kill()
            raise KilnError(f"the server did not start (exit {proc.wait()}): {''.join(log[-20:])}")
        if m := re.search(r"on (http://\S+) ", line):
            return proc, m.group(1), log


async def one_request(client, prompt: list[int], max_tokens: int) -> tuple[float, float | None, int]:
    """-> (TTFT, TPOT or None for one token, tokens) of one streamed completion."""
    sent = time.perf_counter()
    stream = await client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    first = last = None
    tokens = 0
    async for chunk in stream:
        n = len((chunk.choices[0].model_extra or {}).get("token_ids") or []) if chunk.choices else 0
        if not n:
            continue
        last = time.perf_counter()
        first = first or last
        tokens += n
    if first is None:
        return float("nan"), None, 0
    return first - sent, (last - first) / (tokens - 1) if tokens > 1 else None, tokens


async def server_level(url: str, a, conc: int, prompts: list[list[int]]) -> dict:
    import openai
    from tqdm import tqdm

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600) as client:
        await one_request(client, prompts[0][:16], 4)  # warm-up: connection, first-use costs
        todo = list(reversed(prompts))
        results: list = []
        bar = tqdm(total=len(prompts), desc=f"server c={conc}", unit="req", disable=a.no_progress, file=sys.stderr)

        async def worker() -> None:
            while todo:
                results.append(await one_request(client, todo.pop(), a.output_len))
                bar.update(1)
        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(conc)])
        wall = time.perf_counter() - t0
        bar.close()
    return level_stats(conc, [r[0] for r in results], [r[1] for r in results], sum(r[2] for r in results), wall,
                       a.output_len * len(prompts))


def run_server_workload(a) -> dict:
    from kiln.bench.workloads import engine, greedy
    from kiln.build import load_frontend

    cfg, _ = load_frontend(a.model, tokenizer=False)
    requests = {c: level_requests(a, c, cfg.vocab_size) for c in a.concurrency}
    offline: dict = {}
    if not a.no_offline:
        with engine(a) as llm:
            llm.generate([requests[a.concurrency[0]][0][:16]], greedy(4))  # warm-up
            for c in a.concurrency:
                offline[c] = offline_level(llm, a, c, requests[c])
                print(f"[kiln] offline c={c}: {offline[c]['output_tok_s']:.1f} tok/s", file=sys.stderr)
    proc, url, _ = start_server(a)
    try:
        levels = []
        for c in a.concurrency:
            srv = asyncio.run(server_level(url, a, c, requests[c]))
            levels.append({"concurrency": c, "server": srv, "offline": offline.get(c)})
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    top = max(levels, key=lambda lv: lv["concurrency"])
    return {"metric": "output_tok_s", "value": top["server"]["output_tok_s"], "roofline": None,
            "concurrency": list(a.concurrency), "input_len": a.input_len, "output_len": a.output_len,
            "levels": levels, "output_tokens": sum(lv["server"]["output_tokens"] for lv in levels),
            "expected_output_tokens": sum(a.output_len * len(requests[c]) for c in a.concurrency)}
