"""Host memory of `build.py serve` on the default model (SmolLM2-135M Q4_1) on the CPU target.

    python bench/cpu_serve_rss.py [--backend compiled|numpy] [--json OUT]

Starts the server (front process and engine process) on a free loopback port with
KILN_CPU_BACKEND set, waits for /health, and sums VmRSS over the process tree: once when ready,
once after one 32-token completion. Then stops it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for c in f.read().split():
                    out += tree(int(c))
    except OSError:
        pass
    return out


def rss_mb(pid: int) -> float:
    total = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="compiled", choices=("compiled", "numpy"))
    ap.add_argument("--json")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "KILN_CPU_BACKEND": a.backend}
    proc = subprocess.Popen([sys.executable, str(REPO / "build.py"), "serve", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        ready_s = time.time() - t0
        ready = rss_mb(proc.pid)
        model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=10))["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 32}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=600).read()
        after = rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    res = {"backend": a.backend, "ready_s": round(ready_s, 1), "rss_ready_mb": round(ready, 1),
           "rss_after_request_mb": round(after, 1), "processes": "front + engine"}
    print(json.dumps(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
