"""A live server for tests: make_app(engine, config) on 127.0.0.1 at a port the OS picks,
served from a thread with its own event loop, plus small raw-HTTP and /metrics helpers.

It runs the real Tornado app over a real socket, so clients (the official openai
package, http.client, raw sockets) talk to it exactly as to `build.py serve`.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time
from typing import Any, Optional

from kiln.entrypoints.async_llm import AsyncLLM
from kiln.server.api_server import listen
from kiln.server.app import make_app
from kiln.server.state import ServerConfig


class LiveServer:
    """make_app(engine, config) served on 127.0.0.1:<free port> from a thread of its own."""

    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"server did not start: {self._error}")
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        try:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            self.app = make_app(self.engine, self.config)
            srv = listen(self.app, self.config, "127.0.0.1", 0)
            self.port = srv.port
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        await self.stop_event.wait()
        await srv.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self._thread.join(10)

    # ---- small raw-HTTP helpers (the openai client covers the happy paths)

    def request(self, method: str, path: str, body: Any = None, headers: Optional[dict] = None,
                timeout: float = 30) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
            conn.request(method, path, body=data, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """Sample name (labels dropped) -> value, summed over label sets."""
        _, _, body = self.request("GET", "/metrics")
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds a KV block (or fail after timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.get("kiln:num_requests_running") == 0 and m.get("kiln:num_requests_waiting") == 0 \
                    and m.get("kiln:kv_cache_usage_perc") == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {m}")
            time.sleep(0.05)
