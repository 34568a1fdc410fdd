"""The server workload: `build.py serve` in a subprocess (its own processes, as deployed) and
closed-loop streaming clients at each concurrency level, next to the offline engine on the same
requests.

Per level C: --num-requests requests (default max(4, 2C)) of exactly --input-len random token
ids, streaming /v1/completions with max_tokens --output-len, greedy (or --temperature with
--top-k and --top-p, unseeded: the server's sampler on the host), ignore_eos;
C workers each send their next request when the last one ends. TTFT = first chunk with a token
- send time; TPOT = (last chunk - first chunk) / (tokens - 1), counting tokens from the
return_token_ids of each chunk; output tok/s = the level's tokens / its wall time.

--client lean (the default) reads the streams with SSEConnection below: raw HTTP/1.1 over
asyncio streams, one keep-alive connection per worker, json.loads per event. --client openai
runs the official async openai client, as this workload did first; in one Python process it
costs ~280 us of CPU per streamed chunk (pydantic models, httpx, its SSE decoder), so at 128
streams it saturates its core below the server's rate and the level measured the client
(bench/server_host.py measures both clients against the same server).

Offline (unless --no-offline): LLM.generate on the same requests in waves of C, which is what
closed-loop clients with equal lengths amount to; TTFT and TPOT from the engine's request metrics.
It runs first and gives the GPU back before the server loads the model.
"""
from __future__ import annotations

import asyncio
import functools
import json
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


def request_sampling(a) -> dict:
    """The requests' sampling fields: greedy, or the bench's --temperature, --top-k, --top-p."""
    if not getattr(a, "temperature", 0):
        return {"temperature": 0}
    return {"temperature": a.temperature, "top_k": a.top_k or -1, "top_p": a.top_p}


def offline_level(llm, a, conc: int, prompts: list[list[int]]) -> dict:
    from kiln.bench.workloads import check_lengths, sampling

    outs = []
    t0 = time.perf_counter()
    for k in range(0, len(prompts), conc):
        outs += llm.generate(prompts[k:k + conc], sampling(a.output_len, a))
    wall = time.perf_counter() - t0
    tokens = check_lengths(outs, [a.output_len] * len(outs))
    return level_stats(conc, [o.metrics.ttft for o in outs], [o.metrics.tpot for o in outs], tokens, wall,
                       a.output_len * len(prompts))


def start_server(a) -> tuple[subprocess.Popen, str, list[str]]:
    from kiln.bench.workloads import BUILD

    cmd = [sys.executable, str(BUILD), "serve", "--port", "0", "--served-model-name", SERVED_NAME,
           "--target", a.target, "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    if a.async_scheduling is not None:
        cmd.append("--async-scheduling" if a.async_scheduling else "--no-async-scheduling")
    for flag, value in (("--model", a.model), ("--bundle", a.bundle), ("--kv-cache-tokens", a.kv_cache_tokens),
                        ("--kv-cache-dtype", a.kv_cache_dtype),
                        ("--quantization", getattr(a, "quantization", None))):
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


class SSEConnection:
    """One keep-alive HTTP/1.1 connection to the server: POST a streaming completion, read its
    chunked Server-Sent Events. Checks what a client must (status 200, no error event, [DONE]
    at the end) and keeps the token ids of each chunk (return_token_ids)."""

    def __init__(self, url: str) -> None:
        m = re.match(r"http://([^:/]+):(\d+)", url)
        if m is None:
            raise KilnError(f"cannot parse the server address {url!r}")
        self.host, self.port = m.group(1), int(m.group(2))
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def completion(self, body: dict) -> tuple[float, list[tuple[float, list[int]]]]:
        """-> (send time, [(arrival time, token ids)] of each event that carries tokens)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        sent = time.perf_counter()
        self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), self.port, len(data), data))
        r = self.reader
        status = await r.readline()
        headers = {}
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if status.split(b" ")[1:2] != [b"200"]:
            text = await r.read(int(headers.get("content-length", 0) or 0))
            raise KilnError(f"the server answered {status.decode().strip()}: {text[:500]!r}")
        if headers.get("transfer-encoding", "").lower() != "chunked":
            raise KilnError(f"expected a chunked event stream, got headers {headers}")
        events: list[tuple[float, list[int]]] = []
        buf, done, loads = b"", False, json.loads
        while size := int(await r.readline(), 16):
            buf += (await r.readexactly(size + 2))[:-2]
            while (k := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:k], buf[k + 2:]
                if not event.startswith(b"data: "):
                    continue
                if event == b"data: [DONE]":
                    done = True
                    continue
                obj = loads(event[6:])
                if "error" in obj:
                    raise KilnError(f"the stream carried an error: {obj['error']}")
                ids = obj["choices"][0].get("token_ids") if obj["choices"] else None
                if ids:
                    events.append((time.perf_counter(), ids))
        await r.readexactly(2)  # the CRLF after the last (empty) chunk
        if not done or buf:
            raise KilnError("the event stream ended without [DONE]")
        return sent, events

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def timings(sent: float, events: list[tuple[float, list[int]]]) -> tuple[float, float | None, int]:
    """-> (TTFT, TPOT or None for one token, tokens) from a stream's token-carrying events."""
    tokens = sum(len(ids) for _, ids in events)
    if not events:
        return float("nan"), None, 0
    first, last = events[0][0], events[-1][0]
    return first - sent, (last - first) / (tokens - 1) if tokens > 1 else None, tokens


async def lean_request(conn: SSEConnection, prompt: list[int], max_tokens: int,
                       sampling: dict | None = None) -> tuple[float, float | None, int]:
    """-> (TTFT, TPOT or None for one token, tokens) of one streamed completion."""
    return timings(*await conn.completion({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                           **(sampling or {"temperature": 0}), "stream": True,
                                           "ignore_eos": True, "return_token_ids": True}))


async def one_request(client, prompt: list[int], max_tokens: int,
                      sampling: dict | None = None) -> tuple[float, float | None, int]:
    """The same through the official openai client."""
    sampling = dict(sampling or {"temperature": 0})
    top_k = sampling.pop("top_k", None)
    sent = time.perf_counter()
    stream = await client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, stream=True, **sampling,
        extra_body={"ignore_eos": True, "return_token_ids": True, **({"top_k": top_k} if top_k else {})})
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
    from tqdm import tqdm

    kind = getattr(a, "client", None) or "lean"
    todo = list(reversed(prompts))
    results: list = []
    bar = tqdm(total=len(prompts), desc=f"server c={conc}", unit="req", disable=a.no_progress, file=sys.stderr)
    if kind == "openai":
        import openai

        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600)
        await one_request(client, prompts[0][:16], 4)  # warm-up: connection, first-use costs
        send = functools.partial(one_request, client)
        workers = [send] * conc
    else:
        conns = [SSEConnection(url) for _ in range(conc)]
        await lean_request(conns[0], prompts[0][:16], 4)
        workers = [functools.partial(lean_request, c) for c in conns]

    async def worker(send) -> None:
        while todo:
            results.append(await send(todo.pop(), a.output_len, request_sampling(a)))
            bar.update(1)
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(w) for w in workers])
        wall = time.perf_counter() - t0
    finally:
        bar.close()
        if kind == "openai":
            await client.close()
        else:
            for c in conns:
                c.close()
    stats = level_stats(conc, [r[0] for r in results], [r[1] for r in results], sum(r[2] for r in results), wall,
                        a.output_len * len(prompts))
    return {**stats, "client": kind}


def run_server_workload(a) -> dict:
    from kiln.bench.workloads import engine, sampling
    from kiln.loader import load_frontend

    cfg, _ = load_frontend(a.model, tokenizer=False)
    requests = {c: level_requests(a, c, cfg.vocab_size) for c in a.concurrency}
    offline: dict = {}
    if not a.no_offline:
        with engine(a) as llm:
            llm.generate([requests[a.concurrency[0]][0][:16]], sampling(4))  # warm-up
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
            "client": getattr(a, "client", None) or "lean", "levels": levels, "output_tokens": sum(lv["server"]["output_tokens"] for lv in levels),
            "expected_output_tokens": sum(a.output_len * len(requests[c]) for c in a.concurrency)}
