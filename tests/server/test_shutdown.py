"""`build.py serve` stopping (issue 42 "Faults") on the tiny model: SIGTERM stops accepting,
lets the streams in flight finish within --shutdown-timeout, aborts the rest with an error as their
last frame and exits 0; an engine that raises inside a step (KILN_FAULT_AFTER_STEPS, the test
hook of runtime/engine/core.py) fails every stream in flight with an error frame and the server
exits non-zero (/health's 503 for a dead engine: test_engine_process.py)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading

from tests.server.test_cli_serve import ServeProcess
from tests.server.tiny_chat_model import MODEL_NAME


def start(tiny_chat_dir, *args: str, env: dict | None = None) -> tuple[ServeProcess, int]:
    if env:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
    try:
        srv = ServeProcess("--model", str(tiny_chat_dir), "--served-model-name", MODEL_NAME,
                           "--kv-cache-tokens", "8192", *args)
    finally:
        if env:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
    port = int(srv.wait_for(r"serving \S+ on http://127\.0\.0\.1:(\d+)").group(1))
    return srv, port


class Stream:
    """One streaming completion over a raw socket, read on a thread: its SSE events."""

    def __init__(self, port: int, max_tokens: int) -> None:
        body = json.dumps({"model": MODEL_NAME, "prompt": "tell me", "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True}).encode()
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.raw = b""
        self.first = threading.Event()
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        self.sock.settimeout(120)
        try:
            while chunk := self.sock.recv(65536):
                self.raw += chunk
                if b"data: " in self.raw:
                    self.first.set()
                if b"data: [DONE]" in self.raw or b"0\r\n\r\n" in self.raw:
                    break
        finally:
            self.first.set()
            self.done.set()

    def events(self) -> list:
        out = []
        for line in self.raw.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                out.append(json.loads(line[6:]))
        return out


def health(port: int) -> int | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None


def test_sigterm_lets_streams_finish_then_exits_0(tiny_chat_dir):
    srv, port = start(tiny_chat_dir, "--shutdown-timeout", "60")
    streams = [Stream(port, 48) for _ in range(2)]
    assert all(s.first.wait(60) for s in streams)
    srv.proc.send_signal(signal.SIGTERM)
    assert all(s.done.wait(60) for s in streams)
    for s in streams:
        ev = s.events()
        assert b"data: [DONE]" in s.raw
        assert ev[-1]["choices"][0]["finish_reason"] == "length"  # finished, not cut
        assert not any("error" in e for e in ev)
    assert srv.proc.wait(60) == 0
    assert health(port) is None  # no longer listening


def test_sigterm_past_the_timeout_aborts_with_an_error_frame(tiny_chat_dir):
    srv, port = start(tiny_chat_dir, "--shutdown-timeout", "0", "--no-engine-process")
    s = Stream(port, 480)
    assert s.first.wait(60)
    srv.proc.send_signal(signal.SIGTERM)
    assert s.done.wait(60)
    ev = s.events()
    assert ev[-1]["error"]["code"] == "shutting_down" and b"data: [DONE]" in s.raw
    assert srv.proc.wait(60) == 0


def test_engine_fault_fails_requests_and_exits_nonzero(tiny_chat_dir):
    srv, port = start(tiny_chat_dir, env={"KILN_FAULT_AFTER_STEPS": "30"})
    s = Stream(port, 480)
    assert s.done.wait(60)
    ev = s.events()
    assert ev and ev[-1]["error"]["code"] == "engine_dead" and ev[-1]["error"]["type"] == "server_error"
    code = srv.proc.wait(60)
    assert code not in (0, None)
    out = []
    while (line := srv.lines.get(timeout=5)) is not None:
        out.append(line)
    assert any("the engine failed" in line for line in out), out
