"""Soak and burst against `build.py serve` on the default model (issue 42; not CI).

    python bench/server_soak.py soak  [--requests 10000] [--concurrency 32] [--max-tokens 4] [--json OUT]
    python bench/server_soak.py burst [--streams 1000 3000] [--json OUT] [-- extra serve flags]

Both start `build.py serve --host 127.0.0.1 --port P` (front process + engine process, the
default mode) on a free loopback port and wait for /health. Every request is a streaming
/v1/completions with temperature 0, ignore_eos and return_token_ids; a stream counts as
complete only if every choice index got exactly max_tokens token ids, one finish_reason, no
error event and one [DONE] at the end (so nothing lost or duplicated).

soak: --concurrency workers, each on its own keep-alive connection, send the next request
when the last ends, until --requests are done. Every --sample-every completed requests the
VmRSS of the server's process tree (front, engine) is read from /proc. TTFT = first event
carrying a token - send time.

burst: for each count in --streams, that many streams opened at once (one connection each);
a 503 (the waiting bound, --max-waiting-requests) is retried after its Retry-After, as a
client should, and counted. Then one request with n at the server's limit (--max-n, 128 by
default) and one with n 3000, which must be the limit's 400. Wall time for each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kiln.bench.cpu_serve_rss import tree  # a process and its descendants

REPO = Path(__file__).resolve().parent.parent


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def start_server(extra: list[str]) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(REPO / "build.py"), "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
    print("server:", " ".join(cmd[1:]), file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open("/tmp/server_soak.log", "w"))
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}: see /tmp/server_soak.log")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc, port
        except OSError:
            time.sleep(0.5)


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class Refused(Exception):
    def __init__(self, status: int, headers: dict, body: bytes) -> None:
        super().__init__(f"{status}: {body[:300]!r}")
        self.status, self.headers, self.body = status, headers, body


class Conn:
    """One keep-alive HTTP/1.1 connection; stream() POSTs a completion and checks its events."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader = self.writer = None

    async def stream(self, body: dict) -> tuple[float, dict[int, list[int]]]:
        """-> (TTFT, {choice index: token ids}); raises Refused for a non-200, ValueError for a
        stream that is incomplete or carries more than it should."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        data = json.dumps(body).encode()
        sent = time.perf_counter()
        self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        r = self.reader
        status = int((await r.readline()).split(b" ")[1])
        headers = {}
        while (line := await r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if status != 200:
            raw = await r.readexactly(int(headers.get("content-length", 0) or 0))
            if headers.get("connection", "").lower() == "close":
                self.close()
            raise Refused(status, headers, raw)
        tokens: dict[int, list[int]] = {}
        finishes: dict[int, int] = {}
        ttft = None
        buf, dones = b"", 0
        while size := int(await r.readline(), 16):
            buf += (await r.readexactly(size + 2))[:-2]
            while (k := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:k], buf[k + 2:]
                if event == b"data: [DONE]":
                    dones += 1
                    continue
                if dones:
                    raise ValueError("an event after [DONE]")
                obj = json.loads(event[6:])
                if "error" in obj:
                    raise ValueError(f"error event: {obj['error']}")
                for c in obj["choices"]:
                    if c.get("token_ids"):
                        if ttft is None:
                            ttft = time.perf_counter() - sent
                        tokens.setdefault(c["index"], []).extend(c["token_ids"])
                    if c.get("finish_reason") is not None:
                        finishes[c["index"]] = finishes.get(c["index"], 0) + 1
        await r.readexactly(2)
        n, want = body.get("n", 1), body["max_tokens"]
        if dones != 1 or buf:
            raise ValueError(f"{dones} [DONE] events, {len(buf)} bytes left over")
        if sorted(tokens) != list(range(n)) or any(len(t) != want for t in tokens.values()):
            raise ValueError(f"choices {sorted(tokens)[:5]}..., token counts {sorted({len(t) for t in tokens.values()})}")
        if sorted(finishes) != list(range(n)) or set(finishes.values()) != {1}:
            raise ValueError("a choice without exactly one finish_reason")
        return ttft, tokens

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def model_id(port: int) -> str:
    return json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30))["data"][0]["id"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# ------------------------------------------------------------------------ soak

async def soak(port: int, proc: subprocess.Popen, a) -> dict:
    model = model_id(port)
    pids = tree(proc.pid)
    todo = list(range(a.requests))
    todo.reverse()
    ttfts: list[float] = []
    samples: list[dict] = []
    failures: list[str] = []
    t0 = time.perf_counter()

    def sample() -> None:
        front, engines = rss_mb(proc.pid), [rss_mb(p) for p in tree(proc.pid)[1:]]
        s = {"done": len(ttfts) + len(failures), "t_s": round(time.perf_counter() - t0, 1),
             "front_mb": round(front, 1), "engine_mb": round(sum(engines), 1),
             "total_mb": round(front + sum(engines), 1)}
        samples.append(s)
        print(json.dumps(s), file=sys.stderr, flush=True)

    sample()

    async def worker() -> None:
        conn = Conn(port)
        while todo:
            i = todo.pop()
            body = {"model": model, "prompt": f"Request {i}: the quick brown fox jumps over", "max_tokens": a.max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True, "return_token_ids": True}
            try:
                ttft, _ = await conn.stream(body)
                ttfts.append(ttft)
            except Exception as e:  # counted, and the connection starts over
                failures.append(f"{i}: {type(e).__name__}: {e}")
                conn.close()
            if (len(ttfts) + len(failures)) % a.sample_every == 0:
                sample()
            if a.deadline and time.time() > a.deadline:
                todo.clear()
        conn.close()

    await asyncio.gather(*[worker() for _ in range(a.concurrency)])
    wall = time.perf_counter() - t0
    if samples[-1]["done"] != len(ttfts) + len(failures):
        sample()
    after = [s["total_mb"] for s in samples if s["done"] >= a.warmup]
    return {"requests_done": len(ttfts), "failures": len(failures), "failure_examples": failures[:5],
            "wall_s": round(wall, 1), "req_per_s": round(len(ttfts) / wall, 2),
            "ttft_p50_ms": round(pct(ttfts, 50) * 1e3, 1), "ttft_p99_ms": round(pct(ttfts, 99) * 1e3, 1),
            "rss_after_warmup_min_mb": min(after) if after else None,
            "rss_after_warmup_max_mb": max(after) if after else None,
            "rss_spread_pct": round(100 * (max(after) - min(after)) / min(after), 2) if after else None,
            "samples": samples, "server_pids": pids}


# ------------------------------------------------------------------------ burst

a_retry_connect = False


async def one_stream(port: int, body: dict, stats: dict) -> dict[int, list[int]]:
    while True:
        conn = Conn(port)
        try:
            if a_retry_connect:
                try:  # the listen backlog full (SYNs dropped, connect times out): retried, counted
                    conn.reader, conn.writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    stats["connect_failed_retried"] = stats.get("connect_failed_retried", 0) + 1
                    continue
            _, tokens = await conn.stream(body)
            return tokens
        except Refused as e:
            if e.status != 503:
                raise
            stats["retried_503"] += 1
            await asyncio.sleep(float(e.headers.get("retry-after", "1")))
        finally:
            conn.close()


async def burst(port: int, proc: subprocess.Popen, a) -> dict:
    model = model_id(port)
    out: dict = {"levels": []}
    for count in a.streams:
        stats = {"retried_503": 0}
        bodies = [{"model": model, "prompt": f"Burst stream {i} of {count}:", "max_tokens": a.max_tokens,
                   "temperature": 0, "stream": True, "ignore_eos": True, "return_token_ids": True}
                  for i in range(count)]
        t0 = time.perf_counter()
        res = await asyncio.wait_for(asyncio.gather(*[one_stream(port, b, stats) for b in bodies],
                                                    return_exceptions=True), a.timeout)
        wall = time.perf_counter() - t0
        errors = [r for r in res if isinstance(r, BaseException)]
        level = {"streams": count, "complete": len(res) - len(errors), "errors": len(errors),
                 "error_examples": [repr(e)[:300] for e in errors[:3]], "wall_s": round(wall, 1), **stats,
                 "server_rss_mb_after": round(sum(rss_mb(p) for p in tree(proc.pid)), 1)}
        print(json.dumps(level), file=sys.stderr, flush=True)
        out["levels"].append(level)
    limit = a.max_n
    for n, expect in ((limit, 200), (3000, 400)):
        body = {"model": model, "prompt": "One prompt, many choices:", "max_tokens": a.max_tokens, "n": n,
                "temperature": 1.0, "seed": 7, "stream": True, "ignore_eos": True, "return_token_ids": True}
        t0 = time.perf_counter()
        conn = Conn(port)
        try:
            await asyncio.wait_for(conn.stream(body), a.timeout)
            got = {"n": n, "status": 200, "complete": True}
        except Refused as e:
            got = {"n": n, "status": e.status, "message": json.loads(e.body)["error"]["message"]}
        finally:
            conn.close()
        got["wall_s"] = round(time.perf_counter() - t0, 2)
        got["as_expected"] = got["status"] == expect
        print(json.dumps(got), file=sys.stderr, flush=True)
        out[f"n_{n}"] = got
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("soak", "burst"))
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--sample-every", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=1000, help="requests before the RSS flatness window")
    ap.add_argument("--deadline", type=float, default=0, help="soak: stop sending at this Unix time")
    ap.add_argument("--streams", type=int, nargs="*", default=[1000, 3000])
    ap.add_argument("--max-n", type=int, default=128, help="the server's --max-n")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--retry-connect", action="store_true",
                    help="burst: a connect that fails (the listen backlog full) is retried and counted")
    ap.add_argument("--json")
    a, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    global a_retry_connect
    a_retry_connect = a.retry_connect
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    res = {"mode": a.mode, "argv": sys.argv, "serve_flags": extra, "commit": commit, "uptime_before": uptime()}
    proc, port = start_server(extra)
    try:
        res.update(asyncio.run(soak(port, proc, a) if a.mode == "soak" else burst(port, proc, a)))
    finally:
        res["server_exit"] = stop_server(proc)
        res["uptime_after"] = uptime()
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
